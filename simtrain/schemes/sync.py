"""Synchronous data parallelism: compute, all-reduce (naive | ring | tree), step.

Every step, each device runs forward and backward on its own batch (real
torch, charged as FLOPs on its compute stream), the group all-reduces the
gradient bucket with the chosen collective (real chunks over the simulated
network), and every replica applies the same averaged gradient with its own
optimizer (real, charged as memory-bound work). A device that finishes early
waits inside the all-reduce for the others: that wait is its idle time.

    scheme = SyncDataParallel(cluster, replicas, algorithm="ring", steps=200)
    scheme.start(); cluster.env.run()
"""
from ..comm import ALL_REDUCE
from ..comm.simulated import SimCommunicator
from ..cost import StepCost, measure_step_cost
from ..hw.cluster import Cluster
from ..train.optim import optimizer_state_bytes, optimizer_step_bytes
from ..train.replica import Replica


class SyncDataParallel:
    """Data-parallel training with a synchronous gradient all-reduce every step."""

    def __init__(self, cluster: Cluster, replicas: list[Replica], algorithm: str, steps: int,
                 optimizer: str, optimizer_options: dict, dtype: str = "fp32", on_step=None):
        self.cluster = cluster
        self.replicas = replicas
        self.world = len(replicas)
        self.devices = cluster.devices[: self.world]
        self.all_reduce = ALL_REDUCE[algorithm]
        self.steps = steps
        self.dtype = dtype
        self.on_step = on_step  # called as on_step(step, sim_time_s, mean_loss) when a step ends
        self.comm = SimCommunicator(cluster.network, [d.node for d in self.devices], log=cluster.log,
                                    ledgers=[d.memory for d in self.devices])
        param_bytes = replicas[0].param_bytes
        self._state_bytes = optimizer_state_bytes(optimizer, optimizer_options, param_bytes)
        self._step_bytes = optimizer_step_bytes(optimizer, optimizer_options, param_bytes)
        self._costs: dict[tuple, StepCost] = {}
        self._step_losses = [[None] * self.world for _ in range(steps)]
        self.loss_curve: list[tuple[float, float]] = []  # (sim_time_s, mean loss over devices)

    def step_cost(self, replica: Replica) -> StepCost:
        """FLOPs and activation bytes of one forward+backward, measured once per input shape."""
        x, y = replica.last_batch
        key = tuple(x.shape)
        if key not in self._costs:
            self._costs[key] = measure_step_cost(replica.model, x, y)
        return self._costs[key]

    def single_device_step_s(self) -> float:
        """Seconds one device alone needs for a step on its own batch: no communication."""
        cost = next(iter(self._costs.values()))
        device = self.devices[0]
        return (device.compute_time(cost.forward_flops + cost.backward_flops, self.dtype)
                + device.memory_bound_time(self._step_bytes))

    def start(self) -> None:
        for rank in range(self.world):
            self.cluster.env.process(self._train(rank))

    def _train(self, rank: int):
        device, replica = self.devices[rank], self.replicas[rank]
        memory = device.memory
        memory.alloc("weights", replica.param_bytes)
        memory.alloc("gradients", replica.grad_buffer.numel() * replica.grad_buffer.element_size())
        memory.alloc("optimizer_state", self._state_bytes)
        for step in range(self.steps):
            if replica.loader.host_seconds > 0:  # prioritized/mh bookkeeping, before the batch exists
                yield device.run_for(replica.loader.host_seconds, "sample batch", kind="sampling")
            loss = replica.forward_backward()
            cost = self.step_cost(replica)
            memory.alloc("activations", cost.activation_bytes)
            yield device.compute(cost.forward_flops, self.dtype, "forward")
            yield device.compute(cost.backward_flops, self.dtype, "backward")
            memory.free("activations", cost.activation_bytes)
            self._step_losses[step][rank] = loss
            program = self.all_reduce(rank, self.world, replica.grad_buffer, average=True)
            yield self.comm.run(rank, program, label="all_reduce")
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
        if self.on_step is not None:
            self.on_step(step, now, mean_loss)
