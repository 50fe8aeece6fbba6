"""All-gather and reduce-scatter of sequence shards as ring programs: sequence parallelism's collectives.

Under sequence parallelism (Korthikanti et al. 2022) tp rank r holds part r of
a (batch, sequence, hidden) activation's sequence. Its two collectives are the
two halves of a ring all-reduce (ring.py): each rank sends (N - 1)/N of the
whole tensor in each, so a reduce-scatter and an all-gather move exactly the
bytes of one all-reduce. The ring phases want equal parts of a flat buffer,
so the sequence goes first ((sequence, batch, hidden), Megatron-LM's own
layout) and part r of the buffer is rank r's shard; the rings are rotated so
that rank r ends with part r (ring.py's phases leave part r + 1 at rank r).

`gather_program(rank, world, shard)` and `scatter_program(rank, world, whole)`
return (program, result): the per-rank program, and the tensor that holds the
result once it has run, in the (batch, sequence, hidden) layout.

    program, whole = gather_program(rank, 2, shard)      # shard (b, s/2, h) -> whole (b, s, h)
    yield Collective(program, "tp_allgather", comm, rank)
"""
import torch

from .ring import ring_all_gather, ring_reduce_scatter


def gather_program(rank: int, world: int, shard: torch.Tensor):
    """(program, whole): every rank's sequence shard (dimension 1 of `shard`) gathered into `whole`."""
    buffer = shard.new_empty((shard.shape[1] * world, shard.shape[0], *shard.shape[2:]))
    parts = buffer.tensor_split(world)
    parts[rank].copy_(shard.transpose(0, 1))
    return _all_gather(rank, world, parts), buffer.transpose(0, 1)


def scatter_program(rank: int, world: int, whole: torch.Tensor):
    """(program, shard): `whole` summed over the ranks, and rank `rank`'s part of the sum's sequence."""
    buffer = whole.transpose(0, 1).contiguous()
    parts = buffer.tensor_split(world)
    return _reduce_scatter(rank, world, parts), parts[rank].transpose(0, 1)


SEQUENCE_COLLECTIVES = {"all_gather": gather_program, "reduce_scatter": scatter_program}


def _rotated(rank: int, world: int, parts) -> tuple[int, int, list]:
    """(right, left, parts so that ring position p + 1 is part p)."""
    return (rank + 1) % world, (rank - 1) % world, [parts[(i - 1) % world] for i in range(world)]


def _all_gather(rank: int, world: int, parts):  # its name names its collective (a span's op)
    yield from ring_all_gather(rank, *_rotated(rank, world, parts))


def _reduce_scatter(rank: int, world: int, parts):
    yield from ring_reduce_scatter(rank, *_rotated(rank, world, parts))


def gather_steps(rank: int, world: int, shard: torch.Tensor):
    """(programs, whole): gather_program's ring as its world - 1 steps, each a program of its own (a step sends
    one shard on to the next rank and receives one from the previous: parallel.tp_comm_overlap's ring exchange,
    strategies/tp_overlap.py)."""
    program, whole = gather_program(rank, world, shard)
    return _one_program_a_step(program), whole


def scatter_splits(rank: int, world: int, whole: torch.Tensor, splits: int):
    """(programs, fractions, shard): scatter_program's reduce-scatter as `splits` reduce-scatters one after
    another, split k of every rank's part of the sequence (at most one position each) in the k-th; each
    element is summed in the same ring order as by scatter_program, so the sum is the same bit for bit.
    `fractions`: each split's share of the tensor (parallel.tp_comm_overlap's pipelined GEMM + reduce-scatter,
    strategies/tp_overlap.py)."""
    buffer = whole.transpose(0, 1).contiguous()
    parts = buffer.tensor_split(world)
    cuts = [part.tensor_split(min(splits, len(part))) for part in parts]
    programs = [_reduce_scatter(rank, world, [cut[k] for cut in cuts]) for k in range(len(cuts[0]))]
    return programs, [len(piece) / len(parts[0]) for piece in cuts[0]], parts[rank].transpose(0, 1)


def _one_program_a_step(program) -> list:
    """Each yield of a ring program whose steps do not depend on what the earlier ones returned, as a program."""
    return [_step(operations) for operations in program]


def _step(operations):
    yield operations
