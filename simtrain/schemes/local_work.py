"""What a device is charged for its own replica's work in a step, in every scheme.

Before a batch: the sampler's host bookkeeping (prioritized and mh sampling),
as a `sampling` span. After the real forward and backward: their measured
FLOPs at the device's peak for the replica's compute dtype, as `forward` and
`backward` compute spans, with the measured activation peak held on the
device's ledger meanwhile.

    yield from charge_sampling(device, replica)
    loss = replica.forward_backward()
    yield from charge_forward_backward(device, replica)
"""
from ..hw.device import Device
from ..train.replica import Replica


def charge_sampling(device: Device, replica: Replica):
    """The loader's host work to pick the next batch (none for uniform batches)."""
    if replica.loader.host_seconds > 0:
        yield device.run_for(replica.loader.host_seconds, "sample batch", kind="sampling")


def charge_forward_backward(device: Device, replica: Replica):
    """The forward and backward the replica just ran on its last batch."""
    cost = replica.step_cost()
    dtype = replica.precision.name
    device.memory.alloc("activations", cost.activation_bytes)
    yield device.compute(cost.forward_flops, dtype, "forward")
    yield device.compute(cost.backward_flops, dtype, "backward")
    device.memory.free("activations", cost.activation_bytes)
