"""Megatron-Core's overlap of the distributed optimizer's collectives with the compute, bucket by bucket.

With `parallel.sharding.overlap_grad_reduce` (stages 1 and 2 under pp/tp,
strategies/distributed_optimizer.py) a rank's gradient buffer is cut as
Megatron-Core's DistributedDataParallel cuts it
(megatron/core/distributed/param_and_grad_buffer.py): each model chunk (the
rank's pipeline stage's part; each virtual stage's) has its own buffer, and
the first stage's first chunk is cut into **buckets**, its parameters taken
in reverse order (the order the backward completes them), a bucket closed
once it holds `bucket_size` elements (default max(40,000,000, 1,000,000 x
dp x cp)); every other chunk is one bucket (Megatron-Core turns bucketing
off there: their reduction is off the critical path). Each bucket is a unit
of the rank's ShardLayout: padded to the shard degree and cut into chunks,
one owned by each rank of the shard group.

- **Gradient reduce-scatter**: in the last microbatch's backward of a chunk,
  once a backward region has run, every bucket of that chunk whose
  parameters no later region adds to is reduce-scattered, posted beside the
  rest of the backward (and under a pipeline beside its cool-down and the
  other chunks' work); the optimizer step first awaits them all
  (`finish_grad_sync`). The regions are the chunk's tensor-parallel regions
  (schemes/stage_execution.py); which parameters each region's backward adds
  to is measured on the meta copy (`ChunkCost.backward_params`). The
  parameters whose gradient is each tp rank's share (under sequence
  parallelism every one a tp rank holds whole; an MoE layer's under tp) are
  summed across the tp group bucket by bucket, just before the bucket's
  reduce-scatter, instead of all at once after the walk.
- **Parameter all-gather** (`overlap_param_gather`): after the optimizer
  step nothing is gathered; in the next step's first forward of each chunk,
  before a region runs, each bucket holding a parameter it uses is awaited
  (posted then if it was not yet: exposed), and awaiting a bucket posts the
  next one's (Megatron-Core's forward pre-hooks, `finish_param_sync`
  dispatching the next bucket group). The step's first bucket is posted as
  the step begins.

Plain DDP under pp/tp with `parallel.overlap` (ReplicatedUpdate,
replicated_update.py) weaves its buckets the same way: every chunk cut
at `bucket_cap_mb`, one shard (no padding), each bucket all-reduced over the
dp (x cp) group where the reduce-scatter would be posted.

With experts sharded over ep (expert_model_parallel.py) the parameters are
laid out dense first, experts last (expert_groups.py `experts_last`), and,
as Megatron-Core keeps its expert buffers apart (DistributedDataParallel's
`expert_parallel_buffers`, reduced over the expert data-parallel group),
each chunk has a dense buffer and an expert buffer, each cut into buckets by
the same rule (`buffer_runs`); a dense bucket is reduced over the dp (x cp)
group, an expert bucket over the experts' holders (DDP: ExpertUpdate; the
distributed optimizer: its expert units). Where the backward's FLOPs at
which each parameter's gradient is complete are measured
(`ChunkCost.grad_ready_flops`), a bucket is posted inside the region that
completes it, never before the bucket of its buffer posted before it; the
FLOPs are counted as measured, so a region that does a share of its
measured work (an MoE layer's experts, by the tokens they received) is cut
at the same share of its way, and every rank posts its buckets at the same
place among its regions and their collectives.

Posted collectives on one communicator run one after another, as NCCL runs
them on one stream (representatives: MirroredCommunicator.post; the flow
model shares the links among them fairly, which ends the last at the same
time). Under full recomputation the regions are not measured per chunk:
a chunk's buckets are reduced once its last backward has ended and
gathered before its first forward. The units change where each element's
sum starts on the ring, so the reduction is the same sum in another order:
with two ranks, bit for bit (tests/test_bucket_overlap.py).

    units = megatron_buckets([[p.numel() for p in params_of_chunk] ...], bucketed, bucket_size)
    units = megatron_buckets([[numels[p] for p in run] for run in buffer_runs(chunks, first_expert)], ...)
    overlap = BucketOverlap(optimizer, rank, layout, chunks, first_expert)   # chunks = chunk_params(replica)
    program = overlap.during(action, cost, program)      # the chunk's forward or backward, buckets woven in
"""
from ..step_ops import Await, Collective, Compute, Post
from .shard_layout import ShardLayout
from .shard_units import compute_piece


def megatron_buckets(chunk_numels: list[list[int]], bucketed: list[bool], bucket_size: int) -> list[list[int]]:
    """Units of a rank's trainable parameters (indices over all its chunks, in order): each chunk one unit, or,
    where `bucketed`, cut in reverse parameter order into buckets closed at `bucket_size` elements or more."""
    units, start = [], 0
    for numels, cut in zip(chunk_numels, bucketed):
        indices = list(range(start, start + len(numels)))
        start += len(numels)
        if not indices:
            continue
        if not cut:
            units.append(indices)
            continue
        buckets, current, size = [], [], 0
        for index in reversed(indices):
            current.insert(0, index)
            size += numels[index - indices[0]]
            if size >= bucket_size:
                buckets.insert(0, current)
                current, size = [], 0
        if current:
            buckets.insert(0, current)
        units.extend(buckets)
    return units


def chunk_params(replica) -> list[list[int]]:
    """For each of the rank's model chunks, where its trainable parameters sit among the replica's (`params`), in
    the chunk's order: one run after another, unless `experts_last` (expert_groups.py) moved the experts behind
    every chunk's dense parameters."""
    index = {id(p): i for i, p in enumerate(replica.params)}
    return [[index[id(p)] for p in chunk.parameters() if p.requires_grad] for chunk in replica.model.chunks]


def buffer_runs(chunks: list[list[int]], experts: int | None = None) -> list[list[int]]:
    """The runs of parameter indices Megatron-Core cuts into buckets, one buffer each: each chunk's parameters;
    with the experts laid out last (`experts`: the first expert's index), its dense buffers (each chunk's
    parameters before it), then its expert buffers (each chunk's from it on)."""
    if experts is None:
        return [list(params) for params in chunks]
    return [[p for p in params if p < experts] for params in chunks] + \
        [[p for p in params if p >= experts] for params in chunks]


class BucketOverlap:
    """One rank's buckets: the reduce-scatters woven into its backward, the all-gathers into its forward."""

    def __init__(self, optimizer, rank: int, layout: ShardLayout, chunks: list[list[int]], experts: int | None = None):
        self.optimizer, self.rank, self.layout = optimizer, rank, layout
        self.units = len(layout.units)
        self.unit_of = {param: unit for unit, params in enumerate(layout.units) for param in params}
        self.chunks = chunks  # chunk -> its parameters' indices (chunk_params)
        self.units_of_chunk = [sorted({self.unit_of[p] for p in params}) for params in chunks]
        # each unit's buffer: 1 for the experts' (from parameter `experts` on: expert buffers), else 0
        self.buffer_of = [int(experts is not None and params[0] >= experts) for params in layout.units]
        self.microbatches = optimizer.microbatches
        self.gather_deferred = optimizer.overlap_param_gather
        self._backwards: dict[int, int] = {}  # chunk -> its backwards run this step
        self.reducing: list[int] = []  # the buckets whose collectives this step posted, on the rank's stream
        self._left: dict[int, dict] = {}  # chunk -> its buckets left to reduce once its last backward has ended
        self._pending: list[int] = []  # units whose parameters the next forward must gather, in order
        self._gathers: dict[int, object] = {}  # unit -> its posted all-gather
        # chunk -> (the cost its backward was cut for, `_ready_after`, `_ready_flops`, `_region_flops` of it): every
        # step's backward of a chunk is cut alike, worked out once
        self._cuts: dict[int, tuple] = {}

    def begin(self):
        """Step program: a new step; the first deferred all-gather posted."""
        self._backwards = {}
        if self._pending:
            yield from self._post_gather(self._pending[0])

    def loaded(self) -> None:
        """A load (a restart from a checkpoint, a PBT exploit), after which every bucket is gathered whole: no
        gather is left deferred, and what a step cut short had posted went with it (its buffers freed with the
        device's memory); the next step starts afresh."""
        self._backwards, self.reducing, self._left, self._gathers, self._pending = {}, [], {}, {}, []

    def defer_gathers(self) -> None:
        """After the optimizer step: every bucket's parameters gathered in the next forward."""
        self._pending = list(range(self.units))

    @property
    def deferred(self) -> bool:
        """Whether some bucket's parameters wait for the next forward's all-gather."""
        return bool(self._pending)

    def gather_pending(self):
        """Step program: every deferred all-gather run now, one after another (the end of the run)."""
        while self._pending:
            yield from self._await_gather(self._pending[0])

    def during(self, action, cost, program):
        """Step program: `program`, the forward or backward of schedule action `action` (its chunk's measured
        `cost`: a ChunkCost, or under recomputation a list of them), with the buckets' collectives woven in."""
        units = self.units_of_chunk[action.chunk]
        if action.kind == "forward":
            if not any(unit in self._pending for unit in units):
                return (yield from program)
            regions = self._forward_units(action.chunk, cost)
            if regions is None:  # unmeasured regions: the chunk's buckets gathered before it starts
                for unit in units:
                    yield from self._await_gather(unit)
                return (yield from program)
            for unit in regions[0]:
                yield from self._await_gather(unit)
            value = yield from _weave(program, "forward", lambda region: self._gather_for(regions, region + 1))
            for unit in units:  # buckets no region used
                yield from self._await_gather(unit)
            return value
        if action.kind == "backward_input":  # the gradients are complete after the W pass
            return (yield from program)
        count = self._backwards.get(action.chunk, 0) + 1
        self._backwards[action.chunk] = count
        if count < self.microbatches:
            return (yield from program)
        if action.kind == "backward_weight":  # one span: every bucket of the chunk complete at its end
            value = yield from program
            self._left[action.chunk] = {unit: None for unit in units}
            return value
        ready, points, sizes = self._backward_cut(action.chunk, cost)
        if points is not None:  # each bucket posted once its gradient is complete
            value = yield from _cut(program, points, lambda unit: self._reduce_ready(ready, None, (unit,)), sizes)
        else:  # each bucket posted after the region that completes it
            last = len(cost.backward_params) - 1 if not isinstance(cost, list) else -1
            value = yield from _weave(program, "backward", lambda region: self._reduce_ready(ready, region)
                                      if region < last else iter(()))
        self._left[action.chunk] = ready
        return value

    def after(self, action):
        """Step program, after a schedule action: once the chunk's last backward has ended and its activations are
        let go, the reduce-scatters of its buckets that only the backward's end completed."""
        if action.kind in ("backward", "backward_weight") and action.chunk in self._left:
            yield from self._reduce_ready(self._left.pop(action.chunk), None)

    # ---- the gradients ----

    def _backward_cut(self, chunk: int, cost) -> tuple[dict[int, int], list | None, list | None]:
        """(`_ready_after`, a copy the step consumes; where the FLOPs at which each gradient is complete are
        measured, `_ready_flops` and `_region_flops`, else None and None) of the chunk's backward under `cost`."""
        cut = self._cuts.get(chunk)
        if cut is None or cut[0] is not cost:
            ready = self._ready_after(chunk, cost)
            measured = not isinstance(cost, list) and bool(cost.grad_ready_flops)
            cut = (cost, ready, self._ready_flops(chunk, cost, ready) if measured else None,
                   _region_flops(cost) if measured else None)
            self._cuts[chunk] = cut
        return dict(cut[1]), cut[2], cut[3]

    def _ready_after(self, chunk: int, cost) -> dict[int, int]:
        """unit -> the backward region after which its gradient is complete (its chunk's last region that adds
        to one of its parameters); unmeasured (recomputation): the end of the backward."""
        units = self.units_of_chunk[chunk]
        if isinstance(cost, list) or not cost.backward_params:
            return {unit: None for unit in units}
        params, last = self.chunks[chunk], {}
        for region, locals_ in enumerate(cost.backward_params):
            for param in locals_:
                last[self.unit_of[params[param]]] = region
        return {unit: last.get(unit, len(cost.backward_params) - 1) for unit in units}

    def _ready_flops(self, chunk: int, cost, ready: dict[int, int]) -> list[tuple[float, int]]:
        """(backward FLOPs, unit) of each of the chunk's buckets in `ready`, in posting order: the FLOPs done when
        its last gradient is complete, never before the bucket of its buffer posted before it (each buffer's
        latest parameters first; the dense and the expert buffers' buckets merged by those FLOPs)."""
        local = {param: index for index, param in enumerate(self.chunks[chunk])}
        points = []
        for buffer in sorted({self.buffer_of[unit] for unit in ready}):
            at = 0.0
            for unit in sorted((unit for unit in ready if self.buffer_of[unit] == buffer), reverse=True):
                at = max(at, *(cost.grad_ready_flops[local[param]] for param in self.layout.units[unit]))
                points.append((at, unit))
        return sorted(points, key=lambda point: point[0])

    def _reduce_ready(self, ready: dict[int, int], region: int | None, units: tuple[int, ...] | None = None):
        """Step program: post the reduce-scatter of every bucket complete after backward region `region`
        (None: the backward has ended, all that are left; or those of `units`), latest parameters first."""
        for unit in sorted(ready if units is None else units, reverse=True):
            if region is None or ready[unit] is not None and ready[unit] <= region:
                del ready[unit]
                yield from self.optimizer.sum_bucket_tp_grads(self.rank, unit)
                yield from self.optimizer.post_reduce(self.rank, unit)
                self.reducing.append(unit)

    # ---- the parameters ----

    def _forward_units(self, chunk: int, cost) -> list[list[int]] | None:
        """Per forward region, the deferred buckets holding a parameter it uses (the parameters the backward
        region that reverses it adds to); None where the regions are not measured (recomputation)."""
        if isinstance(cost, list) or not cost.backward_params:
            return None
        chunk_params = self.chunks[chunk]
        return [sorted({self.unit_of[chunk_params[param]] for param in params})
                for params in reversed(cost.backward_params)]

    def _gather_for(self, regions: list[list[int]], region: int):
        """Step program: before forward region `region` runs, its buckets' parameters gathered."""
        for unit in regions[region] if region < len(regions) else ():
            yield from self._await_gather(unit)

    def _await_gather(self, unit: int):
        """Step program: bucket `unit`'s all-gather awaited (posted first if it was not yet), the next deferred
        bucket's then posted."""
        if unit not in self._pending:
            return
        if unit not in self._gathers:
            yield from self._post_gather(unit)
        yield Await(self._gathers.pop(unit))
        self._pending.remove(unit)
        if self._pending and self._pending[0] not in self._gathers:
            yield from self._post_gather(self._pending[0])

    def _post_gather(self, unit: int):
        collective: Collective = self.optimizer.collective("all_gather", self.rank, unit)
        self._gathers[unit] = yield Post(*collective)


def _region_flops(cost) -> list[float]:
    """Per backward region, the measured FLOPs of its Compute named "backward" (a region whose kept shard is
    gathered again runs half its Linears' FLOPs under that name: schemes/stage_execution.py)."""
    splits = cost.backward_regather or (None,) * len(cost.backward_flops)
    return [flops if split is None else split.after_flops / 2 for flops, split in zip(cost.backward_flops, splits)]


def _cut(program, points: list[tuple[float, int]], post, sizes: list[float]):
    """Step program: `program` as it is, each backward Compute cut where a point of `points` ([(backward FLOPs,
    unit)], in order) falls inside it, `post(unit)` (a step program) run there; points at the backward's end are
    left. Each piece gets its share of the Compute's operators and kernels, the first its passes. The FLOPs are
    counted as measured (`sizes`: each region's): a region that did a share of its measured work (an MoE layer's
    experts, by the tokens they received) is cut at the same share of its way, so that every rank posts its
    buckets at the same place among its regions and their collectives."""
    done, value, points, region = 0.0, None, list(points), 0
    while True:
        try:
            op = program.send(value)
        except StopIteration as stop:
            return stop.value
        if type(op) is Compute and op.name == "backward":
            size = sizes[region] if region < len(sizes) else op.flops
            region += 1
            scale = op.flops / size if size > 0 and op.flops != size else 1.0
            end, cut = done + size, done
            while points and points[0][0] < end:
                flops, unit = points.pop(0)
                if flops > cut and op.flops > 0:
                    yield compute_piece(op, (cut - done) * scale, (flops - done) * scale)
                    cut = flops
                yield from post(unit)
            value = yield op if cut == done else compute_piece(op, (cut - done) * scale, op.flops)
            done = end
        else:
            value = yield op


def _weave(program, kind: str, between):
    """Step program: `program` as it is, with `between(region)` (a step program) run once its `region`-th
    Compute named `kind` has been charged; returns `program`'s value."""
    region, value = 0, None
    while True:
        try:
            op = program.send(value)
        except StopIteration as stop:
            return stop.value
        value = yield op
        if type(op) is Compute and op.name == kind:
            yield from between(region)
            region += 1
