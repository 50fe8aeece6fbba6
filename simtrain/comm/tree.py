"""Binary reduction tree all-reduce (FireCaffe, Iandola et al. 2016).

Ranks form a binary heap: the parent of r is (r-1)//2, its children 2r+1 and
2r+2, so any N works. Each rank adds in its children's whole buffers, sends the
sum to its parent; rank 0 ends with the total, which then flows back down the
same tree. With floor(log2 N) levels, on a fully connected topology the time is
2*floor(log2 N)*(alpha + S/B): the whole buffer crosses one link per level.
"""
from .ops import Recv, Send


def tree_all_reduce(rank: int, world: int, buf, average: bool = False):
    """Per-rank program: sum (or mean) of `buf` over all ranks, in place."""
    children = [child for child in (2 * rank + 1, 2 * rank + 2) if child < world]
    if children:
        yield [Recv(child, buf, reduce=True) for child in children]
    if rank > 0:
        parent = (rank - 1) // 2
        yield Send(parent, buf)
        yield Recv(parent, buf)
    if children:
        yield [Send(child, buf) for child in children]
    if average:
        buf.div_(world)
    return buf
