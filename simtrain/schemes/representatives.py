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
When the mirrors' groups share no link (every route between two members of
one group is disjoint from those of the others) the representative's group
is timed alone, as a ring schedule (comm/ring_schedule.py) where it is one.
Every other rank reports its representative's figures.

What that leaves out is contention between a collective and traffic other
than its mirrors' (a pipeline send still on a NIC when the dp all-reduce
starts there, another stage's all-reduce on a shared switch uplink); on
links sized for all of them, as in a non-blocking fat tree, that is small.
tests/test_representatives.py puts the figures beside the full simulation's.
It is what lets a 3,072-GPU Megatron step be simulated in minutes.

    collectives = MirroredCollectives(job)
    seconds, nbytes = collectives.all_reduce([tp_group_nodes, *mirror_group_nodes], buffer)
"""
import simpy
import torch

from ..comm.simulated import SimCommunicator
from ..hw.cluster import run_to_end
from ..hw.network import Network


class MirroredCollectives:
    """All-reduce times of groups that run an all-reduce together, on an idle copy of a job's network."""

    def __init__(self, job):
        parallel, topology = job.scenario.parallel, job.cluster.topology
        self._env = simpy.Environment()
        self._network = Network(self._env, topology, record=False)
        self._program = lambda nodes: job.all_reduce_builder(parallel.scheme, topology, nodes, parallel.channels,
                                                             "parallel.scheme", "parallel.channels")
        self._timed: dict[tuple, tuple[float, int]] = {}

    def all_reduce(self, groups: list[tuple[str, ...]], buffer: torch.Tensor) -> tuple[float, int]:
        """(seconds, bytes the first group sends) of an all-reduce of `buffer`'s shape and dtype started at
        once by every group of `groups` (each a tuple of network nodes, in group-rank order)."""
        key = (tuple(groups), buffer.numel(), buffer.dtype)
        if key not in self._timed:
            self._timed[key] = self._simulate(groups, buffer)
        return self._timed[key]

    def _simulate(self, groups: list[tuple[str, ...]], buffer: torch.Tensor) -> tuple[float, int]:
        env = self._env
        alone = self._disjoint(groups)
        started, finished, comms = env.now, [], []
        for nodes in groups[:1] if alone else groups:
            comm = SimCommunicator(self._network, list(nodes), exclusive=alone)
            program = self._program(list(nodes))
            for rank in range(len(nodes)):
                meta = torch.empty(buffer.shape, dtype=buffer.dtype, device="meta")
                comm.run(rank, program(rank, len(nodes), meta), label="all_reduce").callbacks.append(
                    lambda _: finished.append(env.now))
            comms.append(comm)
        run_to_end(env)
        return max(finished) - started, comms[0].bytes_by_label.get("all_reduce", 0)

    def _disjoint(self, groups: list[tuple[str, ...]]) -> bool:
        """Whether no link lies on a route between two members of one group and two members of another."""
        seen: set = set()
        for nodes in groups:
            links = {link for a in nodes for b in nodes if a != b for link in self._network.route(a, b)[1]}
            if links & seen:
                return False
            seen |= links
        return True
