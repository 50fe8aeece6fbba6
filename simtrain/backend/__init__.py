"""Where a job's ranks run: the backend supplies its local ranks, its communicators and its interpreter.

A job (job.py) asks its backend, never anything else, for what depends on
where it runs:

- `local_ranks(world)`: the job ranks whose replicas this process holds;
- `communicator(job, ranks, exclusive)`: a group of job ranks that runs
  per-rank programs (comm/ops.py) together, by `run(rank, program, label)`,
  `post(rank, program, label)` and `wait(handle, idle)`: the one mailbox;
- `all_reduce(job, ranks)`: the all-reduce program the scenario's
  algorithm gives that group (comm.build_all_reduce);
- `start(job, rank, program)`: interpret a rank's step program.

`SimulatedBackend` (here) holds every rank in this process, on the cluster's
simulated network and clock: its communicators are SimCommunicators, its
interpreter (interpreter.py), which supports every step operation. The real
backend (simtrain/real/backend.py) holds one rank per process of a
torch.distributed group, with gloo communicators and a host-clock interpreter.

    job = Job(scenario, cluster, ranks=range(cluster.size), backend=SimulatedBackend())
"""
from ..comm import build_all_reduce
from ..comm.simulated import SimCommunicator
from .interpreter import run_program


class SimulatedBackend:
    """Every rank of the job in this process, on the cluster's simulated network and clock."""

    def local_ranks(self, world: int) -> list[int]:
        return list(range(world))

    def communicator(self, job, ranks: list[int], exclusive: bool = False, copies: int = 1) -> SimCommunicator:
        """Job ranks `ranks` (in group-rank order) as a group on the cluster's network, logging under their
        devices' global ranks; `exclusive`: promised that its links carry nothing else; `copies`: the ranks each
        of its ranks stands for, under representatives (comm/simulated.py)."""
        devices = [job.devices[rank] for rank in ranks]
        return SimCommunicator(job.cluster.network, [device.node for device in devices], log=job.cluster.log,
                               ledgers=[device.memory for device in devices],
                               global_ranks=[device.rank for device in devices], exclusive=exclusive,
                               copies=copies, host=job.cluster.host_messages)

    def all_reduce(self, job, ranks: list[int]):
        """fn(rank, world, buf, average=False) -> the all-reduce program of the group of job ranks `ranks`."""
        parallel = job.scenario.parallel
        return build_all_reduce(parallel.all_reduce, job.cluster.topology, [job.devices[rank].node for rank in ranks],
                                parallel.channels, "parallel.all_reduce", "parallel.channels")

    def start(self, job, rank: int, program):
        """Rank `rank`'s program as a process on the cluster's clock."""
        return job.cluster.env.process(run_program(job, rank, program))
