"""Models a replica trains: a multi-layer perceptron, a small CNN, or your own.

`build_model(name, options, info, seed)` returns a freshly initialised
`nn.Module` for a dataset of shape `info`. Initialisation follows one contract:
`torch.manual_seed(seed)` immediately before the model is constructed, so a real
DDP job that seeds and builds the same way starts from the same weights. The
seeding runs inside `torch.random.fork_rng`, so the caller's global RNG stream
is left as it was.

- `mlp`: options `hidden` (list of widths, default [128, 128]), `batchnorm`
  (default false). nn.Sequential(Flatten, Linear(in, h1), [BatchNorm1d(h1),]
  ReLU, ..., Linear(h_last, classes)).
- `cnn`: for image inputs; options `channels` (default [16, 32]), `batchnorm`
  (default false). nn.Sequential(Unflatten to (C, H, W), then per entry
  Conv2d 3x3 (padding 1) + [BatchNorm2d +] ReLU + MaxPool2d(2) while both
  spatial sides are at least 2, then Flatten and a Linear head).
- With `batchnorm`, every hidden Linear or Conv2d is followed by BatchNorm
  (before the ReLU, as Ioffe & Szegedy 2015 place it); the output layer is not.
- `package.module:function`: called with the options as keyword arguments; it
  returns an `nn.Module` with trainable parameters that maps a batch of the
  data's inputs to one logit per class (checked with one forward of two zero
  samples in eval mode). This runs the user's code, as Hydra's `_target_`
  does: a scenario that names one is code, to be trusted as such.

Both built-in models are a flat nn.Sequential, so gradient checkpointing can
cut them into segments (`torch.utils.checkpoint.checkpoint_sequential`).

    model = build_model("mlp", {"hidden": [64]}, splits.info, seed=0)
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch import nn

from ..errors import ScenarioError
from .data import DatasetInfo, call_with_options, load_callable

_MLP_DEFAULTS = {"hidden": [128, 128], "batchnorm": False}
_CNN_DEFAULTS = {"channels": [16, 32], "batchnorm": False}


def build_model(name: str, options: dict, info: DatasetInfo, seed: int) -> nn.Module:
    """A freshly initialised model; the same (name, options, info, seed) give the same weights."""
    construct = _constructor(name, dict(options or {}), info)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return construct()


def _constructor(name: str, options: dict, info: DatasetInfo) -> Callable[[], nn.Module]:
    """Validate the model's name and options; return what builds it (after seeding)."""
    if name == "mlp":
        return partial(_mlp, info, _widths(options, _MLP_DEFAULTS, "hidden", allow_empty=True),
                       _flag(options, "batchnorm"))
    if name == "cnn":
        channels = _widths(options, _CNN_DEFAULTS, "channels", allow_empty=False)
        if info.image_shape is None or len(info.image_shape) != 3:
            raise ScenarioError("model.name: cnn needs image inputs (C, H, W), and this dataset has none")
        return partial(_cnn, info, channels, _flag(options, "batchnorm"))
    if isinstance(name, str) and ":" in name:
        return partial(_user_model, load_callable(name, "model.name"), options, name, info)
    raise ScenarioError(f"model.name: unknown model {name!r} (known: mlp, cnn, or package.module:function)")


def _widths(options: dict, defaults: dict, key: str, allow_empty: bool) -> list[int]:
    for option in options:
        if option not in defaults:
            raise ScenarioError(f"model.{option}: unknown option (known: {', '.join(defaults)})")
    widths = options.get(key, defaults[key])
    valid = isinstance(widths, (list, tuple)) and all(
        isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in widths
    )
    if not valid or (not allow_empty and not widths):
        raise ScenarioError(f"model.{key}: must be a list of positive integers, got {widths!r}")
    return list(widths)


def _flag(options: dict, key: str) -> bool:
    value = options.get(key, False)
    if not isinstance(value, bool):
        raise ScenarioError(f"model.{key}: must be true or false, got {value!r}")
    return value


def _mlp(info: DatasetInfo, hidden: list[int], batchnorm: bool) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Flatten()]
    width = info.num_features
    for next_width in hidden:
        layers += [nn.Linear(width, next_width), *([nn.BatchNorm1d(next_width)] if batchnorm else []), nn.ReLU()]
        width = next_width
    layers.append(nn.Linear(width, info.num_classes))
    return nn.Sequential(*layers)


def _cnn(info: DatasetInfo, channels: list[int], batchnorm: bool) -> nn.Sequential:
    in_channels, height, width = info.image_shape
    layers: list[nn.Module] = [nn.Unflatten(1, (in_channels, height, width))]
    for out_channels in channels:
        norm = [nn.BatchNorm2d(out_channels)] if batchnorm else []
        layers += [nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1), *norm, nn.ReLU()]
        if height >= 2 and width >= 2:
            layers.append(nn.MaxPool2d(2))
            height, width = height // 2, width // 2
        in_channels = out_channels
    layers += [nn.Flatten(), nn.Linear(in_channels * height * width, info.num_classes)]
    return nn.Sequential(*layers)


def _user_model(function: Callable, options: dict, name: str, info: DatasetInfo) -> nn.Module:
    model = call_with_options(function, options, "model")
    if not isinstance(model, nn.Module):
        raise ScenarioError(f"model.name: {name} returned {type(model).__name__}, not an nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise ScenarioError(f"model.name: {name} returned a model with no trainable parameters")
    _check_fits_the_data(model, info, name)
    return model


def _check_fits_the_data(model: nn.Module, info: DatasetInfo, name: str) -> None:
    """One forward of a batch of two zero samples, in eval mode (no running statistics move):
    it must take the data's inputs and give one logit per class."""
    shape = (2, *info.input_shape)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(torch.zeros(shape, dtype=info.input_dtype))
    except Exception as exc:
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        raise ScenarioError(f"model.name: {name} does not take the data's inputs: a batch of shape {list(shape)} "
                            f"raises {type(exc).__name__}: {lines[0]}") from exc
    finally:
        model.train(training)
    expected = [2, info.num_classes]
    got = list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
    if got != expected:
        raise ScenarioError(f"model.name: {name} maps a batch of shape {list(shape)} to {got}, not to the "
                            f"{expected} logits of the data's {info.num_classes} classes")


def weight_norms(model: nn.Module) -> dict[str, float]:
    """The Frobenius norm of each Linear and Conv2d layer's weight, by module name."""
    return {name: float(module.weight.detach().float().norm())
            for name, module in model.named_modules() if isinstance(module, (nn.Linear, nn.Conv2d))}


def layers_before_batchnorm(model: nn.Module) -> list[str]:
    """Names of the Linear and Conv2d layers an nn.Sequential feeds straight into a BatchNorm."""
    if not isinstance(model, nn.Sequential):
        return []
    names = list(model._modules)
    return [name for name, following in zip(names, names[1:])
            if isinstance(model._modules[name], (nn.Linear, nn.Conv2d))
            and isinstance(model._modules[following], nn.modules.batchnorm._BatchNorm)]
