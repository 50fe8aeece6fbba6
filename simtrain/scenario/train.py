"""The scenario's `train` section: steps, optimizer, precision, checkpointing, schedules, checkpoints.

    train:
      steps: 200
      optimizer: {name: sgd, lr: 0.1, momentum: 0.9}
      precision: bf16
      schedule: [{step: 0, train.optimizer.lr: 0.1}, {step: 100, train.optimizer.lr: 0.01}]
"""
from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from ..limits import MAX_LAYERS, MAX_LEARNING_RATE, MAX_SCHEDULE_ENTRIES
from .fields import Bandwidth, Count, Duration, Flag, Number, Real, Section, Steps

# Hyperparameters that apply live, between two steps (train/hyperparameters.py sets them).
LIVE_HYPERPARAMETERS = ("train.optimizer.lr", "train.optimizer.momentum", "train.optimizer.weight_decay",
                        "train.optimizer.eps", "data.batch_size")


class OptimizerSpec(Section):
    """The optimizer (simtrain/train/optim.py) and, for kfac, its preconditioner (simtrain/train/kfac.py)."""

    name: Literal["sgd", "adam", "kfac"] = Field("sgd", description="sgd | adam | kfac (K-FAC preconditioning, "
                                                                   "then SGD with lr, momentum, weight_decay).")
    lr: Real(gt=0, le=MAX_LEARNING_RATE) = Field(0.1, description="Learning rate.")
    momentum: Real(ge=0, lt=1) = Field(0.0, description="sgd, kfac: momentum.")
    weight_decay: Real(ge=0, le=1e6) = Field(0.0, description="L2 penalty added to the gradient (torch's).")
    nesterov: Flag = Field(False, description="sgd: Nesterov momentum; needs momentum above 0.")
    betas: tuple[Real(ge=0, lt=1), Real(ge=0, lt=1)] = Field((0.9, 0.999), description="adam: the running "
                                                                                       "averages' coefficients.")
    eps: Real(gt=0, le=1) = Field(1e-8, description="adam: term added to the denominator.")
    damping: Real(ge=1e-12, le=1e6) = Field(1e-3, description="kfac: Tikhonov damping lambda (below 1e-12 "
                                                              "singular in fp32).")
    factor_decay: Real(ge=0, lt=1) = Field(0.95, description="kfac: running average of the factors.")
    factor_update_steps: Steps = Field(1, description="kfac: steps between factor updates.")
    inv_update_steps: Steps = Field(10, description="kfac: steps between decompositions.")
    kl_clip: Real(ge=0, le=1e6) = Field(1e-3, description="kfac: KL clipping of the update; 0: none.")
    method: Literal["eigen", "inverse"] = Field("eigen", description="kfac: how factors are decomposed.")
    distribute_inverses: Flag = Field(True, description="kfac: each factor decomposed on one device, then "
                                                        "broadcast; false: every device decomposes every factor.")

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


class AmpSpec(Section):
    """fp16 dynamic loss scaling (simtrain/train/precision.py); defaults are torch.amp.GradScaler's."""

    init_scale: Real(ge=1, le=2.0**64) = Field(2.0 ** 16, description="The loss scale at step 0.")
    growth_factor: Real(gt=1, le=1e3) = Field(2.0, description="The scale is multiplied by this after "
                                                               "growth_interval steps without overflow.")
    backoff_factor: Real(gt=0, lt=1) = Field(0.5, description="The scale is multiplied by this at an overflow "
                                                              "(the step is skipped).")
    growth_interval: Steps = Field(2000, description="Steps without overflow before the scale grows.")


class CheckpointSegments(Section):
    """Gradient checkpointing in k segments."""

    segments: Count(MAX_LAYERS + 1) = Field(description="Segments, at most the model's blocks "
                                                        "(train/checkpointing.py).")


class TrainCheckpointSpec(Section):
    """Checkpoints a synchronous job restarts from after losing a device (train/job_checkpoint.py): every rank
    writes its training state every `every` steps, each write taking latency + bytes / bandwidth. `host`:
    each rank over its own link to host memory, concurrently (default: PCIe 4.0 x16, 31.5 GB/s per direction,
    as cluster.shared_memory.host_link); `storage`: one store whose `bandwidth` (to give) all ranks share."""

    every: Steps = Field(description="Steps between checkpoints.")
    to: Literal["host", "storage"] = Field("host", description="host: each rank over its own link to host "
                                                               "memory; storage: one store all ranks share.")
    bandwidth: Bandwidth = Field(31.5e9, description="Bandwidth of a write: a rank's host link, or the storage's "
                                                     "(to give with storage) (bytes/s).")
    latency: Duration = Field(1e-6, description="Latency of a write or read (s).")

    @model_validator(mode="after")
    def _storage_has_a_bandwidth(self) -> "TrainCheckpointSpec":
        if self.to == "storage" and "bandwidth" not in self.model_fields_set:
            raise ValueError("train.checkpoint.bandwidth: give the storage's bandwidth (all ranks share it)")
        return self


class TrainSpec(Section):
    """The training recipe."""

    steps: Steps = Field(200, description="Training steps (updates across workers under async).")
    optimizer: OptimizerSpec = Field(OptimizerSpec(), description="The optimizer.")
    precision: Literal["fp32", "fp16", "bf16", "fp8"] = Field(
        "fp32", description="Compute dtype; fp16 and bf16 keep fp32 master weights (fp16 with loss scaling); fp8: "
                            "bf16 with every Linear's matrix multiplies in float8, scaled per tensor (torchao's "
                            "tensorwise recipe, train/fp8.py), on a device with an fp8 rate.")
    amp: AmpSpec = Field(AmpSpec(), description="fp16's dynamic loss scaling.")
    checkpointing: Union[Literal["none", "sqrt", "full", "selective"], CheckpointSegments] = Field(
        "none", description="Gradient checkpointing (simtrain/train/checkpointing.py): none | sqrt | full (every "
                            "layer recomputed, one at a time) | selective (only the attention core recomputed: "
                            "models with attention) | {segments: k}.")
    target_loss: Real() | None = Field(None, description="Report time_to_target_s, when the smoothed "
                                                         "training-set loss first reaches this.")
    schedule: Annotated[list[dict[str, Number]], Field(max_length=MAX_SCHEDULE_ENTRIES)] = Field(
        [], description="Hyperparameters by step, applied live before that step (train/hyperparameters.py): "
                        "[{step: 0, train.optimizer.lr: 0.1}, {step: 200, train.optimizer.lr: 0.02}]; steps "
                        "ascending.")
    checkpoint: TrainCheckpointSpec | None = Field(None, description="Checkpoints to restart from; null: none (a "
                                                                     "sync job that loses a device fails).")
