"""Naive all-reduce: everyone sends to rank 0, which sums and sends back.

Rank 0 receives the N-1 whole buffers (they arrive concurrently and share its
port) and adds them in one after another as they land; then it sends the result
to every rank. On a switch topology the root's port carries 2(N-1) buffers:
about 2(N-1)*S/B plus latency.
"""
from .ops import Recv, Send


def naive_all_reduce(rank: int, world: int, buf, average: bool = False):
    """Per-rank program: sum (or mean) of `buf` over all ranks, in place."""
    if rank == 0:
        if world > 1:
            yield [Recv(peer, buf, reduce=True) for peer in range(1, world)]
            yield [Send(peer, buf) for peer in range(1, world)]
    else:
        yield Send(0, buf)
        yield Recv(0, buf)
    if average:
        buf.div_(world)
    return buf
