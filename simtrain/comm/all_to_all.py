"""All-to-all as per-rank programs: pairwise exchange, and a hierarchical form (NCCL's PXN order).

An all-to-all moves block (src, dst) of every rank's send buffer to rank dst,
which keeps the blocks it receives in source order. Sizes may differ per pair
(MPI's alltoallv, torch's `all_to_all_single` with split sizes, the dispatch of
a mixture-of-experts layer): `counts[src][dst]` is the rows (entries along
dimension 0) rank src sends to rank dst, and every rank is given the whole
matrix, as after the count exchange that precedes a token dispatch. Rank r's
`send` holds its blocks for ranks 0, 1, ... one after another (row r of
`counts`); its `recv` gets the blocks from ranks 0, 1, ... (column r). A rank's
own block is copied locally; an empty block moves nothing.

- `pairwise_all_to_all`: every rank posts its sends to and receives from every
  peer at once, as NCCL runs `ncclAllToAll` (a group of ncclSend/ncclRecv, one
  pair per peer; nccl-tests' alltoall.cu does the same).
- `hierarchical_all_to_all`: the ranks sit on hosts of g GPUs; the rank at
  host position i is on rail i. First inside each host: rank (h, i) sends to
  its host peer (h, j) every block it has for rail j, on any host (one message
  per peer). Then between hosts, one rail at a time: (h, j) forwards to (h', j)
  the blocks its host has for (h', j), gathered into one message. This is the
  order of NCCL's PXN (NVLink to the GPU on the destination's rail, then the
  network without crossing rails, NCCL 2.12); DeepEP's internode dispatch does
  the two hops the other way round (RDMA to the same-index GPU of the
  destination host, then NVLink). Each rank sends g-1 messages inside its host
  and n-1 between hosts, where pairwise sends N-g between hosts: g times fewer,
  g times larger. It needs hosts of equal size.

Closed forms (S bytes in every rank's send buffer, N ranks, balanced blocks of
S/N, every rank starting at once on an idle network, hop latency alpha):

- pairwise on a switch (links of B each way): every uplink and downlink
  carries N-1 blocks at an equal share, T = 2 alpha + (N-1)/N * S/B;
- pairwise on a ring of odd N (shortest paths, no ties): each directed link
  carries (N^2-1)/8 blocks, always saturated once the 1-hop blocks start,
  T = alpha + (N^2-1)/8 * S/(N B);
- on n hosts of g GPUs (a node switch of B_in per GPU, a NIC of B_out per GPU
  to one spine): pairwise overlaps the two link classes,
  T = max(2 alpha_in + (g-1)/N * S/B_in, 2 alpha_out + (N-g)/N * S/B_out);
  hierarchical runs its phases one after the other,
  T = 2 alpha_in + (g-1)/g * S/B_in + 2 alpha_out + (n-1)/n * S/B_out.

    counts = [[2, 1], [0, 3]]                       # rows rank src sends to rank dst
    program = pairwise_all_to_all(rank, 2, send, recv, counts)
    program = hierarchical_all_to_all(rank, 4, send, recv, counts4, hosts=[[0, 1], [2, 3]])
"""
import torch

from .ops import Recv, Send


def pairwise_all_to_all(rank: int, world: int, send: torch.Tensor, recv: torch.Tensor, counts, *, tag: int = 0):
    """Per-rank program: `recv` gets block (src, rank) of every rank's `send`, in source order."""
    sends = send.split(_row(counts, rank, world))
    recvs = recv.split(_column(counts, rank, world))
    recvs[rank].copy_(sends[rank])
    ops = [Send(peer, sends[peer], tag) for peer in range(world) if peer != rank and counts[rank][peer]]
    ops += [Recv(peer, recvs[peer], tag=tag) for peer in range(world) if peer != rank and counts[peer][rank]]
    if ops:
        yield ops
    return recv


def hierarchical_all_to_all(rank: int, world: int, send: torch.Tensor, recv: torch.Tensor, counts, *, hosts,
                            tag: int = 0):
    """Per-rank program: the all-to-all of `pairwise_all_to_all`, inside each host first, then per rail.

    `hosts` lists each host's ranks; the rank at position i of its host is on rail i."""
    host = next(index for index, ranks in enumerate(hosts) if rank in ranks)
    local, position = hosts[host], hosts[host].index(rank)
    rails = [list(ranks) for ranks in zip(*hosts)]  # rails[j]: the rank at position j of every host
    if len(rails) * len(hosts) != world or any(len(ranks) != len(local) for ranks in hosts):
        raise ValueError(f"hierarchical all-to-all needs hosts of equal size covering {world} ranks, got {hosts}")
    sends = send.split(_row(counts, rank, world))
    recvs = recv.split(_column(counts, rank, world))

    # Inside the host: the blocks for rail j's ranks (host order) go to host peer j in one message.
    def rail_rows(src: int, j: int) -> list[int]:
        return [counts[src][dst] for dst in rails[j]]

    ops, staged = [], {}
    for j, peer in enumerate(local):
        if peer != rank and sum(rail_rows(rank, j)):
            ops.append(Send(peer, torch.cat([sends[dst] for dst in rails[j]]), tag))
    for peer in local:
        rows = rail_rows(peer, position)
        if peer == rank:
            staged[peer] = [sends[dst] for dst in rails[position]]
        elif sum(rows):
            buffer = send.new_empty((sum(rows), *send.shape[1:]))
            ops.append(Recv(peer, buffer, tag=tag))
            staged[peer] = buffer.split(rows)
    if ops:
        yield ops
    # staged[src][h]: the block host peer src sends to this rail's rank on host h; this host's are final.
    for src in local:
        if src in staged:
            recvs[src].copy_(staged[src][host])

    # Between hosts, along this rank's rail: everything the host has for (h', position), one message each.
    ops, landed = [], []
    for h, dst in enumerate(rails[position]):
        if h != host and sum(counts[src][dst] for src in local):
            ops.append(Send(dst, torch.cat([staged[src][h] for src in local if src in staged]), tag))
    for h, peer in enumerate(rails[position]):
        rows = [counts[src][rank] for src in hosts[h]]
        if h != host and sum(rows):
            buffer = send.new_empty((sum(rows), *send.shape[1:]))
            ops.append(Recv(peer, buffer, tag=tag))
            landed.append((hosts[h], buffer.split(rows)))
    if ops:
        yield ops
    for sources, blocks in landed:
        for src, block in zip(sources, blocks):
            recvs[src].copy_(block)
    return recv


ALL_TO_ALL = {"pairwise": pairwise_all_to_all, "hierarchical": hierarchical_all_to_all}


def _row(counts, rank: int, world: int) -> list[int]:
    return [int(counts[rank][dst]) for dst in range(world)]


def _column(counts, rank: int, world: int) -> list[int]:
    return [int(counts[src][rank]) for src in range(world)]
