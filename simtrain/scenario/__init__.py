"""The scenario file: what to simulate, validated with pydantic, one module per section.

A scenario names a cluster (topology, devices, links), a model, a data set, a
training recipe and a parallel layout. Unknown keys are errors; quantities take
SI numbers or strings with units ("100 GB/s", "5 us", "40 GiB").

    scenario = load_scenario("scenarios/quickstart.yaml", ["cluster.devices=16"])

Each section is a module: cluster.py, model.py, data.py, train.py, parallel.py,
pbt.py, report.py (model_presets.py and fleet_presets.py: the published models
and failure mixes their `preset` names); root.py is the Scenario and the
checks across sections, loading.py reads files and overrides, fields.py the
field types they share.
Every field's `description` says what it means and its unit, and is the one
home of its default: `Scenario.model_json_schema()` is the reference the docs
are generated from, and the CLI's options and `simtrain.dist.spawn`'s keywords
take their defaults from these specs.
"""
from .cluster import (DTYPES, OPTIONAL_DTYPES, ClusterSpec, DeviceFields, DeviceOverride, FaultSpec, LinkSpec,
                      PeakFlops, RandomFaultsSpec, SharedMemorySpec, TOPOLOGY_BUILDERS)
from .data import DataSpec, MHSpec
from .loading import apply_override, load_cluster, load_scenario
from .model import ModelSpec
from .parallel import AsyncSpec, ParallelSpec, PipelineSpec
from .pbt import CheckpointStorageSpec, MetricSpec, PbtSpec, PbtStopSpec, RangeSpec
from .report import ReportSpec
from .root import Scenario, validate_scenario
from .train import (LIVE_HYPERPARAMETERS, AmpSpec, CheckpointSegments, OptimizerSpec, TrainCheckpointSpec,
                    TrainSpec)

__all__ = [
    "DTYPES", "OPTIONAL_DTYPES", "LIVE_HYPERPARAMETERS", "AmpSpec", "AsyncSpec", "CheckpointSegments",
    "CheckpointStorageSpec", "ClusterSpec", "DataSpec", "DeviceFields", "DeviceOverride", "FaultSpec", "LinkSpec", "MHSpec", "MetricSpec",
    "ModelSpec", "OptimizerSpec", "ParallelSpec", "PbtSpec", "PbtStopSpec", "PeakFlops", "PipelineSpec",
    "RandomFaultsSpec", "RangeSpec", "ReportSpec", "Scenario", "SharedMemorySpec", "TOPOLOGY_BUILDERS",
    "TrainCheckpointSpec",
    "TrainSpec", "apply_override", "load_cluster", "load_scenario", "validate_scenario",
]
