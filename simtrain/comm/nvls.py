"""NVLS: collectives reduced and multicast inside an NVSwitch (NVLink SHARP, NCCL's NVLS and NVLS-tree).

An NVSwitch of the H100 generation can sum what GPUs send it and send one
message to many GPUs at once. NCCL's NVLS all-reduce on one node has two phases
over a buffer cut into one shard per GPU (GPU j owns shard j):

1. reduce-scatter: the switch reads shard j from every GPU, sums it, and
   returns the sum to GPU j (`multimem.ld_reduce`);
2. all-gather: GPU j stores its summed shard to the switch, which multicasts
   it to every GPU (`multimem.st`).

Each GPU's link carries S(1 + 1/N) each way for an S-byte buffer on N GPUs,
against 2(N-1)/N·S for a ring, and each GPU adds nothing itself. Here the
switch is a rank of the communicator (its network node), running its own
program: the sums are done on its receiving buffer, so they are real torch
sums with numerics on. Each shard is pipelined in pieces (dbtree.pieces_for),
piece k of phase 2 moving while piece k+1 is in phase 1, so that on the flow
model the time is about (P + 3)/P · S(1 + 1/N)/B for P pieces.

`reduce` alone is NVLS's reduce-scatter, `gather` alone its all-gather (GPU j
holding shard j of its buffer). `nvls_tree_all_reduce` is NCCL's NVLS-tree
for several nodes: each piece is reduced in its node's switch, its owner then
exchanges the node's sum with the owners of the same shard on the other nodes
(one per node, each through its own NIC: one step between nodes, which on two
nodes is what NCCL's tree of nodes sends; on more nodes NCCL's tree sends each
NIC less than this direct exchange's (n-1) pieces), and stores the total to
its switch for the multicast, every stage pipelined with the others.

    programs = [nvls_all_reduce(rank, buf[rank], gpus=[0, ..., 7], switch=8) for rank in range(8)]
    programs.append(nvls_switch(torch.zeros_like(buf[0]), gpus=[0, ..., 7]))
    nvls_tree_all_reduce(rank, 16, buf, hosts=[[0, ..., 7], [8, ..., 15]], switch=16 + rank // 8)
"""
from .dbtree import pieces_for
from .ops import Concurrently, Recv, Send


def nvls_all_reduce(rank: int, buf, *, gpus, switch: int, reduce: bool = True, gather: bool = True,
                    peers=None, tag: int = 0, pieces: int | None = None):
    """Per-GPU program: sum of `buf` over `gpus` through the reducing `switch` (ranks of the communicator).

    `peers[j]`, for NVLS-tree: the ranks on the other nodes that own shard j, with which the owner here
    exchanges its node's sum of each piece before storing it to the switch."""
    shards = buf.tensor_split(len(gpus))
    yield Concurrently([_gpu_shard(rank == owner, shard, switch, peers[j] if peers else (), reduce, gather,
                                   tag + j, pieces)
                        for j, (owner, shard) in enumerate(zip(gpus, shards))])
    return buf


def nvls_switch(accumulator, *, gpus, reduce: bool = True, gather: bool = True, across_nodes: bool = False,
                tag: int = 0, pieces: int | None = None):
    """The switch's program: `accumulator` (zeros, the buffer's size) holds each shard's sum as it passes;
    `across_nodes` leaves a step for the owners' exchange between nodes (NVLS-tree)."""
    shards = accumulator.tensor_split(len(gpus))
    yield Concurrently([_switch_shard(owner, gpus, shard, reduce, gather, across_nodes, tag + j, pieces)
                        for j, (owner, shard) in enumerate(zip(gpus, shards))])
    return accumulator


def nvls_tree_all_reduce(rank: int, world: int, buf, *, hosts, switch: int, pieces: int | None = None):
    """Per-GPU program of NVLS-tree: `hosts` lists each node's GPU ranks, all nodes alike; `switch` the
    communicator rank of this GPU's node switch. Shard j's owner on each node exchanges the node's sum of
    every piece with shard j's owners on the other nodes, pipelined with the switch's reduce and multicast."""
    host = next(ranks for ranks in hosts if rank in ranks)
    peers = [[ranks[j] for ranks in hosts if ranks is not host] for j in range(len(host))]
    yield from nvls_all_reduce(rank, buf, gpus=host, switch=switch, peers=peers, pieces=pieces)
    return buf


def _steps(reduce: bool, gather: bool, across_nodes: bool) -> dict:
    """The step, counted from a piece's first, at which each stage handles that piece."""
    steps, step = {}, 0
    for stage, present in (("contribute", reduce), ("return", reduce), ("exchange", reduce and across_nodes),
                           ("store", gather), ("multicast", gather)):
        if present:
            steps[stage] = step
            step += 1
    return steps


def _gpu_shard(owner: bool, shard, switch: int, peers, reduce: bool, gather: bool, tag: int, pieces):
    count = pieces if pieces is not None else pieces_for(shard.nbytes)
    parts = shard.tensor_split(count)
    at = _steps(reduce, gather, bool(peers))
    received = [[part.clone() for part in parts] for _ in peers] if owner and peers else []
    for step in range(count + max(at.values())):
        ops, summed = [], None
        piece = {stage: step - offset for stage, offset in at.items() if 0 <= step - offset < count}
        if "contribute" in piece:
            ops.append(Send(switch, parts[piece["contribute"]], tag))  # the switch reads the piece
        if owner and "return" in piece:
            ops.append(Recv(switch, parts[piece["return"]], False, tag))  # its sum over the node comes back
        if owner and "exchange" in piece:
            summed = piece["exchange"]
            for peer, scratch in zip(peers, received):
                ops += [Send(peer, parts[summed], tag), Recv(peer, scratch[summed], False, tag)]
        if owner and "store" in piece:
            ops.append(Send(switch, parts[piece["store"]], tag))  # stored to the multicast address
        if "multicast" in piece:
            ops.append(Recv(switch, parts[piece["multicast"]], False, tag))  # and every GPU receives it
        if ops:
            yield ops
        if summed is not None:
            for scratch in received:
                parts[summed].add_(scratch[summed])
    return shard


def _switch_shard(owner: int, gpus, shard, reduce: bool, gather: bool, across_nodes: bool, tag: int, pieces):
    count = pieces if pieces is not None else pieces_for(shard.nbytes)
    parts = shard.tensor_split(count)
    at = _steps(reduce, gather, across_nodes)
    for step in range(count + max(at.values())):
        ops = []
        piece = {stage: step - offset for stage, offset in at.items() if 0 <= step - offset < count}
        if "contribute" in piece:
            ops.extend(Recv(gpu, parts[piece["contribute"]], True, tag) for gpu in gpus)
        if "return" in piece:
            ops.append(Send(owner, parts[piece["return"]], tag))
        if "store" in piece:
            ops.append(Recv(owner, parts[piece["store"]], False, tag))
        if "multicast" in piece:
            ops.extend(Send(gpu, parts[piece["multicast"]], tag) for gpu in gpus)
        if ops:
            yield ops
    return shard
