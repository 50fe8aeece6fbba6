"""A replica's own forward and backward in a step, as step-program operations, for every scheme.

Before the batch: the sampler's host bookkeeping (prioritized and mh
sampling), as a `sampling` span. Then the real forward and backward (with
SyncBN, its statistics all-reduced on the way, with the scheme's collective).
After them: their measured FLOPs at the device's peak for the replica's
compute dtype, as `forward` and `backward` compute spans, with the measured
activation peak held on the device's ledger meanwhile. A scheme that
overlaps communication with the backward gives the operations to yield as
the backward completes gradients: the backward is charged in pieces between
them.

    loss = yield from forward_backward(replica)
"""
from ..train.replica import Replica
from .program import Alloc, Busy, Collective, Compute, Free


def forward_backward(replica: Replica, statistics_all_reduce=None, during_backward=None):
    """Step program: the replica's forward and backward on its next batch; returns the loss.

    `statistics_all_reduce(buffer)`, when given, is the collective program that sums a
    SyncBN statistics buffer across the group (the forward and backward exchange them).
    `during_backward(cost, loss)`, when given, is called once the real forward and backward are
    done and returns [(backward FLOPs, operation)] in FLOPs order: each operation is yielded
    once the simulated backward has done that many FLOPs."""
    if replica.loader.host_seconds > 0:
        yield Busy(replica.loader.host_seconds, "sample batch", kind="sampling")
    if statistics_all_reduce is None:
        loss = replica.forward_backward()
    else:
        loss = yield from _exchanging(replica.sync_batchnorm_forward_backward(), statistics_all_reduce)
    cost = replica.step_cost()
    dtype = replica.precision.name
    yield Alloc("activations", cost.activation_bytes)
    yield Compute(cost.forward_flops, dtype, "forward")
    done = 0.0
    for flops, operation in during_backward(cost, loss) if during_backward is not None else ():
        if flops > done:
            yield Compute(flops - done, dtype, "backward")
            done = flops
        yield operation
    if cost.backward_flops > done or during_backward is None:
        yield Compute(cost.backward_flops - done, dtype, "backward")
    yield Free("activations", cost.activation_bytes)
    return loss


def _exchanging(forward_backward_program, statistics_all_reduce):
    """Serve a SyncBN forward/backward's StatsAllReduce requests; return its loss."""
    try:
        request = next(forward_backward_program)
        while True:
            yield Collective(statistics_all_reduce(request.buffer), "sync_batchnorm")
            request = forward_backward_program.send(None)
    except StopIteration as stop:
        return stop.value
