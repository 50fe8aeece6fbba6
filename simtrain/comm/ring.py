"""Ring all-reduce (Baidu, 2017): reduce-scatter then all-gather over N chunks.

The buffer is cut into N nearly equal chunks (sizes differ by at most one
element, so any size works). In N-1 reduce-scatter steps every rank sends one
chunk to its right neighbour and adds the chunk arriving from its left; rank r
then holds the fully reduced chunk r+1. In N-1 all-gather steps those chunks go
round the ring. Each rank sends 2(N-1)/N of the buffer, so on a ring topology
the time is 2(N-1)(alpha + S/(N*B)).
"""
from .ops import Recv, Send


def ring_all_reduce(rank: int, world: int, buf, average: bool = False):
    """Per-rank program: sum (or mean) of `buf` over all ranks, in place."""
    if world > 1:
        chunks = buf.tensor_split(world)
        right, left = (rank + 1) % world, (rank - 1) % world
        for step in range(world - 1):
            yield [Send(right, chunks[(rank - step) % world]),
                   Recv(left, chunks[(rank - step - 1) % world], reduce=True)]
        for step in range(world - 1):
            yield [Send(right, chunks[(rank + 1 - step) % world]),
                   Recv(left, chunks[(rank - step) % world])]
    if average:
        buf.div_(world)
    return buf
