"""Models a replica trains: a multi-layer perceptron, a small CNN, or your own.

`build_model(spec, info, seed)` returns a freshly initialised `nn.Module`
for a dataset of shape `info`. Initialisation follows one contract:
`torch.manual_seed(seed)` immediately before the model is constructed, so a
real DDP job that seeds and builds the same way starts from the same weights.
The seeding runs inside `torch.random.fork_rng`, so the caller's global RNG
stream is left as it was.

- `mlp`: `model.hidden` (list of widths), `model.batchnorm`.
  nn.Sequential(Flatten, Linear(in, h1), [BatchNorm1d(h1),] ReLU, ...,
  Linear(h_last, classes)).
- `cnn`: for image inputs; `model.channels`, `model.batchnorm`.
  nn.Sequential(Unflatten to (C, H, W), then per entry Conv2d 3x3 (padding 1) + [BatchNorm2d +] ReLU + MaxPool2d(2) while both
  spatial sides are at least 2, then Flatten and a Linear head).
- With `batchnorm`, every hidden Linear or Conv2d is followed by BatchNorm
  (before the ReLU, as Ioffe & Szegedy 2015 place it); the output layer is not.
- `gpt`: a small decoder-only transformer for token data (train/gpt.py);
  `model.hidden` (one width), `model.layers`, `model.heads`; `model.moe`
  makes every n-th block past its first_dense a mixture of experts
  (train/moe.py).
- `llama`: a Llama-style transformer for token data (train/llama.py): gpt's
  fields and `model.kv_heads`, `model.ffn_hidden`, `model.rope_theta`;
  `model.moe` makes every n-th block past its first_dense a mixture of SwiGLU
  experts (train/llama_moe.py); `model.latent_attention` makes every block's
  attention multi-head latent attention (train/latent_attention.py).
- `model.attention: fused` (gpt, llama): every block's attention core is one
  FlashAttention kernel (train/fused_attention.py).
- `package.module:function`: called with `model.options` as keyword
  arguments; it returns an `nn.Module` with trainable parameters that maps a
  batch of the data's inputs to one logit per class (checked with one forward
  of two zero samples in eval mode). This runs the user's code, as Hydra's
  `_target_` does: a scenario that names one is code, to be trusted as such.

Defaults and checks of the fields live in scenario.ModelSpec.

Every built-in model is a flat nn.Sequential, so gradient checkpointing can
cut them into segments (`torch.utils.checkpoint.checkpoint_sequential`).

    model = build_model(ModelSpec(name="mlp", hidden=[64]), splits.info, seed=0)
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch import nn

from ..errors import ScenarioError
from ..scenario import ModelSpec
from .architecture import check_model_fits_data
from .data import DatasetInfo, call_with_options, load_callable
from .fused_attention import use_fused_attention_
from .gpt import build_gpt
from .latent_attention import latent_attention_block
from .llama import build_llama
from .llama_moe import llama_moe_block
from .moe import moe_block


def build_model(spec: ModelSpec, info: DatasetInfo, seed: int) -> nn.Module:
    """A freshly initialised model; the same (spec, info, seed) give the same weights."""
    construct = _constructor(spec, info)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = construct()
    if spec.attention == "fused":
        use_fused_attention_(model)
    return model


def _constructor(spec: ModelSpec, info: DatasetInfo) -> Callable[[], nn.Module]:
    """What builds the model `spec` names (after seeding); the spec's fields are validated already."""
    if spec.name == "mlp":
        return partial(_mlp, info, list(spec.hidden), spec.batchnorm)
    if spec.name in ("mlp", "cnn", "gpt", "llama"):
        check_model_fits_data(spec, info)
    if spec.name == "cnn":
        return partial(_cnn, info, list(spec.channels), spec.batchnorm)
    if spec.name == "gpt":
        block = moe_block(spec.moe) if spec.moe is not None else None
        return partial(build_gpt, info.num_classes, info.input_shape[0], spec.width, spec.layers, spec.heads, block)
    if spec.name == "llama":
        if spec.latent_attention is not None:
            block = latent_attention_block(spec.latent_attention, spec.moe)
        else:
            block = llama_moe_block(spec.moe) if spec.moe is not None else None
        return partial(build_llama, info.num_classes, spec.width, spec.layers, spec.heads, spec.key_value_heads,
                       spec.ffn_width, spec.rotary_base, block)
    if ":" in spec.name:
        return partial(_user_model, load_callable(spec.name, "model.name"), dict(spec.options), spec.name, info)
    raise ScenarioError(f"model.name: unknown model {spec.name!r} (known: mlp, cnn, gpt, llama, or "
                          "package.module:function)")


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
            logits = model(torch.zeros(shape, dtype=getattr(torch, info.input_dtype)))
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
