"""Synchronous data parallelism: compute, all-reduce (comm.ALGORITHMS, over channels), step.

Every step, each device runs forward and backward on its own batch (real
torch, charged as FLOPs on its compute stream), the group all-reduces the
gradient bucket with the chosen collective (real chunks over the simulated
network), and every replica applies the same averaged gradient with its own
optimizer (real, charged as memory-bound work). A device that finishes early
waits inside the all-reduce for the others: that wait is its idle time.

    scheme = SyncDataParallel(cluster, replicas, algorithm="ring", steps=200)
    scheme.start(); cluster.env.run()

With `optimizer="kfac"` the K-FAC work (factors averaged with the same
collective, inversions shared out and broadcast, preconditioning) runs between
the all-reduce and the base optimizer's step (schemes/kfac_sync.py). With
`sync_batchnorm` each forward and backward all-reduces the BatchNorm
statistics with the same collective (train/syncbn.py). Rank 0's per-layer
weight norms are recorded before training and every `report_every` steps.

The replicas' precision sets the dtype FLOPs are charged in (the device's peak
for fp16/bf16) and the bucket's dtype (what the all-reduce moves); the device
ledger holds the replica's persistent bytes (train/precision.py) for the whole
run and the measured activation peak during forward and backward, where a
checkpointed segment's recomputation is part of the backward FLOPs. A ledger
past its capacity raises OutOfMemory at that step.
"""
from ..comm import build_all_reduce
from ..comm.simulated import SimCommunicator
from ..hw.cluster import Cluster
from ..errors import ScenarioError
from ..train.precision import persistent_bytes, update_bytes
from ..train.models import layers_before_batchnorm, weight_norms
from ..train.replica import Replica
from ..train.syncbn import synced_batchnorms
from .kfac_sync import DistributedKfac
from .local_work import charge_forward_backward, charge_sampling


class SyncDataParallel:
    """Data-parallel training with a synchronous gradient all-reduce every step."""

    def __init__(self, cluster: Cluster, replicas: list[Replica], algorithm: str, steps: int,
                 optimizer: str, optimizer_options: dict, on_step=None, sync_batchnorm: bool = False,
                 report_every: int = 10, channels: int | None = None):
        self.cluster = cluster
        self.replicas = replicas
        self.world = len(replicas)
        self.devices = cluster.devices[: self.world]
        self.all_reduce = build_all_reduce(algorithm, cluster.topology, [d.node for d in self.devices], channels,
                                           "parallel.scheme", "parallel.channels")
        self.steps = steps
        self.on_step = on_step  # called as on_step(step, sim_time_s, mean_loss) when a step ends
        self.comm = SimCommunicator(cluster.network, [d.node for d in self.devices], log=cluster.log,
                                    ledgers=[d.memory for d in self.devices])
        params, precision = replicas[0].params, replicas[0].precision.name
        self._held_bytes = persistent_bytes(params, precision, optimizer, optimizer_options)
        self._step_bytes = update_bytes(params, precision, optimizer, optimizer_options)
        self._step_losses = [[None] * self.world for _ in range(steps)]
        self.loss_curve: list[tuple[float, float]] = []  # (sim_time_s, mean loss over devices)
        self.kfac = None
        if optimizer == "kfac":
            self.kfac = DistributedKfac(replicas, self.devices, self.comm, self.all_reduce, optimizer_options,
                                        dtype="fp32")
        self.sync_batchnorm = sync_batchnorm
        if sync_batchnorm:
            try:
                synced_batchnorms(replicas[0].model)
            except ValueError as error:
                raise ScenarioError(f"parallel.sync_batchnorm: {error}") from None
        self.report_every = report_every
        self._norm_steps = [0]
        self._norms = {name: [norm] for name, norm in weight_norms(replicas[0].model).items()}

    def single_device_step_s(self) -> float | None:
        """Seconds one device alone needs for a step on its own batch: no communication."""
        replica, device = self.replicas[0], self.devices[0]
        if replica.last_batch is None:  # stopped (out of memory) before any step
            return None
        cost = replica.step_cost()
        kfac = self.kfac.single_device_step_s(self.steps) if self.kfac is not None else 0.0
        return (device.compute_time(cost.forward_flops + cost.backward_flops, replica.precision.name)
                + device.memory_bound_time(self._step_bytes) + kfac)

    def start(self) -> None:
        for rank in range(self.world):
            self.cluster.env.process(self._train(rank))

    def _train(self, rank: int):
        device, replica = self.devices[rank], self.replicas[rank]
        memory = device.memory
        for category, nbytes in self._held_bytes.items():
            memory.alloc(category, nbytes)
        for step in range(self.steps):
            yield from charge_sampling(device, replica)
            if self.sync_batchnorm:
                loss = yield from self._serve_statistics(rank, replica.sync_batchnorm_forward_backward())
            else:
                loss = replica.forward_backward()
            yield from charge_forward_backward(device, replica)
            self._step_losses[step][rank] = loss
            program = self.all_reduce(rank, self.world, replica.grad_buffer, average=True)
            yield self.comm.run(rank, program, label="all_reduce")
            if self.kfac is not None:
                yield from self.kfac.step(rank)
            replica.step()
            yield device.memory_bound(self._step_bytes, "optimizer step", kind="optimizer")
            if rank == 0:
                self._end_step(step)

    def _end_step(self, step: int) -> None:
        # Every rank posted its gradient before rank 0's all-reduce could finish,
        # so all losses of this step are in.
        losses = self._step_losses[step]
        mean_loss = float(sum(loss.item() for loss in losses)) / self.world
        self._step_losses[step] = None
        now = self.cluster.env.now
        self.loss_curve.append((now, mean_loss))
        if (step + 1) % self.report_every == 0 or step + 1 == self.steps:
            self._norm_steps.append(step + 1)
            for name, norm in weight_norms(self.replicas[0].model).items():
                self._norms[name].append(norm)
        if self.on_step is not None:
            self.on_step(step, now, mean_loss)

    def _serve_statistics(self, rank: int, program):
        """Drive a SyncBN forward/backward: sum each StatsAllReduce buffer across ranks; return its loss."""
        try:
            request = next(program)
            while True:
                summed = self.all_reduce(rank, self.world, request.buffer)
                yield self.comm.run(rank, summed, label="sync_batchnorm")
                request = program.send(None)
        except StopIteration as stop:
            return stop.value

    def report_sections(self) -> dict:
        """report.json's `weight_norms` (and `kfac` with K-FAC): technique sections of this scheme."""
        sections = {"weight_norms": {
            "steps": list(self._norm_steps),
            "layers": {name: list(norms) for name, norms in self._norms.items()},
            "before_batchnorm": layers_before_batchnorm(self.replicas[0].model),
        }}
        if self.kfac is not None:
            sections.update(self.kfac.report_section(self.steps))
        return sections
