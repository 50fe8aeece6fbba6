"""The training loss of every model simtrain trains: cross entropy computed in fp32.

The logits are upcast before the loss, as torch.autocast does for
cross_entropy and log_softmax, so a mixed-precision replica computes its loss
exactly as an fp32 one would from the same logits. Every place that computes
a loss (replicas, samplers, SyncBN, the cost measurement, evaluation) calls
this one function.

    loss = cross_entropy(model(x), y)                       # batch mean
    per_sample = cross_entropy(model(x), y, reduction="none")

Sequence models (a GPT on token data) give logits of shape (batch, positions,
vocab) against labels (batch, positions): every position is a prediction of
the next token. The mean is over every position of every sample; "none"
gives each sample's mean over its positions; "sum" sums every position.
"""
import torch
import torch.nn.functional as F


def cross_entropy(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy of `logits` (any float dtype, upcast to fp32) against class labels `y`."""
    if logits.dim() == 3:  # (batch, positions, vocab): one prediction per position
        per_position = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
        if reduction == "none":
            return per_position.view(y.shape).mean(dim=1)
        return per_position.mean() if reduction == "mean" else per_position.sum()
    return F.cross_entropy(logits.float(), y, reduction=reduction)
