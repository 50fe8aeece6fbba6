"""The training loss of every model simtrain trains: cross entropy computed in fp32.

The logits are upcast before the loss, as torch.autocast does for
cross_entropy and log_softmax, so a mixed-precision replica computes its loss
exactly as an fp32 one would from the same logits. Every place that computes
a loss (replicas, samplers, SyncBN, the cost measurement, evaluation) calls
this one function.

    loss = cross_entropy(model(x), y)                       # batch mean
    per_sample = cross_entropy(model(x), y, reduction="none")
"""
import torch
import torch.nn.functional as F


def cross_entropy(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy of `logits` (any float dtype, upcast to fp32) against class labels `y`."""
    return F.cross_entropy(logits.float(), y, reduction=reduction)
