"""The data-parallel half of a model-parallel step: DDP's gradient all-reduce, or Megatron-Core's distributed
optimizer (ZeRO stages 1 and 2 under pipeline and tensor parallelism).

Under pp x tp (model_parallel.py) each rank holds a share of the model; the
ranks holding the same share in the other replicas form its dp group. After
the last microbatch's backward of a step, what the rank does with its
gradient is one of:

- `ReplicatedUpdate` (`parallel.sharding.stage: 0`, plain DDP): all-reduce
  (and average) the gradient over the dp group with `parallel.all_reduce`'s
  algorithm, then step the rank's own optimizer on its whole share;
- `DistributedOptimizer` (stage 1 or 2): the rank's share becomes a
  ShardedReplica (sharded_replica.py) of one unit cut into dp chunks, as
  Megatron-Core's distributed optimizer cuts its gradient buffer: the
  gradient is reduce-scattered over the dp group (a ring, in the reduce
  dtype), each rank steps the fp32 master weights and optimizer state of
  its 1/dp chunk alone (sharded_update.py, the step sharded data
  parallelism runs too), and the updated parameters are all-gathered.
  Stage 1 keeps the whole gradient in the compute dtype for the run; stage 2
  holds it (as `comm_buffers`) only from the step's start, where the
  microbatches begin accumulating into it, to the end of its
  reduce-scatter: what stays is the fp32 gradient of the chunk. With
  gradient accumulation over microbatches that is all stage 2 can save,
  which is why DeepSpeed runs only stage 1 beside a pipeline.

Both move the same bytes: a ring all-reduce sends 2(N-1)/N of the buffer per
rank, a ring reduce-scatter and all-gather (N-1)/N each (the ZeRO paper's
2 Psi for stages 0, 1 and 2). With representatives (representatives.py) the
representative's reduce-scatter and all-gather are timed as mirrored
collectives, with the dp groups of its stage's other tp ranks.

    update = data_parallel_update(scheme)        # the ModelParallel scheme
    yield from update.begin(rank)                # before the step's first microbatch
    yield from update.update(rank)               # after its last backward
"""
from functools import partial

from ..errors import ScenarioError
from ..step_ops import Alloc, Collective, Free, MemoryBound
from ..train.precision import persistent_bytes, update_bytes
from .overflow_vote import overflow_vote
from .representatives import MirroredCollective
from .shard_layout import ShardLayout
from .sharded_replica import ShardedReplica, held_bytes, shard_update_bytes
from .sharded_update import LABELS, bytes_by_kind, sharded_update

_GATHER, _REDUCE = 0, 1  # the tags of a rank's all-gather and reduce-scatter on its dp communicator


def data_parallel_update(scheme):
    """The model-parallel scheme's data-parallel update: the distributed optimizer when sharded, else DDP's."""
    if scheme.job.scenario.parallel.sharding.stage:
        return DistributedOptimizer(scheme)
    return ReplicatedUpdate(scheme)


class ReplicatedUpdate:
    """Plain DDP under pp x tp: the gradient all-reduced over the dp group, every rank stepping its share."""

    def __init__(self, scheme):
        self.scheme = scheme
        train = scheme.job.scenario.train
        replicas = scheme.replicas
        self.held = [None if r is None else persistent_bytes(r.params, train.precision, train.optimizer)
                     for r in replicas]
        self._step_bytes = [None if r is None else update_bytes(r.params, train.precision, train.optimizer)
                            for r in replicas]

    def begin(self, rank: int):
        """Step program: nothing before a step's microbatches."""
        yield from ()

    def resume(self, rank: int):
        """Step program: nothing to fetch after a load (each rank holds its whole share)."""
        yield from ()

    def update(self, rank: int):
        """Step program: all-reduce and average the gradient over the dp (x cp) group, vote on an fp16 overflow, step."""
        scheme = self.scheme
        replica = scheme.replicas[rank]
        if scheme.layout.dp * scheme.layout.cp > 1:  # the dp-cp group (context parallelism: cp > 1)
            dp_comm, dp_index, dp_reduce = scheme.comms["dp"][rank]
            yield Collective(dp_reduce(dp_index, dp_comm.world, replica.grad_buffer, average=True), "dp_allreduce",
                             dp_comm, dp_index)
        found_inf = replica.precision.find_overflow(replica.grad_buffer)
        if scheme.vote:
            found_inf = yield from overflow_vote(*scheme.comms["model"][rank], found_inf)
        replica.apply_update(replica.precision.settle(found_inf))
        yield MemoryBound(self._step_bytes[rank], "optimizer step", kind="optimizer")

    def ended(self, rank: int) -> None:
        """A rank's program has ended: nothing to gather."""

    def report_sections(self) -> dict:
        return {}


class DistributedOptimizer:
    """ZeRO stage 1 or 2 over each dp group of a pp x tp job: every running rank's share becomes a ShardedReplica."""

    def __init__(self, scheme):
        self.scheme = scheme
        job, layout = scheme.job, scheme.layout
        train, sharding = job.scenario.train, job.scenario.parallel.sharding
        if sharding.degree is not None and sharding.degree != layout.dp:
            raise ScenarioError(f"parallel.sharding.degree: with pp/tp the shard group is the whole dp group of "
                                f"{layout.dp} ranks (HSDP with pp/tp is not built yet), got {sharding.degree}")
        # The shard group is the dp-cp group, as Megatron-Core's (get_data_parallel_group(with_context_parallel=True))
        self.stage, self.dp = sharding.stage, layout.dp * layout.cp
        self.reduce_dtype = sharding.reduce_dtype or train.precision
        self.held, self._step_bytes, self._unsharded_bytes = {}, {}, {}
        replicas = scheme.replicas
        for rank in scheme.running:
            params = replicas[rank].params
            shard_layout = ShardLayout([p.numel() for p in params], [range(len(params))], self.dp)
            shard = ShardedReplica(replicas[rank], shard_layout, scheme.comms["dp"][rank][1], self.stage,
                                   train.optimizer, self.reduce_dtype)
            replicas[rank] = shard
            self.held[rank] = held_bytes(shard_layout, self.stage, train.precision, train.optimizer)
            self._step_bytes[rank] = shard_update_bytes(shard_layout, train.precision, train.optimizer)
            self._unsharded_bytes[rank] = nbytes(shard.grad_buffer)
        self._ended = 0

    def begin(self, rank: int):
        """Step program: a loaded shard (a PBT exploit) gathers the chunks it does not own; stage 2 holds the whole
        gradient the microbatches accumulate into."""
        yield from self.resume(rank)
        if self.stage == 2:
            yield Alloc("comm_buffers", self._unsharded_bytes[rank])

    def resume(self, rank: int):
        """Step program: a loaded shard (a restart, a PBT exploit) gathers the chunks it does not own."""
        shard = self.scheme.replicas[rank]
        if shard.stale:
            yield from self._gather(rank)
            shard.stale = False

    def update(self, rank: int):
        """Step program: reduce-scatter the gradient over the dp group, step the rank's chunk, all-gather."""
        scheme, shard = self.scheme, self.scheme.replicas[rank]
        if self.dp > 1:
            comm, index, _ = scheme.comms["dp"][rank]
            copy_bytes = 0 if shard.reduced is shard.grad_buffer else nbytes(shard.reduced)
            yield Alloc("comm_buffers", copy_bytes)  # the gradient's copy in the reduce dtype, while reduced
            yield Collective(self._program("reduce_scatter", rank), LABELS["reduce_scatter"], comm, index)
            yield Free("comm_buffers", copy_bytes)
        if self.stage == 2:
            yield Free("comm_buffers", self._unsharded_bytes[rank])
        vote = partial(overflow_vote, *scheme.comms["model"][rank]) if scheme.vote else None
        yield from sharded_update(shard, self.dp, self._step_bytes[rank], vote)
        shard.reshard_all()  # the chunks it does not own are the dp group's to send
        yield from self._gather(rank)

    def _gather(self, rank: int):
        if self.dp > 1:
            comm, index, _ = self.scheme.comms["dp"][rank]
            yield Collective(self._program("all_gather", rank), LABELS["all_gather"], comm, index)

    def _program(self, kind: str, rank: int):
        """The rank's ring `kind` (reduce_scatter or all_gather) on its dp communicator: over the dp group's
        ranks, or under representatives mirrored, timed with the mirror groups'."""
        shard, group = self.scheme.replicas[rank], list(range(self.dp))
        if self.scheme.representatives:
            return MirroredCollective(kind, shard.reduced if kind == "reduce_scatter" else shard.param_flat)
        if kind == "reduce_scatter":
            return shard.reduce_scatter(0, group, _REDUCE)
        return shard.gather(0, group, _GATHER)

    def ended(self, rank: int) -> None:
        """A rank's program has ended; after the last, every rank's share takes the fp32 master weights its dp
        group's chunks hold (what Job.finish turns the model into). Representatives compute nothing: each
        representative publishes its own (meta) chunk as every position's."""
        self._ended += 1
        scheme = self.scheme
        if self._ended < len(scheme.running):
            return
        for rank in scheme.running:
            if scheme.representatives:
                group = [rank] * self.dp
            else:
                group = scheme.layout.group(("dp", "cp"), rank)
            scheme.replicas[rank].publish([scheme.replicas[member] for member in group])

    def report_sections(self) -> dict:
        """report.json's `sharding`: the stage, the dp group as the shard group, job rank 0's shard and the bytes
        the reduce-scatters and all-gathers sent."""
        scheme = self.scheme
        shard = scheme.replicas[scheme.running[0]]
        return {"sharding": {"stage": self.stage, "degree": self.dp, "replicate": 1, "reduce_dtype": self.reduce_dtype,
                             "reshard_after_forward": False, "units": 1, "shard_elements": shard.layout.shard_numel,
                             "padded_elements": shard.layout.padded_numel,
                             "bytes_by_kind": bytes_by_kind(scheme.job.cluster.log, scheme.job.devices)}}


def nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()
