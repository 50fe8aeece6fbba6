"""Peak device memory of one training step, without training, and the largest batch that fits.

`plan_memory(scenario)` builds the scenario's model on the meta device (shapes
and dtypes, no storage, no arithmetic: a model far larger than the host's RAM
is fine), applies its precision and checkpointing, and replays on a memory
ledger per device what a synchronous data-parallel step holds, in the order
`simtrain.schemes.sync` holds it:

1. for the whole run, the replica's weights, master weights, gradients and
   optimizer state (`simtrain.train.precision.persistent_bytes`);
2. during forward and backward, the activation peak measured from the
   tensors autograd really saves (`simtrain.cost.measure_step_cost` on meta
   tensors of the batch's shape);
3. during the all-reduce, the staging buffers of the scenario's collective,
   measured by running the collective program itself on meta gradient buckets
   over the scenario's simulated network.

The result per device is the ledger's peak and its split by category at the
moment of the peak, exactly what report.json's `devices` shows after a run.

`largest_batch` finds the largest per-device batch size whose step peak fits
a device: doubling from 1 until a batch does not fit, then bisection between
the last that fits and the first that does not. Each probe is a measurement
of the model on meta tensors (cached per shape), not an extrapolation: the
activation peak is not linear in the batch size for every model.

    plans = plan_memory(load_scenario("scenarios/quickstart.yaml"))
    plans[0].peak_bytes, plans[0].by_category, plans[0].largest_batch
"""
from __future__ import annotations

from dataclasses import dataclass

import simpy
import torch

from .comm import ALGORITHMS, build_all_reduce
from .comm.simulated import SimCommunicator
from .cost import measure_step_cost
from .hw.cluster import build_cluster, run_to_end
from .hw.device import MemoryLedger
from .hw.network import Network
from .scenario import Scenario
from .train.checkpointing import apply_checkpointing
from .train.data import load_dataset
from .train.models import build_model
from .train.precision import DTYPES, persistent_bytes

_LARGEST_PROBE = 1 << 40  # no batch beyond this is tried


@dataclass(frozen=True)
class DeviceMemory:
    """One device's peak over a training step."""

    rank: int
    device: str
    capacity_bytes: int
    peak_bytes: int
    by_category: dict[str, int]  # at the moment of the peak; adds up to peak_bytes
    largest_batch: int  # largest per-device batch size whose step fits (0: not even 1)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes


class StepMemoryModel:
    """A scenario's model on meta tensors: the memory one step holds on each device, for any batch size."""

    def __init__(self, scenario: Scenario):
        self.scenario = scenario
        train = scenario.train
        data = load_dataset(scenario.data.name, scenario.data.loader_options(), scenario.seed)
        x, y = data.train[0]
        self.sample_shape, self.x_dtype = tuple(x.shape), x.dtype
        self.y_shape, self.y_dtype = tuple(torch.as_tensor(y).shape), torch.as_tensor(y).dtype
        with torch.device("meta"):
            model = build_model(scenario.model.name, scenario.model.builder_options(), data.info, scenario.seed)
        self.dtype = DTYPES[train.precision]
        self.model = apply_checkpointing(model, train.checkpointing).to(self.dtype)
        params = list(self.model.parameters())
        optimizer = train.optimizer
        self.held = persistent_bytes(params, train.precision, optimizer.name, optimizer.builder_options())
        self.bucket_numel = sum(p.numel() for p in params if p.requires_grad)
        self.cluster = build_cluster(scenario.cluster, scenario.base_dir, record=False)
        self._staging = self._staging_peaks()

    def activation_bytes(self, batch_size: int) -> int:
        """Peak bytes autograd saves in one forward and backward of a batch (measured on meta)."""
        x_dtype = self.dtype if self.x_dtype.is_floating_point else self.x_dtype
        x = torch.empty((batch_size, *self.sample_shape), dtype=x_dtype, device="meta")
        y = torch.empty((batch_size, *self.y_shape), dtype=self.y_dtype, device="meta")
        return measure_step_cost(self.model, x, y).activation_bytes

    def ledger(self, rank: int, batch_size: int) -> MemoryLedger:
        """Device `rank`'s ledger after one step, replayed in the sync scheme's order (no capacity check)."""
        device = self.cluster.devices[rank]
        ledger = MemoryLedger(device.memory.device, float("inf"))
        for category, nbytes in self.held.items():
            ledger.alloc(category, nbytes)
        activations = self.activation_bytes(batch_size)
        ledger.alloc("activations", activations)
        ledger.free("activations", activations)
        ledger.alloc("comm_buffers", self._staging[rank])
        ledger.free("comm_buffers", self._staging[rank])
        return ledger

    def fits(self, rank: int, batch_size: int) -> bool:
        return self.ledger(rank, batch_size).peak_total <= self.cluster.devices[rank].spec.memory_bytes

    def largest_batch(self, rank: int) -> int:
        """The largest per-device batch size whose step fits device `rank` (0 if none does)."""
        if not self.fits(rank, 1):
            return 0
        fits, too_big = 1, None
        while too_big is None:
            probe = fits * 2
            if probe > _LARGEST_PROBE:
                return fits
            if self.fits(rank, probe):
                fits = probe
            else:
                too_big = probe
        while too_big - fits > 1:
            middle = (fits + too_big) // 2
            if self.fits(rank, middle):
                fits = middle
            else:
                too_big = middle
        return fits

    def device_memory(self, rank: int, batch_size: int) -> DeviceMemory:
        ledger = self.ledger(rank, batch_size)
        device = self.cluster.devices[rank]
        return DeviceMemory(rank=rank, device=device.spec.name, capacity_bytes=int(device.spec.memory_bytes),
                            peak_bytes=ledger.peak_total, by_category=dict(ledger.peak_breakdown),
                            largest_batch=self.largest_batch(rank))

    def _staging_peaks(self) -> list[int]:
        """Per rank, the peak staging bytes of the scenario's all-reduce of the gradient bucket."""
        world = self.cluster.size
        scheme = self.scenario.parallel.scheme
        if scheme not in ALGORITHMS:  # no collective (asynchronous schemes): nothing staged
            return [0] * world
        nodes = [device.node for device in self.cluster.devices]
        all_reduce = build_all_reduce(scheme, self.cluster.topology, nodes, self.scenario.parallel.channels,
                                      "parallel.scheme", "parallel.channels")
        env = simpy.Environment()
        ledgers = [MemoryLedger(f"rank {rank}", float("inf")) for rank in range(world)]
        comm = SimCommunicator(Network(env, self.cluster.topology, record=False),
                               nodes, ledgers=ledgers)
        for rank in range(world):
            bucket = torch.empty(self.bucket_numel, dtype=self.dtype, device="meta")
            comm.run(rank, all_reduce(rank, world, bucket, average=True))
        run_to_end(env)
        return [ledger.peak["comm_buffers"] for ledger in ledgers]


def plan_memory(scenario: Scenario, batch_size: int | None = None) -> list[DeviceMemory]:
    """Per device: the peak of one training step at `batch_size` (default the scenario's), by category."""
    model = StepMemoryModel(scenario)
    batch = scenario.data.batch_size if batch_size is None else batch_size
    return [model.device_memory(rank, batch) for rank in range(model.cluster.size)]
