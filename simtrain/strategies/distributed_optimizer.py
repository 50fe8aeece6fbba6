"""ZeRO stages 1 and 2 (Megatron-Core's distributed optimizer) and 3 (FSDP), each optionally as HSDP, in every
layout: the sharded strategy of the step engine's data parallelism (replicated_update.py is DDP's).

Under data parallelism alone (pp = tp = cp = 1, no ep) a rank's share, the
whole model, is cut as FSDP2 wraps it: a unit per block (unit_overlap.py).
In every layout `offload` keeps each rank's fp32 shard and its optimizer on
the host (offload.py), each reduced chunk copied there as its reduction
(under HSDP: its all-reduce) ends. What follows is pp / tp / cp's.

Under pp x tp (model_parallel.py) each rank holds a share of the model; the
ranks holding the same share in the other replicas form its dp group. The
shard group is `parallel.sharding.degree` adjacent ranks of it (all of it by
default); with a degree below dp the shard groups replicate each other
(HSDP). What the rank does with its share:

- stage 1 or 2: the rank's share becomes a ShardedReplica
  (sharded_replica.py) of one unit cut into chunks, as Megatron-Core's
  distributed optimizer cuts its gradient buffer: after the last backward
  the gradient is reduce-scattered over the shard group (a ring, in the
  reduce dtype; under HSDP each chunk is then all-reduced across the
  replicate group), each rank steps the fp32 master weights and optimizer
  state of its chunk alone (sharded_update.py, the step sharded data
  parallelism runs too), and the updated parameters are all-gathered.
  Stage 1 keeps the whole gradient in the compute dtype for the run; stage 2
  holds it (as `comm_buffers`) only from the step's start, where the
  microbatches begin accumulating into it, to the end of its
  reduce-scatter: what stays is the fp32 gradient of the chunk. With
  gradient accumulation over microbatches that is all stage 2 can save,
  which is why DeepSpeed runs only stage 1 beside a pipeline. With
  `overlap_grad_reduce` the units are Megatron-Core's buckets, each
  reduce-scattered beside the last microbatch's backward as soon as it is
  complete, and with `overlap_param_gather` all-gathered in the next step's
  forward (bucket_overlap.py, woven into the walk by `during`);
- with experts sharded over ep (stages 1 and 2), two units, as Megatron-Core
  keeps the experts in a buffer of their own: the dense parameters, sharded
  over the dp (x cp) group, and the rank's experts, sharded over the ranks
  that hold the same experts (the experts' data-parallel group, dp / ep
  ranks). Each reduce-scatter sums over its own group; dividing both by dp
  gives the gradient of the mean loss over the global batch (an expert's
  holders' gradients are sums over their ep groups' ranks, as
  expert_model_parallel.py's ExpertUpdate explains); under HSDP only the
  dense chunk is then all-reduced across the replicas; with
  `overlap_grad_reduce` each of the two is cut into Megatron-Core's buckets
  (its dense and expert buffers, bucket_overlap.py);
- stage 3: each tp shard is sharded again over the shard group, its
  parameters too. The units are the rank's model chunks (its pipeline
  stage's part; each virtual stage's). The pipeline walk (pipeline.py) calls
  `before` each schedule action, ahead of awaiting its input (so the gather
  hides behind the wait for the previous stage), and `after` it: the chunk
  is gathered unless still whole, resharded after a forward if
  `reshard_after_forward` and after its last backward of the step always;
  then its gradient, accumulated over the microbatches as under stage 2, is
  reduce-scattered (and under HSDP its chunk's all-reduce posted). No
  all-gather follows the optimizer step: the next step's gathers bring the
  parameters.

The bytes per rank per step: a ring reduce-scatter and all-gather send
(N-1)/N of the buffer each (the ZeRO paper's 2 Psi for stages 1 and 2, as
DDP's all-reduce); stage 3 gathers before the forward and again before the
backward (3 Psi with one microbatch; 2 Psi with `reshard_after_forward:
false`). With representatives (representatives.py) the representative's
reduce-scatters and all-gathers are timed as mirrored collectives, with the
dp groups of its stage's other tp ranks (not under HSDP).

    update = DistributedOptimizer(scheme)        # the ModelParallel scheme, parallel.sharding.stage above 0
    yield from update.begin(rank)                # before the step's first microbatch
    yield from update.before(rank, action)       # before each schedule action (pipeline.py), and after it:
    output = yield from update.during(rank, action, cost, program)    # the action's forward or backward
    yield from update.after(rank, action)
    yield from update.update(rank)               # after its last backward
"""
from functools import partial

from ..parallel import Membership
from ..step_ops import Alloc, Await, Collective, Free, Post, PostCollective, WaitCollectives
from .bucket_overlap import BucketOverlap, buffer_runs, chunk_params, megatron_buckets
from .expert_groups import dense_and_expert_units, experts_last, first_expert
from .offload import HostOffload
from .overflow_vote import overflow_vote
from .representatives import MirroredCollective
from .shard_layout import ShardLayout
from .shard_units import UnitCosts
from .sharded_replica import ShardedReplica, groups_of, held_bytes, shard_update_bytes
from .sharded_update import LABELS, sharded_update, sharding_section
from .unit_overlap import UnitOverlap

_GATHER, _REDUCE, _REPLICATE, _PUBLISH = 0, 1, 2, 3  # the kinds of a unit's collectives, for their tags


class DistributedOptimizer:
    """ZeRO stage 1, 2 or 3 (FSDP) over each dp group of a pp x tp job, or HSDP (a shard degree below dp): every
    running rank's share becomes a ShardedReplica."""

    def __init__(self, scheme):
        self.scheme = scheme
        job, layout = scheme.job, scheme.layout
        train, sharding = job.scenario.train, job.scenario.parallel.sharding
        # The dp-cp group is the distributed optimizer's (Megatron-Core: get_data_parallel_group(
        # with_context_parallel=True)); the shard group is `degree` adjacent ranks of it (all of it by default)
        self.stage, self.dp = sharding.stage, layout.dp * layout.cp
        self.degree, self.replicate = layout.dp_shard, layout.dp_replicate
        self.reshard_after_forward = sharding.reshard_after_forward
        self.microbatches = scheme.microbatches
        self.reduce_dtype = sharding.reduce_dtype or train.precision
        # Megatron-Core's overlap of the reduce-scatters with the backward, the all-gathers with the next forward
        overlapping = sharding.overlap_grad_reduce and self.degree > 1  # a shard group of one reduces nothing
        self.overlap_param_gather = sharding.overlap_param_gather
        bucket_size = sharding.bucket_size or max(40_000_000, 1_000_000 * self.dp)
        self.buckets: dict[int, BucketOverlap] = {}  # rank -> its buckets, under overlap_grad_reduce
        # data parallelism alone (no ep): FSDP's units, the model's blocks, beside the compute (unit_overlap.py)
        self.blocks: dict[int, UnitOverlap] = {}
        # (unit by unit only where each forward's whole backward follows it: a unit resharded after one microbatch's
        # backward is not whole for another's, and a backward split in I and W is not one pass)
        unit_costs = (UnitCosts(job.model) if layout.world == layout.dp and layout.ep == 1
                      and scheme.schedule.backwards_follow_forwards() else None)
        self._tp_summed: dict[int, set] = {}  # rank -> ids of its parameters summed over tp (tp_summed_parameters)
        self.held, self._step_bytes = {}, {}
        self.ranks = [rank for rank in scheme.running if scheme.replicas[rank] is not None]  # launched: its own
        self._gathered = {rank: set() for rank in self.ranks}  # stage 3: the units whose parameters are whole
        self._backwards = {rank: {} for rank in self.ranks}  # stage 3: unit -> backwards run this step
        self._replicating = {rank: [] for rank in self.ranks}  # HSDP: the units' posted all-reduces
        replicas = scheme.replicas
        self.ep = layout.ep  # above 1: the experts are a unit of their own, sharded over their holders
        self._first_expert: dict[int, int] = {}  # ep above 1: rank -> its first expert parameter's index
        for rank in self.ranks:
            experts = None
            if self.ep > 1:  # Megatron-Core's expert buffers: the dense parameters first, then the rank's experts
                experts_last(replicas[rank])
                experts = self._first_expert[rank] = first_expert(replicas[rank])
            params, chunks = replicas[rank].params, chunk_params(replicas[rank])
            shards, positions = self.degree, self.shard_comms[rank].index
            if unit_costs is not None:
                units = unit_costs.param_units
            elif overlapping:  # Megatron-Core buckets only the first stage's first chunk (dense and expert buffer)
                stage, runs = layout.coordinates(rank)["pp"], buffer_runs(chunks, experts)
                units = megatron_buckets([[params[p].numel() for p in run] for run in runs],
                                         [stage == 0 and run % len(chunks) == 0 for run in range(len(runs))],
                                         bucket_size)
            else:
                units = _units(chunks, self.stage, experts)
            if self.ep > 1:
                units, shards, positions = dense_and_expert_units(
                    replicas[rank], units if overlapping or self.stage == 3 else None,
                    (self.degree, self.shard_comms[rank].index),
                    (len(layout.rank_groups(rank).expert_dp), scheme.comms.expert_dp[rank].index))
            shard_layout = ShardLayout([p.numel() for p in params], units, shards)
            shard = ShardedReplica(replicas[rank], shard_layout, positions, self.stage, train.optimizer,
                                   self.reduce_dtype)
            replicas[rank] = shard
            if unit_costs is not None:
                self.blocks[rank] = UnitOverlap(self, rank, unit_costs)
            elif overlapping:
                self.buckets[rank] = BucketOverlap(self, rank, shard_layout, chunks, experts)
                self._tp_summed[rank] = {id(p) for p in shard.model.tp_summed_parameters()}
            main = shard.main_grads
            self.held[rank] = held_bytes(shard_layout, self.stage, train.precision, train.optimizer, main)
            self._step_bytes[rank] = shard_update_bytes(shard_layout, train.precision, train.optimizer, main)
        # ZeRO-Offload: the host keeps part of what each rank holds (offload.py)
        self.offload_what, self.offload, self.host_held = sharding.offload, None, {}
        if sharding.offload != "none":
            shard = replicas[self.ranks[0]]
            self.offload = HostOffload(job, {rank: replicas[rank].layout for rank in self.ranks}, self.stage,
                                       sharding.offload, shard.param_flat.element_size(),
                                       shard.reduced.element_size(), shard.main_grads)
            for rank in self.ranks:
                self.held[rank], self.host_held[rank] = self.offload.split(rank, self.held[rank])
        self.sums_tp_grads = overlapping  # the buckets sum them over tp, each before its reduce-scatter
        self._step_kernels = scheme.update_kernels(self.ranks)  # a calibrated host's kernel_overhead
        self._ended, self._published = 0, False

    @property
    def shard_comms(self) -> dict:
        """rank -> its shard group's (communicator, rank there, all-reduce): the dp-cp group's, or HSDP's
        (ModelParallel.regroup builds both, again after a restart)."""
        comms = self.scheme.comms
        return comms.dp_cp if self.replicate == 1 else comms.dp_shard

    def unit_comms(self, rank: int, unit: int) -> Membership:
        """The rank's membership of unit `unit`'s shard group: the experts' holders for the experts' unit, else
        the shard group."""
        return (self.scheme.comms.expert_dp if self._experts(rank, unit) else self.shard_comms)[rank]

    def _experts(self, rank: int, unit: int) -> bool:
        """Whether unit `unit` of the rank's is one of its experts' (ep above 1: sharded over their holders)."""
        return self.ep > 1 and self.scheme.replicas[rank].layout.units[unit][0] >= self._first_expert[rank]

    @property
    def replicate_comms(self) -> dict:
        """HSDP: rank -> the communicator of the ranks at its position in the other shard groups."""
        return self.scheme.comms.dp_replicate

    # ---- the step program's hooks ----

    def begin(self, rank: int):
        """Step program: a loaded shard (a PBT exploit) gathers the chunks it does not own; stages 2 and 3 hold the
        whole gradient the microbatches accumulate into."""
        yield from self.resume(rank)
        if self.stage >= 2 and rank not in self.blocks:  # unit by unit there, as each unit's backward runs
            gradient = self.scheme.replicas[rank].grad_buffer
            yield Alloc("comm_buffers", gradient.numel() * gradient.element_size())
        # every unit is resharded after its last backward, its all-reduces awaited before the update: what a step
        # cut short by a lost device left here went with that device (its program restarts from a checkpoint)
        self._backwards[rank], self._gathered[rank], self._replicating[rank] = {}, set(), []
        if rank in self.buckets:
            yield from self.buckets[rank].begin()
        if rank in self.blocks:
            self.blocks[rank].new_step()

    def resume(self, rank: int):
        """Step program: a loaded shard (a restart, a PBT exploit) gathers the chunks it does not own."""
        shard = self.scheme.replicas[rank]
        if shard.stale:
            if rank in self.buckets:
                self.buckets[rank].loaded()
            yield from self._gather_all(rank)
            shard.stale = False

    def before(self, rank: int, action):
        """Step program, before a schedule action's input is awaited (stage 3): its chunk's parameters gathered,
        unless still whole (kept since a forward: `reshard_after_forward: false`); a W pass needs none."""
        if rank in self.blocks:  # gathered unit by unit in the chunk's work
            return
        if self.stage == 3 and action.kind != "backward_weight" and action.chunk not in self._gathered[rank]:
            for unit in self._chunk_units(rank, action.chunk):
                yield Alloc("comm_buffers", self.unit_bytes(rank, unit))
                if self.offload is not None:  # the rank's chunk, from the host (optimizer_and_parameters)
                    yield from self.offload.parameters_to_device(rank, unit)
                yield self.collective("all_gather", rank, unit)
            self._gathered[rank].add(action.chunk)

    def during(self, rank: int, action, cost, program):
        """Step program: a schedule action's forward or backward `program` (its chunk's measured `cost`), with
        the buckets' reduce-scatters and all-gathers woven in under overlap_grad_reduce (bucket_overlap.py)."""
        if rank in self.buckets:
            return (yield from self.buckets[rank].during(action, cost, program))
        if rank in self.blocks:
            return (yield from self.blocks[rank].during(action, cost, program))
        return (yield from program)

    def after(self, rank: int, action):
        """Step program, after a schedule action (stage 3): a forward's (or an I pass's) chunk resharded if
        `reshard_after_forward`, a backward's (or a W pass's) always; after the chunk's last backward (or W) of the
        step, its gradient reduce-scattered over the shard group (the HSDP all-reduce of its chunk posted across
        the replicas). Stages 1 and 2 under overlap_grad_reduce: the buckets the backward's end completed, posted
        (bucket_overlap.py)."""
        if rank in self.buckets:
            yield from self.buckets[rank].after(action)
        if rank in self.blocks:
            yield from self.blocks[rank].after(action)
            return
        if self.stage < 3:
            return
        chunk, last = action.chunk, False
        if action.kind in ("forward", "backward_input"):  # a chunk's gradients are ready after its W, not its I
            if not self.reshard_after_forward:
                return
        else:
            backwards = self._backwards[rank]
            backwards[chunk] = backwards.get(chunk, 0) + 1
            last = backwards[chunk] == self.microbatches
            if not (last or self.reshard_after_forward):
                return
        units = self._chunk_units(rank, chunk)
        if chunk in self._gathered[rank]:  # a W pass runs with its chunk resharded after its I
            self._gathered[rank].discard(chunk)
            for unit in units:
                self.scheme.replicas[rank].reshard(unit)
                yield Free("comm_buffers", self.unit_bytes(rank, unit))
        for unit in units if last else ():
            yield from self._reduce(rank, unit)

    def _chunk_units(self, rank: int, chunk: int) -> list[int]:
        """Stage 3: the units of the rank's model chunk `chunk`: the chunk itself, or with ep its dense and its
        experts' parameters (each sharded over its own group)."""
        shard = self.scheme.replicas[rank]
        if self.ep == 1:
            return [chunk]
        held = set(chunk_params(shard)[chunk])
        return [unit for unit, params in enumerate(shard.layout.units) if params[0] in held]

    def update(self, rank: int):
        """Step program: reduce-scatter the gradient over the shard group (stage 3: done unit by unit), all-reduce
        the chunk across the replicas (HSDP), step the rank's chunk, all-gather (stages 1 and 2)."""
        scheme, shard = self.scheme, self.scheme.replicas[rank]
        if rank in self.buckets:  # Megatron-Core's finish_grad_sync: the posted reduce-scatters awaited
            yield WaitCollectives()
            for unit in self.buckets[rank].reducing:
                yield from self.reduced(rank, unit)
            self.buckets[rank].reducing = []
        elif self.stage < 3 and rank not in self.blocks:  # the units reduce-scatter in the backward there
            for unit in range(len(shard.layout.units)):
                yield from self._reduce(rank, unit)
        for handle in self.replicating(rank):
            yield Await(handle)
        vote = partial(overflow_vote, *scheme.comms.model[rank]) if scheme.vote else None
        charge = None
        if self.offload is not None:  # the step runs on the host, once the gradient has landed there
            yield from self.offload.gradients_on_host(rank)
            charge = self.offload.host_step(rank)
        yield from sharded_update(shard, self.dp, self._step_bytes[rank], vote, charge,
                                  kernels=self._step_kernels[rank])
        if self.stage < 3:
            shard.reshard_all()  # the chunks it does not own are the shard group's to send
            if rank in self.buckets and self.overlap_param_gather:
                self.buckets[rank].defer_gathers()
            else:
                yield from self._gather_all(rank)

    def _reduce(self, rank: int, unit: int):
        """Step program: unit `unit`'s gradient reduce-scattered over the shard group (in a copy in the reduce
        dtype, held while it runs); stages 2 and 3 then free its unsharded gradient; HSDP posts the all-reduce
        of its chunk across the replicas (awaited before the optimizer step)."""
        if self._sharded(rank, unit):
            copy_bytes = self._copy_bytes(rank, unit)
            yield Alloc("comm_buffers", copy_bytes)
            yield self.collective("reduce_scatter", rank, unit)
            yield Free("comm_buffers", copy_bytes)
        yield from self.reduced(rank, unit)

    def post_gather(self, rank: int, unit: int):
        """Step program: unit `unit`'s all-gather posted into a unit-sized buffer (offloaded parameters: the rank's
        chunk copied from the host first); returns its handle."""
        yield Alloc("comm_buffers", self.unit_bytes(rank, unit))
        if self.offload is not None:
            yield from self.offload.parameters_to_device(rank, unit)
        return (yield Post(*self.collective("all_gather", rank, unit)))

    def post_reduce(self, rank: int, unit: int):
        """Step program (BucketOverlap's): bucket `unit`'s reduce-scatter posted on the rank's communication
        stream, its reduce-dtype copy held until `reduced`: the buckets' reduce-scatters run one after another,
        as Megatron-Core's on its data-parallel group's stream; `update` waits for them all."""
        yield Alloc("comm_buffers", self._copy_bytes(rank, unit))
        yield PostCollective(*self.collective("reduce_scatter", rank, unit))

    def post_unit_reduce(self, rank: int, unit: int):
        """Step program (UnitOverlap's): FSDP unit `unit`'s reduce-scatter posted (its reduce-dtype copy held
        until `reduced`); returns the handle the unit awaits."""
        yield Alloc("comm_buffers", self._copy_bytes(rank, unit))
        return (yield Post(*self.collective("reduce_scatter", rank, unit)))

    def sum_bucket_tp_grads(self, rank: int, unit: int):
        """Step program, with overlap_grad_reduce: the gradients of unit `unit`'s parameters that are each tp
        rank's share (train/partition.py tp_summed_parameters) summed across the tp group (model_parallel.py sums
        them all at once without overlap), before the unit's reduce-scatter."""
        shard, whole = self.scheme.replicas[rank], self._tp_summed[rank]
        grads = shard.gradients([shard.params[index] for index in shard.layout.units[unit]
                                 if id(shard.params[index]) in whole])
        if grads:
            yield from self.scheme.sum_tp_grads(rank, grads)

    def _copy_bytes(self, rank: int, unit: int) -> int:
        """The reduce-dtype copy of unit `unit`'s gradient a reduce-scatter holds (0 in the compute dtype)."""
        shard = self.scheme.replicas[rank]
        if shard.reduced is shard.grad_buffer or not self._sharded(rank, unit):
            return 0
        return self.unit_bytes(rank, unit, shard.reduced)

    def reduced(self, rank: int, unit: int):
        """Step program, once unit `unit`'s reduce-scatter has ended: its posted copy freed; stages 2 and 3 free
        its unsharded gradient; HSDP posts the all-reduce of its chunk across the replicas; offloading, the reduced
        chunk is copied to the host beside the rest as its reduction ends (HSDP: its all-reduce)."""
        shard = self.scheme.replicas[rank]
        if rank in self.buckets or rank in self.blocks:
            yield Free("comm_buffers", self._copy_bytes(rank, unit))
        if self.stage >= 2:
            yield Free("comm_buffers", self.unit_bytes(rank, unit, shard.grad_buffer))
        if self.replicate == 1 or self._experts(rank, unit):  # the experts': reduced over every holder
            if self.offload is not None:
                self.offload.post_gradient(rank, unit)
            return
        comm, index, _ = self.replicate_comms[rank]
        program = shard.all_reduce(unit, index, list(range(self.replicate)), self._tag(_REPLICATE, rank, unit))
        if self.offload is not None:
            program = self.offload.gradient_after(program, rank, unit)
        self._replicating[rank].append((yield Post(program, LABELS["all_reduce"], comm, index)))

    def replicating(self, rank: int) -> list:
        """HSDP: the handles of the all-reduces the rank's reduce-scatters posted since this was last asked."""
        handles, self._replicating[rank] = self._replicating[rank], []
        return handles

    def _gather_all(self, rank: int):
        """Step program: every unit's parameters all-gathered over the shard group: Megatron-Core's buffers one
        after another; FSDP's units (data parallelism alone) side by side, coalesced as DeepSpeed's ZeRO 1 and 2
        gather the whole flat buffer in one call."""
        units = [unit for unit in range(len(self.scheme.replicas[rank].layout.units)) if self._sharded(rank, unit)]
        if rank not in self.blocks:
            for unit in units:
                yield self.collective("all_gather", rank, unit)
            return
        handles = []
        for unit in units:
            handles.append((yield Post(*self.collective("all_gather", rank, unit))))
        for handle in handles:
            yield Await(handle)

    def _sharded(self, rank: int, unit: int) -> bool:
        """Whether unit `unit` is cut over more than one rank (a group of one moves nothing)."""
        return self.scheme.replicas[rank].layout.unit_shards[unit] > 1

    def collective(self, kind: str, rank: int, unit: int) -> Collective:
        """The rank's ring `kind` (reduce_scatter or all_gather) of unit `unit` on its shard group's communicator,
        or under representatives mirrored, timed with the mirror groups'."""
        shard = self.scheme.replicas[rank]
        group = list(range(shard.layout.unit_shards[unit]))
        comm, index, _ = self.unit_comms(rank, unit)
        if self.scheme.representatives:
            buffer = shard.reduced if kind == "reduce_scatter" else shard.param_flat
            program = MirroredCollective(kind, buffer[shard.layout.unit_slice(unit)])
        elif kind == "reduce_scatter":
            program = shard.reduce_scatter(unit, group, self._tag(_REDUCE, rank, unit))
        else:
            program = shard.gather(unit, group, self._tag(_GATHER, rank, unit))
        return Collective(program, LABELS[kind], comm, index)

    def _tag(self, kind: int, rank: int, unit: int) -> int:  # each unit's collectives of each kind: their own
        return kind * len(self.scheme.replicas[rank].layout.units) + unit

    def unit_bytes(self, rank: int, unit: int, buffer=None) -> int:
        """Bytes of unit `unit`'s padded region of `buffer` (the parameters' by default)."""
        shard = self.scheme.replicas[rank]
        buffer = shard.param_flat if buffer is None else buffer
        return shard.layout.chunk_numel(unit) * shard.layout.unit_shards[unit] * buffer.element_size()

    def finish(self, rank: int):
        """Step program, after a rank's last step: the all-gathers its last optimizer step left to a next forward
        (overlap_param_gather) run now, as Megatron-Core syncs the parameters at the end of training, so that a run
        of N steps moves N steps' bytes; a launched rank (simtrain launch: its process holds it alone) gathers its
        shard groups' fp32 chunks, the whole model it publishes."""
        if rank in self.buckets:
            yield from self.buckets[rank].gather_pending()
        if len(self.ranks) < len(self.scheme.running):  # a launched rank: the others' fp32 chunks over the network
            shard = self.scheme.replicas[rank]
            for unit in range(len(shard.layout.units)):
                comm, index, _ = self.unit_comms(rank, unit)
                group = list(range(shard.layout.unit_shards[unit]))
                yield Collective(shard.gather_master(unit, group, self._tag(_PUBLISH, rank, unit)), "publish_gather",
                                 comm, index)

    def ended(self, rank: int) -> None:
        """A rank's program has ended; after the last, every rank's share takes the fp32 master weights its shard
        group's chunks hold (what Job.finish turns the model into). Representatives compute nothing: each
        representative publishes its own (meta) chunk as every position's."""
        self._ended += 1
        if self._ended == len(self.ranks):
            self.publish()

    def publish(self) -> None:
        """Every running rank's share takes the fp32 master weights its shard group's chunks hold: at the end,
        or where the clock stopped before it (ModelParallel.stopped)."""
        scheme = self.scheme
        for rank in self.ranks:
            shard = scheme.replicas[rank]
            shard.publish(self._shard_groups(rank) if len(self.ranks) == len(scheme.running) else None)
        self._published = True

    def _shard_groups(self, rank: int) -> list[list]:
        """The shards of each of rank `rank`'s units' shard groups, by position (representatives: its own, for
        every position)."""
        scheme, layout = self.scheme, self.scheme.replicas[rank].layout
        if scheme.representatives:
            return groups_of(layout, [scheme.replicas[rank]] * self.degree)
        groups = scheme.layout.rank_groups(rank)
        return [[scheme.replicas[member] for member in (groups.expert_dp if self._experts(rank, unit)
                                                        else groups.dp_shard)]
                for unit in range(len(layout.units))]

    def whole_model(self, rank: int):
        """The rank's share of the model, whole (what ModelParallel.trained_model assembles): while the
        all-gathers wait for the next forward (overlap_param_gather), a copy assembled from the chunks its shard
        group owns."""
        shard = self.scheme.replicas[rank]
        if rank in self.buckets and self.buckets[rank].deferred or self.stage == 3 and not self._published:
            return shard.assembled(self._shard_groups(rank))
        return shard.model

    def update_s(self, rank: int) -> float:
        """Seconds rank `rank`'s device alone needs for its own update, its shard's (scaling efficiency's
        baseline, data parallelism alone). Not the whole model's: a device of a shard group updates 1/degree of
        it, so one device's whole update over a sharded step measured the sharding's saving, not the scaling,
        and passed 100% (267% for zero3.yaml at hidden 512 on 5,000 GB/s links)."""
        return self.scheme.job.devices[rank].memory_bound_time(self._step_bytes[rank])

    def report_sections(self) -> dict:
        """report.json's `sharding`: the stage, the shard and replicate degrees, job rank 0's shard, the bytes
        the collectives sent and what was offloaded; under data parallelism alone `parallel`'s units reduced beside
        the backward."""
        layout = self.scheme.replicas[self.ranks[0]].layout
        overlap = {"parallel": {"overlap": True, "buckets": len(layout.units)}} if self.blocks else {}
        return {**overlap, "sharding": sharding_section(self, layout)}


def _units(chunks: list[list[int]], stage: int, experts: int | None) -> list[list[int]]:
    """The units a rank's share is cut into, as parameter indices: one (stages 1 and 2, as Megatron-Core's gradient
    buffer), or under stage 3 each of its model chunks (its pipeline stage's part; each virtual stage's), with the
    experts laid out last (`experts`: the first one's index) each chunk's dense and expert parameters apart."""
    if stage < 3:
        return [list(range(sum(len(params) for params in chunks)))]
    return [run for run in buffer_runs(chunks, experts) if run or experts is None]
