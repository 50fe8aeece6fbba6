"""The scenario file: what to simulate, validated with pydantic.

A scenario names a cluster (topology, devices, links), a model, a data set, a
training recipe and a parallel scheme. Unknown keys are errors; quantities take
SI numbers or strings with units ("100 GB/s", "5 us", "40 GiB").

    scenario = load_scenario("scenarios/quickstart.yaml", ["cluster.devices=16"])

Overrides are `dotted.path=value` with the value parsed as YAML; they are
validated like the file. Every error is a ScenarioError whose one-line message
names the file and the field.
"""
import math
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, Strict, ValidationError,
                      field_validator, model_validator)

from .errors import ScenarioError, SimtrainError, one_line
from .limits import (MAX_BATCH_SIZE, MAX_CHANNELS, MAX_COMPUTE_JITTER, MAX_DEVICES, MAX_FAULTS, MAX_FEATURES,
                     MAX_HEADS,
                     MAX_LAYERS, MAX_LEARNING_RATE, MAX_MH_STEPS, MAX_MICROBATCHES, MAX_NAME_BYTES, MAX_SAMPLES,
                     MAX_SCHEDULE_ENTRIES, MAX_SEED, MAX_SEQ_LEN, MAX_SLOWDOWN, MAX_STEPS, MAX_WIDTH,
                     MIN_EFFICIENCY)
from .units import parse_quantity
from .user_files import load_yaml_file, parse_yaml_text, user_path


def _quantity(kind: str):
    def parse(value):
        try:
            return parse_quantity(value, kind)
        except SimtrainError as error:  # pydantic reports ValueError with the field's location
            raise ValueError(str(error)) from None

    return BeforeValidator(parse)


def _not_a_boolean(value):
    if isinstance(value, bool):  # bool is an int to Python: `devices: true` would be 1 device
        raise ValueError(f"expected a number, got {str(value).lower()}")
    return value


def Count(maximum: int, minimum: int = 1):  # noqa: N802 (a type, as pydantic's conint)
    """An integer from `minimum` to `maximum` (limits.py); a boolean is refused."""
    return Annotated[int, BeforeValidator(_not_a_boolean), Field(ge=minimum, le=maximum)]


def Real(**bounds):  # noqa: N802 (a type, as pydantic's confloat)
    """A finite number within `bounds` (pydantic's gt, ge, lt, le); a boolean is refused."""
    return Annotated[float, BeforeValidator(_not_a_boolean), Field(**bounds)]


Number = Annotated[Union[int, float], BeforeValidator(_not_a_boolean)]  # a finite int or float, as given
Bandwidth = Annotated[float, _quantity("bandwidth"), Field(gt=0)]
Duration = Annotated[float, _quantity("time")]
Interval = Annotated[float, _quantity("time"), Field(gt=0)]
Flag = Annotated[bool, Strict()]  # true or false, not 1 or "yes"
Steps = Count(MAX_STEPS)
Width = Count(MAX_WIDTH)


class _Strict(BaseModel):
    # allow_inf_nan: .inf and .nan are refused by every number field.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class LinkSpec(_Strict):
    bandwidth: Bandwidth
    latency: Duration = 0.0


class ClusterSpec(_Strict):
    topology: str = "ring"  # builder name, or a path to a topology YAML file
    devices: Count(MAX_DEVICES) | None = None  # None: take the count from a topology file
    device: Union[str, dict[str, Any]] = "a100-40gb"  # catalog name or inline spec
    link: LinkSpec = LinkSpec(bandwidth=50e9, latency=5e-6)
    inter_node_link: LinkSpec | None = None  # hierarchical: each GPU's NIC to the spine
    gpus_per_node: Count(MAX_DEVICES) | None = None  # hierarchical, fat_tree
    # fat_tree: nodes whose same-rail NICs share a leaf switch (a DGX SuperPOD scalable unit: 20 nodes,
    # NVIDIA DGX SuperPOD reference architecture), and a leaf's downlink to uplink bandwidth (1: non-blocking)
    nodes_per_leaf: Count(MAX_DEVICES) = 20
    oversubscription: Real(ge=1, le=MAX_DEVICES) = 1.0
    torus_shape: tuple[Count(MAX_DEVICES), Count(MAX_DEVICES)] | None = None  # torus2d: rows, cols
    # Heterogeneous and noisy devices (hw/cluster.py): per-rank changes, lognormal compute noise.
    overrides: dict[Count(MAX_DEVICES - 1, minimum=0), "DeviceOverride"] = {}
    compute_jitter: Real(ge=0, le=MAX_COMPUTE_JITTER) = 0.0  # std of log(factor) per compute span
    # What a forward or backward costs (hw/device.py): its FLOPs at peak x efficiency (flops), or per
    # operator the slower of its FLOPs and its HBM bytes at bandwidth x efficiency (roofline: op_cost.py).
    compute_model: Literal["flops", "roofline"] = "flops"
    shared_memory: "SharedMemorySpec | None" = None  # where async training's parameters live
    # Faults (hw/faults.py) and what a job does about them (recovery.py).
    faults: Annotated[list["FaultSpec"], Field(max_length=MAX_FAULTS)] = []  # at given times
    random_faults: "RandomFaultsSpec | None" = None  # drawn from a seeded Generator
    spares: Count(MAX_DEVICES - 1, minimum=0) = 0  # the last `spares` devices stay idle to replace a lost one
    # Seconds from a device's loss until its job notices: torchrun's elastic agent polls its workers every
    # --monitor-interval (default 0.1 s in torch 2.13, torch/distributed/run.py), so at most that long.
    fault_detection: Duration = 0.1


class FaultSpec(_Strict):
    """One fault: a link degraded (bandwidth_factor, healed at `until` if given) or failed, or a device lost.
    `link` names the two nodes of a topology link; `device` a device's index (global rank)."""

    at: Duration  # simulated time it happens
    link: tuple[str, str] | None = None
    device: Count(MAX_DEVICES - 1, minimum=0) | None = None
    bandwidth_factor: Real(gt=0, le=1) | None = None  # the link moves bytes at this fraction of its rate
    fail: Flag = False
    until: Duration | None = None  # a degraded link is healed then

    @model_validator(mode="after")
    def _one_fault(self) -> "FaultSpec":
        if (self.link is None) == (self.device is None):
            raise ValueError("give either link: [u, v] or device: N")
        if self.device is not None:
            if not self.fail or self.bandwidth_factor is not None or self.until is not None:
                raise ValueError("a device fault is {at, device: N, fail: true}")
        elif self.fail == (self.bandwidth_factor is not None):
            raise ValueError("a link fault gives either bandwidth_factor or fail: true")
        if self.until is not None:
            if self.bandwidth_factor is None:
                raise ValueError("until: only a degraded link (bandwidth_factor) is healed")
            if self.until <= self.at:
                raise ValueError(f"until: must be after at ({self.until:g} s <= {self.at:g} s)")
        return self


class RandomFaultsSpec(_Strict):
    """Faults drawn as they come: every device of the job (every link) fails after an exponential time of
    mean `device_mtbf` (`link_mtbf`), independently; a failed link stays failed."""

    device_mtbf: Interval | None = None
    link_mtbf: Interval | None = None
    seed: Count(MAX_SEED, minimum=0) | None = None  # None: the scenario's seed

    @model_validator(mode="after")
    def _something_fails(self) -> "RandomFaultsSpec":
        if self.device_mtbf is None and self.link_mtbf is None:
            raise ValueError("give device_mtbf, link_mtbf or both")
        return self


class DeviceOverride(_Strict):
    """One rank's device: another device (catalog name or inline spec), changed fields, a slowdown."""

    device: Union[str, dict[str, Any], None] = None  # replaces cluster.device for this rank
    slowdown: Real(gt=0, le=MAX_SLOWDOWN) = 1.0  # every span on its compute stream takes this much longer
    efficiency: Real(ge=MIN_EFFICIENCY, le=1) | None = None
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
    store attached to a node of the topology (a parameter server). The defaults are a DGX A100's
    host: one AMD EPYC 7742 socket's eight DDR4-3200 channels (8 x 25.6 GB/s = 204.8 GB/s, AMD's
    EPYC 7002 datasheet) behind one PCIe 4.0 x16 link per GPU (16 GT/s x 16 lanes x 128/130
    encoding = 31.5 GB/s per direction, PCI-SIG base specification 4.0)."""

    location: str = "host"  # host | the name of a topology node
    bandwidth: Bandwidth = 204.8e9  # of the store itself: every reader and writer shares it
    latency: Duration = 0.0  # of the store's own link
    host_link: LinkSpec = LinkSpec(bandwidth=31.5e9, latency=1e-6)  # location host: each device's link to it
    capacity: Annotated[float, _quantity("bytes"), Field(gt=0)] | None = None  # None: unlimited

    @model_validator(mode="after")
    def _host_link_only_for_the_host(self) -> "SharedMemorySpec":
        default = type(self).model_fields["host_link"].default
        if self.location != "host" and self.host_link != default:
            raise ValueError(f"cluster.shared_memory.host_link: only for location host, not {self.location!r}")
        return self


class ModelSpec(_Strict):
    name: str = "mlp"  # mlp | cnn | gpt | package.module:function
    # mlp: the hidden layers' widths; gpt: the model width, one number (default 64)
    hidden: Annotated[list[Width], Field(max_length=MAX_LAYERS)] = [128, 128]
    layers: Count(MAX_LAYERS) = 2  # gpt: transformer blocks
    heads: Count(MAX_HEADS) = 4  # gpt: attention heads per block (must divide hidden)
    channels: Annotated[list[Width], Field(min_length=1, max_length=MAX_LAYERS)] = [16, 32]  # cnn: conv widths
    batchnorm: Flag = False  # mlp, cnn: BatchNorm after each hidden Linear / Conv2d
    options: dict[str, Any] = {}  # keyword arguments of a user's model function (not mlp, cnn or gpt)

    @model_validator(mode="before")
    @classmethod
    def _gpt_width(cls, raw):
        """A gpt's width is one number (kept as a one-entry list); its default is 64."""
        if isinstance(raw, dict) and raw.get("name") == "gpt":
            hidden = raw.get("hidden", 64)
            raw = {**raw, "hidden": [hidden] if isinstance(hidden, int) and not isinstance(hidden, bool) else hidden}
        return raw

    @model_validator(mode="after")
    def _fields_of_this_model(self) -> "ModelSpec":
        if self.name == "gpt":
            if len(self.hidden) != 1:
                raise ValueError("model.hidden: a gpt's width is one number")
            if self.hidden[0] % self.heads:
                raise ValueError(f"model.heads: {self.heads} heads do not divide model.hidden {self.hidden[0]}")
        return self

    @property
    def width(self) -> int:
        """A gpt's width."""
        return self.hidden[0]


class MHSpec(_Strict):
    steps: Count(MAX_MH_STEPS) = 2  # Metropolis-Hastings proposals per batch slot per batch


class DataSpec(_Strict):
    name: str = "digits"  # digits | synthetic | tokens | package.module:function
    batch_size: Count(MAX_BATCH_SIZE) = 32  # per device (per data-parallel replica with pp or tp)
    samples: Count(MAX_SAMPLES) | None = None  # synthetic, tokens
    features: Count(MAX_FEATURES) | None = None  # synthetic
    classes: Count(MAX_FEATURES) | None = None  # synthetic
    seq_len: Count(MAX_SEQ_LEN) | None = None  # tokens: positions per sample
    vocab: Count(MAX_FEATURES, minimum=2) | None = None  # tokens: distinct tokens
    test_fraction: Real(gt=0, lt=1) | None = None  # synthetic, tokens: the share of samples held out as the test set
    options: dict[str, Any] = {}  # keyword arguments of a user's data function (not digits or synthetic)
    # How batches are drawn (simtrain/train/sampling.py): uniform | prioritized | mh.
    sampling: Literal["uniform", "prioritized", "mh"] = "uniform"
    # The share of the training split held out as a validation set (a seeded draw; train/data.py
    # hold_out_validation): pbt's val_* metrics read it; 0: train on the whole split.
    validation_fraction: Real(ge=0, lt=1) = 0.0
    alpha: Real(ge=0, le=100) = 0.6  # P(i) = p_i^alpha / sum_k p_k^alpha
    eps: Real(gt=0, le=1e6) = 0.01  # p_i = last loss + eps
    beta0: Real(ge=0, le=1) = 0.4  # importance-sampling exponent at step 0
    beta_end: Real(ge=0, le=1) = 1.0  # ... annealed linearly to this (0 with beta0 0: off)
    beta_steps: Steps | None = None  # steps over which beta reaches beta_end; None: train.steps
    mh: MHSpec = MHSpec()

    def loader_options(self) -> dict[str, Any]:
        """The keyword options the data loader of `name` takes."""
        if self.name in _DATA_FIELDS:
            fields = {key: getattr(self, key) for key in _DATA_FIELDS[self.name]}
            return {key: value for key, value in fields.items() if value is not None}
        return dict(self.options)

    @model_validator(mode="after")
    def _fields_of_this_data(self) -> "DataSpec":
        for key in dict.fromkeys(key for keys in _DATA_FIELDS.values() for key in keys):
            if getattr(self, key) is not None and key not in _DATA_FIELDS.get(self.name, ()):
                options = "; ".join(f"{name}: {', '.join(fields)}" for name, fields in _DATA_FIELDS.items())
                raise ValueError(f"data.{key}: not an option of {self.name} ({options})")
        return self


_DATA_FIELDS = {
    "synthetic": ("samples", "features", "classes", "test_fraction"),
    "tokens": ("samples", "seq_len", "vocab", "test_fraction"),
}


class OptimizerSpec(_Strict):
    """The optimizer (simtrain/train/optim.py) and, for kfac, its preconditioner (simtrain/train/kfac.py)."""

    name: Literal["sgd", "adam", "kfac"] = "sgd"
    lr: Real(gt=0, le=MAX_LEARNING_RATE) = 0.1  # learning rate
    momentum: Real(ge=0, lt=1) = 0.0  # sgd, kfac
    weight_decay: Real(ge=0, le=1e6) = 0.0  # L2 penalty added to the gradient (torch's)
    nesterov: Flag = False  # sgd; needs momentum > 0
    betas: tuple[Real(ge=0, lt=1), Real(ge=0, lt=1)] = (0.9, 0.999)  # adam
    eps: Real(gt=0, le=1) = 1e-8  # adam
    # kfac (simtrain/train/kfac.py): K-FAC preconditioning, then SGD with lr, momentum, weight_decay.
    damping: Real(ge=1e-12, le=1e6) = 1e-3  # Tikhonov lambda; below 1e-12 singular in fp32
    factor_decay: Real(ge=0, lt=1) = 0.95  # running average of the factors
    factor_update_steps: Steps = 1  # steps between factor updates
    inv_update_steps: Steps = 10  # steps between decompositions
    kl_clip: Real(ge=0, le=1e6) = 1e-3  # 0: no clipping
    method: Literal["eigen", "inverse"] = "eigen"
    distribute_inverses: Flag = True  # each factor decomposed on one device, then broadcast

    @model_validator(mode="after")
    def _fields_of_this_optimizer(self) -> "OptimizerSpec":
        # A field of another optimizer may only hold its default (as a resolved scenario writes it).
        allowed = _OPTIMIZER_FIELDS[self.name]
        for field in sorted(self.model_fields_set - allowed - {"name"}):
            if getattr(self, field) == type(self).model_fields[field].default:
                continue
            raise ValueError(f"train.optimizer.{field}: not an option of {self.name} "
                             f"(its options: {', '.join(sorted(allowed))})")
        if self.nesterov and self.momentum == 0:
            raise ValueError("train.optimizer.nesterov: needs a momentum above 0")
        return self


_OPTIMIZER_FIELDS = {
    "sgd": {"lr", "momentum", "weight_decay", "nesterov"},
    "adam": {"lr", "betas", "eps", "weight_decay"},
    "kfac": {"lr", "momentum", "weight_decay", "damping", "factor_decay", "factor_update_steps",
             "inv_update_steps", "kl_clip", "method", "distribute_inverses"},
}


class AmpSpec(_Strict):
    """fp16 dynamic loss scaling (simtrain/train/precision.py); defaults are torch.amp.GradScaler's."""

    init_scale: Real(ge=1, le=2.0**64) = 2.0 ** 16
    growth_factor: Real(gt=1, le=1e3) = 2.0
    backoff_factor: Real(gt=0, lt=1) = 0.5
    growth_interval: Steps = 2000


class CheckpointSegments(_Strict):
    segments: Count(MAX_LAYERS + 1)  # at most the model's blocks (train/checkpointing.py)


class TrainCheckpointSpec(_Strict):
    """Checkpoints a synchronous job restarts from after losing a device (train/job_checkpoint.py): every rank
    writes its training state every `every` steps, each write taking latency + bytes / bandwidth. `host`:
    each rank over its own link to host memory, concurrently (default: PCIe 4.0 x16, 31.5 GB/s per direction,
    as cluster.shared_memory.host_link); `storage`: one store whose `bandwidth` (to give) all ranks share."""

    every: Steps  # steps between checkpoints
    to: Literal["host", "storage"] = "host"
    bandwidth: Bandwidth = 31.5e9
    latency: Duration = 1e-6

    @model_validator(mode="after")
    def _storage_has_a_bandwidth(self) -> "TrainCheckpointSpec":
        if self.to == "storage" and "bandwidth" not in self.model_fields_set:
            raise ValueError("train.checkpoint.bandwidth: give the storage's bandwidth (all ranks share it)")
        return self


class TrainSpec(_Strict):
    steps: Steps = 200
    optimizer: OptimizerSpec = OptimizerSpec()
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"  # compute dtype; fp16/bf16 keep fp32 master weights
    amp: AmpSpec = AmpSpec()
    # Gradient checkpointing (simtrain/train/checkpointing.py): none | sqrt | full | {segments: k}.
    checkpointing: Union[Literal["none", "sqrt", "full"], CheckpointSegments] = "none"
    target_loss: Real() | None = None  # report time_to_target_s (report.py: smoothed_loss_curve)
    # Hyperparameters by step, applied live before that step (train/hyperparameters.py):
    # [{step: 0, train.optimizer.lr: 0.1}, {step: 200, train.optimizer.lr: 0.02}]; steps ascending.
    schedule: Annotated[list[dict[str, Number]], Field(max_length=MAX_SCHEDULE_ENTRIES)] = []
    checkpoint: TrainCheckpointSpec | None = None  # None: no checkpoints (a sync job that loses a device fails)


class AsyncSpec(_Strict):
    consistency: Literal["hogwild", "locked"] = "hogwild"
    staleness_lr: Literal["none", "inverse"] = "none"  # inverse: lr / (1 + staleness)


class PipelineSpec(_Strict):
    """How a pipeline runs (schemes/pipeline_schedule.py, schemes/model_parallel.py)."""

    schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    # the device batch is cut into this many (must divide it); under tp alone that is gradient accumulation;
    # None: 4 with a pipeline (pp > 1), else 1 (ParallelSpec.microbatches). Data parallelism alone (pp = tp = 1)
    # takes the device batch whole.
    microbatches: Count(MAX_MICROBATCHES) | None = None
    virtual_stages: Count(MAX_LAYERS) = 1  # interleaved: model chunks per device
    # layers (splittable units) per model part, pp x virtual_stages counts; None: balanced by measured FLOPs
    split: Annotated[list[Count(MAX_LAYERS + 2)], Field(max_length=MAX_DEVICES)] | None = None

    @model_validator(mode="after")
    def _chunks_need_interleaving(self) -> "PipelineSpec":
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ValueError(f"parallel.pipeline.virtual_stages: {self.virtual_stages} chunks per device need "
                             "schedule interleaved")
        return self


class ParallelSpec(_Strict):
    model_config = ConfigDict(extra="forbid", frozen=True, serialize_by_alias=True)
    # sync: every step waits for the gradient all-reduce; async: asynchronous SGD on a shared store
    # (schemes/asynchronous.py). The scheme follows from the mode and the layout (simtrain/schemes/__init__.py).
    mode: Literal["sync", "async"] = "sync"
    # The all-reduce algorithm of the data-parallel gradient and of the tp all-reduces (simtrain/comm/):
    # naive | ring | tree (FireCaffe) | hierarchical (in-host reduce-scatter, cross-host all-reduce per
    # rail, in-host all-gather) | dbtree (NCCL's double binary tree)
    all_reduce: Literal["naive", "ring", "tree", "hierarchical", "dbtree"] = "ring"
    # all-reduce channels (buffer parts run side by side, each crossing hosts on its own rail);
    # None: the topology's default, one per NIC rail across hosts, else 1 (simtrain/comm/channels.py)
    channels: Count(MAX_CHANNELS) | None = None
    async_: AsyncSpec = Field(AsyncSpec(), alias="async")  # mode async (schemes/asynchronous.py)
    sync_batchnorm: Flag = False  # all-reduce BatchNorm batch statistics (simtrain/train/syncbn.py)
    # Data-parallel sync: all-reduce the gradient in DDP's buckets (reverse parameter order, bucket_cap_mb MiB
    # each, torch DDP's default 25), each as soon as the backward has completed it (train/grad_bucket.py);
    # false: one all-reduce of the whole gradient after the backward
    overlap: Flag = True
    bucket_cap_mb: Real(gt=0, le=1 << 20) = 25.0
    # The layout (schemes/layout.py): dp x pp x tp must equal the job's devices.
    dp: Count(MAX_DEVICES) | None = None  # data-parallel replicas; None: devices / (pp x tp)
    pp: Count(MAX_DEVICES) = 1  # pipeline stages
    tp: Count(MAX_DEVICES) = 1  # tensor-parallel ranks per stage (Megatron-LM's split of Linear pairs and heads)
    pipeline: PipelineSpec = PipelineSpec()
    # innermost first: the default puts a stage's tp ranks on adjacent devices, then the stages, then the replicas
    placement: tuple[Literal["tp", "pp", "dp"], Literal["tp", "pp", "dp"], Literal["tp", "pp", "dp"]] = (
        "tp", "pp", "dp")
    # Simulate one rank per pipeline stage (tp rank 0 of replica 0) and time its collectives with their
    # mirrors' at the collective level (schemes/representatives.py): numerics off, identical devices
    representatives: Flag = False

    @model_validator(mode="before")
    @classmethod
    def _no_scheme(cls, raw):
        """The old `parallel.scheme` mixed the all-reduce algorithm and the mode: one line naming the new keys."""
        if isinstance(raw, dict) and "scheme" in raw:
            raise ValueError("parallel.scheme: replaced by parallel.all_reduce (naive | ring | tree | hierarchical "
                             "| dbtree) and parallel.mode (sync | async); the scheme follows from them and the "
                             "layout")
        return raw

    @model_validator(mode="after")
    def _a_layout(self) -> "ParallelSpec":
        if sorted(self.placement) != ["dp", "pp", "tp"]:
            raise ValueError(f"parallel.placement: must order tp, pp and dp, each once, got {list(self.placement)}")
        if self.pipeline.schedule == "interleaved" and self.pp > 1 and self.microbatches % self.pp:
            raise ValueError(f"parallel.pipeline.microbatches: interleaved needs a multiple of pp {self.pp}, got "
                             f"{self.microbatches}")
        return self

    @property
    def microbatches(self) -> int:
        """Microbatches per device batch: as given, else 4 with a pipeline and 1 without."""
        if self.pipeline.microbatches is not None:
            return self.pipeline.microbatches
        return 4 if self.pp > 1 else 1

    @property
    def model_parallel(self) -> bool:
        """Whether the model itself is split (pipeline or tensor parallelism)."""
        return self.pp > 1 or self.tp > 1


# Hyperparameters that apply live, between two steps (train/hyperparameters.py sets them).
LIVE_HYPERPARAMETERS = ("train.optimizer.lr", "train.optimizer.momentum", "train.optimizer.weight_decay",
                        "train.optimizer.eps", "data.batch_size")


class MetricSpec(_Strict):
    # val_loss | val_accuracy: on data.validation_fraction of the training split (never the test set);
    # train_loss: over the whole training split. Evaluated at no simulated cost (evaluation.py).
    name: Literal["val_loss", "val_accuracy", "train_loss"] = "val_loss"
    mode: Literal["min", "max"] = "min"  # whether smaller or larger is better


class RangeSpec(_Strict):
    """A continuous hyperparameter's range: exactly one of uniform or log_uniform."""

    uniform: tuple[Real(), Real()] | None = None  # [low, high]
    log_uniform: tuple[Real(gt=0), Real(gt=0)] | None = None  # [low, high]; log(value) is uniform

    @model_validator(mode="after")
    def _one_range(self) -> "RangeSpec":
        given = [bounds for bounds in (self.uniform, self.log_uniform) if bounds is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of uniform: [low, high] or log_uniform: [low, high]")
        if not given[0][0] < given[0][1]:
            raise ValueError(f"low must be below high, got {list(given[0])}")
        return self


def _mutation(value):
    """A pbt.hyperparam_mutations entry: a RangeSpec, or a list of numbers (explore moves to a neighbour)."""
    if isinstance(value, dict):
        try:
            return RangeSpec.model_validate(value)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise ValueError((f"{where}: " if where else "") + first["msg"].removeprefix("Value error, ")) from None
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_SCHEDULE_ENTRIES:
        raise ValueError(f"give a range ({{uniform: [low, high]}} or {{log_uniform: [low, high]}}) or a list of "
                         f"1 to {MAX_SCHEDULE_ENTRIES} values")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (int, float)) or not math.isfinite(item):
            raise ValueError(f"expected numbers, got {item!r}")
    return value


class CheckpointStorageSpec(_Strict):
    """Storage that checkpoints go through instead of device-to-device copies: every member writes its state at
    every round, a recipient's ranks read the donor's; each access takes latency + bytes / bandwidth and
    accesses do not slow one another (an aggregate limit of the storage is not modelled)."""

    bandwidth: Bandwidth  # of one write or read
    latency: Duration = 0.0  # of one write or read


class PbtStopSpec(_Strict):
    metric: Real()  # stop every member once a member's metric reaches this (mode decides the side)


class PbtSpec(_Strict):
    """Population-based training (simtrain/studies/pbt.py); names and defaults are Ray Tune's
    PopulationBasedTraining's where it has them."""

    population: Count(MAX_DEVICES, minimum=2)  # members; each gets cluster.devices / population devices
    perturbation_interval: Steps = 60  # a member's steps between two exploit/explore rounds (Ray: 60)
    metric: MetricSpec = MetricSpec()
    quantile_fraction: Real(ge=0, le=0.5) = 0.25  # the bottom fraction copies the top fraction; 0: no exploit
    exploit: Literal["truncation", "binary_tournament"] = "truncation"
    resample_probability: Real(ge=0, le=1) = 0.25  # explore: resample instead of perturbing
    perturbation_factors: tuple[Real(gt=0, le=1e6), Real(gt=0, le=1e6)] = (1.2, 0.8)  # explore: multiply by one
    # path -> range or list of values; paths from LIVE_HYPERPARAMETERS (data.batch_size: a list)
    hyperparam_mutations: Annotated[dict[str, Annotated[Any, BeforeValidator(_mutation)]], Field(min_length=1)]
    synch: Flag = False  # true: rounds wait for every member; false: each member acts when it is ready (Ray)
    stop: PbtStopSpec | None = None  # None: every member trains train.steps
    checkpoint: CheckpointStorageSpec | None = None  # None: exploits copy device to device over the network


class ReportSpec(_Strict):
    trace: Flag = True  # write trace.json (Chrome trace event format)
    every: Steps = 10  # steps per point of report.json's periodic series (sampling)


class Scenario(_Strict):
    name: str = "scenario"
    seed: Count(MAX_SEED, minimum=0) = 0
    # false: the same job on meta tensors (shapes, bytes and FLOPs, no arithmetic); loss and accuracy are null
    numerics: Flag = True
    cluster: ClusterSpec = ClusterSpec()
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    train: TrainSpec = TrainSpec()
    parallel: ParallelSpec = ParallelSpec()
    report: ReportSpec = ReportSpec()
    pbt: PbtSpec | None = None  # a population of this scenario's job (simtrain/studies/pbt.py)
    # Folder that relative paths in the scenario (topology files) are read from.
    _base_dir: Path = PrivateAttr(default=Path("."))

    @property
    def base_dir(self) -> Path:
        return self._base_dir

    @model_validator(mode="before")
    @classmethod
    def _async_gets_a_store(cls, raw):
        """parallel.mode async without cluster.shared_memory: the default store (host DRAM)."""
        if not isinstance(raw, dict):
            return raw
        parallel, cluster = raw.get("parallel"), raw.get("cluster", {})
        if (isinstance(parallel, dict) and parallel.get("mode") == "async" and isinstance(cluster, dict)
                and cluster.get("shared_memory") is None):
            raw = {**raw, "cluster": {**cluster, "shared_memory": {}}}
        return raw

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        """The default output folder is runs/<name>/: a name any file system takes."""
        if not value or "/" in value or value.startswith(".") or any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise ValueError("must be a plain name (no '/', no control characters or NUL, not empty, not starting "
                             "with '.')")
        if len(value.encode("utf-8", errors="replace")) > MAX_NAME_BYTES:
            raise ValueError(f"longer than {MAX_NAME_BYTES} bytes")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate, from a YAML escape
            raise ValueError("not encodable as UTF-8") from None
        return value

    @model_validator(mode="after")
    def _techniques_fit_together(self) -> "Scenario":
        """Combinations no scheme implements: one-line errors naming the field, before anything runs."""
        precision, optimizer = self.train.precision, self.train.optimizer.name
        if self.parallel.mode == "async":
            if precision != "fp32":  # the shared fp32 parameters have no master copy
                raise ValueError(f"train.precision: {precision} runs with the synchronous schemes (parallel.mode "
                                 "sync), not with async")
            if optimizer == "kfac":
                raise ValueError("train.optimizer.name: kfac needs a synchronous scheme (parallel.mode sync)")
            if self.parallel.sync_batchnorm:
                raise ValueError("parallel.sync_batchnorm: needs a synchronous scheme (parallel.mode sync)")
        if not self.numerics and self.data.sampling != "uniform":
            raise ValueError(f"data.sampling: {self.data.sampling} needs numerics (its priorities are the "
                             "samples' losses); use uniform with numerics false")
        if optimizer == "kfac" and precision == "fp16":
            raise ValueError("train.optimizer.name: kfac does not run under fp16 loss scaling "
                             "(train.precision fp32 or bf16)")
        if self.parallel.sync_batchnorm and precision != "fp32":
            raise ValueError("parallel.sync_batchnorm: needs train.precision fp32")
        builtin_batchnorm = self.model.batchnorm and self.model.name in ("mlp", "cnn")
        if self.model.batchnorm and self.model.name == "gpt":
            raise ValueError("model.batchnorm: a gpt normalizes with LayerNorm; batchnorm is for mlp and cnn")
        if builtin_batchnorm and self.data.batch_size == 1:  # torch's BatchNorm raises on one sample
            raise ValueError("data.batch_size: model.batchnorm needs at least 2 samples per device (BatchNorm "
                             "normalizes over the batch; with parallel.sync_batchnorm too, as torch computes)")
        for section, spec, builtins in (("model", self.model, ("mlp", "cnn", "gpt")),
                                        ("data", self.data, ("digits", "synthetic", "tokens"))):
            if spec.name in builtins and spec.options:
                raise ValueError(f"{section}.options: the built-in {section} {spec.name} takes none (options are "
                                 "the keyword arguments of a package.module:function)")
        if self.parallel.model_parallel:
            self._model_parallel_fits()
        if self.parallel.representatives:
            self._representatives_fit()
        if self.parallel.sync_batchnorm and self.train.checkpointing != "none":
            # SyncBN's exchanging forward runs the layers itself, outside any checkpointed segment
            raise ValueError("parallel.sync_batchnorm: does not combine with train.checkpointing")
        return self

    @model_validator(mode="after")
    def _faults_fit(self) -> "Scenario":
        """Faults, spares and checkpoints where recovery.py handles them: one-line errors naming the field."""
        cluster, checkpoint = self.cluster, self.train.checkpoint
        device_faults = any(fault.device is not None for fault in cluster.faults) or (
            cluster.random_faults is not None and cluster.random_faults.device_mtbf is not None)
        if self.pbt is not None:
            for field, used in (("cluster.faults", cluster.faults), ("cluster.random_faults", cluster.random_faults),
                                ("cluster.spares", cluster.spares), ("train.checkpoint", checkpoint)):
                if used:
                    raise ValueError(f"{field}: not with a population (pbt); its members share the cluster")
        if cluster.devices is not None and cluster.spares >= cluster.devices:
            raise ValueError(f"cluster.spares: {cluster.spares} leaves no device for the job "
                             f"(cluster.devices {cluster.devices} counts the spares)")
        if self.parallel.model_parallel:
            for field, used in (("cluster.faults", device_faults), ("cluster.random_faults", device_faults),
                                ("train.checkpoint", checkpoint is not None)):
                if used:
                    raise ValueError(f"{field}: lost devices and checkpoints run with data parallelism only, not "
                                     "with parallel.pp or parallel.tp > 1 (link faults do)")
        if checkpoint is None:
            return self
        if self.parallel.mode == "async":
            raise ValueError("train.checkpoint: for synchronous schemes; async goes on without a lost worker")
        if self.train.optimizer.name == "kfac":
            raise ValueError("train.checkpoint: K-FAC's factors are not part of the training state; use sgd or adam")
        if self.data.sampling != "uniform":
            raise ValueError(f"train.checkpoint: {self.data.sampling} sampling's priorities are not part of the "
                             "training state; use uniform")
        return self

    def _representatives_fit(self) -> None:
        """Where every replica and every tp rank of a stage do the same at the same times."""
        cluster = self.cluster
        for refuse, why in ((not self.parallel.model_parallel, "needs parallel.pp or parallel.tp > 1"),
                            (self.numerics, "needs numerics false (the mirrored ranks compute nothing)"),
                            (cluster.overrides, "needs identical devices (no cluster.overrides)"),
                            (cluster.compute_jitter > 0, "needs identical devices (no cluster.compute_jitter)"),
                            (cluster.faults or cluster.random_faults, "does not run with faults")):
            if refuse:
                raise ValueError(f"parallel.representatives: {why}")

    def _model_parallel_fits(self) -> None:
        """What pipeline and tensor parallelism (schemes/model_parallel.py) do not combine with."""
        field = "parallel.pp" if self.parallel.pp > 1 else "parallel.tp"
        refused = {
            "parallel.mode": (self.parallel.mode == "async", "async"),
            "train.optimizer.name": (self.train.optimizer.name == "kfac", "kfac"),
            "parallel.sync_batchnorm": (self.parallel.sync_batchnorm, "sync_batchnorm"),
            "data.sampling": (self.data.sampling != "uniform", f"{self.data.sampling} sampling"),
        }
        for name, (refuse, what) in refused.items():
            if refuse:
                raise ValueError(f"{name}: {what} does not combine with {field} > 1")
        if self.parallel.tp > 1 and self.train.checkpointing not in ("none", "full"):
            raise ValueError("train.checkpointing: with parallel.tp > 1 only full (each chunk recomputed with its "
                             "all-reduces) or none")
        if self.data.batch_size % self.parallel.microbatches:
            raise ValueError(f"parallel.pipeline.microbatches: {self.parallel.microbatches} does not "
                             f"divide data.batch_size {self.data.batch_size}")

    @model_validator(mode="after")
    def _hyperparameters_apply_live(self) -> "Scenario":
        """train.schedule and pbt name live hyperparameters with values their fields accept."""
        previous = -1
        for index, entry in enumerate(self.train.schedule):
            field = f"train.schedule.{index}"
            step = entry.get("step")
            if not isinstance(step, int) or not 0 <= step <= MAX_STEPS:
                raise ValueError(f"{field}.step: give the step (0 to {MAX_STEPS}) the values apply from")
            if step <= previous:
                raise ValueError(f"{field}.step: steps must be ascending, got {step} after {previous}")
            previous = step
            values = {path: value for path, value in entry.items() if path != "step"}
            if not values:
                raise ValueError(f"{field}: give at least one hyperparameter besides step")
            self._check_live(values, field)
        if self.pbt is None:
            return self
        if self.train.schedule:
            raise ValueError("train.schedule: a population makes its own schedules (drop it, or the pbt section)")
        if not self.numerics:
            raise ValueError("pbt: needs numerics (members are compared on a metric of their models)")
        if self.pbt.metric.name.startswith("val_") and self.data.validation_fraction == 0:
            raise ValueError(f"pbt.metric.name: {self.pbt.metric.name} needs data.validation_fraction above 0 "
                             "(the held-out part of the training split)")
        for path, mutation in self.pbt.hyperparam_mutations.items():
            field = f"pbt.hyperparam_mutations.{path}"
            if path == "data.batch_size" and not isinstance(mutation, list):
                raise ValueError(f"{field}: give a list of batch sizes")
            bounds = mutation if isinstance(mutation, list) else (mutation.uniform or mutation.log_uniform)
            for value in bounds:
                self._check_live({path: value}, field)
        return self

    def _check_live(self, values: dict, field: str) -> None:
        for path in values:
            if path not in LIVE_HYPERPARAMETERS:
                raise ValueError(f"{field}: {path} is not a hyperparameter that applies live (one of: "
                                 f"{', '.join(LIVE_HYPERPARAMETERS)})")
        if self.train.optimizer.name == "kfac":
            raise ValueError(f"{field}: live hyperparameters need sgd or adam (K-FAC's factors are not copied)")
        if "data.batch_size" in values and self.data.sampling != "uniform":
            raise ValueError(f"{field}: data.batch_size changes need data.sampling uniform")
        try:
            self.with_hyperparameters(values)
        except ScenarioError as error:
            raise ValueError(f"{field}: {str(error).removeprefix('scenario: ')}") from None

    def with_hyperparameters(self, values: dict) -> "Scenario":
        """This scenario with live hyperparameters set ({"train.optimizer.lr": 0.1}), without schedule or
        population; a value its field refuses is a ScenarioError naming the field."""
        raw = self.model_dump(mode="json", by_alias=True)
        raw["train"]["schedule"], raw["pbt"] = [], None
        for path, value in values.items():
            node = raw
            *parents, leaf = path.split(".")
            for part in parents:
                node = node[part]
            node[leaf] = value
        return validate_scenario(raw, base_dir=self.base_dir)

    def to_yaml(self) -> str:
        """The scenario with every default filled in, as YAML (SI units)."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def load_scenario(path, overrides: list[str] | tuple[str, ...] = ()) -> Scenario:
    """Read, override and validate a scenario file."""
    path = user_path(path, "scenario file", ScenarioError)
    raw = load_yaml_file(path, str(path), ScenarioError)
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
    value = parse_yaml_text(text, f"--set {key}", ScenarioError)
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
        field = one_line(".".join(str(part) for part in first["loc"]))
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = "unknown field"
        elif first["type"] == "literal_error":
            message = f"{message}, got {first['input']!r}"
        # A check across fields names its field at the start of its message.
        named = not field or message.startswith(field + ".")
        raise ScenarioError(f"{source}: {message}" if named else f"{source}: {field}: {message}") from None
