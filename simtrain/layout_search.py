"""Which layouts would fit: the dp x pp x tp splits, with or without full recomputation, whose step fits the devices.

When a scenario's step does not fit its devices, the same job can often be laid
out otherwise on the same devices: split the model by pipeline stages or
tensor-parallel ranks, or recompute activations. `layouts_that_fit(scenario)`
tries those, keeping the global batch (the device batch times dp) and every
other setting, and returns the first few that fit.

Candidates are every dp x pp x tp whose product is the job's devices and whose
device batch (the global batch over dp) is a whole number, each with the
scenario's `train.checkpointing` and then with `full`; they are tried in order
of the fewest model-parallel ranks (pp x tp), then the fewest stages (a
pipeline adds a bubble, tensor parallelism does not), then without
recomputation before with it (a layout that fits without it is not
offered again with it). A candidate is validated as a scenario would be
(one that its model cannot take, say tp not dividing the heads, is skipped)
and decided by replaying its step (memory_plan.replay_step), not estimated.
Before a replay, one bound prunes: the bytes of the scenario's parameters,
gradients and optimizer state are split at best evenly over pp x tp ranks,
so a layout whose even share of them passes the capacity cannot fit.

    for fit in layouts_that_fit(load_scenario("scenarios/data_vs_model_parallel.yaml"), limit=2):
        print(fit.describe(), fit.peak_bytes)     # "tp 2 x dp 4, batch 8 per replica" ...
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ScenarioError
from .hw.resolved_cluster import resolve_cluster
from .memory_plan import replay_step
from .scenario import Scenario, validate_scenario
from .parallel import Layout

# The categories of the training state: what an even split over pp x tp ranks bounds from below.
STATE_CATEGORIES = ("weights", "master_weights", "gradients", "optimizer_state")


@dataclass(frozen=True)
class LayoutFit:
    """A layout whose step fits every device: its degrees, device batch, recomputation and peak."""

    dp: int
    pp: int
    tp: int
    batch_size: int  # per data-parallel replica: the scenario's global batch over dp
    checkpointing: str
    peak_bytes: int  # the largest device's peak over the step

    def describe(self) -> str:
        """"pp 2 x tp 2 x dp 2, batch 16 per replica, train.checkpointing full"."""
        degrees = " x ".join(f"{name} {degree}" for name, degree in (("pp", self.pp), ("tp", self.tp), ("dp", self.dp))
                             if degree > 1 or name == "dp")
        recompute = f", train.checkpointing {self.checkpointing}" if self.checkpointing != "none" else ""
        return f"{degrees}, batch {self.batch_size} per replica{recompute}"


def layouts_that_fit(scenario: Scenario, limit: int = 3) -> list[LayoutFit]:
    """The first `limit` layouts (in the order the module docstring gives) whose step fits the devices."""
    resolved = resolve_cluster(scenario.cluster, scenario.base_dir)
    world = resolved.devices - scenario.cluster.spares
    current = Layout.of(scenario.parallel, world)
    global_batch = scenario.data.batch_size * current.dp
    own = replay_step(scenario, resolved, scenario.data.batch_size)
    capacity = max(device.spec.memory_bytes for device in own.devices)  # a bound for every device
    state_bytes = sum(device.memory.peak_breakdown.get(category, 0)
                      for device in own.devices for category in STATE_CATEGORIES) / world * current.pp * current.tp
    fits = []
    for pp, tp, checkpointing in _candidates(world, scenario.train.checkpointing):
        dp = world // (pp * tp)
        if global_batch % dp or (pp, tp, checkpointing) == (current.pp, current.tp, scenario.train.checkpointing):
            continue
        if state_bytes / (pp * tp) > capacity or any((fit.pp, fit.tp) == (pp, tp) for fit in fits):
            continue
        candidate = _laid_out(scenario, dp, pp, tp, global_batch // dp, checkpointing)
        if candidate is None:
            continue
        try:
            job = replay_step(candidate, resolved, candidate.data.batch_size)
        except ScenarioError:  # the model cannot be split this way
            continue
        peak = max(device.memory.peak_total for device in job.devices)
        if all(device.memory.peak_total <= device.spec.memory_bytes for device in job.devices):
            fits.append(LayoutFit(dp, pp, tp, candidate.data.batch_size, checkpointing, peak))
            if len(fits) == limit:
                break
    return fits


def _candidates(world: int, checkpointing) -> list[tuple[int, int, str]]:
    """(pp, tp, checkpointing) in the order they are tried."""
    recomputations = [checkpointing] if checkpointing == "full" else [checkpointing, "full"]
    layouts = [(pp, tp) for tp in _divisors(world) for pp in _divisors(world // tp)]
    return [(pp, tp, recompute) for pp, tp in sorted(layouts, key=lambda layout: (layout[0] * layout[1], layout[0]))
            for recompute in recomputations]


def _divisors(number: int) -> list[int]:
    return [divisor for divisor in range(1, number + 1) if number % divisor == 0]


def _laid_out(scenario: Scenario, dp: int, pp: int, tp: int, batch_size: int, checkpointing) -> Scenario | None:
    """The scenario with this layout, device batch and recomputation; None if it is not a valid scenario."""
    raw = scenario.model_dump(mode="json", by_alias=True)
    raw["parallel"].update(dp=dp, pp=pp, tp=tp)
    if pp == 1:  # no pipeline to interleave
        raw["parallel"]["pipeline"]["virtual_stages"] = 1
    raw["data"]["batch_size"] = batch_size
    if checkpointing == "full":
        raw["train"]["checkpointing"] = "full"
    try:
        return validate_scenario(raw, base_dir=scenario.base_dir)
    except ScenarioError:
        return None
