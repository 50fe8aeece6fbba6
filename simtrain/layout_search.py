"""Which layouts would fit: what a user tries when a step runs out of memory, each checked by replaying its step.

When a scenario's step does not fit its devices, the same job can often be laid
out otherwise on the same devices. `layouts_that_fit(scenario)` tries what a
user would, keeping the global batch (data.batch_size x dp) and every other
setting:

- micro-batches: the replica's batch cut into m (gradient accumulation without
  a pipeline; a pipeline's micro-batches with one), m a power of two dividing it;
- the sharding stage: ZeRO 1, 2, 3 (FSDP) above the scenario's own;
- a split of the model or its sequence: dp x cp x pp x tp, every product that
  is the job's devices, with sequence parallelism under tp (gpt and llama);
- recomputation: the scenario's own, then selective (gpt and llama), then full.

Candidates are tried in the order of their predicted step time, the cheapest
first. The prediction is relative, the ideal step (the same for every layout:
the same FLOPs on the same devices) times what the layout adds to it:
full recomputation runs each forward again (x 4/3: forward 1 + backward 2 +
forward 1), selective its attention cores (x 1.05: Korthikanti et al. 2022
measured 2.7 % to 4 %); a pipeline of pp stages and m micro-batches idles
(pp - 1) / m of its step (x (1 + (pp - 1) / (m v)), v interleaved chunks,
Narayanan et al. 2021). Ties go to fewer model-parallel ranks, fewer stages,
fewer micro-batches, a lower sharding stage, then sequence parallelism on.
A candidate is validated as a scenario would be (one its model cannot take,
say tp not dividing the heads, is skipped) and decided by replaying its step
(memory_plan.replay_step, numerics off), not estimated; each split of the
devices is offered once, with the first of its variants that fits. The
replays time the step too: the layouts found are returned by their replayed
step time. Before a replay one bound prunes: the training state's bytes
(weights, master weights, gradients, optimizer state) split at best evenly
over pp x tp ranks, and over dp x cp too as far as the sharding stage shards
them, cannot pass the capacity. At most `MAX_REPLAYS` candidates are replayed.

    for fit in layouts_that_fit(load_scenario("scenarios/data_vs_model_parallel.yaml"), limit=2):
        print(fit.describe(), fit.peak_bytes, fit.step_time_s)   # "dp 8, batch 4 per replica, ..."
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ScenarioError
from .hw.resolved_cluster import resolve_cluster
from .memory_plan import replay_step
from .scenario import Scenario, validate_scenario
from .parallel import Layout
from .units import format_bytes, format_seconds

# The categories of the training state: what an even split over the ranks that share it bounds from below.
STATE_CATEGORIES = ("weights", "master_weights", "gradients", "optimizer_state")
# Of the training state's categories, those each sharding stage cuts over dp (sharded_replica.held_bytes).
SHARDED_BY_STAGE = {0: (), 1: ("master_weights", "optimizer_state"),
                    2: ("master_weights", "optimizer_state", "gradients"), 3: STATE_CATEGORIES}
RECOMPUTE_FACTOR = {"none": 1.0, "selective": 1.05, "full": 4 / 3}  # the step's compute, relative
MAX_MICROBATCHES = 16  # the most micro-batches a candidate cuts its batch into
MAX_REPLAYS = 48  # the most candidates replayed in one search


@dataclass(frozen=True)
class LayoutFit:
    """A layout whose step fits every device: its degrees, batch, micro-batches, stage, recomputation, peak."""

    dp: int
    pp: int
    tp: int
    cp: int
    sequence_parallel: bool
    batch_size: int  # per data-parallel replica: the scenario's global batch over dp
    microbatches: int
    stage: int  # parallel.sharding.stage
    checkpointing: str
    peak_bytes: int  # the largest device's peak over the step
    step_time_s: float  # the replayed step's simulated time

    def describe(self) -> str:
        """"pp 2 x tp 2 x dp 2, batch 16 per replica, 4 micro-batches, train.checkpointing full"."""
        degrees = " x ".join(f"{name} {degree}" for name, degree in (("pp", self.pp), ("tp", self.tp),
                                                                     ("cp", self.cp), ("dp", self.dp))
                             if degree > 1 or name == "dp")
        parts = [degrees + (" with sequence parallelism" if self.sequence_parallel else ""),
                 f"batch {self.batch_size} per replica"]
        if self.microbatches > 1:
            parts.append(f"{self.microbatches} micro-batches")
        if self.stage:
            parts.append(f"sharding.stage {self.stage}")
        if self.checkpointing != "none":
            parts.append(f"train.checkpointing {self.checkpointing}")
        return ", ".join(parts)

    def summary(self) -> str:
        """describe() with the replayed peak and step time: "dp 8, ... (peak 15.0 GiB, step 1.2 s)"."""
        return f"{self.describe()} (peak {format_bytes(self.peak_bytes)}, step {format_seconds(self.step_time_s)})"


@dataclass(frozen=True)
class _Candidate:
    dp: int
    pp: int
    tp: int
    cp: int
    sequence_parallel: bool
    microbatches: int
    stage: int
    checkpointing: str
    predicted: float  # the step relative to the ideal (module docstring)


def layouts_that_fit(scenario: Scenario, limit: int = 3) -> list[LayoutFit]:
    """The first `limit` layouts found (tried in order of predicted step time) whose step fits the devices, in
    order of their replayed step time."""
    resolved = resolve_cluster(scenario.cluster, scenario.base_dir)
    world = resolved.devices - scenario.cluster.spares
    current = Layout.of(scenario.parallel, world)
    global_batch = scenario.data.batch_size * current.dp
    own = replay_step(scenario, resolved, scenario.data.batch_size)
    capacity = max(device.spec.memory_bytes for device in own.devices)  # a bound for every device
    state = _state_bytes(own, world, current, scenario.parallel.sharding.stage)
    fits, replays = [], 0
    for candidate in _candidates(scenario, world, global_batch):
        if replays == MAX_REPLAYS or len(fits) == limit:
            break
        if _same_as_scenario(candidate, scenario, current) or any(
                (fit.dp, fit.pp, fit.tp, fit.cp) == (candidate.dp, candidate.pp, candidate.tp, candidate.cp)
                for fit in fits):
            continue
        sharded_over = {category: candidate.dp * candidate.cp if category in SHARDED_BY_STAGE[candidate.stage]
                        else 1 for category in STATE_CATEGORIES}
        if sum(state[category] / (candidate.pp * candidate.tp) / sharded_over[category]
               for category in state) > capacity:
            continue
        laid_out = _laid_out(scenario, candidate, global_batch // candidate.dp)
        if laid_out is None:
            continue
        replays += 1
        try:
            job = replay_step(laid_out, resolved, laid_out.data.batch_size)
        except ScenarioError:  # the model cannot be split this way
            continue
        if all(device.memory.peak_total <= device.spec.memory_bytes for device in job.devices):
            step_s = job.cluster.env.now / job.scenario.train.steps
            fits.append(LayoutFit(candidate.dp, candidate.pp, candidate.tp, candidate.cp, candidate.sequence_parallel,
                                  laid_out.data.batch_size, candidate.microbatches, candidate.stage,
                                  candidate.checkpointing, max(device.memory.peak_total for device in job.devices),
                                  step_s))
    return sorted(fits, key=lambda fit: fit.step_time_s)


def _state_bytes(job, world: int, layout: Layout, stage: int) -> dict[str, float]:
    """The whole training state's bytes by category (STATE_CATEGORIES), from the scenario's own replay: each
    device's share times the ranks it was split over (pp x tp; the dp x cp group where the stage shards it:
    context-parallel ranks hold the same weights)."""
    state = {}
    for category in STATE_CATEGORIES:
        held = sum(device.memory.peak_breakdown.get(category, 0) for device in job.devices) / world
        sharded = layout.dp * layout.cp if category in SHARDED_BY_STAGE[stage] else 1
        state[category] = held * layout.pp * layout.tp * sharded
    return state


def _candidates(scenario: Scenario, world: int, global_batch: int) -> list[_Candidate]:
    """Every candidate, in the order tried (the module docstring)."""
    sequence_model = scenario.model.name in ("gpt", "llama")
    own = scenario.train.checkpointing
    recomputations = list(dict.fromkeys([own, *(["selective"] if sequence_model and own != "full" else []),
                                         "full"]))
    stages = range(scenario.parallel.sharding.stage, 4)
    interleaved = scenario.parallel.pipeline.virtual_stages
    found = []
    for tp in _divisors(world):
        for cp in _divisors(world // tp) if sequence_model else [1]:
            for pp in _divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                if global_batch % dp:
                    continue
                batch = global_batch // dp
                counts = [m for m in _powers_of_two(min(batch, MAX_MICROBATCHES)) if batch % m == 0]
                if pp > 1 and scenario.parallel.pipeline.microbatches is None:
                    counts = [m for m in counts if m >= scenario.parallel.microbatches] or counts
                for m in counts:
                    bubble = 1 + (pp - 1) / (m * (interleaved if pp > 1 else 1))
                    for stage in stages:
                        for sp in ([True, False] if tp > 1 and sequence_model else [False]):
                            for recompute in recomputations:
                                found.append(_Candidate(dp, pp, tp, cp, sp, m, stage, recompute,
                                                        RECOMPUTE_FACTOR.get(recompute, 1.0) * bubble))
    return sorted(found, key=lambda c: (c.predicted, c.pp * c.tp * c.cp, c.pp, c.microbatches, c.stage,
                                        not c.sequence_parallel))


def _same_as_scenario(candidate: _Candidate, scenario: Scenario, current: Layout) -> bool:
    parallel = scenario.parallel
    return ((candidate.dp, candidate.pp, candidate.tp, candidate.cp, candidate.sequence_parallel,
             candidate.microbatches, candidate.stage, candidate.checkpointing)
            == (current.dp, current.pp, current.tp, current.cp, parallel.sequence_parallel, parallel.microbatches,
                parallel.sharding.stage, scenario.train.checkpointing))


def _divisors(number: int) -> list[int]:
    return [divisor for divisor in range(1, number + 1) if number % divisor == 0]


def _powers_of_two(most: int) -> list[int]:
    return [1 << power for power in range(most.bit_length()) if 1 << power <= most]


def _laid_out(scenario: Scenario, candidate: _Candidate, batch_size: int) -> Scenario | None:
    """The scenario laid out as `candidate` with this device batch; None if it is not a valid scenario."""
    raw = scenario.model_dump(mode="json", by_alias=True)
    raw["parallel"].update(dp=candidate.dp, pp=candidate.pp, tp=candidate.tp, cp=candidate.cp,
                           sequence_parallel=candidate.sequence_parallel)
    raw["parallel"]["pipeline"]["microbatches"] = candidate.microbatches
    raw["parallel"]["sharding"]["stage"] = candidate.stage
    if candidate.tp == 1:
        raw["parallel"]["tp_comm_overlap"] = False
    if candidate.pp == 1:  # no pipeline to interleave
        raw["parallel"]["pipeline"]["virtual_stages"] = 1
    raw["data"]["batch_size"] = batch_size
    raw["train"]["checkpointing"] = candidate.checkpointing
    try:
        return validate_scenario(raw, base_dir=scenario.base_dir)
    except ScenarioError:
        return None
