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
for several nodes: phase 1 inside each node, then a double binary tree between
nodes of each shard, among the GPUs that own it (one per node, each through its
own NIC), then phase 2 inside each node.

    programs = [nvls_all_reduce(rank, buf[rank], gpus=[0, ..., 7], switch=8) for rank in range(8)]
    programs.append(nvls_switch(torch.zeros_like(buf[0]), gpus=[0, ..., 7]))
"""
from .dbtree import dbtree_all_reduce, pieces_for
from .ops import Concurrently, Recv, Send


def nvls_all_reduce(rank: int, buf, *, gpus, switch: int, reduce: bool = True, gather: bool = True,
                    tag: int = 0, pieces: int | None = None):
    """Per-GPU program: sum of `buf` over `gpus` through the reducing `switch` (ranks of the communicator)."""
    shards = buf.tensor_split(len(gpus))
    yield Concurrently([_gpu_shard(rank == owner, shard, switch, reduce, gather, tag + j, pieces)
                        for j, (owner, shard) in enumerate(zip(gpus, shards))])
    return buf


def nvls_switch(accumulator, *, gpus, reduce: bool = True, gather: bool = True, tag: int = 0,
                pieces: int | None = None):
    """The switch's program: `accumulator` (zeros, the buffer's size) holds each shard's sum as it passes."""
    shards = accumulator.tensor_split(len(gpus))
    yield Concurrently([_switch_shard(owner, gpus, shard, reduce, gather, tag + j, pieces)
                        for j, (owner, shard) in enumerate(zip(gpus, shards))])
    return accumulator


def nvls_tree_all_reduce(rank: int, world: int, buf, *, hosts, switch: int, pieces: int | None = None):
    """Per-GPU program of NVLS-tree: `hosts` lists each node's GPU ranks, all nodes alike; `switch` the
    communicator rank of this GPU's node switch."""
    host = next(ranks for ranks in hosts if rank in ranks)
    position = host.index(rank)
    yield from nvls_all_reduce(rank, buf, gpus=host, switch=switch, gather=False, pieces=pieces)
    shard = buf.tensor_split(len(host))[position]
    rail = [ranks[position] for ranks in hosts]
    yield from dbtree_all_reduce(rank, len(rail), shard, order=rail, tags=(len(host), len(host) + 1))
    yield from nvls_all_reduce(rank, buf, gpus=host, switch=switch, reduce=False, pieces=pieces)
    return buf


def nvls_tree_switch(accumulator, *, gpus, pieces: int | None = None):
    """A node switch's program in NVLS-tree: the reduce phase, then (after the trees) the multicast."""
    yield from nvls_switch(accumulator, gpus=gpus, gather=False, pieces=pieces)
    yield from nvls_switch(accumulator, gpus=gpus, reduce=False, pieces=pieces)
    return accumulator


def _offsets(reduce: bool, gather: bool) -> tuple[int, int]:
    """Steps after which the store to the switch and the multicast start: after the reduce's two."""
    return (2, 3) if reduce else (0, 1)


def _gpu_shard(owner: bool, shard, switch: int, reduce: bool, gather: bool, tag: int, pieces):
    count = pieces if pieces is not None else pieces_for(shard.nbytes)
    parts = shard.tensor_split(count)
    store, multicast = _offsets(reduce, gather)
    for step in range(count + (multicast if gather else 1)):
        ops = []
        if reduce and step < count:
            ops.append(Send(switch, parts[step], tag))  # the switch reads piece `step`
        if reduce and owner and 1 <= step <= count:
            ops.append(Recv(switch, parts[step - 1], False, tag))  # its sum comes back to the owner
        if gather and owner and store <= step < count + store:
            ops.append(Send(switch, parts[step - store], tag))  # the owner stores it to the multicast address
        if gather and multicast <= step < count + multicast:
            ops.append(Recv(switch, parts[step - multicast], False, tag))  # and every GPU receives it
        if ops:
            yield ops
    return shard


def _switch_shard(owner: int, gpus, shard, reduce: bool, gather: bool, tag: int, pieces):
    count = pieces if pieces is not None else pieces_for(shard.nbytes)
    parts = shard.tensor_split(count)
    store, multicast = _offsets(reduce, gather)
    for step in range(count + (multicast if gather else 1)):
        ops = []
        if reduce and step < count:
            ops.extend(Recv(gpu, parts[step], True, tag) for gpu in gpus)
        if reduce and 1 <= step <= count:
            ops.append(Send(owner, parts[step - 1], tag))
        if gather and store <= step < count + store:
            ops.append(Recv(owner, parts[step - store], False, tag))
        if gather and multicast <= step < count + multicast:
            ops.extend(Send(gpu, parts[step - multicast], tag) for gpu in gpus)
        if ops:
            yield ops
    return shard
