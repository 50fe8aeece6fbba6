"""Synchronized BatchNorm: batch statistics summed across devices, mid-forward and mid-backward.

A real SyncBatchNorm all-reduces each BN layer's batch statistics in the
forward pass and two gradient sums in the backward pass, so every device
normalizes with the statistics of the whole global batch. Here every rank's
forward and backward must therefore stop at each BN layer until the others
have contributed. simtrain's ranks are simpy processes on one host thread, so
the forward and backward are written as a generator,
`sync_batchnorm_forward_backward(model, x, y)`, that yields a `StatsAllReduce`
request at each exchange; the scheme serves each request by running the
chosen all-reduce program (sum, in place) for that rank through the simulated
communicator, so the statistics really travel through the network and the
bytes and time are charged, then resumes the generator with the summed
buffer. Every rank yields the same requests in the same order.

The model must be an nn.Sequential whose BatchNorm layers are direct
children (the built-in mlp and cnn are). It is cut at the BN layers into runs
of ordinary layers, each run forward with autograd; a BN layer in training
mode is computed by hand:

- forward: local per-channel [sum x, sum x^2, count] -> all-reduce ->
  mean = S1/n, var = S2/n - mean^2 (biased, as BN normalizes with),
  xhat = (x - mean) / sqrt(var + eps), out = weight * xhat + bias; running
  statistics updated as torch does (unbiased variance n/(n-1), momentum, or
  the cumulative average when momentum is None). The sum-of-squares form
  loses precision when |mean| >> std; fine in fp32 for normalized inputs.
- backward (as torch.nn.SyncBatchNorm): dy = gradient at the BN output;
  weight.grad += sum dy*xhat, bias.grad += sum dy (local: the scheme's
  gradient all-reduce averages them like any parameter); [sum dy, sum dy*xhat]
  -> all-reduce -> dx = weight/sqrt(var+eps) * (dy - mean(dy) - xhat*mean(dy*xhat))
  with the means over the global batch; dx goes into the previous run's
  backward (torch.autograd.backward).

dx is the gradient of the sum of all ranks' losses with respect to this rank's
input, so after the usual gradient averaging the update is that of BatchNorm
over the concatenated batch with the mean loss (tested).

Timing: the collective's time is charged when the rank reaches the exchange;
the scheme charges the forward and backward FLOPs after the numerics, so on
the trace a step's BN all-reduces come before its compute spans instead of
between them. Each exchange blocks the device either way, so the step time is
the same.

    loss = yield from sync_batchnorm_forward_backward(model, x, y)   # in the scheme's driver
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..loss import cross_entropy


class StatsAllReduce(NamedTuple):
    """A request: sum `buffer` across all ranks, in place, then resume."""

    buffer: torch.Tensor


class _SavedNorm:
    """What a BN layer's backward needs: its input (in the previous run's graph), xhat, 1/std, count."""

    def __init__(self, module: _BatchNorm, run_output: torch.Tensor, xhat, invstd, count, output_leaf):
        self.module = module
        self.run_output = run_output
        self.xhat = xhat
        self.invstd = invstd
        self.count = count
        self.output_leaf = output_leaf


def synced_batchnorms(model: nn.Module) -> list[_BatchNorm]:
    """The BatchNorm layers of a model SyncBN can run; a ValueError if it cannot run this model."""
    norms = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    direct = [m for m in model.children() if isinstance(m, _BatchNorm)] if isinstance(model, nn.Sequential) else []
    if len(norms) != len(direct):
        raise ValueError("needs a model that is an nn.Sequential with its BatchNorm layers as direct children")
    return direct


def _channel_shape(x: torch.Tensor) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def sync_batchnorm_forward_backward(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor,
                                    loss_fn=cross_entropy):
    """Generator: forward and backward of loss_fn(model(x), y) with BN statistics summed across ranks.

    Yields StatsAllReduce requests; returns the (local) loss. Parameter
    gradients accumulate into .grad as loss.backward() would put them.
    """
    saved: list[_SavedNorm] = []
    h = x
    for module in model.children():
        if isinstance(module, _BatchNorm) and module.training:
            h = yield from _norm_forward(module, h, saved)
        else:
            h = module(h)
    loss = loss_fn(h, y)
    loss.backward()
    for norm in reversed(saved):
        dx = yield from _norm_backward(norm)
        if norm.run_output.requires_grad:
            torch.autograd.backward(norm.run_output, dx)
    return loss.detach()


def _norm_forward(module: _BatchNorm, h: torch.Tensor, saved: list[_SavedNorm]):
    x = h.detach()
    dims, shape = _reduce_dims(x), _channel_shape(x)
    channels = x.shape[1]
    local_count = x.numel() // channels
    stats = torch.cat([x.sum(dims), (x * x).sum(dims), x.new_tensor([float(local_count)])])
    yield StatsAllReduce(stats)
    count = float(local_count) if stats.is_meta else stats[-1].item()  # meta: numerics off
    mean = stats[:channels] / count
    var = stats[channels:2 * channels] / count - mean * mean
    invstd = torch.rsqrt(var + module.eps)
    if module.track_running_stats:
        _update_running_stats(module, mean, var, count)
    xhat = (x - mean.view(shape)) * invstd.view(shape)
    out = xhat
    if module.affine:
        out = xhat * module.weight.detach().view(shape) + module.bias.detach().view(shape)
    out = out.requires_grad_(True)
    saved.append(_SavedNorm(module, h, xhat, invstd, count, out))
    return out


def _update_running_stats(module: _BatchNorm, mean, var, count: float) -> None:
    module.num_batches_tracked.add_(1)
    momentum = module.momentum
    if momentum is None:  # cumulative moving average, as torch does
        momentum = 1.0 / float(module.num_batches_tracked)
    unbiased = var * (count / (count - 1)) if count > 1 else var
    module.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
    module.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)


def _norm_backward(norm: _SavedNorm):
    dy = norm.output_leaf.grad
    if dy is None:
        dy = torch.zeros_like(norm.xhat)
    xhat = norm.xhat
    dims, shape = _reduce_dims(xhat), _channel_shape(xhat)
    channels = xhat.shape[1]
    sum_dy = dy.sum(dims)
    sum_dy_xhat = (dy * xhat).sum(dims)
    module = norm.module
    if module.affine:
        for parameter, grad in ((module.weight, sum_dy_xhat), (module.bias, sum_dy)):
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            parameter.grad.add_(grad)
    sums = torch.cat([sum_dy, sum_dy_xhat])
    yield StatsAllReduce(sums)
    mean_dy = (sums[:channels] / norm.count).view(shape)
    mean_dy_xhat = (sums[channels:] / norm.count).view(shape)
    scale = norm.invstd.view(shape)
    if module.affine:
        scale = scale * module.weight.detach().view(shape)
    return scale * (dy - mean_dy - xhat * mean_dy_xhat)
