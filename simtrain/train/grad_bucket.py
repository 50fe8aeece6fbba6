"""The gradient bucket: every parameter's gradient as a view into one flat buffer.

As DDP's `gradient_as_bucket_view`: backward writes each parameter's gradient
straight into its slice of the bucket, so a collective reduces the whole
gradient in place with no copies, and an optimizer stepping the parameters
reads the reduced values. Replicas, mixed precision's fp32 master gradients
and the async store's shared parameters all keep their gradients this way.

    bucket = flat_grad_buffer(params)      # zeroed; p.grad is a view into it
"""
import torch


def flat_grad_buffer(params: list[torch.Tensor]) -> torch.Tensor:
    """One zeroed buffer (the parameters' dtype and device) holding every parameter's gradient;
    each .grad becomes a view into it."""
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        p.grad = buffer[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return buffer
