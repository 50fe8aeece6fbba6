"""What combines, and why not: the one table of the feature combinations simtrain refuses (pure Python).

A feature (`FEATURES`) is one thing a scenario can use, named as the docs and
the issues name it (dp, ZeRO 1, HSDP, tp, sp, ep, fp16, full recomputation,
numerics off, representatives, simtrain launch, async, K-FAC, SyncBN, ...),
with the keys that turn it on and a test of whether a case uses it. A row of
`REFUSED` is a combination of features simtrain does not run: the features,
what Megatron-Core and torchtitan do with them, and the one line simtrain
refuses with, naming the key at fault. A row that a framework runs is *not
built* in simtrain and names that framework (each goes when simtrain builds
it); a row neither runs is a combination real frameworks do not offer either
(often because one of its features is simtrain's own). Any other
combination of features runs, given each feature's own needs (sequence
parallelism needs tp, offload a ZeRO stage: the scenario's checks of one
section, scenario/parallel.py and scenario/root.py).

A case is a scenario and what is known of its run: the layout once the devices
are (HSDP), the pipeline schedule once built, whether simtrain launch runs it.
`refusal(case)` is the line of the first row the case falls in; a feature that
needs what the case does not know yet is not used. The scenario's validators
ask with the scenario alone; the job's build and check (job.py, job_checks.py)
with its layout; the pipeline's schedule (parallel/schedules) with the schedule;
simtrain launch (real/launch.py) as itself. The table reads the scenario's
sections by name and imports nothing of simtrain, so the scenario layer below
it consults it (pyproject.toml's layer contract names that one import);
docs/hooks/reference.py renders it into docs/reference/support.md.

    line = refusal(Case(scenario))                  # None, or "parallel.ep: expert parallelism runs with ..."
    refuse(Case(scenario, layout=layout), ScenarioError)   # raises ScenarioError(line), the layout's rows too
    [(row.features, row.verdict) for row in REFUSED if row.built_by]   # what real frameworks run and simtrain not
"""
from dataclasses import dataclass
from string import Formatter
from typing import Any, Callable

MEGATRON_CORE = "Megatron-Core"
TORCHTITAN = "torchtitan"


@dataclass(frozen=True)
class Case:
    """A scenario (simtrain.scenario.Scenario) and what is known of its run."""

    scenario: Any
    layout: Any = None  # parallel/layout.py's Layout, once the job's devices are known
    schedule: Any = None  # parallel/schedules' Schedule, once built
    launched: bool = False  # run for real by simtrain launch

    @property
    def parallel(self):
        return self.scenario.parallel

    @property
    def train(self):
        return self.scenario.train

    @property
    def model(self):
        return self.scenario.model

    @property
    def data(self):
        return self.scenario.data

    @property
    def cluster(self):
        return self.scenario.cluster


@dataclass(frozen=True)
class Feature:
    """One thing a scenario can use: its name, the keys that turn it on, and whether a case uses it."""

    name: str
    keys: str
    used: Callable[[Case], bool]


def _hsdp(case: Case) -> bool:
    layout = case.layout
    return layout is not None and case.parallel.sharding.stage > 0 and layout.dp_shard < layout.dp * layout.cp


FEATURES = (
    Feature("dp", "parallel.dp above 1", lambda c: (c.layout.dp if c.layout is not None else c.parallel.dp or 1) > 1),
    Feature("ZeRO 1", "parallel.sharding.stage 1", lambda c: c.parallel.sharding.stage == 1),
    Feature("ZeRO 2", "parallel.sharding.stage 2", lambda c: c.parallel.sharding.stage == 2),
    Feature("ZeRO 3", "parallel.sharding.stage 3 (FSDP)", lambda c: c.parallel.sharding.stage == 3),
    Feature("HSDP", "parallel.sharding.degree below the data-parallel ranks", _hsdp),
    Feature("offload", "parallel.sharding.offload optimizer or optimizer_and_parameters",
            lambda c: c.parallel.sharding.offload != "none"),
    Feature("tp", "parallel.tp above 1", lambda c: c.parallel.tp > 1),
    Feature("sp", "parallel.sequence_parallel", lambda c: c.parallel.sequence_parallel),
    Feature("cp", "parallel.cp above 1", lambda c: c.parallel.cp > 1),
    Feature("pp", "parallel.pp above 1 (schedules gpipe, 1f1b, interleaved, zero_bubble, dualpipev, file)",
            lambda c: c.parallel.pp > 1),
    Feature("split backward", "a pipeline schedule with I and W passes (zero_bubble, dualpipev, a file with them)",
            lambda c: c.schedule is not None and c.schedule.splits_backward()),
    Feature("gradient accumulation", "parallel.pipeline.microbatches above 1 without pp, tp or cp",
            lambda c: c.parallel.microbatches > 1 and not c.parallel.model_parallel),
    Feature("dp alone", "none of parallel.pp, parallel.tp, parallel.cp above 1",
            lambda c: not c.parallel.model_parallel),
    Feature("DDP overlap", "parallel.overlap true", lambda c: bool(c.parallel.overlap)),
    Feature("ZeRO overlap", "parallel.sharding.overlap_grad_reduce",
            lambda c: c.parallel.sharding.overlap_grad_reduce),
    Feature("MoE", "model.moe", lambda c: c.model.moe is not None),
    Feature("drawn routing", "model.moe.routing.model zipf or histogram",
            lambda c: c.model.moe is not None and c.model.moe.routing.model != "balanced"),
    Feature("capacity", "model.moe.capacity_factor (assignments past an expert's capacity dropped)",
            lambda c: c.model.moe is not None and c.model.moe.capacity_factor is not None),
    Feature("capacity below 1", "model.moe.capacity_factor below 1 (even balanced routing drops assignments)",
            lambda c: c.model.moe is not None and (c.model.moe.capacity_factor or 1) < 1),
    Feature("ep", "parallel.ep above 1", lambda c: c.parallel.ep > 1),
    Feature("deepep dispatch", "parallel.moe_dispatch deepep (each token sent once to each host it reaches)",
            lambda c: c.parallel.ep > 1 and c.parallel.moe_dispatch == "deepep"),
    Feature("bf16", "train.precision bf16", lambda c: c.train.precision == "bf16"),
    Feature("fp16", "train.precision fp16", lambda c: c.train.precision == "fp16"),
    Feature("fp8", "train.precision fp8", lambda c: c.train.precision == "fp8"),
    Feature("selective recomputation", "train.checkpointing selective",
            lambda c: c.train.checkpointing == "selective"),
    Feature("full recomputation", "train.checkpointing full", lambda c: c.train.checkpointing == "full"),
    Feature("recomputation in segments", "train.checkpointing sqrt or {segments: k}",
            lambda c: c.train.checkpointing not in ("none", "selective", "full")),
    Feature("numerics off", "numerics false", lambda c: not c.scenario.numerics),
    Feature("representatives", "parallel.representatives", lambda c: c.parallel.representatives),
    Feature("faults", "cluster.faults, cluster.random_faults (a device or a link lost)",
            lambda c: bool(c.cluster.faults or c.cluster.random_faults)),
    Feature("restart", "train.checkpoint (the training state saved, restored after a lost device)",
            lambda c: c.train.checkpoint is not None),
    Feature("simtrain launch", "simtrain launch (real processes)", lambda c: c.launched),
    Feature("async", "parallel.mode async", lambda c: c.parallel.mode == "async"),
    Feature("K-FAC", "train.optimizer.name kfac", lambda c: c.train.optimizer.name == "kfac"),
    Feature("SyncBN", "parallel.sync_batchnorm", lambda c: c.parallel.sync_batchnorm),
    Feature("prioritized sampling", "data.sampling prioritized or mh", lambda c: c.data.sampling != "uniform"),
)
FEATURE = {feature.name: feature for feature in FEATURES}

# Groups of features a row refuses any one of.
ZERO = ("ZeRO 1", "ZeRO 2", "ZeRO 3")
MODEL_PARALLEL = ("pp", "tp", "cp")
LOW_PRECISION = ("bf16", "fp16", "fp8")
WHOLE_LAYER_RECOMPUTATION = ("full recomputation", "recomputation in segments")
RECOMPUTATION = ("selective recomputation", *WHOLE_LAYER_RECOMPUTATION)

# The values a row's line names, by the name it gives them in braces.
FACTS = {
    "precision": lambda c: c.train.precision,
    "sampling": lambda c: c.data.sampling,
    "stage": lambda c: c.parallel.sharding.stage,
    "microbatches": lambda c: c.parallel.microbatches,
    "cp": lambda c: c.parallel.cp,
    "checkpointing": lambda c: c.train.checkpointing,
    "schedule": lambda c: c.parallel.pipeline.schedule,
    "model_parallel_key": lambda c: next(f"parallel.{name}" for name in MODEL_PARALLEL
                                         if getattr(c.parallel, name) > 1),
    "shard_degree": lambda c: c.layout.dp_shard,
    "dp_ranks": lambda c: c.layout.dp * c.layout.cp,
    "capacity_factor": lambda c: f"{c.model.moe.capacity_factor:g}",
}


@dataclass(frozen=True)
class Refusal:
    """A combination simtrain does not run: every entry of `features` used (an entry is a feature's name, or a
    tuple of names any one of which counts)."""

    features: tuple
    line: str  # what simtrain says: the key at fault, then why; {name}s are FACTS of the case
    frameworks: str  # what Megatron-Core and torchtitan do with the combination
    built_by: tuple[str, ...] = ()  # the frameworks that run it; empty where neither does

    @property
    def groups(self) -> tuple[tuple[str, ...], ...]:
        """The features, each entry as the tuple of its alternatives."""
        return tuple((entry,) if isinstance(entry, str) else entry for entry in self.features)

    def applies(self, case: Case) -> bool:
        return all(any(FEATURE[name].used(case) for name in group) for group in self.groups)

    def message(self, case: Case) -> str:
        """The line, its {names} filled in from `case`."""
        names = [name for _, name, _, _ in Formatter().parse(self.line) if name]
        return self.line.format(**{name: FACTS[name](case) for name in names})

    @property
    def verdict(self) -> str:
        if self.built_by:
            runs = "runs" if len(self.built_by) == 1 else "run"
            return f"not built in simtrain ({' and '.join(self.built_by)} {runs} it)"
        return "refused: neither Megatron-Core nor torchtitan runs it"


def refusal(case: Case) -> str | None:
    """The line of the first row of REFUSED that `case` falls in; None where every combination it uses runs."""
    return next((row.message(case) for row in REFUSED if row.applies(case)), None)


def refuse(case: Case, error: Callable[[str], Exception]) -> None:
    """Raise `error(line)` where `case` falls in a row: the one place the table's refusals are raised, each
    caller naming its kind of error (ValueError in the scenario's pydantic validators, else ScenarioError)."""
    line = refusal(case)
    if line is not None:
        raise error(line)


NO_ASYNC = "Neither trains asynchronously: every step all-reduces (or reduce-scatters) the gradients."
NO_KFAC = "Neither has a K-FAC optimizer."
NO_BATCHNORM = "Neither has BatchNorm: their transformers normalize with LayerNorm or RMSNorm."
NO_PRIORITIZED = "Neither draws samples by their losses (prioritized or Metropolis-Hastings sampling)."
EP_SYNC = "parallel.ep: expert parallelism runs with synchronous data parallelism (parallel.mode sync)"
GRADIENT_ACCUMULATION = ("does not combine with gradient accumulation (parallel.pipeline.microbatches "
                         "{microbatches} without pp, tp or cp)")
OWN_REPRESENTATIVES = "Representatives are simtrain's own (one rank simulated for many that do the same)."
SPLIT_BACKWARD = "parallel.pipeline.schedule: {schedule} splits backwards into I and W passes, not built with "

REFUSED = (
    # -- parallel layouts
    Refusal(("ep", "async"), EP_SYNC, NO_ASYNC),
    Refusal((ZERO, "async"),
            "parallel.sharding.stage: {stage} shards synchronous data parallelism; async keeps one shared store "
            "(set parallel.mode sync, or sharding.stage 0)", NO_ASYNC),
    # -- precision, optimizers, samplers
    # async: the shared fp32 parameters have no master copy
    Refusal(("async", LOW_PRECISION),
            "train.precision: {precision} runs with the synchronous schemes (parallel.mode sync), not with async",
            NO_ASYNC),
    Refusal(("async", "K-FAC"), "train.optimizer.name: kfac needs a synchronous scheme (parallel.mode sync)",
            NO_ASYNC + " " + NO_KFAC),
    Refusal(("async", "SyncBN"), "parallel.sync_batchnorm: needs a synchronous scheme (parallel.mode sync)",
            NO_ASYNC + " " + NO_BATCHNORM),
    Refusal(("numerics off", "prioritized sampling"),
            "data.sampling: {sampling} needs numerics (its priorities are the samples' losses); use uniform with "
            "numerics false",
            "Numerics off is simtrain's own (meta tensors: no losses to draw by). " + NO_PRIORITIZED),
    Refusal(("K-FAC", "fp16"),
            "train.optimizer.name: kfac does not run under fp16 loss scaling (train.precision fp32 or bf16)",
            NO_KFAC),
    Refusal(("SyncBN", LOW_PRECISION), "parallel.sync_batchnorm: needs train.precision fp32", NO_BATCHNORM),
    # -- experts
    # before the row below, which representatives under pp or tp would reach first
    Refusal(("representatives", "drawn routing"),
            "parallel.representatives: with a drawn routing model (model.moe.routing.model zipf or histogram) the ep "
            "ranks' loads differ, and one rank cannot stand for the others (use balanced, or set it false)",
            OWN_REPRESENTATIVES),
    Refusal(("representatives", "capacity below 1"),
            "parallel.representatives: with model.moe.capacity_factor {capacity_factor} below 1 an expert drops "
            "the assignments of the ep ranks past its capacity, so the ranks' loads differ and one rank cannot "
            "stand for the others (use a capacity_factor of 1 or more, or set it false)", OWN_REPRESENTATIVES),
    Refusal(("drawn routing", MODEL_PARALLEL, "numerics off"),
            "model.moe.routing.model: drawn routing (zipf, histogram) under parallel.pp or parallel.tp with "
            "numerics off is not built (balanced is; data parallelism alone draws it)",
            "Numerics off is simtrain's own: both frameworks compute every token's routing."),
    Refusal(("ep", "K-FAC"),
            "parallel.ep: runs with a first-order optimizer (the expert gradients are kept apart from the "
            "replicated ones)", NO_KFAC),
    # -- gradient accumulation (micro-batches without a pipeline)
    Refusal(("gradient accumulation", "async"),
            "parallel.mode: async (each worker pushes its own batch's gradient) " + GRADIENT_ACCUMULATION, NO_ASYNC),
    Refusal(("gradient accumulation", "K-FAC"),
            "train.optimizer.name: kfac (its factors read one forward) " + GRADIENT_ACCUMULATION, NO_KFAC),
    Refusal(("gradient accumulation", "SyncBN"),
            "parallel.sync_batchnorm: sync_batchnorm " + GRADIENT_ACCUMULATION, NO_BATCHNORM),
    Refusal(("gradient accumulation", "prioritized sampling"),
            "data.sampling: {sampling} sampling (its weights are the whole batch's) " + GRADIENT_ACCUMULATION,
            NO_PRIORITIZED),
    # -- model parallelism
    Refusal((MODEL_PARALLEL, "async"), "parallel.mode: async does not combine with {model_parallel_key} > 1",
            NO_ASYNC),
    # before the row below, which representatives under pp or tp would reach first
    Refusal(("representatives", "K-FAC"),
            "parallel.representatives: not built with K-FAC (its factors' inverses are spread over every rank)",
            OWN_REPRESENTATIVES),
    Refusal((MODEL_PARALLEL, "K-FAC"), "train.optimizer.name: kfac does not combine with {model_parallel_key} > 1",
            NO_KFAC),
    Refusal((MODEL_PARALLEL, "SyncBN"),
            "parallel.sync_batchnorm: sync_batchnorm does not combine with {model_parallel_key} > 1", NO_BATCHNORM),
    # the gpt head of an MoE model computes its own loss (vocabulary-parallel), which a sampler cannot weight
    Refusal(("MoE", "prioritized sampling"),
            "data.sampling: {sampling} sampling does not combine with model.moe (the head's loss is its own)",
            NO_PRIORITIZED),
    Refusal((MODEL_PARALLEL, "prioritized sampling"),
            "data.sampling: {sampling} sampling does not combine with {model_parallel_key} > 1", NO_PRIORITIZED),
    # -- SyncBN's recomputation, representatives, faults and restarts
    # SyncBN's exchanging forward runs the layers itself, outside any checkpointed segment
    Refusal(("SyncBN", RECOMPUTATION), "parallel.sync_batchnorm: does not combine with train.checkpointing",
            NO_BATCHNORM),
    Refusal(("representatives", "faults"), "parallel.representatives: does not run with faults",
            OWN_REPRESENTATIVES),
    Refusal(("representatives", "restart"),
            "parallel.representatives: does not run with train.checkpoint (the mirrored ranks hold no state of "
            "their own)",
            OWN_REPRESENTATIVES),
    Refusal(("restart", "async"), "train.checkpoint: for synchronous schemes; async goes on without a lost worker",
            NO_ASYNC),
    Refusal(("restart", "K-FAC"),
            "train.checkpoint: K-FAC's factors are not part of the training state; use sgd or adam", NO_KFAC),
    Refusal(("restart", "prioritized sampling"),
            "train.checkpoint: {sampling} sampling's priorities are not part of the training state; use uniform",
            NO_PRIORITIZED),
    # -- sharded data parallelism
    Refusal((ZERO, "K-FAC"), "train.optimizer.name: kfac preconditions whole layers; shard sgd or adam", NO_KFAC),
    Refusal((ZERO, "SyncBN"), "parallel.sharding: does not combine with parallel.sync_batchnorm yet", NO_BATCHNORM),
    # -- known once the job's devices are (the layout)
    Refusal(("representatives", "HSDP"),
            "parallel.representatives: time the whole dp group's collectives; with HSDP (parallel.sharding.degree "
            "below dp) set it false",
            OWN_REPRESENTATIVES),
    # -- known once the pipeline's schedule is built
    Refusal(("split backward", "recomputation in segments", ("tp", "cp", "MoE")),
            SPLIT_BACKWARD + "train.checkpointing {checkpointing} under parallel.tp or parallel.cp or with model.moe "
            "(its segments recomputed with their collectives)",
            "Neither runs it: torchtitan's zero-bubble schedules take its activation checkpointing (full, selective "
            "by operator, or every k-th layer), not groups of layers; Megatron-Core's --recompute-method runs "
            "under its 1F1B and interleaved schedules, which do not split backwards."),
    # -- simtrain launch (real processes)
    Refusal(("simtrain launch", "numerics off"), "numerics: launch trains for real; false is for simulations",
            "Numerics off is simtrain's own; a real run computes."),
    Refusal(("simtrain launch", "async"),
            "parallel.mode: async runs simulated only (its workers share parameters through a simulated "
            "shared-memory store, which a process group lacks)", NO_ASYNC),
)
