"""Hierarchical all-reduce (Ying et al. 2018's 2D scheme, Horovod's hierarchical mode).

The group's ranks sit on n hosts of g GPUs each. Three phases:

1. reduce-scatter inside each host: a ring over the host's g ranks leaves the
   rank at host position p with chunk p+1 of g, summed over the host;
2. all-reduce across hosts: the ranks at the same position p of every host run
   a ring all-reduce of that chunk among themselves, each through its own NIC
   (its rail), so all g rails work at once;
3. all-gather inside each host: the ring spreads the g summed chunks.

Uncontended, with B_intra per GPU inside a host and B_inter per NIC, the time
is 2(g-1)/g * S/B_intra + 2(n-1)/n * S/(g * B_inter) plus 2(g-1) intra-host and
2(n-1) inter-host step latencies. `hosts` lists each host's ranks in the ring
order to use (a channel's order, channels.py); `tag` keeps channels apart.

    program = hierarchical_all_reduce(rank, 16, buf, hosts=[[0, ..., 7], [8, ..., 15]])
"""
from .ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter


def hierarchical_all_reduce(rank: int, world: int, buf, average: bool = False, *, hosts, tag: int = 0):
    """Per-rank program: sum (or mean) of `buf` over all ranks of `hosts`, in place."""
    host = next(ranks for ranks in hosts if rank in ranks)
    size = len(host)
    position = host.index(rank)
    chunks = buf.tensor_split(size)
    right, left = host[(position + 1) % size], host[position - 1]
    yield from ring_reduce_scatter(position, right, left, chunks, tag)
    across = [ranks[position] for ranks in hosts]
    yield from ring_all_reduce(rank, len(across), chunks[(position + 1) % size], ring=across, tag=tag)
    yield from ring_all_gather(position, right, left, chunks, tag)
    if average:
        buf.div_(world)
    return buf
