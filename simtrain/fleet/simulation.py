"""A fleet's long run, event by event: training at the measured step time, failures, restarts, checkpoints.

The step is simulated once by the runner (its `step_time_s`); here a simpy
clock runs weeks around it. Steps go by at that pace (times a straggler's
slowdown while a GPU is slow), with a checkpoint every `every` steps
(costs.py). Failures come from every component's units (inventory.py),
each after an exponential time of mean `mtbf`, independently: the next one
after an exponential time of mean `1 / sum(units / mtbf)`, of a component
drawn in proportion to its rate and a unit drawn uniformly; or they are
replayed from `fleet.failures`. Draws come from numpy Generators seeded with
`[fleet.seed (default: the scenario's), stream]`.

A failure interrupts whatever the job does. The work since the checkpoint the
job will restart from is lost (`work_redone`); background writes in flight
are lost; the hosts in its blast radius go to repair (back in the spare pool
after `repair`). Then, each a phase: `detection` (the component's, else
`recovery.detection`), `waiting_for_spares` (until the pool has a host for
each one lost; none with an unlimited pool), `relaunch`, `communicator_init`,
`checkpoint_load` (from a peer's memory if the failure took at most
`replicas` hosts and that copy is the latest, else from storage). A failure
during detection or while waiting for spares joins the restart under way (its
hosts too); one during relaunch, initialisation or load starts the restart
again from detection. Two kinds differ:

- a **planned stop** (`maintenance`) comes right after a checkpoint: nothing
  is redone and no host is lost (the write before it is not charged);
- a **silent data corruption** (`sdc`) does not stop the job: it trains on,
  corrupted, for the sdc's `detection`; checkpoints written meanwhile are bad.
  Then the job stops and goes back to the last checkpoint written before the
  corruption (from storage): everything since is `work_redone`, and the
  restart has no detection phase of its own (one corruption at a time: a
  second one before the first is noticed is noticed with it).

Every second of the run is useful training or lost to one phase (blocking
checkpoint writes: `checkpoint_writes`; a straggler's extra time:
`stragglers`), so `elapsed = steps_done x step_time + sum(lost)` (tested).

    run = FleetRun(scenario.fleet, inventory, costs, step_time_s=2.1, seed=0)
    run.run()
    run.progress, run.lost_by_phase, run.interruptions, run.timeline.daily(run.end_s)
"""
import math

import numpy as np
import simpy

from .costs import Costs
from .expected import checkpoint_interval_s
from .failures import drawn, failure_rates, replayed, slowdowns
from .inventory import Inventory
from .timeline import Timeline

PHASES = ("detection", "waiting_for_spares", "relaunch", "communicator_init", "checkpoint_load", "work_redone",
          "checkpoint_writes", "stragglers")
_RESTART_PHASES = ("detection", "waiting_for_spares", "relaunch", "communicator_init", "checkpoint_load")
_FAILURE_STREAM = 0x666C656574  # "fleet": apart from every other stream of the seed
_STRAGGLER_STREAM = 0x736C6F77  # "slow"


class _Failure:
    def __init__(self, component: str, unit: int, hosts: tuple[int, ...], cause: str):
        self.component, self.unit, self.hosts, self.cause = component, unit, hosts, cause


class FleetRun:
    """One long run of a job on a fleet: what it trained and what it lost, by phase and by cause."""

    def __init__(self, fleet, inventory: Inventory, costs: Costs, step_time_s: float, seed: int):
        self.fleet, self.inventory, self.costs, self.step_time_s = fleet, inventory, costs, step_time_s
        self.env = simpy.Environment()
        interval_s = checkpoint_interval_s(fleet, costs.blocking_s, failure_rates(fleet, inventory))
        self.every = max(1, round(interval_s / step_time_s))  # steps between checkpoints
        seed = fleet.seed if fleet.seed is not None else seed
        self.rng = np.random.default_rng([seed, _FAILURE_STREAM])
        self.slow_rng = np.random.default_rng([seed, _STRAGGLER_STREAM])
        self.progress = 0.0  # steps the job stands at
        self.storage_step, self.memory_step = 0, None  # latest checkpoints committed (0: the initial state)
        self.lost_by_phase = dict.fromkeys(PHASES, 0.0)
        self.lost_by_cause: dict[str, float] = {}
        self.interruptions: dict[str, int] = {}
        self.hosts_replaced = 0
        self.pool = fleet.spares  # spare hosts now; None: as many as needed
        self.down: list[int] = []  # the job's hosts lost and not yet replaced
        self.cause = None  # the cause of the failure the job is recovering from; None: training
        self.corrupted_at = None  # the steps the job stood at when a silent corruption began; None: none pending
        self.good_storage_step = 0  # the latest checkpoint in storage written before any pending corruption
        self.from_memory = False
        self.generation = 0  # one more at each failure: writes begun before it do not commit
        self.writing = None  # the background write in flight (an Event), or None
        self.slow = 0  # GPUs slow now
        self.pace_changed = self.env.event()
        self.repaired = self.env.event()
        self.timeline = Timeline()
        self._current = None  # (phase or "training", start, pace)
        self.last_phase = "training"  # the phase the job was in last (when a failure struck: the one it cut)
        self.detected_at_s = 0.0  # when the job notices the failures it is down for
        self.completed_at_s = None

    # -- the run ---------------------------------------------------------------------------------------------

    def run(self) -> None:
        env = self.env
        self.done = env.event()
        self.job = env.process(self._job())
        if self.fleet.failures:
            env.process(replayed(env, self.fleet.failures, self._strike))
        else:
            env.process(drawn(env, self.rng, failure_rates(self.fleet, self.inventory), self.inventory, self._strike))
        if self.fleet.stragglers is not None:
            env.process(slowdowns(env, self.slow_rng, self.fleet.stragglers, self.inventory.gpus, self._set_slow,
                                  self._strike))
        env.run(until=env.timeout(self.fleet.horizon) | self.done)
        self.end_s = env.now
        if self._current is not None:  # the horizon came in the middle of something
            self._close(self._current[0], self._current[1], self._current[2])
        self._mark()

    def _job(self):
        target = self.fleet.target_steps
        while True:
            try:
                if self.cause is not None:
                    yield from self._restart()
                while target is None or self.progress < target:
                    next_checkpoint = (math.floor(self.progress / self.every + 1e-9) + 1) * self.every
                    yield from self._train_until(next_checkpoint if target is None else min(next_checkpoint, target))
                    if target is not None and self.progress >= target:
                        break
                    yield from self._checkpoint(next_checkpoint)
                self.completed_at_s = self.env.now
                self.done.succeed()
                return
            except simpy.Interrupt as interrupt:
                self._failed(interrupt.cause)

    def _train_until(self, step: float):
        env = self.env
        while self.progress < step:
            pace = self.step_time_s * (self.fleet.stragglers.slowdown if self.slow else 1.0)
            if self.pace_changed.triggered:
                self.pace_changed = env.event()
            self._open("training", pace)
            start = env.now
            finished = env.timeout((step - self.progress) * pace)
            yield finished if self.fleet.stragglers is None else finished | self.pace_changed
            self._close("training", start, pace)
            if finished.processed:
                self.progress = float(step)  # not a rounding error short of it

    def _checkpoint(self, step: int):
        if self.writing is not None and not self.writing.triggered:
            yield from self._phase("checkpoint_writes", None, self.writing)  # one write in flight at a time
        yield from self._phase("checkpoint_writes", self.costs.blocking_s)
        generation = self.generation
        if self.fleet.checkpoint.mode == "sync":
            self._stored(step)
        else:
            self.writing = self.env.event()
            self.env.process(self._commit_later(self.costs.background_s, step, generation, "storage", self.writing))
        if self.fleet.checkpoint.replicas:
            self.env.process(self._commit_later(self.costs.replicate_s, step, generation, "memory", None))

    def _commit_later(self, seconds: float, step: int, generation: int, where: str, event):
        yield self.env.timeout(seconds)
        if generation != self.generation:  # a failure came first: this copy is lost
            return
        if where == "storage":
            self._stored(step)
            event.succeed()
        else:
            self.memory_step = step

    def _stored(self, step: float) -> None:
        self.storage_step = step
        if self.corrupted_at is None or step <= self.corrupted_at:
            self.good_storage_step = step

    def _restart(self):
        yield from self._phase("detection", max(0.0, self.detected_at_s - self.env.now))
        while self.down:
            if self.pool is None:
                self.hosts_replaced += len(self.down)
                self.down = []
                break
            taken = min(self.pool, len(self.down))
            self.pool -= taken
            self.hosts_replaced += taken
            self.down = self.down[taken:]
            if self.down:
                if self.repaired.triggered:
                    self.repaired = self.env.event()
                yield from self._phase("waiting_for_spares", None, self.repaired)
        for phase, seconds in self.costs.restart_parts(self.from_memory):
            yield from self._phase(phase, seconds)
        self.cause = None
        self._mark()

    def _phase(self, phase: str, seconds: float | None, event=None):
        """Wait `seconds` (or for `event`), charged to `phase`, also when a failure cuts it short."""
        self._open(phase, None)
        start = self._current[1]
        try:
            yield self.env.timeout(seconds) if event is None else event
        finally:
            if self._current is not None and self._current[0] == phase and self._current[1] == start:
                self._close(phase, start, None)

    # -- accounting ------------------------------------------------------------------------------------------

    def _open(self, phase: str, pace) -> None:
        self._current = (phase, self.env.now, pace)
        self.last_phase = phase
        if phase == "training":
            self._mark()

    def _close(self, phase: str, start: float, pace) -> None:
        elapsed = self.env.now - start
        self._current = None
        if phase == "training":
            self.progress += elapsed / pace
            self._charge("stragglers", elapsed * (1 - self.step_time_s / pace))
            self._mark()
        else:
            self._charge(phase, elapsed)

    def _charge(self, phase: str, seconds: float) -> None:
        if seconds <= 0:
            return
        self.lost_by_phase[phase] += seconds
        if phase in _RESTART_PHASES or phase == "work_redone":
            self.lost_by_cause[self.cause] = self.lost_by_cause.get(self.cause, 0.0) + seconds

    def _mark(self) -> None:
        self.timeline.mark(self.env.now, self.progress)

    # -- failures --------------------------------------------------------------------------------------------

    def _failed(self, failure: _Failure) -> None:
        """A failure struck: lose the work since the checkpoint the job restarts from; its hosts go to repair."""
        if self._current is not None:  # training: what it did until now counts, and is then lost
            phase, start, pace = self._current
            if phase == "training":
                self._close(phase, start, pace)
        component = getattr(self.fleet.components, failure.component)
        if self.cause is None or self.last_phase not in ("detection", "waiting_for_spares"):
            detection = self.fleet.recovery.detection if component.detection is None else component.detection
            self.detected_at_s = self.env.now + (0.0 if failure.component == "sdc" else detection)
            self.cause = failure.cause
        # else: the job is down already; this failure's hosts join the restart under way
        self.generation += 1
        self.writing = None
        self.interruptions[failure.cause] = self.interruptions.get(failure.cause, 0) + 1
        self.timeline.failed(self.env.now)
        if failure.component == "maintenance":  # planned, right after a checkpoint
            self._stored(self.progress)
            self.memory_step = None
        if len(failure.hosts) > self.fleet.checkpoint.replicas:
            self.memory_step = None  # a host and its peers' copies may be gone: back to storage
        self.from_memory = self.memory_step is not None and self.memory_step >= self.storage_step
        restart_step = self.memory_step if self.from_memory else self.storage_step
        if self.progress > restart_step:
            self._charge("work_redone", (self.progress - restart_step) * self.step_time_s)
            self.progress = float(restart_step)
            self._mark()
        for host in failure.hosts:
            if host not in self.down:
                self.down.append(host)
                self.env.process(self._repair(component.repair))

    def _corrupted(self, unit: int):
        """A silent data corruption: training goes on until it is noticed, then back to the last good checkpoint."""
        self.corrupted_at = self.progress
        if self._current is not None and self._current[0] == "training":  # and the steps done since it marked them
            self.corrupted_at += (self.env.now - self._current[1]) / self._current[2]
        sdc = self.fleet.components.sdc
        yield self.env.timeout(self.fleet.recovery.detection if sdc.detection is None else sdc.detection)
        self.storage_step, self.memory_step = self.good_storage_step, None
        self.corrupted_at = None
        if self.job.is_alive:
            self.job.interrupt(_Failure("sdc", unit, self.inventory.hosts_lost("sdc", unit), "sdc"))

    def _repair(self, seconds: float):
        yield self.env.timeout(seconds)
        if self.pool is not None:
            self.pool += 1
            if not self.repaired.triggered:
                self.repaired.succeed()

    def _strike(self, component: str, unit: int, cause: str | None = None) -> None:
        if not self.job.is_alive:
            return
        if component == "sdc":
            if self.corrupted_at is None:  # else: noticed with the one pending
                self.env.process(self._corrupted(unit))
            return
        self.job.interrupt(_Failure(component, unit, self.inventory.hosts_lost(component, unit), cause or component))

    def _set_slow(self, change: int) -> None:
        was_slow = self.slow > 0
        self.slow += change
        if was_slow != (self.slow > 0) and not self.pace_changed.triggered:
            self.pace_changed.succeed()
