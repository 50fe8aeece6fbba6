"""Tensor-parallel communication overlapped with the GEMMs next to it: Megatron-Core's `--tp-comm-overlap`.

Under sequence parallelism every transformer layer all-gathers its input's
sequence shards before its column-parallel Linears (the QKV projection, the
first MLP Linear) and reduce-scatters the partial outputs of its row-parallel
Linears (the output projection, the second MLP Linear); in the backward the
all-gather's reduce-scatter and the reduce-scatter's all-gather come back on
the gradients. Transformer Engine's userbuffers (what `--tp-comm-overlap`
turns on) cut each of them into pieces pipelined with slices of the GEMM next
to it. Its default configuration (`initialize_ub` in Transformer Engine's
`transformer_engine/pytorch/module/base.py`: `methods`) is what
`parallel.tp_comm_overlap: true` models:

- **ring exchange** (`qkv_fprop`, `fc1_fprop`, `proj_dgrad`, `fc2_dgrad`): the
  all-gather runs as its tp - 1 ring steps; at each, the block already here
  goes on to the next tp rank while the GEMM computes on it, one 1/tp slice a
  step, the last slice after the last step:
  `c + (tp - 1) max(c, s)` for a slice's compute c and a step's transfer s.
  Forward: the all-gather before the QKV and first MLP Linears beside those
  GEMMs. Backward: the all-gather of the output gradient beside the output
  projection's and the second MLP Linear's input-gradient GEMMs (their weight
  gradient follows, with the gradient gathered);
- **pipeline** (`proj_fprop`, `fc2_fprop`, `num_splits` 4): the GEMM whose
  output is reduce-scattered runs in 4 slices, each a quarter of every rank's
  part of the sequence; each slice's reduce-scatter starts once that slice and
  the previous reduce-scatter are done (one communication stream), beside the
  next slices: `g + r + (n - 1) max(g, r)` for n slices of compute g and
  reduce-scatters of r;
- **bulk** (`qkv_dgrad`, `fc1_dgrad`, `qkv_wgrad`, `fc1_wgrad`): the re-gather of
  the saved sequence shard beside the QKV and first MLP Linears' input
  gradient (strategies/saved_shards.py, there without the overlap too), and the
  reduce-scatter of that input gradient beside their weight gradient.

Every step moves real tensors on the tp group's links (comm/sequence_shards.py
`gather_steps`, `scatter_splits`: the same bytes as the whole collective, and
the same sums, so the numerics are those without the overlap, bit for bit).
The SMs the userbuffers kernels take are the default configuration's too
(`num_sm`, `set_sm_margin`: 1 SM and no margin for a ring exchange, whose
steps are copies; `COMM_SMS` = 16 for a pipeline or bulk overlap, taken from
the GEMM): the pipeline's slices and the bulk overlaps' GEMMs run on the
device's other SMs (`Compute.sm_margin`: on an H100's 132, 116 of them, the
time x 132/116; hw/device.py), the ring exchange's slices on all of them; a
device without an SM count (a custom one) gives none. Not modelled: a GEMM
cut in slices running below the whole GEMM's efficiency.

Which GEMMs those are is measured, not assumed: `GemmWatch` watches the
operators of a chunk's measurement on its meta copy (schemes/chunk_measurement.py
`measure_chunk`) and costs each operator with FLOPs by an operator recorder of
its own (op_cost.py); the GEMMs that read the gathered input (or a copy of it)
are the ones beside an all-gather, the one that writes what is
reduce-scattered the one beside a reduce-scatter. Only the layers' collectives
are overlapped (train/tensor_parallel.py `beside_gemm`): a vocabulary-parallel
head's all-gather and an embedding's reduce-scatter are not (Megatron-Core's
output layer and embedding are not Transformer Engine modules). `carve` takes
those GEMMs out of the regions' costs into a `TpOverlap`, which the step
programs of stage_execution.py run beside the collectives:

    watches = GemmWatch(parameters), GemmWatch(parameters)   # measuring the forward, the backward: cut at each region
    overlap, forward, backward, splits = carve(*watches, boundaries, forward, backward, splits)
    result = yield from ring_exchange(communicate, shard, overlap.gather_beside[region], dtype, "forward")
"""
import functools
import math
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..comm.sequence_shards import gather_steps, scatter_splits
from ..op_cost import OpCosts, OperatorRecorder, merged, scaled, without
from ..step_ops import Await, Compute, Post
from ..storage_identity import StorageIds
from ..train.tensor_parallel import AllGather, ReduceScatter
from .representatives import MirroredCollective

PIPELINE_SPLITS = 4  # Transformer Engine's default num_splits of a "pipeline" overlap
COMM_SMS = 16  # Transformer Engine's default num_sm of a "pipeline" or "bulk" overlap, taken from its GEMM
STEPWISE = ("all_gather_steps", "reduce_scatter_splits")  # the kinds a `communicate` gives in pieces


class Gemm(NamedTuple):
    """GEMMs run beside a tp collective: their FLOPs and operators."""

    flops: float
    ops: OpCosts


class TpOverlap(NamedTuple):
    """What a chunk runs beside its tp collectives, region by region."""

    gather_beside: tuple  # per forward region: the Gemm ring-exchanged with the all-gather before it, or None
    scatter_beside: tuple  # per forward region: the Gemm pipelined with the reduce-scatter after it, or None
    # per backward region: its input-gradient Gemm, ring-exchanged with the all-gather of its output gradient
    grad_gather_beside: tuple
    grad_scatter_beside: tuple  # per backward region: its input gradient reduce-scattered beside its weight gradient


class _Operator(NamedTuple):
    """An operator with FLOPs seen by GemmWatch."""

    reads_gathered: bool  # it reads the gathered tensor of its region, or a copy of it
    reads_parameter: bool  # it reads a parameter, or a copy of one (an fp8 cast of a weight)
    writes: set  # storages of its outputs and of their copies (their views, a bias added after it)
    flops: float
    ops: OpCosts


class GemmWatch(TorchDispatchMode):
    """Measuring: each region's operators with FLOPs (in regions cut by `cut`), which of them read the tensor the
    all-gather before the region gave (`communicating` notes it) or a parameter, and what each reduce-scatter
    scattered. An operator without FLOPs whose output has as many elements as a tensor it reads is a copy of it
    (a view, a cast, a bias added): its output carries that tensor's marks. An output of another size (an fp8
    cast's scale, train/fp8_kernels.py) is no copy and carries none."""

    def __init__(self, parameters):
        super().__init__()
        self._ids = StorageIds()  # storages by serial number: an address may be handed to a new storage
        self._parameters = {self._ids.of(p) for p in parameters}
        self._probe = OperatorRecorder()
        self.regions: list[list[_Operator]] = []
        self.scattered: dict[int, int] = {}  # region -> storage of what the reduce-scatter after it scattered
        self._current: list[_Operator] = []
        # storages of the gathered tensor and its copies (numbers only: a reference kept here would keep autograd
        # from taking a gradient over without a copy, and change what is measured)
        self._gathered: set[int] = set()
        self._written_by: dict[int, _Operator] = {}  # storage -> the operator with FLOPs that wrote it

    def cut(self) -> None:
        """The current region has ended."""
        self.regions.append(self._current)
        self._current, self._gathered = [], set()

    def communicating(self, communicate):
        """`communicate` noting, for each all-gather, what it gives the next region and, for each
        reduce-scatter, what it scatters."""
        def noting(kind, tensor):
            reduced, result = communicate(kind, tensor)
            if kind == "all_gather":
                self._gathered = {self._ids.of(result)}
            elif kind == "reduce_scatter":
                self.scattered[len(self.regions) - 1] = self._ids.of(tensor)
            return reduced, result
        return noting

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [(self._ids.of(t), t.numel()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        before = self._probe.flops
        with self._probe:
            out = func(*args, **kwargs)
        ops = self._probe.take()
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if self._probe.flops > before:
            reads = {storage for storage, _ in inputs}
            operator = _Operator(bool(reads & self._gathered), bool(reads & self._parameters),
                                 {self._ids.of(t) for t in outputs}, self._probe.flops - before, ops)
            self._current.append(operator)
            self._written_by.update((storage, operator) for storage in operator.writes)
            return out
        for tensor in outputs:
            copied = [storage for storage, numel in inputs if numel == tensor.numel()]
            storage = self._ids.of(tensor)
            if any(source in self._gathered for source in copied):
                self._gathered.add(storage)
            if any(source in self._parameters for source in copied):
                self._parameters.add(storage)
            writers = [self._written_by[source] for source in copied if source in self._written_by]
            if writers:
                writers[-1].writes.add(storage)
                self._written_by[storage] = writers[-1]
        return out


def carve(forward_watch: GemmWatch, backward_watch: GemmWatch, boundaries: list, forward: list, backward: list,
          splits: tuple) -> tuple[TpOverlap, list, list, tuple]:
    """(TpOverlap, and the regions' (FLOPs, collective, OpCosts, parameters) forward and backward and the backward's
    RegionSplits without the GEMMs it runs beside collectives). `boundaries`: the chunk's tp boundary ops in
    forward order, boundary b after forward region b; backward region s is forward region n - 1 - s."""
    n = len(forward)
    assert len(forward_watch.regions) == len(backward_watch.regions) == n, "GemmWatch cut the regions apart"
    marked = [getattr(op, "beside_gemm", False) for op in boundaries]

    def after(b, kind):  # whether forward boundary b is one of a layer's collectives of this type
        return 0 <= b < n - 1 and marked[b] and type(boundaries[b]) is kind
    gather = [_gemm([o for o in forward_watch.regions[r] if o.reads_gathered]) if after(r - 1, AllGather) else None
              for r in range(n)]
    scatter = [_gemm([o for o in forward_watch.regions[r] if forward_watch.scattered.get(r) in o.writes][-1:])
               if after(r, ReduceScatter) else None for r in range(n)]
    forward = [_less(region, gather[r], scatter[r]) for r, region in enumerate(forward)]
    grad_gather, splits = [None] * n, list(splits or [None] * n)
    for s in range(n):
        gemm = (_gemm([o for o in backward_watch.regions[s] if o.reads_gathered and o.reads_parameter])
                if after(n - 1 - s, ReduceScatter) else None)
        split = splits[s]
        if gemm is not None and split is not None:
            if split.before_flops < gemm.flops:  # the input-gradient GEMM is not where it was looked for: alone
                gemm = None
            else:
                splits[s] = split._replace(before_flops=split.before_flops - gemm.flops,
                                           before_ops=without(split.before_ops, gemm.ops))
        grad_gather[s] = gemm
        backward[s] = _less(backward[s], gemm)
    scatter_bulk = tuple(after(n - 2 - s, AllGather) and splits[s] is not None for s in range(n))
    has_split = any(split is not None for split in splits)
    return (TpOverlap(tuple(gather), tuple(scatter), tuple(grad_gather), scatter_bulk), forward, backward,
            tuple(splits) if has_split else ())


def _gemm(operators: list[_Operator]) -> Gemm | None:
    if not operators:
        return None
    ops = ()
    for operator in operators:
        ops = merged(ops, operator.ops)
    return Gemm(sum(operator.flops for operator in operators), ops)


def _less(region: tuple, *gemms) -> tuple:
    """A region's (FLOPs, collective, OpCosts, parameters) without `gemms` (None: none)."""
    flops, reduced, ops, params = region
    for gemm in gemms:
        if gemm is not None:
            flops, ops = flops - gemm.flops, without(ops, gemm.ops)
    return flops, reduced, ops, params


# --- the step programs ---

def ring_exchange(communicate, shard: torch.Tensor, gemm: Gemm, dtype: str, name: str):
    """Step program: the all-gather of `shard` in its ring steps, each posted beside a 1/tp slice of `gemm` and
    awaited after it, the last slice after the last step, on all of the device's SMs (the steps are copies, which
    take none); returns the gathered tensor. The slices are the start of the next region's compute, Computes
    named `name` + "_part" (a region's compute ends with one named `name`: strategies/bucket_overlap.py counts
    regions by it)."""
    steps, result = communicate("all_gather_steps", shard)
    slices = len(steps) + 1
    piece = Compute(gemm.flops / slices, dtype, f"{name}_part", ops=scaled(gemm.ops, 1 / slices))
    for collective, _ in steps:
        handle = yield Post(*collective)
        yield piece
        yield Await(handle)
    yield piece
    return result


def pipelined_scatter(communicate, whole: torch.Tensor, gemm: Gemm, dtype: str, name: str):
    """Step program: `gemm` in slices, each slice's reduce-scatter posted once the slice and the one before it
    are done (one communication stream) and running beside the next slices, every slice on the SMs the
    reduce-scatter's COMM_SMS leave; returns the rank's shard. The last slice ends its region's compute (named
    `name`, the others `name` + "_part")."""
    splits, result = communicate("reduce_scatter_splits", whole)
    handle = None
    for number, (collective, fraction) in enumerate(splits):
        yield Compute(gemm.flops * fraction, dtype, name if number == len(splits) - 1 else f"{name}_part",
                      ops=scaled(gemm.ops, fraction), sm_margin=COMM_SMS)
        if handle is not None:
            yield Await(handle)
        handle = yield Post(*collective)
    yield Await(handle)
    return result


def forward_beside(overlap: TpOverlap | None, region: int, kind: str):
    """The step program that runs forward region `region`'s compute (less its GEMMs beside collectives) and the
    collective `kind` after it beside a GEMM (fn(compute, communicate, tensor) -> the collective's result), or
    None where the collective runs alone."""
    if overlap is None:
        return None
    if kind == "all_gather" and overlap.gather_beside[region + 1] is not None:
        def gather(compute: Compute, communicate, tensor):
            yield compute
            return (yield from ring_exchange(communicate, tensor, overlap.gather_beside[region + 1], compute.dtype,
                                             "forward"))
        return gather
    if kind == "reduce_scatter" and overlap.scatter_beside[region] is not None:
        def scatter(compute: Compute, communicate, tensor):
            yield compute._replace(name="forward_part")
            return (yield from pipelined_scatter(communicate, tensor, overlap.scatter_beside[region], compute.dtype,
                                                 "forward"))
        return scatter
    return None


# --- the pieces of a collective, for a rank's `communicate` (schemes/model_parallel.py) ---

def stepwise(kind: str, rank: int, world: int, tensor: torch.Tensor):
    """([(program, fraction of the GEMM beside it)], result) of `kind` (STEPWISE) on `tensor` across a tp group
    of `world`: the ring steps of a sequence all-gather, or the pipelined splits of a reduce-scatter
    (comm/sequence_shards.py)."""
    if kind == "all_gather_steps":
        programs, whole = gather_steps(rank, world, tensor)
        return [(program, 1 / world) for program in programs], whole
    programs, fractions, shard = scatter_splits(rank, world, tensor, PIPELINE_SPLITS)
    return list(zip(programs, fractions)), shard


def mirrored_stepwise(kind: str, tensor: torch.Tensor, world: int):
    """stepwise's pieces for a representative (numerics off, strategies/representatives.py): a ring step is timed as
    a block sent on to the next rank (ring attention's step, the same concurrency), a split as the ring
    reduce-scatter of its parts."""
    shape = list(tensor.shape)
    shape[1] = shape[1] * world if kind == "all_gather_steps" else shape[1] // world
    result = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)  # torch.empty: meta's new_empty is Python
    return list(_mirrored_pieces(kind, tuple(tensor.shape), tensor.dtype, world)), result


@functools.lru_cache(maxsize=256)
def _mirrored_pieces(kind: str, shape: tuple[int, ...], dtype: torch.dtype, world: int) -> tuple:
    """mirrored_stepwise's pieces for a tensor of `shape` and `dtype` (meta buffers: only their size and dtype
    are read), made once for each: a representative's layers ask for the same few tens of thousands of times."""
    if kind == "all_gather_steps":
        step = MirroredCollective("kv_ring", torch.empty(math.prod(shape), dtype=dtype, device="meta"))
        return ((step, 1 / world),) * (world - 1)
    rows, rest = shape[1] // world, math.prod(shape) // shape[1]  # a part's positions; the elements of one position
    cuts = torch.empty(rows, device="meta").tensor_split(min(PIPELINE_SPLITS, rows))
    return tuple((MirroredCollective("reduce_scatter", torch.empty(world * len(cut) * rest, dtype=dtype,
                                                                   device="meta")), len(cut) / rows) for cut in cuts)
