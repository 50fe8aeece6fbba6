"""Asynchronous SGD through shared memory, Hogwild!-style or under a lock.

The parameters live in the cluster's shared-memory store (hw/shared_memory.py)
together with the optimizer and its state, as with A3C's shared optimizer or a
parameter server. Each worker loops on its own, never waiting for another:

1. **pull**: the worker's replica takes a snapshot of the store's parameters
   (a real tensor copy) at the instant the read begins; the read costs a
   transfer store -> device of the parameters' bytes, and the worker starts
   computing when it ends. An update applied while the read's bytes are moving
   is not in the snapshot: reads are never torn.
2. **compute**: forward and backward on the worker's next batch of its own
   shard (real torch), charged on its compute stream (with the device's
   slowdown and jitter, hw/device.py).
3. **push**: the gradient (a real copy into a staging buffer on the store,
   `comm_buffers` in the store's memory) travels device -> store, then the
   store's optimizer applies it (a real torch optimizer step on the shared
   parameters), charged as memory-bound work at the store's bandwidth
   (`optimizer_step_bytes / bandwidth`, logged as the worker's "optimizer"
   span). An update is applied all at once when that work ends: no read sees
   half an update.

`parallel.async.consistency`:

- `hogwild`: no lock. Pushes of several workers move at once and share the
  store's bandwidth; updates are element-wise adds into the shared parameters
  (Hogwild!'s atomic component-wise updates, coarsened to whole updates), so no
  update is ever lost or overwritten.
- `locked`: a FIFO lock on the store (a simpy Resource of capacity 1) is held
  from the start of a push until its update is applied: writes are serialized
  and each has the store's bandwidth to itself. Reads take no lock (they are
  snapshots either way). The time a worker waits for the lock is reported as
  `lock_wait_s` and shows as idle time in the breakdown.

**Staleness** of an update: the number of updates applied to the store between
the instant its worker's read began and the instant it is applied (all of them
by other workers). `parallel.async.staleness_lr: inverse` applies it with
`lr / (1 + staleness)` (Zhang, Gupta, Lian, Liu, "Staleness-aware Async-SGD for
Distributed Deep Learning", IJCAI 2016, divide the learning rate by the
staleness); `none` keeps `lr`. N equal workers reach staleness N - 1 once
their cycles interleave; identical workers with no `cluster.compute_jitter`
run in lockstep, all updating at the same instants, and then rank r's
staleness is r.

**Order**: everything follows the simulated clock; updates whose application
ends at the same instant are applied in rank order. `train.steps` is the total
number of updates across workers: a worker claims the next update when it
starts a read and stops once all are claimed. One update carries one batch, so
a sync run of S steps on N devices sees N times the samples of an async run of
S updates.

With one worker this is exactly plain single-device training: every read sees
every update (staleness 0) and the store's optimizer steps with the gradient
of the very parameters it holds.

The loss curve has one point per update: (the instant it was applied, the loss
of its batch at the parameters the worker read).

Before claiming update u a worker runs the job's `before_step(rank, u)`
program (job.py); a pause there holds it until the program lets it go on, so a
pause that every worker reaches at the same u finds the first u updates
applied. A learning rate set there applies to every update applied from then on.

    scheme = AsynchronousSGD(job)          # parallel.mode: async
    job.start(); run_to_end(job.cluster.env); scheme.report_sections()
"""
import copy

import simpy
import torch
from pydantic import Field

from ..report.sections import ReportSection, register_section
from ..train.grad_bucket import flat_grad_buffer
from ..train.hyperparameters import set_live
from ..train.optim import build_optimizer, optimizer_state_bytes, optimizer_step_bytes
from ..train.training_state import TrainingState, capture, restore
from . import selection
from .local_work import forward_backward
from ..step_ops import Alloc, Busy, Transfer, Wait
from .scheme import Scheme


class AsynchronousSGD(Scheme):
    """Workers that pull the shared parameters, compute a gradient and push it, each on its own clock."""

    applies = staticmethod(selection.asynchronous)  # the registry's predicate (selection.py)

    def __init__(self, job, on_step=None):
        self.job = job
        self.env = job.cluster.env
        self.store = job.cluster.shared_memory
        self.replicas = job.replicas
        self.world = job.world
        self.devices = job.devices
        self.spec = job.scenario.parallel.async_
        optimizer = job.scenario.train.optimizer
        self.steps = job.scenario.train.steps
        self.on_step = on_step  # on_step(update, sim_time_s, loss) when an update is applied
        # The shared parameters, their gradient slot and the store's optimizer.
        self.shared_model = copy.deepcopy(job.model)
        self.shared_params = [p for p in self.shared_model.parameters() if p.requires_grad]
        self.shared_grad = flat_grad_buffer(self.shared_params)
        self.optimizer = build_optimizer(self.shared_params, optimizer)
        self._base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.param_bytes = self.replicas[0].param_bytes
        self._state_bytes = optimizer_state_bytes(optimizer, self.param_bytes)
        self._step_bytes = optimizer_step_bytes(optimizer, self.param_bytes)
        self.apply_s = self._step_bytes / self.store.bandwidth
        self.lock = simpy.Resource(self.env, capacity=1) if self.spec.consistency == "locked" else None
        self._claimed = 0
        self._landing = []  # updates whose application ends now: applied together, in rank order
        self.version = 0  # updates applied so far
        self.staleness: list[int] = []  # per update, in the order applied
        self.updates_per_rank = [0] * self.world
        self.lock_wait_s = [0.0] * self.world
        self.pushes_lost = 0  # report.json's faults.pushes_lost (recovery.py)
        # Per worker, its update in progress (recovery.py settles it if the device is lost):
        # (stage, lock request or None, what landing it needs); None between updates.
        self._doing: list[tuple | None] = [None] * self.world
        self.loss_curve: list[tuple[float, float | None]] = []  # (sim_time_s, loss) per update
        store = self.store.memory
        store.alloc("weights", self.param_bytes)
        store.alloc("gradients", self.shared_grad.numel() * self.shared_grad.element_size())
        store.alloc("optimizer_state", self._state_bytes)

    @classmethod
    def steps_until_every_rank_stepped(cls, world: int) -> int:
        return world  # one update per worker

    # ---- the workers -------------------------------------------------------

    def program(self, rank: int):
        """Step program of worker `rank`: pull, compute, push, until every update is claimed."""
        device, replica = self.devices[rank], self.replicas[rank]
        yield Alloc("weights", replica.param_bytes)
        yield Alloc("gradients", replica.grad_buffer.numel() * replica.grad_buffer.element_size())
        while self._claimed < self.steps:
            if not (yield from self.job.before_step(rank, self._claimed)) or self._claimed == self.steps:
                break  # ended, or the other workers claimed the rest meanwhile
            self._claimed += 1
            read_version = self.version
            with torch.no_grad():
                for mine, shared in zip(replica.params, self.shared_params):
                    mine.copy_(shared)
            self._doing[rank] = ("compute", None, None)
            yield Transfer(self.store.node, device.node, self.param_bytes, "pull")
            loss = yield from forward_backward(replica)
            request = None
            if self.lock is not None:
                asked = self.env.now
                request = self.lock.request()
                self._doing[rank] = ("compute", request, None)
                yield Wait(request)
                self.lock_wait_s[rank] += self.env.now - asked
            staged = replica.grad_buffer.clone()
            self.store.memory.alloc("comm_buffers", self.param_bytes)
            self._doing[rank] = ("push", request, None)
            yield Transfer(device.node, self.store.node, self.param_bytes, "push")
            landing = (rank, staged, read_version, loss)
            self._doing[rank] = ("apply", request, (self.env.now + self.apply_s, landing))
            yield Busy(self.apply_s, "shared optimizer step", kind="optimizer", nbytes=self._step_bytes)
            applied = self._land(*landing)
            self._doing[rank] = ("land", request, applied)
            yield Wait(applied)
            self._doing[rank] = None
            self._applied(request)

    def _applied(self, request) -> None:
        """An update is in the store: its staging buffer is freed and the lock (if held) released."""
        self.store.memory.free("comm_buffers", self.param_bytes)
        if request is not None:
            self.lock.release(request)

    def device_lost(self, rank: int) -> dict:
        """Worker `rank`'s device was lost now (its program has ended): the others go on without it, and the
        store settles its update in progress. A push whose bytes had not all arrived is lost and its update
        goes back to the others; one that had arrived is applied when it would have been. Returns what
        happened, for the report."""
        doing, self._doing[rank] = self._doing[rank], None
        effect = {"updates_applied": self.updates_per_rank[rank], "push_lost": False}
        if doing is None:
            return effect
        stage, request, landing = doing
        if stage in ("compute", "push"):
            self._claimed -= 1
            if stage == "push":
                self.pushes_lost += 1
                effect["push_lost"] = True
                self.store.memory.free("comm_buffers", self.param_bytes)
            if request is not None:
                if request.triggered:
                    self.lock.release(request)
                else:
                    request.cancel()
        elif stage == "apply":
            ends_at, update = landing
            self.env.timeout(ends_at - self.env.now).callbacks.append(
                lambda _event: self._land(*update).callbacks.append(lambda _applied: self._applied(request)))
            effect["updates_applied"] += 1  # in the store already
        else:
            landing.callbacks.append(lambda _applied: self._applied(request))
            effect["updates_applied"] += 1
        return effect

    # ---- the store ---------------------------------------------------------

    def _land(self, rank: int, staged: torch.Tensor, read_version: int, loss: torch.Tensor) -> simpy.Event:
        """An event that fires once this update is applied, with every other one ending now, in rank order.

        A zero-delay timeout created now fires after every event already due now, and every
        application ending now was scheduled earlier (it lasted apply_s > 0), so all of them
        are in the batch.
        """
        applied = self.env.event()
        if not self._landing:
            self.env.timeout(0).callbacks.append(self._apply_landed)
        self._landing.append((rank, staged, read_version, loss, applied))
        return applied

    def _apply_landed(self, _event) -> None:
        batch, self._landing = sorted(self._landing, key=lambda update: update[0]), []
        now = self.env.now
        for rank, staged, read_version, loss, applied in batch:
            staleness = self.version - read_version
            scale = 1.0 / (1 + staleness) if self.spec.staleness_lr == "inverse" else 1.0
            for group, lr in zip(self.optimizer.param_groups, self._base_lrs):
                group["lr"] = lr * scale
            self.shared_grad.copy_(staged)
            self.optimizer.step()
            self.staleness.append(staleness)
            self.updates_per_rank[rank] += 1
            loss_value = loss.item() if self.job.numerics else None
            self.loss_curve.append((now, loss_value))
            if self.on_step is not None:
                self.on_step(self.version, now, loss_value)
            self.version += 1
            applied.succeed()

    # ---- what the run reports ----------------------------------------------

    def set_hyperparameters(self, rank: int, values: dict) -> None:
        """For every worker (they share the store and the count of updates), whichever `rank` asks."""
        set_live(self.optimizer, [replica.loader for replica in self.replicas], values)
        self._base_lrs = [group["lr"] for group in self.optimizer.param_groups]

    def training_state(self, rank: int) -> TrainingState:
        return capture(self.shared_model, None, self.optimizer, None)

    def load_training_state(self, rank: int, state: TrainingState, flat) -> None:
        """The store takes the state (the workers read it at their next pull); once, from rank 0."""
        if rank == 0:
            restore(state, flat, self.shared_model, None, self.optimizer, None)

    def state_receivers(self) -> list[int]:
        return [0]  # the state lives in the store: rank 0 stands for it

    def receive_state(self, rank: int, donor, state):
        """Step program of rank 0: the store copies the state within itself, read and written at its
        bandwidth ("exploit copy"), then holds it."""
        yield Busy(2 * state.nbytes / self.store.bandwidth, "exploit copy", kind="communication", nbytes=state.nbytes)
        self.load_training_state(rank, state, state.flat.clone())

    def stuck(self) -> list[int]:
        return []  # workers never wait for one another

    def trained_model(self):
        return self.shared_model  # the replicas hold stale copies

    def final_models(self) -> list:
        return [self.shared_model]

    def samples_per_step(self) -> int:
        return self.job.scenario.data.batch_size  # one update carries one batch

    def single_device_step_s(self) -> float:
        """Seconds per update of `world` workers that never interfere: one device's compute and
        device-side optimizer step for one batch (the sync schemes' baseline), over `world`."""
        cost = next(replica.step_cost() for replica in self.replicas if replica.last_batch is not None)
        device = self.devices[0]
        alone = (device.compute_time(cost.forward_flops + cost.backward_flops, "fp32",
                                     cost.forward_ops + cost.backward_ops)
                 + device.memory_bound_time(self._step_bytes))
        return alone / self.world

    def report_sections(self) -> dict:
        """report.json's `async` section."""
        histogram = [0] * (max(self.staleness, default=0) + 1)
        for staleness in self.staleness:
            histogram[staleness] += 1
        updates = len(self.staleness)
        return {"async": {
            "consistency": self.spec.consistency,
            "staleness_lr": self.spec.staleness_lr,
            "updates": updates,
            "updates_per_rank": list(self.updates_per_rank),
            "staleness_mean": sum(self.staleness) / updates if updates else 0.0,
            "staleness_max": max(self.staleness, default=0),
            "staleness_histogram": histogram,
            "lock_wait_s": sum(self.lock_wait_s),
            "lock_wait_s_per_rank": list(self.lock_wait_s),
        }}


class AsyncSection(ReportSection):
    consistency: str = Field(description="parallel.consistency: how a worker reads and writes the shared "
                                         "parameters")
    staleness_lr: str = Field(description="how the learning rate follows an update's staleness")
    updates: int = Field(description="updates applied to the shared parameters")
    updates_per_rank: list[int] = Field(description="updates each worker pushed")
    staleness_mean: float = Field(description="mean staleness: updates applied between a worker's read and its "
                                              "push")
    staleness_max: int = Field(description="the largest staleness")
    staleness_histogram: list[int] = Field(description="updates of each staleness 0, 1, 2...")
    lock_wait_s: float = Field(description="seconds workers waited for the lock, all workers")
    lock_wait_s_per_rank: list[float] = Field(description="seconds each worker waited for the lock")


register_section("async", AsyncSection, "asynchronous training: staleness and lock waits "
                                        "(schemes/asynchronous.py)")
