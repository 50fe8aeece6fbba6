"""Synchronous data parallelism: compute, all-reduce (comm.ALGORITHMS, over channels), step.

Every step, each device runs forward and backward on its own batch (real
torch, charged as FLOPs on its compute stream), the group all-reduces the
gradient bucket with the chosen collective (real chunks over the simulated
network), and every replica applies the same averaged gradient with its own
optimizer (real, charged as memory-bound work). A device that finishes early
waits inside the all-reduce for the others: that wait is its idle time.

With `parallel.overlap` (the default, as DDP) the gradient is all-reduced in
buckets (train/grad_bucket.py) posted on the rank's communication stream as
the backward completes them, so they run while the rest of the backward
computes; the optimizer waits for the last one. Only the communication no
compute hides is counted as communication in the breakdown.

With `parallel.pipeline.microbatches` m > 1 (gradient accumulation) the
batch is cut into m micro-batches run forward and backward in turn, each
gradient added to the buffer, and the gradient is reduced once, as under
torch DDP's `no_sync` for the first m - 1: the buckets are posted during the
last micro-batch's backward (or one all-reduce after it, without overlap).

    scheme = SyncDataParallel(job)          # parallel.mode: sync, parallel.all_reduce: ring | tree | ...
    job.start(); run_to_end(job.cluster.env)

Before each step every rank runs the job's `before_step` program (job.py: a
schedule's hyperparameters, a population's exploit); it may end training there.

With `optimizer="kfac"` the K-FAC work (factors averaged with the same
collective, inversions shared out and broadcast, preconditioning) runs between
the all-reduce and the base optimizer's step (schemes/kfac_sync.py). With
`sync_batchnorm` each forward and backward all-reduces the BatchNorm
statistics with the same collective (train/syncbn.py). Rank 0's per-layer
weight norms are recorded before training and every `report_every` steps.

The replicas' precision sets the dtype FLOPs are charged in (the device's peak
for fp16/bf16) and the bucket's dtype (what the all-reduce moves); the device
ledger holds the replica's persistent bytes (train/precision.py) for the whole
run and the measured activation peak during forward and backward, where a
checkpointed segment's recomputation is part of the backward FLOPs. A ledger
past its capacity raises OutOfMemory at that step.
"""
from pydantic import Field

from ..errors import ScenarioError
from ..report.sections import ReportSection, register_section
from ..train.grad_bucket import overlap_buckets
from ..train.models import layers_before_batchnorm, weight_norms
from ..train.moe import scale_balancing_loss
from ..train.precision import persistent_bytes, update_bytes
from ..train.syncbn import synced_batchnorms
from . import selection
from .kfac_sync import DistributedKfac
from .local_work import forward_backward
from ..step_ops import Alloc, Collective, MemoryBound, PostCollective, WaitCollectives
from .rank_replicas import RankReplicas
from .scheme import Scheme


class SyncDataParallel(RankReplicas, Scheme):
    """Data-parallel training with a synchronous gradient all-reduce every step."""

    applies = staticmethod(selection.data_parallel)  # the registry's predicate (selection.py)

    def __init__(self, job, on_step=None):
        self.job = job
        self.replicas = job.replicas
        self.world = job.world
        train, parallel = job.scenario.train, job.scenario.parallel
        self.regroup()
        self.steps = train.steps
        self.overlap = parallel.overlapped and self.world > 1
        self.microbatches = parallel.microbatches  # gradient accumulation steps (local_work.py)
        for replica in self.replicas:  # a micro-batch's balancing loss (MoE) is its share of the batch's
            if replica is not None:
                scale_balancing_loss(replica.model, 1.0 / self.microbatches)
        self._bucket_cap_bytes = parallel.bucket_cap_bytes
        self._buckets = {}  # the step's StepCost.grad_ready_flops -> its buckets (a tuple hashes quicker)
        # rank -> (its buckets, its gradient buffer, their views of it): a view made every step cost 14 us in a run,
        # torch's caches cold from the backward
        self._bucket_views = {}
        self.on_step = on_step  # called as on_step(step, sim_time_s, mean_loss) when a step ends
        first = self.replicas[job.local_ranks[0]]  # every replica is alike: the first this process holds
        params = first.params
        self._held_bytes = persistent_bytes(params, train.precision, train.optimizer)
        self._step_bytes = update_bytes(params, train.precision, train.optimizer)
        # the update's operators, counted where a device charges a fixed cost per kernel (a calibrated host)
        self._step_kernels = first.step_kernels() if any(d.spec.kernel_overhead_s for d in self.devices) else 0
        self._step_losses = [[None] * self.world for _ in range(self.steps)]
        self.loss_curve: list[tuple[float, float | None]] = []  # (sim_time_s, mean loss over devices)
        self.kfac = None
        if train.optimizer.name == "kfac":
            self.kfac = DistributedKfac(self.replicas, self.devices, self.all_reduce, train.optimizer)
        self.only_ring_all_reduces = parallel.all_reduce == "ring" and self.kfac is None  # K-FAC also broadcasts
        self.sync_batchnorm = job.scenario.parallel.sync_batchnorm
        if self.sync_batchnorm:
            try:
                synced_batchnorms(first.model)
            except ValueError as error:
                raise ScenarioError(f"parallel.sync_batchnorm: {error}") from None
        self.report_every = job.scenario.report.every
        self._norm_steps = [0]
        self._norms = ({name: [norm] for name, norm in weight_norms(first.model).items()}
                       if job.numerics else {})

    @classmethod
    def steps_until_every_rank_stepped(cls, world: int) -> int:
        return 1

    def regroup(self) -> None:
        """The all-reduce over the job's devices as they are now (a spare took a lost device's place)."""
        parallel = self.job.scenario.parallel
        self.devices = self.job.devices
        self.all_reduce = self.job.all_reduce(range(self.world))

    def rewind(self, step: int) -> None:
        """Forget what came after step `step`: the job restarts there from a checkpoint (recovery.py)."""
        super().rewind(step)
        self._step_losses[step:] = [[None] * self.world for _ in range(self.steps - step)]
        kept = sum(1 for done in self._norm_steps if done <= step)
        del self._norm_steps[kept:]
        for norms in self._norms.values():
            del norms[kept:]

    def program(self, rank: int, first_step: int = 0):
        """Step program of job rank `rank`: hold the replica's state, then every step from `first_step`."""
        replica = self.replicas[rank]
        for category, nbytes in self._held_bytes.items():
            yield Alloc(category, nbytes)
        if self.kfac is not None:
            yield Alloc("kfac", self.kfac.memory_bytes(rank))
        statistics = (lambda buffer: self.all_reduce(rank, self.world, buffer)) if self.sync_batchnorm else None
        for step in range(first_step, self.steps):
            if not (yield from self.job.before_step(rank, step)):
                break
            if self.overlap:
                yield from forward_backward(replica, statistics, self._bucket_all_reduces(rank, step),
                                            self.microbatches)
                yield WaitCollectives()
            else:
                self._step_losses[step][rank] = yield from forward_backward(replica, statistics,
                                                                            microbatches=self.microbatches)
                yield Collective(self.all_reduce(rank, self.world, replica.grad_buffer, average=True), "all_reduce")
            if self.kfac is not None:
                yield from self.kfac.step(rank)
            replica.step()
            yield MemoryBound(self._step_bytes, "optimizer step", kind="optimizer", kernels=self._step_kernels,
                              updates=1)
            if rank == 0 and len(self.job.local_ranks) == self.world:
                self._end_step(step)

    def _bucket_all_reduces(self, rank: int, step: int):
        """during_backward for forward_backward: each bucket's all-reduce, posted once the backward completed it.
        The loss is kept before any is posted: rank 0 reads every rank's when its last all-reduce ends."""
        replica = self.replicas[rank]
        buffer = replica.grad_buffer

        def posts(cost, loss):
            self._step_losses[step][rank] = loss
            buckets = self._buckets.get(cost.grad_ready_flops)
            if buckets is None:
                buckets = self._buckets[cost.grad_ready_flops] = overlap_buckets(
                    replica.params, cost.grad_ready_flops, buffer.element_size(), self._bucket_cap_bytes)
            views = self._bucket_views.get(rank)
            if views is None or views[0] is not buckets or views[1] is not buffer:
                views = self._bucket_views[rank] = (buckets, buffer, [buffer[bucket.start:bucket.stop]
                                                                      for bucket in buckets])
            return [(bucket.ready_flops, PostCollective(self.all_reduce(rank, self.world, view, average=True),
                                                        "all_reduce"))
                    for bucket, view in zip(buckets, views[2])]
        return posts

    def _end_step(self, step: int) -> None:
        # Every rank posted its gradient before rank 0's all-reduce could finish,
        # so all losses of this step are in.
        losses = self._step_losses[step]
        mean_loss = float(sum(loss.item() for loss in losses)) / self.world if self.job.numerics else None
        self._step_losses[step] = None
        now = self.job.cluster.env.now
        self.loss_curve.append((now, mean_loss))
        if self.job.numerics and ((step + 1) % self.report_every == 0 or step + 1 == self.steps):
            self._norm_steps.append(step + 1)
            for name, norm in weight_norms(self.replicas[0].model).items():
                self._norms[name].append(norm)
        if self.on_step is not None:
            self.on_step(step, now, mean_loss)

    def rank_losses(self, rank: int) -> list[list[float]]:
        """The losses job rank `rank` computed in each step it ran (its batch's), where the job holds only
        some ranks (a real run, simtrain/real: each process its own); a simulated run reads `loss_curve`."""
        return [[float(losses[rank])] for losses in self._step_losses
                if losses is not None and losses[rank] is not None and self.job.numerics]

    def stuck(self) -> list[int]:
        return self.job.comm.stuck()

    def trained_model(self):
        return self.replicas[0].model

    def final_models(self) -> list:
        return [replica.model for replica in self.replicas]

    def samples_per_step(self) -> int:
        return self.world * self.job.scenario.data.batch_size

    def single_device_step_s(self) -> float | None:
        """Seconds one device alone needs for a step on its own batch (its micro-batches in turn): no
        communication."""
        replica, device = self.replicas[0], self.devices[0]
        if replica.last_batch is None:  # stopped (out of memory) before any step
            return None
        cost = replica.step_cost()
        kfac = self.kfac.single_device_step_s(self.steps) if self.kfac is not None else 0.0
        return (self.microbatches * (device.compute_time(cost.forward_flops + cost.backward_flops,
                                                         replica.precision.name, cost.forward_ops + cost.backward_ops)
                                     + device.fixed_time(cost.forward_kernels + cost.backward_kernels, passes=2))
                + device.memory_bound_time(self._step_bytes) + device.fixed_time(self._step_kernels, updates=1) + kfac)

    def report_sections(self) -> dict:
        """report.json's `weight_norms` (and `kfac` with K-FAC) and `parallel` (the layout: dp only)."""
        sections = {"weight_norms": {
            "steps": list(self._norm_steps),
            "layers": {name: list(norms) for name, norms in self._norms.items()},
            "before_batchnorm": layers_before_batchnorm(self.replicas[0].model),
        }}
        if self.kfac is not None:
            sections.update(self.kfac.report_section(self.steps))
        # the layout: report/parallel.py adds the bubble and the bytes
        sections["parallel"] = {"dp": self.world, "pp": 1, "tp": 1, "overlap": self.overlap,
                                **({"microbatches": self.microbatches} if self.microbatches > 1 else {}),
                                "buckets": max((len(buckets) for buckets in self._buckets.values()), default=1)}
        return sections


class WeightNormsSection(ReportSection):
    steps: list[int] = Field(description="the steps after which the norms were taken")
    layers: dict[str, list[float | None] | dict[str, list[float | None]]] = Field(
        description="each layer's weight norm at those steps (a layer with several weights: by weight name); "
                    "null: not finite")
    before_batchnorm: list[str] = Field(description="the layers whose output a BatchNorm normalizes")


register_section("weight_norms", WeightNormsSection, "weight norms of every layer over training "
                                                     "(schemes/sync.py)")
