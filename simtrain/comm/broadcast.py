"""Binomial-tree broadcast, from one root or from several roots at once.

Relative to a root, rank r has relative rank q = (r - root) mod N. In round
k = 0, 1, ... (mask = 2^k) every rank with q < mask that holds the data sends
it to the rank at q + mask; after ceil(log2 N) rounds everyone has it (the
MPICH binomial broadcast, Thakur et al. 2005). Each rank sends at most one
message per round, so on a fully connected topology one broadcast of S bytes
takes ceil(log2 N) * (alpha + S/B).

`broadcast(rank, world, buffers)` broadcasts `buffers[root]` from each root in
the mapping (every rank passes the same roots and buffer sizes; on a root its
buffer holds the data, elsewhere it receives it). The trees advance together,
round by round, so the latency of the rounds is paid once, not once per root:
this is how K-FAC shares out the results of inversions each device computed.
In round k rank r sends only to r + 2^k in every tree, so the messages of all
trees for that round share one link: on a fully connected topology a round
takes alpha + (bytes rank r sends in it)/B for the busiest r.

    program = broadcast(rank, world, {0: weights})          # plain broadcast from rank 0
    yield comm.run(rank, program, label="broadcast")
"""
from .ops import Recv, Send


def broadcast(rank: int, world: int, buffers: dict):
    """Per-rank program: every rank ends with buffers[root] as the root holds it, for every root."""
    roots = sorted(buffers)
    mask = 1
    while mask < world:
        ops = []
        for root in roots:
            relative = (rank - root) % world
            if relative < mask and relative + mask < world:
                ops.append(Send((rank + mask) % world, buffers[root]))
            elif mask <= relative < 2 * mask:
                ops.append(Recv((rank - mask) % world, buffers[root]))
        if ops:
            yield ops
        mask *= 2
    return buffers
