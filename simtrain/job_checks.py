"""Every refusal a job's build makes, checked on the scenario alone for the built-in models and data: no torch.

A job (job.py) builds its data, its model and every rank's share of it, its
replicas and its scheme; each step of that build refuses what it cannot run,
with one line naming the key. For a scenario whose model and data are built in
(mlp, cnn, gpt, llama with or without model.moe; digits, synthetic, tokens),
`check_job(scenario, shared_memory, world)` makes the same checks, in the same order,
with the same lines, on plain numbers: the layout (parallel/layout.py) and the
support table's rows that read it (parallel/support.py), the data set's
options and splits (train/data_shape.py), the model's entries as data
(train/architecture.py: the pipeline's units, the tensor-parallel cut,
gradient checkpointing's blocks), and what the scheme refuses
(strategies/scheme_checks.py, comm/channels.py). The build itself calls the same
functions, so each check is written once. `simtrain validate` (preflight.py)
then imports no torch and builds nothing for these scenarios.

`covered(scenario)` says whether check_job makes every check the build would.
It does not for a user's model or data set (the user's code is what says
whether it fits: preflight builds the job on meta tensors, which imports
torch), nor where a refusal depends on something only the built job knows:

- `parallel.all_reduce: hierarchical` and `parallel.moe_dispatch: hierarchical`
  or `deepep` refuse groups spread unevenly over hosts, and which groups a scheme builds
  is its own business;
- gradient checkpointing in segments under pipeline parallelism without
  `parallel.pipeline.split` checks each stage's blocks, and the stages are
  balanced on FLOPs measured in a meta forward;
- an mlp cut by tp under virtual stages: which of its widths the line names
  depends on that same balance.

    if covered(scenario):
        check_job(scenario, shared_memory, world)
"""
from .comm.channels import check_channels
from .errors import ScenarioError
from .hw.shared_memory import SharedMemory
from .parallel.schedules import pipeline_placement
from .parallel.support import Case, refuse
from .scenario import CheckpointSegments, Scenario
from .parallel import Layout
from .strategies.scheme_checks import (NOTHING_TO_SPLIT, TP_CUT, check_pipeline_units, check_sequence,
                                    offload_host_bandwidth)
from .train.architecture import (Entry, architecture, check_tensor_cut, checkpoint_blocks, checkpoint_segments,
                                 recompute_segments, units_of)
from .train.data_shape import BUILTIN, builtin_splits, check_validation_split

BUILT_IN_MODELS = ("mlp", "cnn", "gpt", "llama")


def covered(scenario: Scenario) -> bool:
    """Whether check_job makes every check the job's build would make for `scenario`."""
    parallel = scenario.parallel
    segments = scenario.train.checkpointing
    parts = parallel.pp * parallel.pipeline.virtual_stages
    return (scenario.model.name in BUILT_IN_MODELS and scenario.data.name in BUILTIN
            and parallel.all_reduce != "hierarchical"
            and not (parallel.ep > 1 and parallel.moe_dispatch != "pairwise")
            and not (parallel.model_parallel and parts > 1 and parallel.pipeline.split is None
                     and isinstance(segments, CheckpointSegments) and segments.segments > 1)
            and not (scenario.model.name == "mlp" and parallel.tp > 1 and parallel.pipeline.virtual_stages > 1))


def check_job(scenario: Scenario, shared_memory: SharedMemory | None, world: int) -> None:
    """Refuse, as Job(scenario, cluster, range(world)) would on a cluster whose store is `shared_memory`
    (`cluster.shared_memory`'s, None without one), a scenario that `covered` accepts."""
    parallel = scenario.parallel
    layout = Layout.of(parallel, world)
    refuse(Case(scenario, layout=layout), ScenarioError)  # the support table's rows that read the layout
    info, train_samples, _ = builtin_splits(scenario.data.name, scenario.data.loader_options())
    check_validation_split(scenario.data.validation_fraction, train_samples)
    entries = architecture(scenario.model, info)
    if parallel.model_parallel:
        _check_model_parts(scenario, layout, entries, info.input_shape[0])
    elif scenario.train.checkpointing not in ("none", "selective"):  # gpt's and llama's blocks hold attention
        checkpoint_segments(scenario.train.checkpointing, len(checkpoint_blocks([e.matrix for e in entries])))
    _check_scheme(scenario, shared_memory, layout)


def _check_model_parts(scenario: Scenario, layout: Layout, entries: list[Entry], seq_len: int) -> None:
    """schemes/model_parts.py's part_counts and rank_shares: the pipeline's schedule (simtrain/parallel/schedules,
    pure Python), the sequence cuts, the pipeline's units, the tensor-parallel cut, each stage's checkpointing
    blocks."""
    parallel = scenario.parallel
    parts = layout.pp * parallel.pipeline.virtual_stages
    placement = pipeline_placement(scenario, layout.pp)  # the schedule runs with this layout
    check_sequence(parallel, layout, seq_len, scenario.model.moe is not None)
    units = units_of(entries, tensor_parallel=layout.tp > 1)
    check_pipeline_units(parallel.pipeline, parts, len(units))
    if layout.tp > 1:
        try:
            splits = check_tensor_cut(entries, layout.tp)
        except ValueError as error:
            raise ScenarioError(TP_CUT.format(tp=layout.tp, error=error)) from None
        if not splits:
            raise ScenarioError(NOTHING_TO_SPLIT)
    spec = scenario.train.checkpointing
    if isinstance(spec, CheckpointSegments):  # each chunk checkpoints itself, or is recomputed in segments of units
        if parallel.pipeline.split is not None:
            counts = list(parallel.pipeline.split)
        elif parts == 1:
            counts = [len(units)]
        else:  # stages balanced on FLOPs: `covered` leaves them to the build, but for one segment, which fits any
            return
        starts = [sum(counts[:part]) for part in range(len(counts))]
        for stage in range(layout.pp):  # rank order: stage 0's rank first, its chunks in order
            for part in placement[stage]:
                chunk = units[starts[part]:starts[part] + counts[part]]  # its units' blocks: its entries' under tp 1
                recompute_segments(spec, [any(entries[i].matrix for i in unit) for unit in chunk])


def _check_scheme(scenario: Scenario, shared_memory: SharedMemory | None, layout: Layout) -> None:
    """What the scheme the registry picks refuses when it is built (schemes/__init__.py's order)."""
    parallel, sharding = scenario.parallel, scenario.parallel.sharding
    if parallel.mode != "async" and sharding.offload != "none":  # the distributed optimizer's, in every layout
        offload_host_bandwidth(shared_memory, scenario.cluster.shared_memory, sharding.offload)
    if parallel.model_parallel:
        if _model_parallel_all_reduces(scenario, layout):
            _check_all_reduce(parallel)
    elif parallel.mode != "async":
        _check_all_reduce(parallel)


def _model_parallel_all_reduces(scenario: Scenario, layout: Layout) -> bool:
    """Whether a model-parallel job builds an all-reduce when it is built (schemes/model_parallel.py regroup: its
    dp-cp and tp groups of more than one rank, its overflow vote under fp16; representatives time theirs later)."""
    if scenario.parallel.representatives:
        return False
    return layout.dp * layout.cp > 1 or layout.tp > 1 or scenario.train.precision == "fp16"


def _check_all_reduce(parallel) -> None:
    if parallel.channels is not None:
        check_channels(parallel.all_reduce, parallel.channels, "parallel.channels")
