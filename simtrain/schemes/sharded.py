"""Sharded data parallelism: ZeRO stages 1, 2 and 3 (FSDP) and HSDP, on real numerics.

`parallel.sharding.stage` says what each data-parallel rank keeps only a
1/N shard of, N the shard degree (`parallel.sharding.degree`, all of dp by
default); ranks are grouped into shard groups of N adjacent ranks, and the
dp / N groups replicate each other (HSDP, torchtitan's dp_replicate x
dp_shard). Every rank trains on its own batch, as under DDP; parameters and
gradients are cut into units (schemes/shard_layout.py: an entry of the
model's nn.Sequential with parameters and the parameterless ones after it,
so for a gpt the embedding, each transformer block and the head), each
padded to a multiple of N and cut into N chunks, one owned by each rank of
the group (schemes/sharded_replica.py holds a rank's share):

- **stage 1** (Megatron's distributed optimizer): each rank keeps the whole
  gradient in the compute dtype; as the backward completes a unit, its
  gradient is reduce-scattered over the group (a ring, comm/ring.py); each
  rank unscales its chunks into its fp32 master shard and steps its
  optimizer on it alone, then the groups all-gather the updated parameters;
- **stage 2**: the same, but a unit's unsharded gradient lives only from its
  backward to the end of its reduce-scatter: what stays is the fp32 gradient
  of the shard;
- **stage 3** (FSDP): the parameters are sharded too. A unit's parameters
  are all-gathered before its forward and again before its backward (unless
  `reshard_after_forward` is false: then kept from forward to backward),
  the gather of the next unit posted when a unit's compute starts (a prefetch
  of one, overlapped with that compute), and freed after its use; gradients
  are reduce-scattered as each unit's backward ends;
- **HSDP** (degree < dp): each reduced chunk is then all-reduced across the
  replicate group, once its reduce-scatter has ended.

Reduce-scatters run one at a time, as on FSDP2's one reduce-scatter stream:
once a unit's backward has ended, the rank waits for the previous unit's
reduce-scatter to end (freeing its unsharded gradient, posting its HSDP
all-reduce) before it posts this unit's; a step whose reduce-scatters keep up
with the backward never waits. Stages 1 and 2 all-gather every unit's updated
parameters side by side after the optimizer step.

The real forward and backward run once the parameters they need are on the
rank (under stage 3, when the forward's last gather has landed: the host
runs the whole model at once); their time and memory are charged unit by
unit where a GPU spends them: each unit's forward at the FLOPs measured for
it, each unit's backward as the share of the backward between its
gradients' completion and the next unit's (cost.py's grad_ready_flops).
Gathers and reduce-scatters are posted (step_ops.Post) and awaited where
their data is needed, so only what compute does not hide is communication.

The gradient is summed by the reduce-scatter (and the HSDP all-reduce) in
the reduce dtype (`reduce_dtype`, the compute dtype by default, as FSDP2's
MixedPrecisionPolicy: a unit's copy in another dtype is `comm_buffers` while
it is reduced) and divided by dp, as DDP averages its bucket, so the
trained parameters are one device's on the global batch (fp32, within
rounding) and plain DDP's (bf16, two ranks: bit for bit). fp16's overflow is
voted across the job (schemes/overflow_vote.py), as every rank sees only its
shard. What a rank's ledger holds is `held_bytes` (sharded_replica.py); the
gathered units and unsharded gradients in flight are `comm_buffers`.
`offload` (ZeRO-Offload, schemes/offload.py) moves the fp32 shard, its
gradient and its optimizer state (and under stage 3 optionally the parameter
chunks) to the host's memory: each reduced chunk is copied there as its
reduce-scatter ends, and the host steps the shard.

With `parallel.pipeline.microbatches` m > 1 (gradient accumulation) the
batch is cut into m micro-batches run in turn, each loss weighted 1/m.
Stages 2 and 3 do what FSDP2 does by default (torchtitan's train loop never
turns gradient sync off) and DeepSpeed's ZeRO-2: every micro-batch gathers
its units (stage 3) and reduce-scatters its gradient (and all-reduces it
under HSDP), each rank adding its reduced chunk into its fp32 shard
gradient; stage 1 keeps the whole gradient anyway and, as DeepSpeed's ZeRO-1
and Megatron's distributed optimizer, accumulates it in place and
reduce-scatters once, in the last micro-batch's backward.

    parallel: {sharding: {stage: 3, degree: 4, reshard_after_forward: true}}
    scheme = ShardedDataParallel(job)
"""
from functools import partial

import torch
from pydantic import Field

from ..report.sections import ReportSection, register_section
from ..step_ops import Alloc, Await, Free, Post, Transfer
from ..train.moe import scale_balancing_loss
from ..train.precision import update_bytes
from . import selection
from .overflow_vote import overflow_vote
from .rank_replicas import RankReplicas
from .offload import NO_OFFLOAD, HostOffload, OffloadSection
from .scheme import Scheme
from .shard_layout import ShardLayout
from .shard_units import UnitCosts
from .sharded_replica import ShardedReplica, groups_of, held_bytes, shard_update_bytes
from .sharded_update import LABELS, bytes_by_kind, gather_parameters, sharded_update

_GATHER, _REDUCE, _REPLICATE = 0, 1, 2  # the collectives' kinds


class ShardedDataParallel(RankReplicas, Scheme):
    """ZeRO 1/2/3 (FSDP) and HSDP: each rank holds a shard of the training state and trains on its own batch."""

    applies = staticmethod(selection.sharded)  # the registry's predicate (selection.py)

    def __init__(self, job, on_step=None):
        self.job, self.world, self.on_step = job, job.world, on_step
        train, sharding = job.scenario.train, job.scenario.parallel.sharding
        self.stage, self.reshard_after_forward = sharding.stage, sharding.reshard_after_forward
        self.microbatches = job.scenario.parallel.microbatches  # gradient accumulation steps
        for replica in job.replicas:  # a micro-batch's balancing loss (MoE) is its share of the batch's
            if replica is not None:
                scale_balancing_loss(replica.model, 1.0 / self.microbatches)
        self.degree = job.layout.dp_shard
        self.replicate = job.layout.dp_replicate
        self.steps, self.precision = train.steps, train.precision
        self.reduce_dtype = sharding.reduce_dtype or train.precision
        first = job.replicas[job.local_ranks[0]]
        self.units = UnitCosts(job.model)
        self.layout = ShardLayout([p.numel() for p in first.params], self.units.param_units, self.degree)
        self.replicas = job.replicas
        for rank in job.local_ranks:  # each rank's Replica becomes its share (checkpoints and PBT see the shard)
            position = job.layout.rank_groups(rank).dp_shard.index(rank)
            self.replicas[rank] = ShardedReplica(self.replicas[rank], self.layout, position, self.stage,
                                                 train.optimizer, self.reduce_dtype)
        self._held = held_bytes(self.layout, self.stage, self.precision, train.optimizer)
        self._step_bytes = shard_update_bytes(self.layout, self.precision, train.optimizer)
        self._whole_step_bytes = update_bytes(first.params, self.precision, train.optimizer)
        shard = self.replicas[job.local_ranks[0]]
        self._element = shard.param_flat.element_size()
        # bytes per element of a unit's copy in the reduce dtype, held while it is reduce-scattered (0: in place)
        self._reduce_element = 0 if shard.reduced is shard.grad_buffer else shard.reduced.element_size()
        self.offload_what, self.offload, self._host_held = sharding.offload, None, {}
        if sharding.offload != "none":  # ZeRO-Offload: the host keeps part of the held bytes (schemes/offload.py)
            self.offload = HostOffload(job, self.layout, self.stage, sharding.offload, self._element,
                                       shard.reduced.element_size())
            self._held, self._host_held = self.offload.split(self._held)
        self.vote = self.precision == "fp16"
        self._losses = [[] for _ in range(self.steps)]
        self._ranks_done = [0] * self.steps
        self._ended, self._published = 0, False  # rank programs that ran to their end; the model published
        self.loss_curve: list[tuple[float, float | None]] = []
        self.regroup()

    def regroup(self) -> None:
        """The job-wide all-reduce of the fp16 overflow vote, over the job's devices as they are now."""
        self.devices, self.all_reduce = self.job.devices, self.job.all_reduce(range(self.world))

    @classmethod
    def steps_until_every_rank_stepped(cls, world: int) -> int:
        return 1

    def shard_group(self, rank: int) -> list[int]:
        """The job ranks that together hold one copy of the state: `degree` adjacent ranks (the layout's dp_shard
        group)."""
        return list(self.job.layout.rank_groups(rank).dp_shard)

    def replicate_group(self, rank: int) -> list[int]:
        """The job ranks that hold the same shard (HSDP): one in each shard group (the layout's dp_replicate
        group)."""
        return list(self.job.layout.rank_groups(rank).dp_replicate)

    # ---- the program of one rank ----

    def program(self, rank: int, first_step: int = 0):
        """Step program of job rank `rank`: hold its shard, then every step from `first_step` (offloading: with
        its host share held on the host)."""
        program = self._steps(rank, first_step)
        return program if self.offload is None else self.offload.holding(rank, self._host_held, program)

    def _steps(self, rank: int, first_step: int):
        for category, nbytes in self._held.items():
            yield Alloc(category, nbytes)
        for step in range(first_step, self.steps):
            if not (yield from self.job.before_step(rank, step)):
                break
            yield from self.resume(rank)
            loss = yield from self._accumulate(rank)
            yield from self._update(rank)
            self._step_done(rank, step, loss)
        self._ended += 1
        if self._ended % len(self.job.local_ranks) == 0:  # the last rank's program to end
            self._publish()

    def resume(self, rank: int):
        """Step program: a loaded shard (a restart, an exploit) gathers the chunks it does not own."""
        shard = self.replicas[rank]
        if shard.stale:
            yield from self._gather_parameters(rank)
            shard.stale = False

    def _unit_bytes(self, unit: int, element: int | None = None) -> int:
        """Bytes of a unit's padded parameters (or gradient) in the compute dtype (or of `element` bytes)."""
        return self.layout.chunk_numel(unit) * self.degree * (self._element if element is None else element)

    def _accumulate(self, rank: int):
        """Step program: the step's micro-batches (gradient accumulation), each forward and backward in turn;
        stages 2 and 3 reduce each one's gradient (FSDP2's default), stage 1 the sum of all after the last.
        Returns the loss, the mean of the micro-batches' (one micro-batch: its own)."""
        shard, count = self.replicas[rank], self.microbatches
        losses = []
        for index, microbatch in enumerate(shard.microbatches(count)):
            last = index == count - 1
            shard.last_batch = microbatch
            losses.append((yield from self._forward_backward(rank, 1.0 / count, accumulate=index > 0 and
                                                             self.stage == 1, reduce=last or self.stage > 1)))
            if not last and self.stage > 1:
                shard.keep_reduced(self.world)  # before the next backward overwrites the gradient
        return losses[0] if count == 1 else torch.stack(losses).mean()

    def _forward_backward(self, rank: int, share: float, accumulate: bool, reduce: bool):
        """Step program: the forward of the last batch (a micro-batch, `share` of the step's batch) unit by unit
        (gathering under stage 3), the backward unit by unit with each unit's reduce-scatter posted as it ends
        when `reduce` (else the gradient is left in the buffer, added to what it holds with `accumulate`);
        returns the loss."""
        shard, units = self.replicas[rank], len(self.layout.units)
        group = self.shard_group(rank)
        x, _ = shard.last_batch
        cost = shard.step_cost()
        dtype = shard.precision.name
        forward, backward = self.units.forward(x, cost, dtype), self.units.backward(cost, dtype)
        yield Alloc("activations", cost.activation_bytes)
        # stage 3: the units gathered in order, forward then (resharded after forward) backward
        chain = [*range(units), *reversed(range(units))] if self.reshard_after_forward else [*range(units)]
        gathered = self.stage == 3
        handle = (yield from self._post_gather(rank, chain[0], group)) if gathered else None
        loss = None if gathered else shard.forward_backward(share, accumulate)
        for unit in range(units):
            if gathered:
                yield Await(handle)
                if unit == units - 1:  # every unit is on the rank now: the real forward and backward
                    loss = shard.forward_backward(share, accumulate)
                    if self.reshard_after_forward:
                        shard.reshard_all()
                if unit + 1 < len(chain):
                    handle = yield from self._post_gather(rank, chain[unit + 1], group)
            yield forward[unit]
            if gathered and self.reshard_after_forward:
                yield Free("comm_buffers", self._unit_bytes(unit))
        reducing, replicating = None, []
        for position, unit in enumerate(reversed(range(units))):
            if gathered and self.reshard_after_forward:
                yield Await(handle)
                following = units + position + 1
                if following < len(chain):
                    handle = yield from self._post_gather(rank, chain[following], group)
            if self.stage >= 2:
                yield Alloc("comm_buffers", self._unit_bytes(unit))  # the unit's unsharded gradient
            yield backward[position]
            if gathered:
                shard.reshard(unit)
                yield Free("comm_buffers", self._unit_bytes(unit))
            if not reduce:
                continue
            if reducing is not None:  # one reduce-scatter at a time: the one before this unit's has ended
                replicating += yield from self._reduced(rank, *reducing)
            program = shard.reduce_scatter(unit, group, self._tag(_REDUCE, unit))
            yield Alloc("comm_buffers", self._unit_bytes(unit, self._reduce_element))  # its reduce-dtype copy
            reducing = (unit, (yield Post(program, LABELS["reduce_scatter"])))
        yield Free("activations", cost.activation_bytes)
        if not reduce:
            return loss
        replicating += yield from self._reduced(rank, *reducing)
        for posted in replicating:
            yield Await(posted)
        return loss

    def _post_gather(self, rank: int, unit: int, group: list[int]):
        """Step program: post the gather of unit `unit`'s parameters into a unit-sized buffer; returns its handle."""
        yield Alloc("comm_buffers", self._unit_bytes(unit))
        if self.offload is not None:  # the rank's chunk, from the host (optimizer_and_parameters)
            yield from self.offload.parameters_to_device(rank, unit)
        return (yield Post(self.replicas[rank].gather(unit, group, self._tag(_GATHER, unit)), LABELS["all_gather"]))

    def _reduced(self, rank: int, unit: int, posted):
        """Step program: wait for unit `unit`'s reduce-scatter; free its unsharded gradient (stages 2, 3); under
        HSDP post the all-reduce of its chunk across the replicas. Returns the posted all-reduces."""
        yield Await(posted)
        yield Free("comm_buffers", self._unit_bytes(unit, self._reduce_element))
        if self.stage >= 2:
            yield Free("comm_buffers", self._unit_bytes(unit))
        if self.offload is not None:  # the reduced chunk, copied to the host beside the backward
            self.offload.post_gradient(rank, unit)
        if self.replicate == 1:
            return []
        program = self.replicas[rank].all_reduce(unit, rank, self.replicate_group(rank), self._tag(_REPLICATE, unit))
        return [(yield Post(program, LABELS["all_reduce"]))]

    def _update(self, rank: int):
        """Step program: average and unscale the shard's gradient, step its optimizer (all ranks skip an fp16
        overflow together), round it into the owned chunks; stages 1 and 2 then gather the parameters."""
        shard = self.replicas[rank]
        vote = partial(overflow_vote, self.job.comm, rank, self.all_reduce) if self.vote else None
        charge = None
        if self.offload is not None:  # the step runs on the host, once the gradient has landed there
            yield from self.offload.gradients_on_host(rank)
            charge = self.offload.host_step(rank)
        yield from sharded_update(shard, self.world, self._step_bytes, vote, charge)
        if self.stage < 3:
            shard.reshard_all()  # the chunks it does not own are the group's to send
            yield from self._gather_parameters(rank)

    def _gather_parameters(self, rank: int):
        """Step program: every unit's parameters all-gathered over the shard group, in place, side by side."""
        group, shard = self.shard_group(rank), self.replicas[rank]
        yield from gather_parameters([shard.gather(unit, group, self._tag(_GATHER, unit))
                                      for unit in range(len(self.layout.units))])

    def _tag(self, kind: int, unit: int) -> int:  # each unit's collectives of each kind: their own messages
        return kind * len(self.layout.units) + unit

    def _step_done(self, rank: int, step: int, loss) -> None:
        self._losses[step].append(loss)
        self._ranks_done[step] += 1
        if self._ranks_done[step] < len(self.job.local_ranks):
            return
        losses, self._losses[step] = self._losses[step], None
        mean = float(sum(loss.item() for loss in losses)) / len(losses) if self.job.numerics else None
        now = self.job.cluster.env.now
        self.loss_curve.append((now, mean))
        if self.on_step is not None:
            self.on_step(step, now, mean)

    def _publish(self) -> None:
        """Every rank's model becomes the whole trained model, from shard group 0's owned chunks."""
        groups = groups_of(self.layout, [self.replicas[rank] for rank in self.shard_group(0)])
        for rank in self.job.local_ranks:
            self.replicas[rank].publish(groups)
        self._published = True

    # ---- what the runner reads, and the Scheme hooks ----

    def stopped(self) -> None:
        self._publish()

    def rewind(self, step: int) -> None:
        super().rewind(step)
        self._losses[step:] = [[] for _ in range(self.steps - step)]
        self._ranks_done[step:] = [0] * (self.steps - step)

    def state_source(self, rank: int) -> int:
        return rank  # each rank holds its own shard of the state

    def receive_state(self, rank: int, donor, state):
        """Step program: rank `rank`'s shard, whole, from the donor's rank of the same index (the chunks it
        does not own are gathered before its next step)."""
        yield Alloc("comm_buffers", state.nbytes)
        yield Transfer(donor.devices[rank].node, self.job.devices[rank].node, state.nbytes, "exploit")
        self.load_training_state(rank, state, state.flat.clone())
        yield Free("comm_buffers", state.nbytes)

    def stuck(self) -> list[int]:
        return self.job.comm.stuck()

    def trained_model(self):
        """The whole model: the trained fp32 one once published, before that (the training-loss monitor) a copy
        assembled from shard group 0's chunks."""
        if self._published:
            return self.replicas[0].model
        return self.replicas[0].assembled(groups_of(self.layout, [self.replicas[rank] for rank in self.shard_group(0)]))

    def final_models(self) -> list:
        return [replica.model for replica in self.replicas]

    def samples_per_step(self) -> int:
        return self.world * self.job.scenario.data.batch_size

    def single_device_step_s(self) -> float | None:
        """Seconds one device alone (the whole model, unsharded) needs for a step on its own batch."""
        replica, device = self.replicas[0], self.devices[0]
        if replica.last_batch is None:
            return None
        cost, count = replica.step_cost(), self.microbatches
        return (count * device.compute_time(cost.forward_flops + cost.backward_flops, replica.precision.name,
                                            cost.forward_ops + cost.backward_ops)
                + device.memory_bound_time(self._whole_step_bytes)
                + device.fixed_time(count * (cost.forward_kernels + cost.backward_kernels), passes=2 * count,
                                    updates=1))

    def report_sections(self) -> dict:
        """report.json's `parallel` (the layout) and `sharding` (the stage, the groups, the bytes by kind)."""
        return {
            "parallel": {"dp": self.world, "pp": 1, "tp": 1, "overlap": True, "buckets": len(self.layout.units),
                         **({"microbatches": self.microbatches} if self.microbatches > 1 else {})},
            "sharding": {"stage": self.stage, "degree": self.degree, "replicate": self.replicate,
                         "reduce_dtype": self.reduce_dtype,
                         "reshard_after_forward": self.reshard_after_forward, "units": len(self.layout.units),
                         "shard_elements": self.layout.shard_numel, "padded_elements": self.layout.padded_numel,
                         "bytes_by_kind": bytes_by_kind(self.job.cluster.log, self.devices),
                         "offload": NO_OFFLOAD if self.offload is None else self.offload.report(self.offload_what)},
        }


class ShardingBytes(ReportSection):
    all_gather: int = Field(description="bytes the parameter all-gathers sent, every rank's")
    reduce_scatter: int = Field(description="bytes the gradient reduce-scatters sent, every rank's")
    all_reduce: int = Field(description="bytes the HSDP all-reduces of reduced shards across replicas sent")


class ShardingSection(ReportSection):
    stage: int = Field(description="the ZeRO stage: 1 optimizer state, 2 and gradients, 3 (FSDP) and parameters")
    degree: int = Field(description="ranks a shard group holds one copy of the state across")
    replicate: int = Field(description="shard groups that replicate each other (HSDP when above 1)")
    reshard_after_forward: bool = Field(description="stage 3: whether a unit is gathered again for its backward")
    reduce_dtype: str = Field(description="the dtype gradients were reduced in: fp32, bf16 or fp16")
    units: int = Field(description="units the parameters are gathered and their gradients reduced in")
    shard_elements: int = Field(description="parameters in one rank's shard (each unit padded to the degree)")
    padded_elements: int = Field(description="parameters of the model, each unit padded to a multiple of the "
                                             "degree")
    bytes_by_kind: ShardingBytes = Field(description="bytes each kind of collective sent")
    offload: OffloadSection = Field(OffloadSection(**NO_OFFLOAD), description="ZeRO-Offload: what lives in host "
                                                                            "memory, the bytes copied each way")


register_section("sharding", ShardingSection, "sharded data parallelism: the stage, the groups and the bytes "
                                              "each collective moved (schemes/sharded.py)")

