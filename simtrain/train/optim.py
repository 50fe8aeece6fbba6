"""Optimizers a replica steps with, and what their state and step cost in memory.

`build_optimizer(params, spec)` builds the torch optimizer a scenario's
`train.optimizer` (scenario.OptimizerSpec, the one home of its defaults and
checks) names:

- `sgd`: torch.optim.SGD with lr, momentum, weight_decay, nesterov.
- `adam`: torch.optim.Adam with lr, betas, eps, weight_decay.
- `kfac`: the base optimizer of K-FAC: SGD with lr, momentum and weight_decay
  (the K-FAC fields, damping etc., are the preconditioner's:
  simtrain/train/kfac.py); its state is SGD's.

Every optimizer runs with `foreach=False`, the plain per-parameter loop, so a
replica's arithmetic is bit-for-bit that of a single-process run with the same
settings.

The memory side, for the device's ledger and cost model, given the bytes of the
parameters the optimizer owns:

- `optimizer_state_bytes`: persistent state. SGD keeps one momentum buffer per
  parameter iff momentum != 0; Adam keeps exp_avg and exp_avg_sq. Adam's step
  counters (one 4-byte scalar per parameter tensor) are not counted.
- `optimizer_step_bytes`: HBM traffic of one step, charged as memory-bound
  work: parameters read and written, gradients read, and every state buffer
  read and written, i.e. 3 * param_bytes + 2 * state_bytes.

    opt = build_optimizer(model.parameters(), OptimizerSpec(name="sgd", lr=0.1, momentum=0.9))
"""
from __future__ import annotations

from typing import Iterable

import torch

from ..scenario import OptimizerSpec


def build_optimizer(params: Iterable, spec: OptimizerSpec) -> torch.optim.Optimizer:
    """The torch optimizer `spec` names, over `params`."""
    if spec.name == "adam":
        return torch.optim.Adam(params, foreach=False, lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps,
                                weight_decay=spec.weight_decay)
    nesterov = spec.nesterov if spec.name == "sgd" else False
    return torch.optim.SGD(params, foreach=False, lr=spec.lr, momentum=spec.momentum,
                           weight_decay=spec.weight_decay, nesterov=nesterov)


def optimizer_state_bytes(spec: OptimizerSpec, param_bytes: int) -> int:
    """Bytes of persistent optimizer state for parameters of `param_bytes` bytes."""
    if spec.name == "adam":
        return 2 * param_bytes
    return param_bytes if spec.momentum != 0 else 0


def optimizer_step_bytes(spec: OptimizerSpec, param_bytes: int) -> int:
    """Bytes read plus written by one optimizer step (params r+w, grads r, state r+w)."""
    return 3 * param_bytes + 2 * optimizer_state_bytes(spec, param_bytes)
