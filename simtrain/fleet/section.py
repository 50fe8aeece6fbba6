"""report.json's `fleet`: a fleet run of the scenario's job around its measured step, and what it yields.

The runner calls `fleet_section` once the steps have run: their mean time is
the fault-free step time, and one GPU's checkpoint is what its device held as
weights and optimizer state (the memory ledger's peaks, hw/device.py), unless
`fleet.checkpoint.bytes_per_gpu` gives it. `effective_training_time` is the
share of the elapsed time that ended as training (Llama 3's "effective
training time"): `steps_done x step_time_s / elapsed_s`.

Young's and Daly's intervals (expected.py) are reported for the job's mean
time between unplanned failures M and the blocking part of a checkpoint
delta, to set `fleet.checkpoint.interval` from (or give it `young` or
`daly`); `spares_warning` says when the spare pool is smaller than the hosts
the failure model expects in repair at once (`simtrain run` and `simtrain
validate` print it).

    section = fleet_section(scenario, cluster, job, step_time_s)
"""
from pydantic import Field

from ..errors import ScenarioError
from ..limits import MAX_FLEET_EVENTS
from ..report.sections import ReportSection, register_section
from .costs import Costs
from .expected import daly_s, job_mtbf_s, spare_pool_warning, young_s
from .failures import failure_rates
from .inventory import job_inventory
from .simulation import PHASES, FleetRun


def fleet_section(scenario, cluster, job, step_time_s: float) -> dict:
    """Run the fleet around the measured step; report.json's `fleet`."""
    fleet = scenario.fleet
    inventory = job_inventory(scenario, cluster.topology)
    bytes_per_gpu = fleet.checkpoint.bytes_per_gpu
    if bytes_per_gpu is None:
        bytes_per_gpu = max(device.memory.peak["weights"] + device.memory.peak["optimizer_state"]
                            for device in job.devices)
    costs = Costs.of(fleet, inventory.gpus, bytes_per_gpu)
    run = FleetRun(fleet, inventory, costs, step_time_s, scenario.seed)
    rates = failure_rates(fleet, inventory)
    slowdowns_per_s = inventory.gpus / fleet.stragglers.mtbf if fleet.stragglers else 0
    expected = fleet.horizon * (sum(rates.values()) + slowdowns_per_s) + fleet.horizon / (run.every * step_time_s)
    if expected > MAX_FLEET_EVENTS:
        raise ScenarioError(f"fleet.horizon: about {expected:.3g} failures, slowdowns and checkpoints expected, more "
                            f"than a fleet run takes ({MAX_FLEET_EVENTS:,}); shorten it or lengthen "
                            "fleet.checkpoint.interval")
    run.run()
    elapsed = run.end_s
    mtbf = job_mtbf_s(rates)
    return {
        "gpus": inventory.gpus,
        "hosts": inventory.hosts,
        "units": inventory.counts(),
        "step_time_s": step_time_s,
        "checkpoint_bytes_per_gpu": int(bytes_per_gpu),
        "checkpoint_every_steps": run.every,
        "checkpoint_blocking_s": costs.blocking_s,
        "checkpoint_background_s": costs.background_s,
        "restart_s": sum(seconds for _, seconds in costs.restart_parts(from_memory=False)),
        "job_mtbf_s": mtbf,
        "young_interval_s": None if mtbf is None else young_s(costs.blocking_s, mtbf),
        "daly_interval_s": None if mtbf is None else daly_s(costs.blocking_s, mtbf),
        "spares_warning": spare_pool_warning(fleet, inventory),
        "horizon_s": fleet.horizon,
        "elapsed_s": elapsed,
        "completion_time_s": run.completed_at_s,
        "steps_done": run.progress,
        "effective_training_time": run.progress * step_time_s / elapsed if elapsed > 0 else None,
        "interruptions": sum(run.interruptions.values()),
        "interruptions_by_cause": dict(sorted(run.interruptions.items())),
        "time_lost_by_phase_s": run.lost_by_phase,
        "time_lost_by_cause_s": dict(sorted(run.lost_by_cause.items())),
        "hosts_replaced": run.hosts_replaced,
        "daily": run.timeline.daily(run.end_s),
    }


class FleetDay(ReportSection):
    day: int = Field(description="day of the run, from 1")
    steps: float = Field(description="steps the job stood at when the day ended")
    interruptions: int = Field(description="failures that struck that day")


class FleetSection(ReportSection):
    gpus: int = Field(description="GPUs of the job")
    hosts: int = Field(description="its hosts")
    units: dict[str, int] = Field(description="units of each component in the job (simtrain/fleet/inventory.py)")
    step_time_s: float = Field(description="the simulated step's time, fault-free")
    checkpoint_bytes_per_gpu: int = Field(description="one GPU's checkpoint")
    checkpoint_every_steps: int = Field(description="steps between checkpoints (fleet.checkpoint.interval)")
    checkpoint_blocking_s: float = Field(description="training stops this long at each checkpoint")
    checkpoint_background_s: float = Field(description="then the write goes on this long (async)")
    restart_s: float = Field(description="relaunch, communicator initialisation and load from storage")
    job_mtbf_s: float | None = Field(description="the job's mean time between unplanned failures; null: nothing "
                                                 "fails")
    young_interval_s: float | None = Field(description="Young's optimum checkpoint interval for it")
    daly_interval_s: float | None = Field(description="Daly's optimum checkpoint interval for it")
    spares_warning: str | None = Field(description="fleet.spares smaller than the hosts the failure model expects "
                                                   "in repair at once, in one line; null: it covers them")
    horizon_s: float = Field(description="fleet.horizon")
    elapsed_s: float = Field(description="time the run took: the horizon, or until fleet.target_steps")
    completion_time_s: float | None = Field(description="when fleet.target_steps were done; null: not reached "
                                                        "or not given")
    steps_done: float = Field(description="steps done (and kept) at the end")
    effective_training_time: float | None = Field(description="steps_done x step_time_s / elapsed_s")
    interruptions: int = Field(description="failures that struck the job (one during a restart's detection or "
                                           "wait for spares joins that restart)")
    interruptions_by_cause: dict[str, int] = Field(description="those failures by cause: the component, or "
                                                               "slow_gpu (a slow GPU that failed)")
    time_lost_by_phase_s: dict[str, float] = Field(description=f"seconds lost, by phase: {', '.join(PHASES)}; "
                                                               "with the training they add up to elapsed_s")
    time_lost_by_cause_s: dict[str, float] = Field(description="seconds lost to restarts and work redone, by the "
                                                               "component whose failure caused them")
    hosts_replaced: int = Field(description="hosts taken from the spare pool")
    daily: list[FleetDay] = Field(description="the run day by day")


register_section("fleet", FleetSection, "a long run with a fleet's failures around the simulated step "
                                             "(a scenario with fleet: simtrain/fleet/)")
