"""One `spawn`: the simulated cluster, the rank threads' turns, the process groups, each rank's compute.

A `SimRun` is what the backend's process groups and `simtrain.dist.compute`
reach from a rank's thread. It owns the cluster (hw/cluster.py), the `Turns`
that run the rank threads one at a time (scheduler.py), the groups by name
(process_group.py) and each rank's `OpMeter` (op_meter.py), whose FLOPs are
charged on the rank's device whenever the rank posts a communication
(`flush`), waits, calls `compute` or ends.

    run = SimRun(cluster, world=4, algorithm="ring", channels=None)
    run.start(rank, body)            # for each rank that runs (run.runs(rank)), then:
    values = run.finish()            # the ranks' return values, or RankFailed / Deadlock

With `representatives` (numerics off, representatives.py) only a representative
of each class of alike ranks runs, and the witness detached; `stand_ins` are the
ranks a representative's post stands for, `reported_as(rank)` the rank whose
end time, compute and memory a rank reports.

Inside a rank, `SimRun.active(caller)` is the run and `run.bytes_sent(rank)` what a
rank has sent so far (completed transfers, all groups and point-to-point).
"""
from contextlib import nullcontext

import simpy

from ..errors import CollectiveMismatch, Deadlock, SimtrainError
from ..hw.cluster import Cluster, run_to_end
from .numerics_off import FakeFloats
from .op_meter import OpMeter
from .process_group import BELOW_AUTOGRAD, Group, SimWork
from .representatives import Classes, Representatives, Witness
from .scheduler import Turns, current_rank


class SimRun:
    """The simulated side of one spawn, shared by its rank threads."""

    _active: "SimRun | None" = None

    def __init__(self, cluster: Cluster, world: int, algorithm: str, channels: int | None, numerics: bool = True,
                 timeout_s: float | None = None, representatives: Representatives | None = None):
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
        self.collective_end_s = [None] * world  # when each rank's latest collective ended
        self.classes = None if representatives is None else Classes(representatives, world)
        self.witness = None if self.classes is None or self.classes.witness is None else Witness(self.classes)

    @classmethod
    def active(cls, caller: str) -> "SimRun":
        """The run of the calling rank's thread; SimtrainError naming `caller` outside one."""
        if cls._active is None or current_rank() is None:
            raise SimtrainError(f"{caller}: only inside a rank of simtrain.dist.spawn")
        return cls._active

    def group(self, name: str, ranks: list[int]) -> Group:
        """The group called `name` (torch names groups alike on every rank), made by its first member;
        CollectiveMismatch where a member makes it of other ranks than the first did."""
        group = self.groups.get(name)
        if group is None:
            group = self.groups[name] = Group(self, ranks)
        elif group.ranks != list(ranks):
            raise CollectiveMismatch(f"new_group: rank {current_rank()} makes group {name} of ranks {list(ranks)}, "
                                     f"which another rank made of ranks {group.ranks} (every rank calls new_group "
                                     f"with the same ranks, in the same order)")
        return group

    def runs(self, rank: int) -> bool:
        """Whether rank `rank`'s function runs (without representatives, every rank's does)."""
        return self.classes is None or self.classes.runs(rank)

    def reported_as(self, rank: int) -> int:
        """The rank whose compute and memory rank `rank` reports: its representative, or itself."""
        return rank if self.classes is None else self.classes.representative(rank)

    def rank_end_s(self, rank: int) -> float:
        """When rank `rank`'s function returned. A represented rank's: its representative's, or, if that one
        returned as its last collective ended, when the rank's own part of that collective ended."""
        source = self.reported_as(rank)
        if source != rank and self.end_s[source] == self.collective_end_s[source]:
            return self.collective_end_s[rank]
        return self.end_s[source]

    def start(self, rank: int, body) -> None:
        """Run `body()` as rank `rank`, its torch ops counted; its end time is recorded."""
        def counted():
            with self.fake_floats or nullcontext(), self.meters[rank]:
                value = body()
                self.flush()
            self.end_s[rank] = self.env.now
            if self.witness is not None and self.witness.watches(rank):
                self.witness.ended(rank)
            return value

        self.turns.start(rank, counted)

    def finish(self) -> list:
        """Run the clock to the end; the ranks' values (RankFailed, Deadlock or RepresentativesDiverge if they do
        not all end alike). A represented rank's value is its representative's."""
        SimRun._active = self
        try:
            with BELOW_AUTOGRAD():  # the collectives' writes, run by the clock (process_group.py)
                self.turns.run(run_to_end)
        finally:
            SimRun._active = None
        try:
            values = dict(zip([rank for rank in range(self.world) if self.runs(rank)], self.turns.close()))
        except Deadlock:
            if self.witness is not None:  # the witness waits on a call rank 0 never made
                self.witness.check()
            raise
        if self.witness is not None:
            self.witness.check()
        return [values[rank] if rank in values else values[self.reported_as(rank)] for rank in range(self.world)]

    def stand_ins(self, group: Group, me: int, call: str) -> list[tuple[Group, int]]:
        """(group, group rank) of each rank that group rank `me`'s post of `call` stands for (representatives.py):
        the group itself or its mirror."""
        if self.classes is None:
            return []
        stand_ins = []
        for _, ranks, index in self.classes.stand_ins(group.ranks, me, call):
            mirror = group if ranks == group.ranks else group.mirrors.get(tuple(ranks))
            if mirror is None:
                mirror = group.mirrors[tuple(ranks)] = Group(self, ranks)
            stand_ins.append((mirror, index))
        return stand_ins

    def detached(self, ranks: list[int], call: str) -> bool:
        """The calling rank calls `call` in group `ranks`: recorded if the witness watches it; whether it is the
        witness, whose calls are not run (`witness_work`)."""
        rank = current_rank()
        if self.witness is None or not self.witness.watches(rank):
            return False
        self.witness.called(rank, ranks, call, self.meters[rank].allocated_bytes)
        return rank != 0

    def witness_work(self, call: str, result) -> SimWork:
        """The witness's work: it moves nothing (Witness.witness_done)."""
        return SimWork(self, self.witness.witness_done(self.env, result), call, result)

    def posted(self, work: SimWork) -> SimWork:
        """The calling rank posted `work`: kept for the witness if the rank is 0."""
        if self.witness is not None and current_rank() == 0:
            self.witness.posted(work._done, work._result)
        return work

    def flush(self) -> None:
        """Charge the calling rank's counted FLOPs on its device, and wait until they have run (the witness's are
        recorded instead)."""
        rank = current_rank()
        meter = self.meters[rank]
        pending, ops = meter.take_flops(), meter.take()
        if pending and self.witness is not None and self.witness.watches(rank):
            self.witness.computed(rank, pending)
            if rank != 0:
                return
        if pending:
            # the operators at their own rate dtypes (op_cost.py), under the cluster's compute model
            done = self.cluster.devices[rank].compute(sum(pending.values()), "fp32", "torch ops", ops=ops)
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

    def bytes_sent_by_rank(self) -> list[int]:
        """Bytes of the transfers each rank sent that have completed so far, in rank order."""
        by_node = {}
        for record in self.cluster.network.records:
            by_node[record.src] = by_node.get(record.src, 0) + record.nbytes
        return [by_node.get(device.node, 0) for device in self.cluster.devices]

    def bytes_received(self, rank: int) -> int:
        """Bytes of the transfers rank `rank` received that have completed so far."""
        node = self.cluster.devices[rank].node
        return sum(record.nbytes for record in self.cluster.network.records if record.dst == node)
