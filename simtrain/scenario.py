"""The scenario file: what to simulate, validated with pydantic.

A scenario names a cluster (topology, devices, links), a model, a data set, a
training recipe and a parallel scheme. Unknown keys are errors; quantities take
SI numbers or strings with units ("100 GB/s", "5 us", "40 GiB").

    scenario = load_scenario("scenarios/quickstart.yaml", ["cluster.devices=16"])

Overrides are `dotted.path=value` with the value parsed as YAML; they are
validated like the file. Every error is a ScenarioError whose one-line message
names the file and the field.
"""
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, field_validator,
                      model_validator)

from .errors import ScenarioError, SimtrainError
from .units import parse_quantity


def _quantity(kind: str):
    def parse(value):
        try:
            return parse_quantity(value, kind)
        except SimtrainError as error:  # pydantic reports ValueError with the field's location
            raise ValueError(str(error)) from None

    return BeforeValidator(parse)


Bandwidth = Annotated[float, _quantity("bandwidth"), Field(gt=0)]
Duration = Annotated[float, _quantity("time")]
PositiveInt = Annotated[int, Field(gt=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LinkSpec(_Strict):
    bandwidth: Bandwidth
    latency: Duration = 0.0


class ClusterSpec(_Strict):
    topology: str = "ring"  # builder name, or a path to a topology YAML file
    devices: PositiveInt | None = None  # None: take the count from a topology file
    device: Union[str, dict[str, Any]] = "a100-40gb"  # catalog name or inline spec
    link: LinkSpec = LinkSpec(bandwidth=50e9, latency=5e-6)
    inter_node_link: LinkSpec | None = None  # hierarchical: each GPU's NIC to the spine
    gpus_per_node: PositiveInt | None = None  # hierarchical
    torus_shape: tuple[PositiveInt, PositiveInt] | None = None  # torus2d: rows, cols
    # Heterogeneous and noisy devices (hw/cluster.py): per-rank changes, lognormal compute noise.
    overrides: dict[Annotated[int, Field(ge=0)], "DeviceOverride"] = {}
    compute_jitter: Annotated[float, Field(ge=0)] = 0.0  # std of log(factor) per compute span
    shared_memory: "SharedMemorySpec | None" = None  # where async training's parameters live


class DeviceOverride(_Strict):
    """One rank's device: another device (catalog name or inline spec), changed fields, a slowdown."""

    device: Union[str, dict[str, Any], None] = None  # replaces cluster.device for this rank
    slowdown: Annotated[float, Field(gt=0)] = 1.0  # every span on its compute stream takes this much longer
    efficiency: Annotated[float, Field(gt=0, le=1)] | None = None
    peak_flops: dict[str, Any] | None = None  # some or all of fp32, tf32, fp16, bf16
    memory: Any = None
    memory_bandwidth: Any = None

    def device_fields(self) -> dict[str, Any]:
        """The device fields this override changes (catalog.py's inline-spec keys)."""
        fields = {"efficiency": self.efficiency, "peak_flops": self.peak_flops, "memory": self.memory,
                  "memory_bandwidth": self.memory_bandwidth}
        return {key: value for key, value in fields.items() if value is not None}


class SharedMemorySpec(_Strict):
    """The store holding the shared parameters: host DRAM over each device's host link, or a
    store attached to a node of the topology (a parameter server)."""

    location: str = "host"  # host | the name of a topology node
    bandwidth: Bandwidth  # of the store itself: every reader and writer shares it
    latency: Duration = 0.0
    host_link: LinkSpec | None = None  # location host: each device's own link to the host (PCIe)
    capacity: Annotated[float, _quantity("bytes"), Field(gt=0)] | None = None  # None: unlimited


class ModelSpec(_Strict):
    name: str = "mlp"  # mlp | cnn | package.module:function
    hidden: list[PositiveInt] = [128, 128]  # mlp
    channels: list[PositiveInt] = [16, 32]  # cnn
    batchnorm: bool = False  # mlp, cnn: BatchNorm after each hidden Linear / Conv2d
    options: dict[str, Any] = {}  # keyword arguments of a user's model function

    def builder_options(self) -> dict[str, Any]:
        """The keyword options the model builder of `name` takes."""
        if self.name == "mlp":
            return {"hidden": list(self.hidden), "batchnorm": self.batchnorm}
        if self.name == "cnn":
            return {"channels": list(self.channels), "batchnorm": self.batchnorm}
        return dict(self.options)


class MHSpec(_Strict):
    steps: PositiveInt = 2  # Metropolis-Hastings proposals per batch slot per batch


class DataSpec(_Strict):
    name: str = "digits"  # digits | synthetic | package.module:function
    batch_size: PositiveInt = 32  # per device
    samples: PositiveInt | None = None  # synthetic
    features: PositiveInt | None = None  # synthetic
    classes: PositiveInt | None = None  # synthetic
    options: dict[str, Any] = {}  # keyword arguments of a user's data function
    # How batches are drawn (simtrain/train/sampling.py): uniform | prioritized | mh.
    sampling: Literal["uniform", "prioritized", "mh"] = "uniform"
    alpha: Annotated[float, Field(ge=0)] = 0.6  # P(i) = p_i^alpha / sum_k p_k^alpha
    eps: Annotated[float, Field(gt=0)] = 0.01  # p_i = last loss + eps
    beta0: Annotated[float, Field(ge=0, le=1)] = 0.4  # importance-sampling exponent at step 0
    beta_end: Annotated[float, Field(ge=0, le=1)] = 1.0  # ... annealed linearly to this (0 with beta0 0: off)
    beta_steps: PositiveInt | None = None  # steps over which beta reaches beta_end; None: train.steps
    mh: MHSpec = MHSpec()

    def loader_options(self) -> dict[str, Any]:
        """The keyword options the data loader of `name` takes."""
        if self.name == "synthetic":
            fields = {"samples": self.samples, "features": self.features, "classes": self.classes}
            return {key: value for key, value in fields.items() if value is not None}
        return dict(self.options)


class OptimizerSpec(_Strict):
    name: Literal["sgd", "adam", "kfac"] = "sgd"
    lr: Annotated[float, Field(gt=0)] = 0.1
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.0
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    eps: Annotated[float, Field(gt=0)] = 1e-8
    # kfac (simtrain/train/kfac.py): K-FAC preconditioning, then SGD with lr, momentum, weight_decay.
    damping: Annotated[float, Field(gt=0)] = 1e-3
    factor_decay: Annotated[float, Field(ge=0, lt=1)] = 0.95
    factor_update_steps: PositiveInt = 1
    inv_update_steps: PositiveInt = 10
    kl_clip: Annotated[float, Field(ge=0)] = 1e-3  # 0: no clipping
    method: Literal["eigen", "inverse"] = "eigen"
    distribute_inverses: bool = True

    def builder_options(self) -> dict[str, Any]:
        """The keyword options of the torch optimizer `name`."""
        if self.name == "sgd":
            return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
                    "nesterov": self.nesterov}
        if self.name == "kfac":
            return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
                    "damping": self.damping, "factor_decay": self.factor_decay,
                    "factor_update_steps": self.factor_update_steps, "inv_update_steps": self.inv_update_steps,
                    "kl_clip": self.kl_clip, "method": self.method, "distribute_inverses": self.distribute_inverses}
        return {"lr": self.lr, "betas": tuple(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}


class AmpSpec(_Strict):
    """fp16 dynamic loss scaling (simtrain/train/precision.py); defaults are torch.amp.GradScaler's."""

    init_scale: Annotated[float, Field(gt=0)] = 2.0 ** 16
    growth_factor: Annotated[float, Field(gt=1)] = 2.0
    backoff_factor: Annotated[float, Field(gt=0, lt=1)] = 0.5
    growth_interval: PositiveInt = 2000


class CheckpointSegments(_Strict):
    segments: PositiveInt


class TrainSpec(_Strict):
    steps: PositiveInt = 200
    optimizer: OptimizerSpec = OptimizerSpec()
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"  # compute dtype; fp16/bf16 keep fp32 master weights
    amp: AmpSpec = AmpSpec()
    # Gradient checkpointing (simtrain/train/checkpointing.py): none | sqrt | {segments: k}.
    checkpointing: Union[Literal["none", "sqrt"], CheckpointSegments] = "none"
    target_loss: float | None = None  # report time_to_target_s (report.py: smoothed_loss_curve)


class AsyncSpec(_Strict):
    consistency: Literal["hogwild", "locked"] = "hogwild"
    staleness_lr: Literal["none", "inverse"] = "none"  # inverse: lr / (1 + staleness)


class ParallelSpec(_Strict):
    model_config = ConfigDict(extra="forbid", frozen=True, serialize_by_alias=True)
    # naive | ring | tree (FireCaffe) | hierarchical (in-host reduce-scatter, cross-host all-reduce per
    # rail, in-host all-gather) | dbtree (NCCL's double binary tree): synchronous all-reduce (simtrain/comm/);
    # async: asynchronous SGD on a shared store
    scheme: Literal["naive", "ring", "tree", "hierarchical", "dbtree", "async"] = "ring"
    # all-reduce channels (buffer parts run side by side, each crossing hosts on its own rail);
    # None: the topology's default, one per NIC rail across hosts, else 1 (simtrain/comm/channels.py)
    channels: PositiveInt | None = None
    async_: AsyncSpec = Field(AsyncSpec(), alias="async")  # scheme async (schemes/asynchronous.py)
    sync_batchnorm: bool = False  # all-reduce BatchNorm batch statistics (simtrain/train/syncbn.py)


class ReportSpec(_Strict):
    trace: bool = True  # write trace.json (Chrome trace event format)
    every: PositiveInt = 10  # steps per point of report.json's periodic series (sampling)


class Scenario(_Strict):
    name: str = "scenario"
    seed: Annotated[int, Field(ge=0)] = 0
    cluster: ClusterSpec = ClusterSpec()
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    train: TrainSpec = TrainSpec()
    parallel: ParallelSpec = ParallelSpec()
    report: ReportSpec = ReportSpec()
    # Folder that relative paths in the scenario (topology files) are read from.
    _base_dir: Path = PrivateAttr(default=Path("."))

    @property
    def base_dir(self) -> Path:
        return self._base_dir

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not value or "/" in value or value.startswith("."):
            raise ValueError("must be a plain name (no '/', not empty, not starting with '.')")
        return value

    @model_validator(mode="after")
    def _techniques_fit_together(self) -> "Scenario":
        """Combinations no scheme implements: one-line errors naming the field, before anything runs."""
        precision, optimizer = self.train.precision, self.train.optimizer.name
        if self.parallel.scheme == "async":
            if self.cluster.shared_memory is None:
                raise ValueError("cluster.shared_memory: required by parallel.scheme async (where the shared "
                                 "parameters live)")
            if precision != "fp32":  # the shared fp32 parameters have no master copy
                raise ValueError(f"train.precision: {precision} runs with the synchronous schemes (naive, ring, "
                                 "tree), not with async")
            if optimizer == "kfac":
                raise ValueError("train.optimizer.name: kfac needs a synchronous scheme (naive, ring or tree)")
            if self.parallel.sync_batchnorm:
                raise ValueError("parallel.sync_batchnorm: needs a synchronous scheme (naive, ring or tree)")
        if optimizer == "kfac" and precision == "fp16":
            raise ValueError("train.optimizer.name: kfac does not run under fp16 loss scaling "
                             "(train.precision fp32 or bf16)")
        if self.parallel.sync_batchnorm and precision != "fp32":
            raise ValueError("parallel.sync_batchnorm: needs train.precision fp32")
        if self.parallel.sync_batchnorm and self.train.checkpointing != "none":
            # SyncBN's exchanging forward runs the layers itself, outside any checkpointed segment
            raise ValueError("parallel.sync_batchnorm: does not combine with train.checkpointing")
        return self

    def to_yaml(self) -> str:
        """The scenario with every default filled in, as YAML (SI units)."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def load_scenario(path, overrides: list[str] | tuple[str, ...] = ()) -> Scenario:
    """Read, override and validate a scenario file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ScenarioError(f"{path}: cannot read the scenario file ({error.strerror})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ScenarioError(f"{path}: not valid YAML{where}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ScenarioError(f"{path}: a scenario must be a mapping of fields")
    for override in overrides:
        apply_override(raw, override, str(path))
    return validate_scenario(raw, source=str(path), base_dir=path.parent)


def apply_override(raw: dict, override: str, source: str = "--set") -> None:
    """Set `dotted.path=value` (value parsed as YAML) in the raw scenario mapping."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise ScenarioError(f"--set {override!r}: expected dotted.path=value")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        raise ScenarioError(f"--set {key}: cannot parse {text!r} as a YAML value") from None
    parts = key.strip().split(".")
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ScenarioError(f"--set {key}: {'.'.join(parts[: depth + 1])} is not a mapping in {source}")
        node = child
    node[parts[-1]] = value


def validate_scenario(raw: dict, source: str = "scenario", base_dir: Path = Path(".")) -> Scenario:
    """Validate a raw mapping; the first problem becomes a one-line ScenarioError."""
    try:
        scenario = Scenario.model_validate(raw)
        scenario._base_dir = Path(base_dir)
        return scenario
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = "unknown field"
        elif first["type"] == "literal_error":
            message = f"{message}, got {first['input']!r}"
        # A check across fields (no location) names its field at the start of its message.
        raise ScenarioError(f"{source}: {field}: {message}" if field else f"{source}: {message}") from None
