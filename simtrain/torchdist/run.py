"""One `spawn`: the simulated cluster, the rank threads' turns, the process groups, each rank's compute.

A `SimRun` is what the backend's process groups and `simtrain.dist.compute`
reach from a rank's thread. It owns the cluster (hw/cluster.py), the `Turns`
that run the rank threads one at a time (scheduler.py), the groups by name
(process_group.py) and each rank's `OpMeter` (op_meter.py), whose FLOPs are
charged on the rank's device whenever the rank posts a communication
(`flush`), waits, calls `compute` or ends.

    run = SimRun(cluster, world=4, algorithm="ring", channels=None)
    run.start(rank, body)            # for each rank, then:
    values = run.finish()            # the ranks' return values, or RankFailed / Deadlock

Inside a rank, `SimRun.active(caller)` is the run and `run.bytes_sent(rank)` what a
rank has sent so far (completed transfers, all groups and point-to-point).
"""
from contextlib import nullcontext

import simpy

from ..errors import SimtrainError
from ..hw.cluster import Cluster, run_to_end
from .numerics_off import FakeFloats
from .op_meter import DEVICE_DTYPE, OpMeter
from .process_group import Group
from .scheduler import Turns, current_rank


class SimRun:
    """The simulated side of one spawn, shared by its rank threads."""

    _active: "SimRun | None" = None

    def __init__(self, cluster: Cluster, world: int, algorithm: str, channels: int | None, numerics: bool = True,
                 timeout_s: float | None = None):
        self.cluster = cluster
        self.fake_floats = None if numerics else FakeFloats()  # numerics off: shared by the ranks
        self.world = world
        self.algorithm = algorithm
        self.channels = channels
        self.env: simpy.Environment = cluster.env
        self.turns = Turns(self.env, timeout_s)
        self.groups: dict[str, Group] = {}
        self.meters = [OpMeter(device.memory) for device in cluster.devices]
        self.end_s = [None] * world  # simulated time each rank's function returned

    @classmethod
    def active(cls, caller: str) -> "SimRun":
        """The run of the calling rank's thread; SimtrainError naming `caller` outside one."""
        if cls._active is None or current_rank() is None:
            raise SimtrainError(f"{caller}: only inside a rank of simtrain.dist.spawn")
        return cls._active

    def group(self, name: str, ranks: list[int]) -> Group:
        """The group called `name` (torch names groups alike on every rank), made by its first member."""
        group = self.groups.get(name)
        if group is None:
            group = self.groups[name] = Group(self, ranks)
        return group

    def start(self, rank: int, body) -> None:
        """Run `body()` as rank `rank`, its torch ops counted; its end time is recorded."""
        def counted():
            with self.fake_floats or nullcontext(), self.meters[rank]:
                value = body()
                self.flush()
            self.end_s[rank] = self.env.now
            return value

        self.turns.start(rank, counted)

    def finish(self) -> list:
        """Run the clock to the end; the ranks' values (RankFailed or Deadlock if they do not all end)."""
        SimRun._active = self
        try:
            self.turns.run(run_to_end)
        finally:
            SimRun._active = None
        return self.turns.close()

    def flush(self) -> None:
        """Charge the calling rank's counted FLOPs on its device, and wait until they have run."""
        rank = current_rank()
        pending = self.meters[rank].take_flops()
        if pending:
            device = self.cluster.devices[rank]
            for dtype, flops in pending.items():
                done = device.compute(flops, DEVICE_DTYPE.get(dtype, "fp32"), "torch ops")
            self.turns.wait(done, "its compute")

    def backend(self):
        """A block of the backend's own work in the calling rank: its ops are not the rank's (OpMeter.paused)."""
        return self.meters[current_rank()].paused()

    def compute(self, flops: float, dtype: str = "fp32", name: str = "compute") -> None:
        """Charge `flops` of `dtype` on the calling rank's device (after its counted ops), and wait."""
        self.flush()
        self.turns.wait(self.cluster.devices[current_rank()].compute(flops, dtype, name), name)

    def wait(self, event: simpy.Event, what) -> None:
        """The calling rank waits for `event` (after its counted compute); `what` names it in a deadlock."""
        self.flush()
        self.turns.wait(event, what)

    @property
    def now_s(self) -> float:
        """The simulated time now, in seconds."""
        return self.env.now

    def bytes_sent(self, rank: int) -> int:
        """Bytes of the transfers rank `rank` sent that have completed so far."""
        node = self.cluster.devices[rank].node
        return sum(record.nbytes for record in self.cluster.network.records if record.src == node)

    def bytes_received(self, rank: int) -> int:
        """Bytes of the transfers rank `rank` received that have completed so far."""
        node = self.cluster.devices[rank].node
        return sum(record.nbytes for record in self.cluster.network.records if record.dst == node)
