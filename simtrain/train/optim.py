"""Optimizers a replica steps with, and what their state and step cost in memory.

`build_optimizer(params, name, options)` builds a torch optimizer:

- `sgd`: lr (default 0.001), momentum (0), weight_decay (0), nesterov (false).
- `adam`: lr (0.001), betas ([0.9, 0.999]), eps (1e-8), weight_decay (0).
- `kfac`: the base optimizer of K-FAC: SGD with lr, momentum and weight_decay
  (the K-FAC options, damping etc., are the preconditioner's:
  simtrain/train/kfac.py); its state is SGD's.

Defaults are torch's own. Every optimizer runs with `foreach=False`, the plain
per-parameter loop, so a replica's arithmetic is bit-for-bit that of a
single-process run with the same settings.

The memory side, for the device's ledger and cost model, given the bytes of the
parameters the optimizer owns:

- `optimizer_state_bytes`: persistent state. SGD keeps one momentum buffer per
  parameter iff momentum != 0; Adam keeps exp_avg and exp_avg_sq. Adam's step
  counters (one 4-byte scalar per parameter tensor) are not counted.
- `optimizer_step_bytes`: HBM traffic of one step, charged as memory-bound
  work: parameters read and written, gradients read, and every state buffer
  read and written, i.e. 3 * param_bytes + 2 * state_bytes.

    opt = build_optimizer(model.parameters(), "sgd", {"lr": 0.1, "momentum": 0.9})
"""
from __future__ import annotations

from typing import Iterable

import torch

from ..errors import ScenarioError

_DEFAULTS = {
    "sgd": {"lr": 1e-3, "momentum": 0.0, "weight_decay": 0.0, "nesterov": False},
    "adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "kfac": {"lr": 1e-3, "momentum": 0.0, "weight_decay": 0.0, "damping": 1e-3, "factor_decay": 0.95,
             "factor_update_steps": 1, "inv_update_steps": 10, "kl_clip": 1e-3, "method": "eigen",
             "distribute_inverses": True},
}
_KFAC_BASE = ("lr", "momentum", "weight_decay")
_FIELD = "train.optimizer"


def build_optimizer(params: Iterable, name: str, options: dict) -> torch.optim.Optimizer:
    """A torch optimizer over `params` with validated options."""
    opts = _validated(name, options)
    if name == "sgd":
        return torch.optim.SGD(params, foreach=False, **opts)
    if name == "kfac":
        return torch.optim.SGD(params, foreach=False, **{key: opts[key] for key in _KFAC_BASE})
    return torch.optim.Adam(params, foreach=False, **opts)


def optimizer_state_bytes(name: str, options: dict, param_bytes: int) -> int:
    """Bytes of persistent optimizer state for parameters of `param_bytes` bytes."""
    opts = _validated(name, options)
    if name in ("sgd", "kfac"):
        return param_bytes if opts["momentum"] != 0 else 0
    return 2 * param_bytes


def optimizer_step_bytes(name: str, options: dict, param_bytes: int) -> int:
    """Bytes read plus written by one optimizer step (params r+w, grads r, state r+w)."""
    return 3 * param_bytes + 2 * optimizer_state_bytes(name, options, param_bytes)


def _validated(name: str, options: dict) -> dict:
    """The options merged over the optimizer's defaults, or a ScenarioError naming the field."""
    if name not in _DEFAULTS:
        raise ScenarioError(f"{_FIELD}.name: unknown optimizer {name!r} (known: {', '.join(_DEFAULTS)})")
    defaults = _DEFAULTS[name]
    for key in options or {}:
        if key not in defaults:
            raise ScenarioError(f"{_FIELD}.{key}: unknown option for {name} (known: {', '.join(defaults)})")
    opts = {**defaults, **(options or {})}
    for key in ("lr", "momentum", "weight_decay", "eps"):
        if key in opts and not _is_non_negative_number(opts[key]):
            raise ScenarioError(f"{_FIELD}.{key}: must be a non-negative number, got {opts[key]!r}")
    if name == "sgd":
        if not isinstance(opts["nesterov"], bool):
            raise ScenarioError(f"{_FIELD}.nesterov: must be true or false, got {opts['nesterov']!r}")
        if opts["nesterov"] and opts["momentum"] == 0:
            raise ScenarioError(f"{_FIELD}.nesterov: needs a momentum above 0")
    elif name == "adam":
        betas = opts["betas"]
        if not (
            isinstance(betas, (list, tuple))
            and len(betas) == 2
            and all(_is_non_negative_number(b) and b < 1 for b in betas)
        ):
            raise ScenarioError(f"{_FIELD}.betas: must be two numbers in [0, 1), got {betas!r}")
        opts["betas"] = tuple(float(b) for b in betas)
    return opts


def _is_non_negative_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
