"""The real backend: one job rank per process of a torch.distributed group, run and timed for real.

What a job asks of its backend (simtrain/backend/), for a process that is
rank `rank` of the world: it holds that job rank only; its communicators are
GlooCommunicators (comm/gloo.py), each group its own process group; a group's
all-reduce is the scenario's program over point-to-point calls, or with
`collective="native"` one `dist.all_reduce` on the group; a step program runs
to its end with the host-clock interpreter (real/interpreter.py), its spans
on `meter`.

Every process builds the same job, so every process asks for the same
communicators in the same order: torch's `new_group` needs exactly that.

    backend = RealBackend(rank, Meter(), collective="programs")
    job = Job(scenario, cluster, range(world), backend=backend)
    backend.start(job, rank, job.scheme.program(rank))
"""
import torch.distributed as dist

from ..comm import build_all_reduce
from ..comm.gloo import GlooCommunicator
from .interpreter import Meter, run_program


class RealBackend:
    """Job rank `rank` in this process; the others in the group's other processes."""

    def __init__(self, rank: int, meter: Meter, collective: str = "programs"):
        self.rank = rank
        self.meter = meter
        self.collective = collective
        self._groups: dict[tuple[int, ...], GlooCommunicator] = {}  # job ranks -> their communicator

    def local_ranks(self, world: int) -> list[int]:
        return [self.rank]

    def communicator(self, job, ranks: list[int], exclusive: bool = False, copies: int = 1) -> GlooCommunicator:
        key = tuple(ranks)
        if key not in self._groups:
            self._groups[key] = GlooCommunicator([job.ranks[rank] for rank in ranks])
        return self._groups[key]

    def all_reduce(self, job, ranks: list[int]):
        if self.collective == "native":
            group = self.communicator(job, ranks).group
            return lambda rank, world, buf, average=False: native_all_reduce(buf, world, average, group)
        parallel = job.scenario.parallel
        return build_all_reduce(parallel.all_reduce, job.cluster.topology, [job.devices[rank].node for rank in ranks],
                                parallel.channels, "parallel.all_reduce", "parallel.channels")

    def start(self, job, rank: int, program):
        """Run the rank's program to its end, for real; its value."""
        return run_program(program, job.comm, job.devices[rank].memory, self.meter)


def native_all_reduce(buf, world: int, average: bool, group):
    """A collective program that is one `dist.all_reduce` on `group` (it yields no Send or Recv)."""
    dist.all_reduce(buf, group=group)
    if average:
        buf.div_(world)
    return buf
    yield  # a generator: a collective program like the others
