"""A replica's own forward and backward in a step, as step-program operations, for every scheme.

Before the batch: the sampler's host bookkeeping (prioritized and mh
sampling), as a `sampling` span. Then the real forward and backward (with
SyncBN, its statistics all-reduced on the way, with the scheme's collective).
Each is followed by its measured FLOPs (and operators, for a roofline device:
op_cost.py) at the device's peak for the replica's compute dtype, as
`forward` and `backward` compute spans, with the measured activation peak
held on the device's ledger meanwhile. A scheme that overlaps communication
with the backward gives the operations to yield as the backward completes
gradients: the backward is charged in pieces between them, each piece its
share of the backward's FLOPs, and the same share of its kernels and of its
operators' FLOPs and bytes. With m micro-batches (gradient accumulation:
`parallel.pipeline.microbatches` without pp/tp) each runs forward and
backward in turn, holding its own activations.

    loss = yield from forward_backward(replica)
    loss = yield from forward_backward(replica, microbatches=4)    # 4 accumulation steps
"""
import torch

from ..op_cost import scaled
from ..train.replica import Replica
from ..step_ops import Alloc, Busy, Collective, Compute, Free


def forward_backward(replica: Replica, statistics_all_reduce=None, during_backward=None, microbatches: int = 1):
    """Step program: the replica's forward and backward on its next batch; returns the loss.

    Each compute operation follows the numerics it charges (the forward's, then the backward's),
    so an interpreter that runs the program for real (simtrain/real) times each by the host clock.
    `statistics_all_reduce(buffer)`, when given, is the collective program that sums a
    SyncBN statistics buffer across the group (the forward and backward exchange them).
    `during_backward(cost, loss)`, when given, is called once the real forward and backward are
    done and returns [(backward FLOPs, operation)] in FLOPs order: each operation is yielded
    once the simulated backward has done that many FLOPs.

    With `microbatches` m > 1 (gradient accumulation) the batch is cut into m micro-batches run
    forward and backward in turn, each loss weighted 1/m and each gradient added to the buffer,
    a micro-batch's activations held only while it runs; `during_backward` posts its operations
    in the last micro-batch's backward alone (torch DDP's no_sync for the others). The loss
    returned is the mean of the micro-batches' (the whole batch's)."""
    if replica.loader.host_seconds > 0:
        yield Busy(replica.loader.host_seconds, "sample batch", kind="sampling")
    dtype = replica.precision.name
    if statistics_all_reduce is not None:  # forward and backward interleave with the exchanges: one host span
        loss = yield from _exchanging(replica.sync_batchnorm_forward_backward(), statistics_all_reduce)
        cost = replica.step_cost()
        yield Alloc("activations", cost.activation_bytes)
        yield Compute(cost.forward_flops, dtype, "forward", kernels=cost.forward_kernels, ops=cost.forward_ops,
                      passes=1)
        yield from _backward(cost, dtype, during_backward(cost, loss) if during_backward is not None else None)
        return loss
    losses = []
    for index, microbatch in enumerate(replica.microbatches(microbatches)):
        loss = replica.forward(microbatch, accumulate=index > 0)
        cost = replica.step_cost()
        yield Alloc("activations", cost.activation_bytes)
        yield Compute(cost.forward_flops, dtype, "forward", kernels=cost.forward_kernels, ops=cost.forward_ops,
                      passes=1)
        loss = replica.backward(loss, 1.0 / microbatches)
        losses.append(loss)
        last = index == microbatches - 1
        if last and microbatches > 1:
            loss = torch.stack(losses).mean()
        yield from _backward(cost, dtype, during_backward(cost, loss) if last and during_backward is not None
                             else None)
    return loss


def _backward(cost, dtype: str, operations):
    """Step program: the backward's compute, cut where each of `operations` ([(backward FLOPs, operation)],
    None: none) is yielded; then the activations freed."""
    done, kernels_done = 0.0, 0
    for flops, operation in operations if operations is not None else ():
        if flops > done:
            kernels = _kernels_until(cost, flops) - kernels_done
            yield Compute(flops - done, dtype, "backward", kernels=kernels,
                          ops=_share(cost, flops - done), passes=int(done == 0))
            done, kernels_done = flops, kernels_done + kernels
        yield operation
    if cost.backward_flops > done or operations is None:
        ops = cost.backward_ops if done == 0 else _share(cost, cost.backward_flops - done)
        yield Compute(cost.backward_flops - done, dtype, "backward", kernels=cost.backward_kernels - kernels_done,
                      ops=ops, passes=int(done == 0))
    yield Free("activations", cost.activation_bytes)


def _kernels_until(cost, flops: float) -> int:
    """The backward's kernels up to its first `flops` FLOPs, in proportion (the pieces add up to all of them)."""
    return round(cost.backward_kernels * flops / cost.backward_flops) if cost.backward_flops else 0


def _share(cost, flops: float) -> tuple:
    """The backward's operators, each scaled to the share `flops` is of the backward's FLOPs (all of them, as
    they are, for the whole backward: the same numbers, without a new tuple every step)."""
    return cost.backward_ops if flops == cost.backward_flops else scaled(cost.backward_ops, flops / cost.backward_flops)


def _exchanging(forward_backward_program, statistics_all_reduce):
    """Serve a SyncBN forward/backward's StatsAllReduce requests; return its loss."""
    try:
        request = next(forward_backward_program)
        while True:
            yield Collective(statistics_all_reduce(request.buffer), "sync_batchnorm")
            request = forward_backward_program.send(None)
    except StopIteration as stop:
        return stop.value
