"""Population-based training: a population of jobs on one simulated cluster that copy and perturb each other.

A scenario with a `pbt` section (scenario.PbtSpec) runs a population of its
job: `population` members, each a Job (job.py) on its own group of
`cluster.devices / population` devices (member i on ranks i*k .. i*k+k-1),
all on the one cluster, sharing its clock and its links. Each member runs the
scenario's scheme with its own hyperparameters, drawn from
`hyperparam_mutations` with a `random.Random` seeded from the scenario seed;
every member starts from the same initial model and data order (the
scenario's seed), so members differ by their hyperparameters only.

**Rounds.** Every `perturbation_interval` steps a member is *ready*: its
ranks pause before their next step (job.before_step), its metric is measured
(evaluation.py, at no simulated cost: `val_loss`/`val_accuracy` on the
validation split held out of the training split, `train_loss` on the
training split, never the test set) and its training state is kept as its
checkpoint (train/training_state.py). With `synch: true` a round waits for
every member and decides for all at once; with `synch: false` (Ray's default)
a ready member is compared with every member's latest metric and goes on at
once. The decisions are pbt_strategy.py's.

**Exploit** is a real copy over the simulated network, charged on the clock
and visible in the trace: the donor's checkpoint (weights and buffers, fp32
master weights under mixed precision, optimizer state, loss scale) is one flat
buffer of bytes; recipient rank r receives 1/k of it from donor rank r (a
`Transfer` between the two groups' devices, "exploit"), then the recipient's
ranks ring-all-gather the rest among themselves ("exploit all-gather"), and
each rank unpacks its received bytes into its replica, bit for bit. So the
bytes crossing from the donor's group to the recipient's are the state's size
once. With async members the state lives in the cluster's store: the copy is
store memory to store memory, read and written at the store's bandwidth.
Under pipeline or tensor parallelism each rank holds its own share: recipient
rank r receives donor rank r's share whole. Which ranks hold the state, which
receive it and how are the scheme's hooks (schemes/scheme.py: `state_holders`,
`state_receivers`, `state_source`, `receive_state`).
**Explore** then perturbs the copied hyperparameters, which apply live from
the recipient's next step (train/hyperparameters.py).

With `checkpoint: {bandwidth, latency}` the state goes through storage
instead, as Ray's checkpoints do: at every round each member's ranks write
their state (latency + bytes / bandwidth, "checkpoint write" spans; the round
waits for them), and a recipient's ranks read the donor's ("checkpoint
read"); accesses do not slow one another.

A lost device (`cluster.faults`, with `cluster.spares` and `checkpoint`)
restarts only its member, from the round it last went on from
(pbt_faults.py).

`stop: {metric: m}`: once a member's metric reaches m at a round, every member
stops at its next round (at once with synch). The report is the cluster's
(report.py), with the best member's model, curves and final figures, and a
`pbt` section.

    report = run_population(load_scenario("scenarios/pbt.yaml"))
    report.data["pbt"]["best"], report.final_model
"""
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy
import torch
from pydantic import Field

from ..errors import JobFailed, ScenarioError
from ..evaluation import TrainLossMonitor, evaluate
from ..hw.cluster import run_to_end
from ..job import Job
from ..preflight import preflight
from ..report import Report, RunResult, build_report
from ..report.sections import ReportSection, register_section
from ..runner import paced_collector, simulated_cluster, single_thread
from ..scenario import Scenario
from ..schemes import scheme_name
from ..step_ops import Busy, Wait
from ..train.model_flops import model_flops_per_step
from ..user_code import user_code_errors
from .pbt_faults import PopulationFaults
from .pbt_strategy import choose_donors, explore, initial_hyperparameters

_STREAM = 0x5042  # separates the population's draws from the other streams of the seed


@dataclass
class _Decision:
    """What a ready member does at a round: go on or stop, and whether (from whom) it copies."""

    go_on: bool
    donor: "Member | None" = None
    state: dict | None = None  # what it goes on from: holder rank -> TrainingState (the donor's, with a donor)
    values: dict | None = None  # the explored hyperparameters, with a donor
    event: dict | None = None  # the event's report entry, completed when the copy ends
    copied: simpy.Event | None = None  # with a donor: fires once every rank that receives the state holds it
    receiving: int = 0  # ranks still receiving the state


@dataclass
class Member:
    """One job of the population and its record."""

    id: int
    job: Job
    values: dict  # its hyperparameters now
    monitor: TrainLossMonitor
    schedule: list = field(default_factory=list)  # [step, sim_time_s, values] whenever they change
    metrics: list = field(default_factory=list)  # [step, sim_time_s, metric] at every round and at the end
    checkpoint: dict = field(default_factory=dict)  # holding job rank -> its TrainingState at its last round
    checkpoint_step: int = 0
    arrived: int = 0  # ranks paused at the current round
    in_round: int | None = None  # the step of the round it is in (from its first rank's pause to its last going on)
    went_on: int = 0  # ranks that went on from the current round
    recovery: Any = None  # with cluster.faults: its job's recovery.py Recovery (pbt_faults.py)
    gate: simpy.Event | None = None  # fires with the round's _Decision

    @property
    def metric(self) -> float:
        return self.metrics[-1][2]


class Population:
    """The members on one cluster, their rounds and their exploits."""

    def __init__(self, scenario: Scenario, on_step=None):
        self.spec = spec = scenario.pbt
        self.scenario = scenario
        resolved = preflight(scenario)  # everything `simtrain validate` checks, before the clock starts
        self.cluster = simulated_cluster(scenario, resolved)
        self.env = self.cluster.env
        size = self.cluster.size
        self.rng = random.Random(int(np.random.SeedSequence([scenario.seed, _STREAM]).generate_state(1)[0]))
        self.on_step = on_step
        self.steps_done = 0
        self.stopping = False
        self.waiting: list[Member] = []  # synch: members ready at the current round
        self.events: list[dict] = []
        self.checkpoint_write_s = 0.0  # member time spent writing checkpoints to storage
        group = (size - scenario.cluster.spares) // spec.population  # the spares stay idle until a loss
        self.members = []
        for index in range(spec.population):
            values = initial_hyperparameters(spec.hyperparam_mutations, self.rng)
            member_scenario = scenario.with_hyperparameters(values).model_copy(
                update={"name": f"{scenario.name}-m{index}"})
            job = Job(member_scenario, self.cluster, range(index * group, (index + 1) * group),
                      on_step=lambda *step, index=index: self.members[index].monitor.on_step(*step),
                      between_steps=lambda rank, step, index=index: self._between_steps(self.members[index],
                                                                                       rank, step))
            monitor = TrainLossMonitor(job.scheme.trained_model, job.data.train, scenario.report.every,
                                       scenario.train.steps, then=self._count_step)
            member = Member(index, job, values, monitor)
            member.schedule.append([0, 0.0, dict(values)])
            self.members.append(member)
        self.faults = PopulationFaults(self) if scenario.cluster.faults else None

    def _count_step(self, step: int, sim_time_s: float, loss) -> None:
        self.steps_done += 1
        if self.on_step is not None:
            self.on_step(self.steps_done - 1, sim_time_s, loss)

    # ---- rounds ---------------------------------------------------------------

    def _between_steps(self, member: Member, rank: int, step: int):
        """Step program of a member's rank before its step `step`: at a round, pause, then copy if told to."""
        restarted_at = member.job.checkpoints.first_step if self.faults is not None else 0
        if step == restarted_at or step % self.spec.perturbation_interval:  # a restart's round was taken before
            return True
        if member.arrived == 0:
            member.gate, member.in_round = self.env.event(), step
        member.arrived += 1
        gate = member.gate
        if member.arrived == member.job.world:
            member.arrived = 0
            self._ready(member, step)
        decision = yield Wait(gate)
        if decision.donor is not None:
            yield from self._copy(member, rank, decision)
        member.went_on += 1
        if self.faults is not None:
            self.faults.went_on(member, rank)
        if member.went_on == member.job.world:
            member.went_on, member.in_round = 0, None
            if self.faults is not None:
                self.faults.round_done(member, step, decision.state, self.env.now)
        return decision.go_on

    def _ready(self, member: Member, step: int) -> None:
        """Every rank of `member` paused before `step`: measure it, take its checkpoint (write it to storage, with
        `checkpoint`), then it takes part in the round."""
        point = [step, self.env.now, self._metric(member)]
        scheme = member.job.scheme
        checkpoint = {rank: scheme.training_state(rank) for rank in scheme.state_holders()}
        storage = self.spec.checkpoint
        if storage is None:
            self._kept(member, point, checkpoint)
            return
        seconds = max(storage.latency + state.nbytes / storage.bandwidth for state in checkpoint.values())
        now = self.env.now
        for rank, state in checkpoint.items():  # the holders write side by side, paused
            self.cluster.log.span(member.job.ranks[rank], "communication", "checkpoint write", now, now + seconds,
                                  nbytes=state.nbytes)
        self.checkpoint_write_s += seconds
        self.env.timeout(seconds).callbacks.append(lambda _: self._kept(member, point, checkpoint))

    def _kept(self, member: Member, point: list, checkpoint: dict) -> None:
        """`member`'s metric and checkpoint of this round are in: others may now see and copy them; decide."""
        member.metrics.append(point)
        member.checkpoint, member.checkpoint_step = checkpoint, point[0]
        if self.spec.stop is not None and self._reached(member.metric, self.spec.stop.metric):
            self.stopping = True
        if not self.spec.synch:
            self._decide([member], point[0])
            return
        self.waiting.append(member)
        if len(self.waiting) == len(self.members):
            ready, self.waiting = sorted(self.waiting, key=lambda m: m.id), []
            self._decide(ready, point[0])

    def _decide(self, ready: list[Member], step: int) -> None:
        scores = {m.id: m.metric for m in self.members if m.metrics}
        donors = choose_donors(scores, [m.id for m in ready], self.spec.exploit, self.spec.metric.mode,
                               self.spec.quantile_fraction, self.rng)
        for member in ready:
            decision = _Decision(go_on=not self.stopping, state=member.checkpoint)
            if member.id in donors and decision.go_on:
                donor = self.members[donors[member.id]]
                decision.donor, decision.state = donor, donor.checkpoint
                decision.values = explore(donor.values, self.spec.hyperparam_mutations,
                                          self.spec.resample_probability, self.spec.perturbation_factors,
                                          self.rng)
                decision.event = {"sim_time_s": self.env.now, "step": step, "from": donor.id, "to": member.id,
                                  "from_step": donor.checkpoint_step,
                                  "bytes": sum(state.nbytes for state in donor.checkpoint.values()),
                                  "transfer_s": 0.0, "old": dict(member.values), "new": dict(decision.values)}
                self.events.append(decision.event)
                member.values = dict(decision.values)
                member.schedule.append([step, self.env.now, dict(decision.values)])
                decision.copied = self.env.event()
                decision.receiving = len(member.job.scheme.state_receivers())
            member.gate.succeed(decision)

    def _metric(self, member: Member) -> float:
        name, data = self.spec.metric.name, member.job.data
        loss, accuracy = evaluate(member.job.scheme.trained_model(),
                                  data.train if name == "train_loss" else data.validation)
        return accuracy if name == "val_accuracy" else loss

    def _reached(self, metric: float, target: float) -> bool:
        return metric <= target if self.spec.metric.mode == "min" else metric >= target

    # ---- exploit: the copy ----------------------------------------------------

    def _copy(self, member: Member, rank: int, decision: _Decision):
        """Step program of the recipient's rank `rank`: receive the donor's checkpoint (or wait while the ranks
        that receive it for this one do: the store's, under async), take it, apply the explored
        hyperparameters."""
        job, scheme, started = member.job, member.job.scheme, self.env.now
        if rank in scheme.state_receivers():
            state = decision.state[scheme.state_source(rank)]
            if self.spec.checkpoint is not None:
                yield from self._read_from_storage(job, rank, state)
            else:
                yield from scheme.receive_state(rank, decision.donor.job, state)
            decision.receiving -= 1
            if decision.receiving == 0:
                decision.copied.succeed()
        else:
            yield Wait(decision.copied)
        scheme.set_hyperparameters(rank, decision.values)
        decision.event["transfer_s"] = max(decision.event["transfer_s"], self.env.now - started)

    def _read_from_storage(self, job: Job, rank: int, state):
        """Step program: rank `rank` reads `state` from storage and goes on from it."""
        storage = self.spec.checkpoint
        yield Busy(storage.latency + state.nbytes / storage.bandwidth, "checkpoint read", kind="communication",
                   nbytes=state.nbytes)
        job.scheme.load_training_state(rank, state, state.flat.clone())

    # ---- the run --------------------------------------------------------------

    def run(self) -> None:
        for member in self.members:
            member.job.start()
        try:
            run_to_end(self.env)
        except JobFailed as error:  # a member that cannot restart: the others do not go on without it
            raise ScenarioError(f"cluster.faults: {error} (a population does not go on without a member)") from None
        for member in self.members:
            stuck = member.job.scheme.stuck()
            if stuck:
                raise RuntimeError(f"member {member.id}: collective deadlock, ranks {stuck} wait for peers")
            member.job.finish()
            member.metrics.append([len(member.job.scheme.loss_curve), self.cluster.log.last_end_s,
                                   self._metric(member)])

    def best(self) -> Member:
        """The member with the best final metric (ties: the lower id)."""
        sign = 1 if self.spec.metric.mode == "min" else -1
        return min(self.members, key=lambda m: (np.nan_to_num(sign * m.metric, nan=np.inf), m.id))

    def section(self) -> dict:
        """report.json's `pbt` section."""
        return {
            "metric": self.spec.metric.model_dump(),
            "synch": self.spec.synch,
            "members": [{"id": m.id, "ranks": list(m.job.ranks), "steps": len(m.job.scheme.loss_curve),
                         "final_metric": m.metric, "metrics": m.metrics, "schedule": m.schedule}
                        for m in self.members],
            "events": self.events,
            "best": self.best().id,
            "copy_time_s": sum(event["transfer_s"] for event in self.events) + self.checkpoint_write_s,
            "checkpoint_write_s": self.checkpoint_write_s,
        }


def run_population(scenario: Scenario, on_step=None) -> Report:
    """Train the scenario's population; on_step(step, sim_time_s, loss) after every member's every step
    (`step` counts the steps of all members)."""
    wall_start = time.perf_counter()
    with user_code_errors(scenario), single_thread(), paced_collector():
        population = Population(scenario, on_step)
        population.run()
        best = population.best()
        job, scheme = best.job, best.job.scheme
        final_loss, _ = evaluate(scheme.trained_model(), job.data.train)
        _, final_accuracy = evaluate(scheme.trained_model(), job.data.test)
    samples = sum(replica.loader.samples_drawn for m in population.members for replica in m.job.replicas)
    steps = scenario.train.steps
    target = scenario.train.target_loss
    model_flops = model_flops_per_step(scenario, job.data, samples / steps)  # every member's samples
    sections = {"amp": job.replicas[0].precision.report(), **scheme.report_sections(), "pbt": population.section()}
    if population.faults is not None:
        sections["faults"] = population.faults.section(_fault_free_time_s(scenario), population.cluster.log.last_end_s)
    result = RunResult(
        scheme=scheme_name(scenario.parallel),
        steps=steps,
        samples_per_step=samples / steps,
        loss_curve=scheme.loss_curve,
        train_loss_curve=best.monitor.curve,
        time_to_target_s=best.monitor.time_to(target) if target is not None else None,
        final_loss=final_loss,
        final_accuracy=final_accuracy,
        single_device_step_s=None,  # one device alone is no baseline for a population
        final_models=scheme.final_models(),
        wall_time_s=time.perf_counter() - wall_start,
        extra=sections,
        section_ranks=list(job.ranks),  # the best member's
        model_flops_per_step=model_flops.per_step,
        model_flops_formula=model_flops.formula,
        tokens_per_sample=model_flops.tokens_per_sample,
    )
    return build_report(scenario, population.cluster, result)


def _fault_free_time_s(scenario: Scenario) -> float:
    """Simulated seconds the population takes without its faults: goodput's numerator."""
    fault_free = scenario.model_copy(update={"cluster": scenario.cluster.model_copy(update={"faults": []}),
                                             "report": scenario.report.model_copy(update={"trace": False})})
    fault_free._base_dir = scenario.base_dir
    return run_population(fault_free).data["sim_time_s"]


class PbtMember(ReportSection):
    id: int = Field(description="the member's index in the population")
    ranks: list[int] = Field(description="the devices it trained on")
    steps: int = Field(description="steps it ran")
    final_metric: float | None = Field(description="its metric at the end")
    metrics: list[list] = Field(description="[step, sim_time_s, metric] at every round and at the end")
    schedule: list[list] = Field(description="[step, sim_time_s, hyperparameters] whenever they changed")


class PbtSection(ReportSection):
    metric: dict[str, str] = Field(description="pbt.metric: its name and whether smaller (min) or larger (max) "
                                               "is better")
    synch: bool = Field(description="whether members meet at each round (synchronous PBT)")
    members: list[PbtMember] = Field(description="every member of the population")
    events: list[dict[str, Any]] = Field(
        description="every exploit: sim_time_s, step, from (donor), to, from_step (its checkpoint's step), bytes "
                    "copied, transfer_s, old and new hyperparameters")
    best: int = Field(description="the member whose model the run reports")
    copy_time_s: float = Field(description="seconds spent copying donors' state and writing checkpoints")
    checkpoint_write_s: float = Field(description="seconds spent writing members' checkpoints")


register_section("pbt", PbtSection, "population-based training: members, exploits, the best (studies/pbt.py)")
