"""What a replica keeps on its device between steps, and what its update step touches.

The device's memory ledger holds, for the whole run (bytes by category):

- `weights`: the model's parameters in the compute dtype (the fp16/bf16 copy
  under mixed precision);
- `master_weights`: under mixed precision only, the fp32 master copy the
  optimizer updates (Micikevicius et al. 2018);
- `gradients`: the flat gradient bucket, in the compute dtype (what the
  all-reduce moves), plus under mixed precision the fp32 master gradients the
  bucket is unscaled into;
- `optimizer_state`: momentum / Adam moments, fp32, one per master parameter
  (`simtrain.train.optim.optimizer_state_bytes`).

Activations and communication staging buffers come and go within a step;
`simtrain.cost` and the collective interpreter account for those.

`update_bytes` is the HBM traffic of one update, charged as memory-bound work:
the optimizer's own (parameters read and written, gradients read, state read
and written, on the fp32 master) plus, under mixed precision, unscaling the
bucket into the master gradients (bucket read, master gradients written; the
inf/NaN check is fused into that pass, as in torch's
`_amp_foreach_non_finite_check_and_unscale_`) and rounding the master weights
back into the model (master read, weights written).

    held = persistent_bytes(model.parameters(), "fp16", "adam", {"lr": 1e-3})
    held["master_weights"], update_bytes(model.parameters(), "fp16", "adam", {"lr": 1e-3})

Parameters may be meta tensors: only their shapes and dtypes are read.
"""
from __future__ import annotations

from typing import Iterable

import torch

from .optim import optimizer_state_bytes, optimizer_step_bytes
from .precision import DTYPES

_FP32_BYTES = 4


def persistent_bytes(params: Iterable[torch.Tensor], precision: str, optimizer: str, options: dict) -> dict[str, int]:
    """Bytes held for the whole run by category; parameters in fp32 or already in the compute dtype."""
    weights, master = _sizes(params, precision)
    held = {"weights": weights}
    if precision != "fp32":
        held["master_weights"] = master
    held["gradients"] = weights + (master if precision != "fp32" else 0)
    held["optimizer_state"] = optimizer_state_bytes(optimizer, options, master)
    return held


def update_bytes(params: Iterable[torch.Tensor], precision: str, optimizer: str, options: dict) -> int:
    """HBM bytes read plus written by one update (optimizer step and mixed-precision copies)."""
    weights, master = _sizes(params, precision)
    touched = optimizer_step_bytes(optimizer, options, master)
    if precision != "fp32":
        touched += (weights + master) + (master + weights)  # unscale into master grads; round back
    return touched


def _sizes(params: Iterable[torch.Tensor], precision: str) -> tuple[int, int]:
    """(bytes of the parameters in the compute dtype, bytes of their fp32 master copy)."""
    element = torch.empty((), dtype=DTYPES[precision]).element_size()
    numel = sum(p.numel() for p in params if p.requires_grad)
    return numel * element, numel * _FP32_BYTES
