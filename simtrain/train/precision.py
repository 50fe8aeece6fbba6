"""Numeric precision of a replica: fp32, or mixed fp16/bf16 (or fp8) with fp32 master weights.

Mixed precision as in Micikevicius et al., "Mixed Precision Training" (ICLR
2018): the model the replica runs forward and backward on holds fp16 (or bf16)
weights, so its activations and gradients are in that dtype; an fp32 master
copy of every parameter is what the optimizer updates, and after each update
the master is rounded back into the model. With fp16 the loss is multiplied by
a dynamic loss scale before backward, so small gradients do not flush to zero.

    precision = MixedPrecision(model, "fp16", scenario.train.amp)   # casts model to fp16
    loss = cross_entropy(model(precision.cast_input(x)), y)
    precision.backward(loss)                                  # (loss * scale).backward()
    ... all-reduce the fp16 gradient bucket ...
    if precision.unscale(grad_bucket):                        # fp32 master grads, inf check, scale update
        optimizer.step()                                      # on precision.master_params
        precision.copy_master_to_model()

`unscale` is `settle(find_overflow(grad_bucket))`: where several ranks each
hold a share of one model (pipeline and tensor parallelism), each finds its
own overflow, they vote, and each settles the vote, so that they all skip the
same steps and keep the same loss scale (schemes/model_parallel.py).

fp8 is bf16 mixed precision whose nn.Linear layers compute their matrix
multiplies in float8 (train/fp8.py, torchao's tensorwise recipe): the model
holds bf16 weights, its Linears' GEMMs are charged at the device's fp8 rate
(their casts as memory-bound kernels; the rest of its compute, attention
included, at the bf16 rate: op_cost.py's rate dtype), and `finish` turns the
Linears back into plain ones.

Only the loss is computed in fp32 (the logits are upcast before
cross-entropy), as torch.autocast does for cross_entropy / log_softmax: the
CPU kernels of torch 2.13 for Linear, Conv2d, ReLU and max-pool run natively
in fp16 and bf16, so everything else stays in the low dtype.

`LossScaler` follows torch.amp.GradScaler's rules step for step: gradients
are unscaled by multiplying with the fp32 reciprocal of the scale (computed in
double, as GradScaler does); a step whose unscaled gradients hold an inf or
NaN is skipped and the scale is multiplied by `backoff_factor`; after
`growth_interval` consecutive clean steps it is multiplied by `growth_factor`
(only if the result is finite). bf16 has fp32's exponent range and needs no
loss scale; fp32 has none either. Every precision counts the steps whose
averaged gradient held an inf or NaN (`overflow_steps`); only fp16 skips them
(`skipped_steps`), the others apply them as plain torch would.

What a replica keeps on its device between steps (its memory ledger, bytes by
category):

- `weights`: the model's parameters in the compute dtype;
- `master_weights`: under mixed precision only, the fp32 master copy;
- `gradients`: the flat gradient bucket in the compute dtype (what the
  all-reduce moves), plus under mixed precision the fp32 master gradients the
  bucket is unscaled into;
- `optimizer_state`: momentum / Adam moments, fp32, one per master parameter.

`update_bytes` is the HBM traffic of one update, charged as memory-bound work:
the optimizer's own on the fp32 master (`simtrain.train.optim`) plus, under
mixed precision, unscaling the bucket into the master gradients (the inf/NaN
check fused into that pass, as in torch's
`_amp_foreach_non_finite_check_and_unscale_`) and rounding the master weights
back into the model. Parameters may be meta tensors.

    held = persistent_bytes(model.parameters(), "fp16", OptimizerSpec(name="adam", lr=1e-3))
"""
from __future__ import annotations

from typing import Iterable

import math

import torch
from pydantic import Field
from torch import nn

from ..report.sections import ReportSection, register_section
from ..scenario import AmpSpec, OptimizerSpec
from .fp8 import convert_to_float8_, restore_linears_
from .grad_bucket import flat_grad_buffer
from .optim import optimizer_state_bytes, optimizer_step_bytes

# The dtype each precision keeps its model in (fp8: bf16 weights, float8 GEMM inputs).
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}
_FP32_BYTES = 4


class LossScaler:
    """Dynamic loss scale with torch.amp.GradScaler's update rule, on fp32 gradients."""

    def __init__(self, init_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int):
        self.scale = torch.tensor(init_scale, dtype=torch.float32)  # fp32, as GradScaler keeps it
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps = 0  # GradScaler's growth tracker

    def unscale_(self, grads: torch.Tensor) -> bool:
        """Divide fp32 `grads` by the scale in place; True iff they hold an inf or NaN."""
        inverse = self.scale.double().reciprocal().float()
        grads.mul_(inverse)
        return _non_finite(grads)

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow; grow after growth_interval clean steps in a row."""
        if found_inf:
            self.scale = self.scale * self.backoff_factor
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            grown = self.scale * self.growth_factor
            if torch.isfinite(grown):
                self.scale = grown
            self.clean_steps = 0


class MixedPrecision:
    """One replica's precision: its compute dtype, fp32 master weights and loss scaler.

    Constructing it casts `model` to the compute dtype in place; the master
    copy starts from the fp32 weights the model had (not from their rounding).
    With fp32 the master parameters are the model's own and nothing is copied.
    """

    def __init__(self, model: nn.Module, name: str, amp: AmpSpec = AmpSpec()):
        self.name = name
        self.dtype = DTYPES[name]
        params = [p for p in model.parameters() if p.requires_grad]
        self.mixed = name != "fp32"
        if self.mixed:
            self.master_params = [p.detach().clone().float().requires_grad_() for p in params]
            self.master_grads = flat_grad_buffer(self.master_params)
            model.to(self.dtype)
            if name == "fp8":
                convert_to_float8_(model)
        else:
            self.master_params = params
        self.model_params = params
        self.scaler = LossScaler(**amp.model_dump()) if name == "fp16" else None
        self.overflow_steps = 0
        self.skipped_steps = 0

    def cast_input(self, x: torch.Tensor) -> torch.Tensor:
        """A floating-point batch in the compute dtype (integer inputs, e.g. token ids, as they are)."""
        return x.to(self.dtype) if x.dtype is not self.dtype and x.is_floating_point() else x

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the (scaled) loss into the model's gradients."""
        if self.scaler is not None:
            loss = loss * self.scaler.scale
        loss.backward()

    def loss_weight(self, fraction: float):
        """What a loss is multiplied by before backward: `fraction` (its share of the batch), times the
        loss scale under fp16 (then a 0-dim fp32 tensor)."""
        return fraction if self.scaler is None else fraction * self.scaler.scale

    def unscale(self, grad_bucket: torch.Tensor) -> bool:
        """Bring the averaged gradient to the fp32 master; True iff the optimizer should step."""
        return self.settle(self.find_overflow(grad_bucket))

    def find_overflow(self, grad_bucket: torch.Tensor) -> bool:
        """Bring the averaged gradient to the fp32 master, unscaled; True iff it holds an inf or NaN."""
        if not self.mixed:
            return _non_finite(grad_bucket)
        if self.master_grads is not grad_bucket:  # fp32 main gradients are the masters' own (train/replica.py)
            self.master_grads.copy_(grad_bucket)
        return self.scaler.unscale_(self.master_grads) if self.scaler else _non_finite(self.master_grads)

    def settle(self, found_inf: bool) -> bool:
        """Count an overflow and update the loss scale from `found_inf` (this replica's, or the vote of the
        ranks sharing its model); True iff the optimizer should step."""
        self.overflow_steps += found_inf
        if self.scaler is None:
            return True
        self.scaler.update(found_inf)
        self.skipped_steps += found_inf
        return not found_inf

    def copy_master_to_model(self) -> None:
        """Round the updated fp32 master weights into the model (no-op in fp32, without entering no_grad: it runs
        every step)."""
        if self.mixed:
            with torch.no_grad():
                for param, master in zip(self.model_params, self.master_params):
                    param.copy_(master)

    @torch.no_grad()
    def finish(self, model: nn.Module) -> None:
        """Turn the model back into fp32 holding the master weights: the trained model, as saved."""
        if self.mixed:
            restore_linears_(model)
            model.float()
            for param, master in zip(self.model_params, self.master_params):
                param.copy_(master)

    def report(self) -> dict:
        """report.json's `amp` section."""
        return {
            "precision": self.name,
            "loss_scale_final": float(self.scaler.scale) if self.scaler else None,
            "skipped_steps": self.skipped_steps,
            "overflow_steps": self.overflow_steps,
        }


def _non_finite(tensor: torch.Tensor) -> bool:
    """True iff `tensor` holds an inf or NaN; meta tensors (no numbers) never do.

    Any inf or NaN makes the sum inf or NaN, so a finite sum (one cheap
    reduction) settles the common case; only a non-finite sum, which finite
    elements can also give by overflowing, needs the element-wise check.
    """
    if tensor.is_meta or math.isfinite(tensor.sum().item()):
        return False
    return not bool(torch.isfinite(tensor).all())


def persistent_bytes(params: Iterable[torch.Tensor], precision: str, optimizer: OptimizerSpec,
                     main_grads: bool = False) -> dict[str, int]:
    """Bytes held for the whole run by category; parameters in fp32 or already in the compute dtype. With
    `main_grads` (train/replica.py) the gradient is the fp32 bucket alone, the masters' own."""
    weights, master = _sizes(params, precision)
    held = {"weights": weights}
    if precision != "fp32":
        held["master_weights"] = master
    held["gradients"] = master if main_grads else weights + (master if precision != "fp32" else 0)
    held["optimizer_state"] = optimizer_state_bytes(optimizer, master)
    return held


def update_bytes(params: Iterable[torch.Tensor], precision: str, optimizer: OptimizerSpec,
                 main_grads: bool = False) -> int:
    """HBM bytes read plus written by one update (optimizer step and mixed-precision copies)."""
    weights, master = _sizes(params, precision)
    touched = optimizer_step_bytes(optimizer, master)
    if precision != "fp32":
        bucket = master if main_grads else weights  # the averaged bucket's bytes
        touched += (bucket + master) + (master + weights)  # unscale into master grads (in place); round back
    return touched


def _sizes(params: Iterable[torch.Tensor], precision: str) -> tuple[int, int]:
    """(bytes of the parameters in the compute dtype, bytes of their fp32 master copy)."""
    element = torch.empty((), dtype=DTYPES[precision]).element_size()
    numel = sum(p.numel() for p in params if p.requires_grad)
    return numel * element, numel * _FP32_BYTES


class AmpSection(ReportSection):
    precision: str = Field(description="the compute dtype: fp32, fp16, bf16 or fp8")
    loss_scale_final: float | None = Field(description="the fp16 loss scale at the end; null: no loss scaling")
    skipped_steps: int = Field(description="optimizer steps skipped because a gradient overflowed")
    overflow_steps: int = Field(description="steps on which a gradient held an inf or NaN")


register_section("amp", AmpSection, "mixed precision: the compute dtype and what loss scaling did "
                                    "(train/precision.py)")
