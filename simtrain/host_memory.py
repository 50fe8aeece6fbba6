"""The host's memory: refuse, before it starts, a run the host cannot hold.

Numerics are real: every simulated device holds a replica of the model with
its gradients and optimizer state in host memory, and the data set lives there
too. A scenario within every bound of limits.py can still ask for more than
the host has (4,096 replicas of a model with two hidden layers of a million
units), and would end in MemoryError or the host's OOM killer far into the run.
`check_scenario_fits_host(scenario, cluster)` estimates a lower bound of what
the run needs from the scenario and its resolved cluster section
(hw/resolved_cluster.py: the device count, a topology file as loaded once), without
building anything real:

- replicas x parameters x bytes per parameter: the model (fp32, plus the
  compute-dtype copy under fp16/bf16), its gradient bucket and the optimizer's
  state (momentum, Adam's two moments). The mlp and the cnn (train/models.py)
  are counted in closed form from their widths, without torch (`model_size`,
  tested equal to the built model's parameters and a forward's outputs at
  several sizes); the transformers and a user's model (package.module:
  function, not called here) count as nothing;
- one replica's activations at a time (replicas compute one after another):
  the outputs of every layer for one batch;
- the data set: synthetic samples x features (fp32) and labels, and every
  replica's shard of indices; a user's data set counts as nothing;
- the network: 1 KiB per link of the topology a builder makes;
- the ring all-reduce: every rank splits its gradient into one chunk per rank
  of its ring (the data-parallel group, or the tp group if larger), views that
  live through the step: 600 B per (rank, chunk) pair, measured (the
  quickstart on 1,024 and 2,048 ring devices peaks at 1.2 and 3.3 GB); with
  representatives, only one rank in pp runs a ring.

It raises a SimtrainError saying how much the run needs and how much the host
has available (MemAvailable in /proc/meminfo, or the cgroup's limit if lower;
os.sysconf where /proc is missing). The check only refuses: no simulated figure
depends on the host, so the same scenario gives the same results everywhere it
runs.

    scenario = load_scenario("scenarios/quickstart.yaml")
    check_scenario_fits_host(scenario, resolve_cluster(scenario.cluster, scenario.base_dir))
    require_host_memory(nbytes, "--sizes 1G on 64 --devices")  # any other need
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from .errors import SimtrainError
from .hw.resolved_cluster import ResolvedCluster
from .scenario import TOPOLOGY_BUILDERS, Scenario
from .train.data_shape import BUILTIN, builtin_splits
from .units import format_bytes

_RING_CHUNK_BYTES = 600  # one chunk view of one rank's bucket in the ring all-reduce (measured, see above)
_LINK_BYTES = 1024  # a networkx edge with its attributes and the network's two directed links: 1.4 KiB measured
_STATE_COPIES = {"sgd": 0, "adam": 2, "kfac": 0}  # fp32 copies of the parameters an optimizer always keeps


def available_bytes() -> int | None:
    """Bytes the host can still give this process, or None where it cannot tell."""
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if available is None:  # no /proc (macOS), or a kernel without MemAvailable: free pages
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    try:  # a container's own limit (cgroup v2)
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            room = max(0, int(limit) - used)
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    return available


def require_host_memory(needed_bytes: int, what: str, detail: str = "") -> None:
    """SimtrainError if `what` needs more than the host has available (nothing when it cannot tell)."""
    available = available_bytes()
    if available is not None and needed_bytes > available:
        detail = f" ({detail})" if detail else ""
        raise SimtrainError(f"host memory: {what} needs at least {format_bytes(needed_bytes)}{detail}; this host "
                            f"has {format_bytes(available)} available")


def check_scenario_fits_host(scenario: Scenario, cluster: ResolvedCluster) -> None:
    """Refuse the scenario (its cluster section resolved as `cluster`) if the lower bound of its host memory is
    more than the host has."""
    needs = scenario_host_bytes(scenario, cluster)
    parts = ", ".join(f"{part} {format_bytes(nbytes)}" for part, nbytes in needs.items() if nbytes)
    require_host_memory(sum(needs.values()), f"scenario {scenario.name}",
                        f"{parts}; smaller cluster.devices, model or data sizes need less")


def scenario_host_bytes(scenario: Scenario, cluster: ResolvedCluster) -> dict[str, int]:
    """A lower bound of the host memory a run of the scenario (its cluster section resolved) takes, by part."""
    replicas = cluster.devices
    info, samples = None, 0
    if scenario.data.name in BUILTIN:
        info, train_samples, test_samples = builtin_splits(scenario.data.name, scenario.data.loader_options())
        samples = train_samples + test_samples
    # Numerics off: parameters and activations are meta tensors, shapes without storage.
    parameters, activations_per_sample = model_size(scenario.model, info) if scenario.numerics else (0, 0)
    train, parallel = scenario.train, scenario.parallel
    ring = parallel.mode == "sync" and parallel.all_reduce == "ring"  # a ring all-reduce's chunk per peer pair
    bytes_per_parameter = 4 * (2 + _STATE_COPIES[train.optimizer.name]) + (2 if train.precision != "fp32" else 0)
    data_bytes = samples * (4 * info.num_features + 8 + 8) if info is not None else 0  # x, label, shard index
    return {
        f"{replicas} replicas x {parameters:,} parameters": replicas * parameters * bytes_per_parameter,
        "activations": 2 * 4 * activations_per_sample * scenario.data.batch_size,
        "data": data_bytes,
        "links": _LINK_BYTES * _link_count(scenario.cluster.topology, replicas),
        "ring chunks": _RING_CHUNK_BYTES * _ring_chunks(parallel, replicas) if ring else 0,
    }


def model_size(model, info) -> tuple[int, int]:
    """(parameters, output values of its layers per sample) of the built-in mlp or cnn `model` (a ModelSpec) on
    data of shape `info` (DatasetInfo), as train/models.py builds them; (0, 0) for any other model, or a cnn on
    data without images (which the job's build refuses)."""
    if info is None or model.name not in ("mlp", "cnn") or (model.name == "cnn" and info.image_shape is None):
        return 0, 0
    norm = 2 if model.batchnorm else 0  # BatchNorm's weight and bias; its running statistics are buffers
    if model.name == "mlp":  # Flatten, then per width: Linear [BatchNorm1d] ReLU; a Linear head
        head_inputs = math.prod(info.input_shape)
        parameters, values = 0, head_inputs
        for hidden in model.hidden:
            parameters += (head_inputs + 1 + norm) * hidden
            values += (2 + (norm > 0)) * hidden
            head_inputs = hidden
    else:  # Unflatten, then per entry: Conv2d 3x3 [BatchNorm2d] ReLU [MaxPool2d(2)]; Flatten, a Linear head
        channels, height, width = info.image_shape
        parameters, values = 0, channels * height * width
        for out_channels in model.channels:
            parameters += (9 * channels + 1 + norm) * out_channels
            values += (2 + (norm > 0)) * out_channels * height * width
            if height >= 2 and width >= 2:
                height, width = height // 2, width // 2
                values += out_channels * height * width
            channels = out_channels
        head_inputs = channels * height * width
        values += head_inputs  # Flatten
    parameters += (head_inputs + 1) * info.num_classes
    return parameters, values + info.num_classes


def _ring_chunks(parallel, devices: int) -> int:
    """(rank, chunk) pairs of the ring all-reduces: every ring rank holds one chunk per member of its ring (the
    gradient's ring is the dp x cp group: context-parallel ranks average their gradients too)."""
    dp_cp = parallel.dp * parallel.cp if parallel.dp else devices // (parallel.pp * parallel.tp)
    ring_ranks = devices // parallel.pp if parallel.representatives else devices
    return ring_ranks * max(dp_cp, parallel.tp)


def _link_count(topology: str, devices: int) -> int:
    if topology == "fully_connected":
        return devices * (devices - 1) // 2
    return 2 * devices if topology in TOPOLOGY_BUILDERS else 0  # a file's links are bounded by its size
