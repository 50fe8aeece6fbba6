"""Ring all-reduce (Baidu, 2017): reduce-scatter then all-gather over N chunks.

The buffer is cut into N nearly equal chunks (sizes differ by at most one
element, so any size works). In N-1 reduce-scatter steps every rank sends one
chunk to its right neighbour and adds the chunk arriving from its left; the
rank at ring position p then holds the fully reduced chunk p+1. In N-1
all-gather steps those chunks go round the ring. Each rank sends 2(N-1)/N of
the buffer, so on a ring topology the time is 2(N-1)(alpha + S/(N*B)).

The ring is rank order unless `ring` lists the ranks in another order (a
channel's ring, channels.py); `tag` keeps one channel's messages apart from
another's. The two phases are also used on their own by hierarchical.py.

    program = ring_all_reduce(rank, world, buf, average=True)
    program = ring_all_reduce(rank, world, part, ring=[0, 2, 3, 1], tag=1)
"""
from .ops import Recv, Send


def ring_all_reduce(rank: int, world: int, buf, average: bool = False, *, ring=None, tag: int = 0):
    """Per-rank program: sum (or mean) of `buf` over the `world` ranks of `ring`, in place."""
    if world > 1:
        chunks = buf.tensor_split(world)
        position = rank if ring is None else ring.index(rank)
        right = (rank + 1) % world if ring is None else ring[(position + 1) % world]
        left = (rank - 1) % world if ring is None else ring[position - 1]
        yield from ring_reduce_scatter(position, right, left, chunks, tag)
        yield from ring_all_gather(position, right, left, chunks, tag)
    if average:
        buf.div_(world)
    return buf


def ring_reduce_scatter(position: int, right: int, left: int, chunks, tag: int = 0):
    """Per-rank program: afterwards the rank at ring `position` holds chunk position+1 summed."""
    size = len(chunks)
    for step in range(size - 1):
        yield [Send(right, chunks[(position - step) % size], tag),
               Recv(left, chunks[(position - step - 1) % size], True, tag)]


def ring_all_gather(position: int, right: int, left: int, chunks, tag: int = 0):
    """Per-rank program: from chunk position+1 held at each position to every chunk everywhere."""
    size = len(chunks)
    for step in range(size - 1):
        yield [Send(right, chunks[(position + 1 - step) % size], tag),
               Recv(left, chunks[(position - step) % size], False, tag)]
