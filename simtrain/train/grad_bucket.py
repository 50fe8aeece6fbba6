"""The gradient bucket: every parameter's gradient as a view into one flat buffer.

As DDP's `gradient_as_bucket_view`: backward writes each parameter's gradient
straight into its slice of the bucket, so a collective reduces the whole
gradient in place with no copies, and an optimizer stepping the parameters
reads the reduced values. Replicas, mixed precision's fp32 master gradients
and the async store's shared parameters all keep their gradients this way.

    bucket = flat_grad_buffer(params)      # zeroed; p.grad is a view into it

For an all-reduce that overlaps the backward pass, the buffer is cut into
DDP's buckets: parameters in reverse order (the order backward finishes
them), a bucket closed once it holds `cap_bytes` or more, so each bucket is
a contiguous slice of the buffer, all-reduced as soon as its last gradient
is complete and after the bucket before it (DDP reduces buckets in order):

    for bucket in overlap_buckets(params, cost.grad_ready_flops, buffer.element_size(), 25 << 20): ...
"""
from typing import NamedTuple

import torch


def flat_grad_buffer(params: list[torch.Tensor], buffer: torch.Tensor | None = None) -> torch.Tensor:
    """One zeroed buffer (the parameters' dtype and device) holding every parameter's gradient;
    each .grad becomes a view into it. `buffer`: the flat tensor to use, zeroed here (a row of a
    tensor the job's replicas share: train/replica.py's share_gradient_rows)."""
    if buffer is None:
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    else:
        buffer.zero_()
    offset = 0
    for p in params:
        p.grad = buffer[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return buffer


class Bucket(NamedTuple):
    """Elements [start, stop) of the gradient buffer, all-reduced once the backward has done `ready_flops`."""

    start: int
    stop: int
    ready_flops: float


def overlap_buckets(params: list[torch.Tensor], grad_ready_flops: tuple[float, ...], element_size: int,
                    cap_bytes: int) -> list[Bucket]:
    """DDP's buckets of `params`' gradient buffer, in the order they are all-reduced.

    `grad_ready_flops[i]`: the backward FLOPs done when params[i]'s gradient is complete (cost.py)."""
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())
    buckets, stop, ready = [], offsets[-1], 0.0
    for index in reversed(range(len(params))):
        ready = max(ready, grad_ready_flops[index])  # never before the bucket it follows
        if (stop - offsets[index]) * element_size >= cap_bytes or index == 0:
            buckets.append(Bucket(offsets[index], stop, ready))
            stop = offsets[index]
    return buckets
