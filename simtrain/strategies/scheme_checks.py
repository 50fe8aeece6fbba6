"""What the schemes refuse to run, as checks on the scenario's numbers alone: no torch, no job.

Each scheme calls its check when it is built (model_parts.py, offload.py; the
degrees themselves, ep's and the shard degree's included, are the layout's to
check: parallel/layout.py; features that do not run together, the support
table's: parallel/support.py), and simtrain/job_checks.py calls the same ones on
the scenario before anything is built, so `simtrain validate` refuses with the
scheme's own line without importing torch. Each raises a ScenarioError naming
the key at fault.

    offload_host_bandwidth(cluster.shared_memory, scenario.cluster.shared_memory, "optimizer")
    check_sequence(scenario.parallel, layout, seq_len=32, experts=True)   # the model-parallel cuts (model_parts.py)
    check_pipeline_units(scenario.parallel.pipeline, parts=4, units=10)
"""
from ..errors import ScenarioError
from ..hw.host_compute import host_memory_bandwidth


TP_CUT = "parallel.tp: the model cannot be split {tp} ways: {error}"
NOTHING_TO_SPLIT = ("parallel.tp: the model has no layers to split (a Linear, element-wise, Linear run, or gpt "
                    "blocks)")


def check_sequence(parallel, layout, seq_len: int, experts: bool = False) -> None:
    """The sequence (`seq_len` long) cut by sequence parallelism over tp and by context parallelism into 2 x cp
    chunks (x tp with sequence parallelism); with `experts` (model.moe) under tp without sequence parallelism,
    each cp rank's part cut into tp parts, one routed by each tp rank (train/moe.py)."""
    if parallel.sequence_parallel and seq_len % layout.tp:
        raise ScenarioError(f"parallel.sequence_parallel: data.seq_len {seq_len} does not divide into tp "
                            f"{layout.tp} equal parts")
    if experts and layout.tp > 1 and not parallel.sequence_parallel and seq_len % (layout.cp * layout.tp):
        raise ScenarioError(f"model.moe: under parallel.tp each tp rank routes its part of the sequence; "
                            f"data.seq_len {seq_len} does not divide into cp x tp = {layout.cp * layout.tp} equal "
                            "parts")
    chunks = 2 * layout.cp * (layout.tp if parallel.sequence_parallel else 1)
    if layout.cp > 1 and seq_len % chunks:
        raise ScenarioError(f"parallel.cp: data.seq_len {seq_len} does not divide into 2 x cp {layout.cp}"
                            + (f" x tp {layout.tp}" if parallel.sequence_parallel else "")
                            + f" = {chunks} equal chunks")


def check_pipeline_units(pipeline, parts: int, units: int) -> None:
    """A model of `units` splittable units cut into `parts` pipeline parts (pp x virtual_stages), as
    `parallel.pipeline.split` says or balanced."""
    if pipeline.split is not None:
        if len(pipeline.split) != parts or sum(pipeline.split) != units:
            raise ScenarioError(f"parallel.pipeline.split: needs {parts} counts (pp x virtual_stages) that add up to "
                                f"the model's {units} splittable layers, got {list(pipeline.split)}")
    elif parts > units:
        raise ScenarioError(f"parallel.pp: {parts} model parts (pp x virtual_stages) but the model has only "
                            f"{units} splittable layers")


def offload_host_bandwidth(shared_memory, spec, what: str) -> float:
    """Bytes/s the host steps an offloaded optimizer at (hw/host_compute.py), offloading `what`
    (parallel.sharding.offload) to the cluster's `shared_memory` store, the scenario's `spec`
    (cluster.shared_memory); refused unless the store is the host's memory (offload.py)."""
    if shared_memory is None:
        raise ScenarioError(f"parallel.sharding.offload: {what} keeps the state in host memory; give "
                            "cluster.shared_memory (e.g. {} for a DGX A100 socket's)")
    if shared_memory.location != "host":
        raise ScenarioError(f"cluster.shared_memory.location: offload keeps the state in the host's memory; "
                            f"set it to host, got {shared_memory.location!r}")
    return host_memory_bandwidth(spec)
