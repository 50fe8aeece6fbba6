"""Distributed K-FAC in synchronous data parallelism: factors averaged, inversions shared out.

Each replica keeps its own K-FAC state (`train.kfac.Kfac`: hooks, factors,
decompositions) on the model its rank runs: under data parallelism alone a
rank's share is the whole model in one chunk (train/partition.py RankModule),
whose layers keep the model's own names and whose forward and backward the
step engine runs as the chunk's ops (schemes/pipeline.py; with numerics off
too, the replica set to `run_every_step`). Each step, after the gradient
all-reduce and before the base optimizer steps, `DistributedKfac.step(rank)`
runs on every rank (a step program, simtrain/step_ops.py: `yield from` it in
the data-parallel strategy's update, strategies/replicated_update.py):

1. factor update steps: the batch factors A = a^T a / B and G = B g^T g of
   every layer (charged as 2*rows*n^2 FLOPs each) are averaged across devices
   by all-reducing the flat factor buffer with the data-parallel group's
   collective (naive, ring or tree), charged on the network like the gradient
   (a group of one device sends nothing); the mean of the
   per-device factors is the factor of the concatenated batch (equal batch
   sizes). Then the running averages are updated.
2. inversion steps: with `distribute_inverses`, each factor is assigned to one
   device by greedy longest-processing-time scheduling on its n^3 cost
   (largest first, to the least-loaded device, ties to the lowest rank; as
   KAISA, Pauloski et al. 2021, shares out its inverse work), that device
   decomposes it, and every device's results are broadcast from it
   (`comm.broadcast`, all roots' binomial trees together, one packed buffer
   per root, staged in comm_buffers). Without it every device decomposes
   every factor and nothing is sent.
3. the gradients of the preconditioned layers are replaced by the K-FAC update
   (charged as the preconditioning matmuls' FLOPs).

Factor, inversion and preconditioning work is charged on the device's compute
stream as kind "optimizer" (it is the optimizer's work), and the
communication as "communication" with labels "kfac factors" and "kfac
inverses". The memory ledger holds the factors and decompositions as `kfac`.
`report_section(steps)` is report.json's `kfac` section: time per step split
into factors, communication, inversions and preconditioning (averaged over
devices), and which device decomposes which factor.

    kfac = DistributedKfac(replicas, job.devices, lambda rank: scheme.comms.dp_cp[rank], scenario.train.optimizer)
    ... yield from kfac.step(rank)      # after the gradient's all-reduce; then the base optimizer steps
"""
import torch
from pydantic import Field

from ..comm.broadcast import broadcast
from ..hw.device import Device
from ..report.sections import ReportSection, register_section
from ..scenario import OptimizerSpec
from ..train.kfac import Kfac
from ..train.replica import Replica
from ..step_ops import Alloc, Collective, Compute, Free

PARTS = ("factors", "communication", "inversions", "preconditioning")
_DTYPE = "fp32"  # factors, decompositions and preconditioning run in fp32 (bf16 gradients are upcast)


def assign_inverses(costs: list[float], world: int) -> list[int]:
    """Greedy LPT: the device of each factor, largest cost first to the least-loaded device."""
    loads = [0.0] * world
    owner = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        device = min(range(world), key=lambda r: (loads[r], r))
        owner[index] = device
        loads[device] += costs[index]
    return owner


class DistributedKfac:
    """K-FAC across the replicas of a synchronous data-parallel group: the job's ranks, in order, each holding
    the whole model (`replicas`, by job rank); `group(rank)` is the rank's Membership of that group
    (parallel/communicators.py: its communicator, its index there, the group's all-reduce)."""

    def __init__(self, replicas: list[Replica], devices: list[Device], group, options: OptimizerSpec):
        # One K-FAC state per replica this process holds (a real run holds one: the others are None), on the
        # share's one chunk: the whole model, its layers named as the model names them.
        self.kfacs = [None if replica is None else Kfac(replica.model.chunks[0], options) for replica in replicas]
        for replica in replicas:
            if replica is not None:
                replica.run_every_step()  # the hooks capture every forward and backward, numerics off too
        self.devices = devices
        self.group = group
        self.world = len(replicas)
        self.method = options.method
        factors = next(kfac for kfac in self.kfacs if kfac is not None).factors
        self.costs = [float(factor.size) ** 3 for factor in factors]
        self.owner = assign_inverses(self.costs, self.world) if options.distribute_inverses else None
        self.seconds = [dict.fromkeys(PARTS, 0.0) for _ in range(self.world)]

    def memory_bytes(self, rank: int) -> int:
        """Bytes rank's K-FAC state holds (factors and decompositions): the `kfac` category."""
        return self.kfacs[rank].memory_bytes()

    def step(self, rank: int):
        """Step program: this rank's K-FAC work between the gradient all-reduce and the step."""
        kfac = self.kfacs[rank]
        comm, index, all_reduce = self.group(rank)
        if kfac.factor_update_due():
            yield self._compute(rank, kfac.compute_batch_factors(), "factors")
            if all_reduce is not None:
                program = all_reduce(index, comm.world, kfac.factor_buffer, average=True)
                self.seconds[rank]["communication"] += yield Collective(program, "kfac factors", comm, index)
            kfac.update_running_factors()
        if kfac.inverse_update_due():
            mine = [j for j in range(len(kfac.factors)) if self.owner is None or self.owner[j] == index]
            yield self._compute(rank, sum(kfac.decompose(j) for j in mine), "inversions")
            if self.owner is not None and self.world > 1:
                yield from self._share_decompositions(rank, kfac, comm, index)
        yield self._compute(rank, kfac.precondition(), "preconditioning")

    def _share_decompositions(self, rank: int, kfac: Kfac, comm, index: int):
        """Broadcast every device's decompositions from it, one packed buffer per device, on the group's
        communicator `comm` (the rank's `index` there)."""
        owned = {root: [j for j in range(len(kfac.factors)) if self.owner[j] == root] for root in range(self.world)}
        buffers = {}
        for root, indices in owned.items():
            if not indices:
                continue
            if root == index:
                buffers[root] = torch.cat([t.reshape(-1) for j in indices for t in kfac.decomposition(j)])
            else:
                buffers[root] = torch.empty(sum(kfac.decomposition_numel(j) for j in indices), device=kfac.device)
        staged = sum(buffer.nbytes for root, buffer in buffers.items() if root != index)
        yield Alloc("comm_buffers", staged)
        self.seconds[rank]["communication"] += yield Collective(broadcast(index, self.world, buffers),
                                                                "kfac inverses", comm, index)
        for root, buffer in buffers.items():
            if root == index:
                continue
            offset = 0
            for j in owned[root]:
                for tensor in kfac.decomposition(j):
                    tensor.copy_(buffer[offset:offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()
        yield Free("comm_buffers", staged)

    def _compute(self, rank: int, flops: float, part: str) -> Compute:
        self.seconds[rank][part] += self.devices[rank].compute_time(flops, _DTYPE)
        return Compute(flops, _DTYPE, f"kfac {part}", kind="optimizer")

    def single_device_step_s(self, steps: int) -> float:
        """Seconds per step one device alone would spend on K-FAC: all of it, nothing sent."""
        kfac, device = self.kfacs[0], self.devices[0]
        updates = -(-steps // kfac.options.inv_update_steps)  # steps 0, k, 2k, ... < steps
        inversions = updates * sum(kfac.decompose_flops(j) for j in range(len(kfac.factors)))
        own = self.seconds[0]
        return (own["factors"] + own["preconditioning"]) / steps + device.compute_time(inversions, _DTYPE) / steps

    def report_section(self, steps: int) -> dict:
        """report.json's `kfac` section."""
        per_step = {part: sum(seconds[part] for seconds in self.seconds) / self.world / steps for part in PARTS}
        layers = self.kfacs[0].layers
        assignment = [
            {"layer": layers[factor.layer].name, "factor": factor.side, "size": factor.size,
             "device": "all" if self.owner is None else self.owner[j]}
            for j, factor in enumerate(self.kfacs[0].factors)
        ]
        loads = [0.0] * self.world
        for j, cost in enumerate(self.costs):
            for device in ([self.owner[j]] if self.owner is not None else range(self.world)):
                loads[device] += cost
        return {"kfac": {
            "method": self.method,
            "distribute_inverses": self.owner is not None,
            "time_per_step_s": per_step,
            "assignment": assignment,
            "inversion_cost_n3_per_device": loads,
        }}


class KfacFactor(ReportSection):
    layer: str = Field(description="the layer the factor belongs to")
    factor: str = Field(description="which Kronecker factor: A (activations) or G (gradients)")
    size: int = Field(description="the factor's side, n (an n x n matrix)")
    device: int | str = Field(description="the rank that inverts it; all: every rank does")


class KfacTimes(ReportSection):
    factors: float = Field(description="seconds computing factors")
    inversions: float = Field(description="seconds inverting (or eigendecomposing) factors")
    preconditioning: float = Field(description="seconds preconditioning gradients")
    communication: float = Field(description="seconds all-reducing factors and broadcasting inverses")


class KfacSection(ReportSection):
    method: str = Field(description="how factors are inverted: inverse or eigen")
    distribute_inverses: bool = Field(description="whether each factor is inverted on one rank and broadcast")
    time_per_step_s: KfacTimes = Field(description="seconds per step of each part, averaged over the ranks")
    assignment: list[KfacFactor] = Field(description="every factor and the rank that inverts it")
    inversion_cost_n3_per_device: list[float] = Field(description="sum of n^3 over the factors each rank inverts")


register_section("kfac", KfacSection, "K-FAC's factors, their placement and its time (strategies/kfac_sync.py)")
