"""One rank simulated for many that do the same: a model-parallel job's representatives.

On identical devices, every data-parallel replica of a model-parallel job runs
the same schedule at the same times, and the tp ranks of a stage run the same
program in lockstep. With `parallel.representatives: true` (numerics off, no
faults, no per-device differences) only the ranks with tp = 0 in replica 0
run their step programs: one rank per pipeline stage. Their pipeline sends
cross the simulated network as flows, as before. Their collectives are timed
at the collective level: a tp all-reduce, or the dp all-reduce of a stage's
gradients, takes the time that all-reduce takes when the representative's
group and every group mirroring it (the same stage's tp group in the other
replicas; the dp groups of the stage's other tp ranks) run it at the same
moment alone on an idle copy of the cluster's network, with the job's
algorithm and channels: the flow model's own time, cached by groups and size.
Each group is first timed alone (as a ring schedule, comm/ring_schedule.py,
where it is one); when no two of them crossed a common link, that is their
time together too, else they run again all at once, flow by flow.
Every other rank reports its representative's figures.

What that leaves out is contention between a collective and traffic other
than its mirrors' (a pipeline send still on a NIC when the dp all-reduce
starts there, another stage's all-reduce on a shared switch uplink); on
links sized for all of them, as in a non-blocking fat tree, that is small.
tests/test_representatives.py puts the figures beside the full simulation's.
It is what lets a 3,072-GPU Megatron step be simulated in minutes.

    collectives = MirroredCollectives(job)
    seconds, nbytes, staging = collectives.all_reduce([tp_group_nodes, *mirror_group_nodes], buffer)
"""
import simpy
import torch

from ..comm import build_all_reduce
from ..comm.simulated import SimCommunicator
from ..hw.cluster import run_to_end
from ..hw.device import MemoryLedger
from ..hw.network import Network


def representative_ranks(layout) -> list[int]:
    """The job ranks whose programs run for all: tp 0 of replica 0, one per pipeline stage."""
    return [layout.rank(pp=stage) for stage in range(layout.pp)]


class MirroredCollectives:
    """All-reduce times of groups that run an all-reduce together, on an idle copy of a job's network."""

    def __init__(self, job):
        parallel, topology = job.scenario.parallel, job.cluster.topology
        self._env = simpy.Environment()
        self._network = Network(self._env, topology, record=True)  # records: the links each group crosses
        self._program = lambda nodes: build_all_reduce(parallel.scheme, topology, nodes, parallel.channels,
                                                       "parallel.scheme", "parallel.channels")
        self._timed: dict[tuple, tuple[float, int, int]] = {}

    def all_reduce(self, groups: list[tuple[str, ...]], buffer: torch.Tensor) -> tuple[float, int, int]:
        """(seconds, bytes the first group sends, the largest staging buffer of its first rank) of an all-reduce
        of `buffer`'s shape and dtype started at once by every group of `groups` (each a tuple of network
        nodes, in group-rank order)."""
        key = (tuple(groups), buffer.numel(), buffer.dtype)
        if key not in self._timed:
            self._timed[key] = self._simulate(groups, buffer)
        return self._timed[key]

    def _simulate(self, groups: list[tuple[str, ...]], buffer: torch.Tensor) -> tuple[float, int, int]:
        """Each group alone first; if no two of them crossed a common link, that is also their time together,
        else they run again, all at once, flow by flow."""
        alone = [self._run([nodes], buffer, exclusive=True) for nodes in groups]
        links = [links for _, _, _, links in alone]
        _, nbytes, staging, _ = alone[0]
        if sum(len(used) for used in links) == len(set().union(*links)):
            return max(seconds for seconds, _, _, _ in alone), nbytes, staging
        seconds, _, _, _ = self._run(groups, buffer, exclusive=False)
        return seconds, nbytes, staging

    def _run(self, groups: list[tuple[str, ...]], buffer: torch.Tensor,
             exclusive: bool) -> tuple[float, int, int, set]:
        """(seconds, bytes the first group sent, its first rank's largest staging buffer, directed links
        crossed) of the groups' all-reduces."""
        env, network = self._env, self._network
        started, finished, comms = env.now, [], []
        first_record = len(network.records)
        staging = MemoryLedger("staging", float("inf"))
        for index, nodes in enumerate(groups):
            ledgers = [staging if index == rank == 0 else MemoryLedger("staging", float("inf")) for rank in
                       range(len(nodes))]
            comm = SimCommunicator(network, list(nodes), ledgers=ledgers, exclusive=exclusive)
            program = self._program(list(nodes))
            for rank in range(len(nodes)):
                meta = torch.empty(buffer.shape, dtype=buffer.dtype, device="meta")
                comm.run(rank, program(rank, len(nodes), meta)).callbacks.append(lambda _: finished.append(env.now))
            comms.append(comm)
        run_to_end(env)
        links = {hop for record in network.records[first_record:] for hop in zip(record.path, record.path[1:])}
        del network.records[first_record:]
        return (max(finished) - started, comms[0].bytes_by_label.get("all_reduce", 0),
                staging.peak.get("comm_buffers", 0), links)
