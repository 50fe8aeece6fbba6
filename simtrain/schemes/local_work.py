"""A replica's own forward and backward in a step, as step-program operations (async workers, a launched
step's timing: simtrain/real/step_timing.py; the step engine runs its model parts itself, pipeline.py).

Before the batch: the sampler's host bookkeeping (prioritized and mh
sampling), as a `sampling` span. Then the real forward and backward, each
followed by its measured FLOPs (and operators, for a roofline device:
op_cost.py) at the device's peak for the replica's compute dtype, as
`forward` and `backward` compute spans, with the measured activation peak
held on the device's ledger meanwhile. With m micro-batches (gradient
accumulation) each runs forward and backward in turn, holding its own
activations.

    loss = yield from forward_backward(replica)
    loss = yield from forward_backward(replica, microbatches=4)    # 4 accumulation steps
"""
import torch

from ..train.replica import Replica
from ..step_ops import Alloc, Busy, Compute, Free


def forward_backward(replica: Replica, microbatches: int = 1):
    """Step program: the replica's forward and backward on its next batch; returns the loss.

    Each compute operation follows the numerics it charges (the forward's, then the backward's),
    so an interpreter that runs the program for real (simtrain/real) times each by the host clock.

    With `microbatches` m > 1 (gradient accumulation) the batch is cut into m micro-batches run
    forward and backward in turn, each loss weighted 1/m and each gradient added to the buffer,
    a micro-batch's activations held only while it runs. The loss returned is the mean of the
    micro-batches' (the whole batch's)."""
    if replica.loader.host_seconds > 0:
        yield Busy(replica.loader.host_seconds, "sample batch", kind="sampling")
    dtype = replica.precision.name
    losses = []
    for index, microbatch in enumerate(replica.microbatches(microbatches)):
        loss = replica.forward(microbatch, accumulate=index > 0)
        cost = replica.step_cost()
        yield Alloc("activations", cost.activation_bytes)
        yield Compute(cost.forward_flops, dtype, "forward", kernels=cost.forward_kernels, ops=cost.forward_ops,
                      passes=1)
        losses.append(replica.backward(loss, 1.0 / microbatches))
        yield Compute(cost.backward_flops, dtype, "backward", kernels=cost.backward_kernels, ops=cost.backward_ops,
                      passes=1)
        yield Free("activations", cost.activation_bytes)
    return losses[0] if microbatches == 1 else torch.stack(losses).mean()
