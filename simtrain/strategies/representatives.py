"""One rank simulated for many that do the same: a model-parallel job's representatives.

On identical devices, every data-parallel replica of a model-parallel job runs
the same schedule at the same times, and the tp ranks of a stage run the same
program in lockstep. With `parallel.representatives: true` (numerics off, no
faults, no per-device differences) only the ranks with tp = 0 in replica 0
run their step programs: one rank per pipeline stage (under context
parallelism cp 0's: with the load-balanced chunks every cp rank computes as
much, tests/test_context_parallel.py). Their pipeline sends
cross the simulated network as flows, as before. Their collectives are timed
at the collective level: a tp all-reduce, or the dp all-reduce of a stage's
gradients, takes the time that all-reduce takes when the representative's
group and every group mirroring it (the same stage's tp group in the other
replicas; the dp groups of the stage's other tp ranks) run it at the same
moment alone on an idle copy of the cluster's network, with the job's
algorithm and channels: the flow model's own time, cached by groups and size.
Each group is first timed alone (as a group-timed ring, Network.time_ring,
where it is one); when on every link they share their flows together stay
within its rate (a top-of-rack uplink that carries the rings of a stage's
tp ranks, each at its NIC's rate), that is their time together too, else
they run again all at once, flow by flow.
Every other rank reports its representative's figures.

To the scheme, the representatives' groups are communicators like any other,
with the same `run(rank, program, label)` (and `post` and `wait`, for ring
attention's steps beside the compute): `mirrored_communicators(job)`
gives, for each representative and each kind of group (tp, dp_cp, cp, and the
fp16 overflow vote's model-parallel group), a
`MirroredCommunicator` and an all-reduce whose programs it times as above;
sequence parallelism's all-gathers and reduce-scatters and ring attention's
key/value steps are timed the same way (`MirroredCollective` of their kind). A group with several running
representatives (the vote: one per stage) waits for all of them, then each
takes the group's time. A representative's collective counts the bytes of
its group and every group it stands for.

What that leaves out is contention between a collective and traffic other
than its mirrors' (a pipeline send still on a NIC when the dp all-reduce
starts there, another stage's all-reduce on a shared switch uplink); on
links sized for all of them, as in a non-blocking fat tree, that is small.
tests/test_representatives.py puts the figures beside the full simulation's.
It is what lets a 3,072-GPU Megatron step be simulated in minutes.

    comms = mirrored_communicators(job)      # a GroupCommunicators: tp, dp_cp, cp, model
    comm, index, all_reduce = comms.tp[rank]
    yield Collective(all_reduce(index, comm.world, buffer), "tp_allreduce", comm, index)
"""
import heapq
from dataclasses import dataclass
from typing import NamedTuple

import simpy
import torch

from ..comm import build_all_reduce
from ..comm.kv_ring import RING_STEPS
from ..comm.ring_schedule import RingPhase
from ..comm.simulated import SimCommunicator
from ..hw.cluster import run_to_end
from ..hw.device import MemoryLedger
from ..hw.eventlog import Message
from ..hw.network import Network
from ..parallel import GroupCommunicators, Membership
from ..step_ops import Collective
from ..train.moe_exchange import ExpertExchange
from .expert_groups import all_to_all_over
from .overflow_vote import vote_groups


def representative_ranks(layout) -> list[int]:
    """The job ranks whose programs run for all: tp 0 of replica 0, one per pipeline stage (rank 0's pipeline)."""
    return list(layout.rank_groups(0).pp)


def represented_by(layout) -> list[int]:
    """Each job rank's representative, whose program stands for the rank's: its stage's."""
    stages = layout.rank_groups(0).pp
    return [stages[layout.coordinates(rank)["pp"]] for rank in range(layout.world)]


class MirroredCollective(NamedTuple):
    """A mirrored communicator's collective program: what it times (the kind: all_reduce, the ring reduce_scatter
    and all_gather of the distributed optimizer, or an MoE layer's all_to_all of `counts[src][dst]` rows, under
    parallel.moe_dispatch deepep with `exchange`, its label and rows per host; the buffer's shape and dtype)."""

    kind: str
    buf: torch.Tensor
    counts: tuple = ()
    exchange: tuple = ()


def mirrored_all_reduce(rank: int, world: int, buf: torch.Tensor, average: bool = False) -> MirroredCollective:
    """comm.build_all_reduce's program signature, for a mirrored communicator."""
    return MirroredCollective("all_reduce", buf)


def mirrored_sequence_collective(kind: str, tensor: torch.Tensor, tp: int) -> tuple[MirroredCollective, torch.Tensor]:
    """(program, result) of a representative's sequence-parallel all-gather or reduce-scatter of (batch, sequence,
    hidden) `tensor` over a tp group of `tp` (numerics off): a ring over the whole tensor, flat (a ring cuts its
    buffer along the first dimension, which a microbatch smaller than tp cannot be cut along), and a tensor
    shaped as what comes back."""
    shape = list(tensor.shape)
    shape[1] = shape[1] * tp if kind == "all_gather" else shape[1] // tp
    result = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)  # torch.empty: meta's new_empty is Python
    return MirroredCollective(kind, (result if kind == "all_gather" else tensor).reshape(-1)), result


class MirroredEpGroup(NamedTuple):
    """A representative's ep group (strategies/expert_groups.py's EpGroup, numerics off): each MoE layer's exchanges
    timed with every ep group of its stage (balanced routing: every group moves the same), as
    parallel.moe_dispatch runs them (`by_label`: deepep's, whose programs differ by exchange)."""

    comm: "MirroredCommunicator"
    size: int
    by_label: bool = False

    def exchange(self, kind, tensor: torch.Tensor):
        """(the mirrored Collective of exchange `kind` (train/moe_exchange.py's ExpertExchange), the meta tensor
        of what arrives): "moe counts" and "moe notify" a ring all-gather of the group's (ranks, n) counts, the
        others an all-to-all of `kind.counts` rows."""
        if kind.gathers:
            gathered = tensor.new_empty((self.size, tensor.shape[1]))
            program = MirroredCollective("all_gather", gathered.reshape(-1))
        else:
            gathered = kind.result_like(tensor)
            program = MirroredCollective("all_to_all", tensor, kind.counts,
                                         (kind.label, kind.node_rows) if self.by_label else ())
        return Collective(program, kind.label, comm=self.comm, rank=0), gathered


def mirrored_communicators(job) -> GroupCommunicators:
    """Each representative's Membership (its MirroredCommunicator, its rank there, mirrored_all_reduce) of tp
    (timed with the same stage's tp groups of the other replicas), dp_cp (with the dp-cp groups of the stage's
    other tp ranks), cp (with the cp groups of the stage's other tp ranks and replicas), with experts ep (a
    MirroredEpGroup, with every ep group of its stage) and expert_dp (with every experts' data-parallel group of
    its stage) and, under fp16, model (replica 0's model-parallel group, or sharded or with ep the whole job's,
    where every representative votes: timed alone, four bytes a rank and latency-bound, which the other replicas'
    votes on shared switch uplinks do not delay; counted for every replica)."""
    layout, timing = job.layout, MirroredCollectives(job)
    nodes = lambda ranks: tuple(job.devices[rank].node for rank in ranks)  # noqa: E731
    groups = layout.rank_groups
    representatives = representative_ranks(layout)

    def mirrored(rank: int, mirrors: list[tuple[int, ...]]) -> Membership:
        """The representative's membership of a group timed with `mirrors` (node groups, its own first)."""
        return Membership(MirroredCommunicator(job, timing, [rank], mirrors[0], [nodes(group) for group in mirrors],
                                               len(mirrors)), 0, mirrored_all_reduce)

    comms = GroupCommunicators(
        tp={rank: mirrored(rank, [groups(first).tp for first in groups(rank).dp_cp]) for rank in representatives},
        dp_cp={rank: mirrored(rank, [groups(first).dp_cp for first in groups(rank).tp]) for rank in representatives})
    if layout.cp > 1:  # the stage's cp groups: each tp rank's of each replica, tp varying fastest
        comms.cp = {rank: mirrored(rank, [groups(first).cp for replica in groups(rank).dp
                                          for first in groups(replica).tp]) for rank in representatives}
    if layout.ep > 1:  # every ep group of a stage exchanges as the representative's does
        def of_its_stage(rank: int, kind: str) -> list[tuple[int, ...]]:
            stage = layout.coordinates(rank)["pp"]
            own = getattr(groups(rank), kind)
            return [own] + [group for group in layout.groups(kind)
                            if group != own and layout.coordinates(group[0])["pp"] == stage]
        comms.ep = {rank: MirroredEpGroup(mirrored(rank, of_its_stage(rank, "ep")).comm, layout.ep,
                                          job.scenario.parallel.moe_dispatch == "deepep")
                    for rank in representatives}
        comms.expert_dp = {rank: mirrored(rank, of_its_stage(rank, "expert_dp")) for rank in representatives}
    if job.scenario.train.precision == "fp16":  # the first voting group, standing for every one
        voting = vote_groups(job.scenario.parallel, layout)
        voters, copies = voting[0], len(voting)
        vote = MirroredCommunicator(job, timing, representatives, voters, [nodes(voters)], copies)
        comms.model = {rank: Membership(vote, index, mirrored_all_reduce) for index, rank in enumerate(representatives)}
    return comms


class MirroredCommunicator:
    """Representatives `members` (job ranks) of `group` (job ranks) standing for it and its mirrors `groups`
    (network nodes, the first the group's own): `run` takes the time `timing` gives their all-reduce together.
    Each collective's span names the group (device ranks), its kind and its buffer, as a Chakra trace needs."""

    def __init__(self, job, timing: "MirroredCollectives", members: list[int], group: tuple[int, ...],
                 groups: list[tuple[str, ...]], copies: int):
        self.world = len(members)
        self.devices = [job.devices[rank] for rank in members]
        self.env = job.cluster.env
        self.group = tuple(job.devices[rank].rank for rank in group)
        self._timing, self._copies = timing, copies  # copies: groups its bytes count
        self._groups = timing.groups(groups)
        self._arrived: list[int] = []  # members at the current collective
        self._posted_until = [0.0] * self.world  # member -> when the collectives it posted will have ended
        self._all_in = self.env.event()

    def run(self, rank: int, program: MirroredCollective, label: str = "all_reduce"):
        """Member `rank`'s collective: once every member has posted its own (idle until then), the mirrored
        time on its device's stream, as communication; the event fires when it has ended. The last member to
        post carries the bytes of every group it stands for on its span."""
        seconds, nbytes, staging = self._timing.collective(self._groups, program)
        counted = nbytes * self._copies
        if self.world == 1:
            return self._charge(rank, program, seconds, staging, label, counted)
        done, all_in = self.env.event(), self._all_in
        self._arrived.append(rank)
        last = len(self._arrived) == self.world
        all_in.callbacks.append(lambda _: self._charge(rank, program, seconds, staging, label, counted if last else 0)
                                .callbacks.append(lambda _: done.succeed()))
        if last:
            self._arrived, self._all_in = [], self.env.event()
            all_in.succeed()
        return done

    def _charge(self, rank: int, program: MirroredCollective, seconds: float, staging: int, label: str,
                nbytes: int):
        """The member's collective from now, `seconds` of communication beside its device's compute stream (a
        collective posted on the rank's stream runs beside the work that follows it, as NCCL's kernels do)."""
        device, now = self.devices[rank], self.env.now
        if staging:  # the receive's staging buffer, for an instant
            device.memory.alloc("comm_buffers", staging)
            device.memory.free("comm_buffers", staging)
        device.log.count(device.rank, "communication", now, now + seconds, label)
        device.log.show(device.rank, "communication", label, now, now + seconds, nbytes, group=self.group,
                        op=program.kind, buffer=_buffer_bytes(program) if device.log.record else 0)
        if program.kind in RING_STEPS and device.log.messages is not None:
            self._log_ring_step(device, program, label, now, now + seconds)
        return self.env.timeout(seconds)

    def post(self, rank: int, program: MirroredCollective, label: str) -> "MirroredPost":
        """Member `rank`'s collective started beside its program (a ring attention step, a bucket's
        reduce-scatter: a one-member communicator): it ends the mirrored time after the collectives the member
        posted before it have ended (one stream, as NCCL's), or from now; its time is the rank's only from
        `wait` on."""
        seconds, nbytes, staging = self._timing.collective(self._groups, program)
        device = self.devices[rank]
        if staging:
            device.memory.alloc("comm_buffers", staging)
            device.memory.free("comm_buffers", staging)
        start = max(self.env.now, self._posted_until[rank])
        self._posted_until[rank] = start + seconds
        if program.kind in RING_STEPS and device.log.messages is not None:
            self._log_ring_step(device, program, label, start, start + seconds)
        return MirroredPost(self, device, start, start + seconds, label, nbytes * self._copies, program)

    def _log_ring_step(self, device, program: MirroredCollective, label: str, start: float, end: float) -> None:
        """A ring step's send and receive of the representative (ring attention's, or a tp all-gather's beside the
        GEMMs), as the messages the full simulation logs (a Chakra trace's: report/chakra.py), each of the step's
        buffer and time."""
        group, nbytes = self.group, _buffer_bytes(program)
        send, receive = next(RING_STEPS[program.kind](group.index(device.rank), len(group), program.buf)[0])
        for src, dst, tag in ((device.rank, group[send.dst], send.tag), (group[receive.src], device.rank,
                                                                          receive.tag)):
            device.log.message(Message(src, dst, tag, nbytes, start, end, label, program.kind))

    def wait(self, handle: "MirroredPost", idle: str | None = None) -> simpy.Event | None:
        """From now the rank waits for a posted collective: what is left of it is its communication (the bytes
        counted on that span, of no length if it has ended). The event fires when it ends; None if it has
        ended already (nothing to wait for: most ring steps end within the GEMM slice beside them)."""
        now = self.env.now
        start = min(now, handle.end)
        handle.charged_s = handle.end - start
        log, rank = handle.device.log, handle.device.rank
        log.count(rank, "communication", start, handle.end, handle.label)
        log.show(rank, "communication", handle.label, start, handle.end, handle.nbytes, group=self.group,
                 op=handle.program.kind, posted_s=handle.start,
                 buffer=_buffer_bytes(handle.program) if log.record else 0)
        return self.env.timeout(handle.end - now) if handle.end > now else None

    def stuck(self) -> list[int]:
        """Members waiting for the others to post (a deadlock once the clock has stopped)."""
        return sorted(self._arrived)


@dataclass
class MirroredPost:
    """A mirrored collective posted: its communicator, device, start and end times, label, bytes and program; once
    awaited, the communication seconds credited for it."""

    comm: MirroredCommunicator
    device: object
    start: float
    end: float
    label: str
    nbytes: int
    program: MirroredCollective
    charged_s: float = 0.0


def _buffer_bytes(program: MirroredCollective) -> int:
    """A mirrored collective's buffer, as nccl-tests size it: the all-reduce's, the whole gathered or scattered
    tensor, the rows a rank sends to all. Worked out only for a log that keeps its spans (the 16k step's
    representatives run 500,000 collectives)."""
    return program.buf.numel() * program.buf.element_size()


class Groups(NamedTuple):
    """Groups that run a collective together (MirroredCollectives.groups): their number and their nodes."""

    number: int
    nodes: tuple[tuple[str, ...], ...]


class MirroredCollectives:
    """Times of groups that run a collective together, on an idle copy of a job's network."""

    def __init__(self, job):
        parallel, topology = job.scenario.parallel, job.cluster.topology
        self._env = simpy.Environment()
        self._topology = topology
        self._network = Network(self._env, topology, record=False)  # records while a run asks for its load
        self._all_reduce = lambda nodes: build_all_reduce(parallel.all_reduce, topology, nodes, parallel.channels,
                                                          "parallel.all_reduce", "parallel.channels")
        self._all_to_all = lambda nodes: all_to_all_over(parallel.moe_dispatch, topology, nodes, nodes)
        self._timed: dict[tuple, tuple[float, int, int]] = {}
        self._alone_by_shape: dict[tuple, tuple[float, int, int, list[float]]] = {}
        self._group_numbers: dict[tuple, int] = {}
        self._shapes: dict[tuple, tuple | None] = {}  # (a group's nodes, whether it runs a ring) -> its shape
        self._links: dict[tuple[str, str], tuple[float, float, bool, bool]] = {}  # directed link -> `_link`

    def groups(self, groups: list[tuple[str, ...]]) -> "Groups":
        """`groups` (each a tuple of network nodes, in group-rank order) as `collective` takes them: numbered
        once, so that a collective's time is looked up without hashing every node of every group."""
        groups = tuple(groups)
        return Groups(self._group_numbers.setdefault(groups, len(self._group_numbers)), groups)

    def collective(self, groups: "Groups", program: MirroredCollective) -> tuple[float, int, int]:
        """(seconds, bytes the first group sends, the largest staging buffer of its first rank) of the collective
        `program` (its kind, on a buffer of its shape and dtype) started at once by every group of `groups`."""
        key = (groups.number, program.kind, program.buf.numel(), program.buf.dtype, program.counts, program.exchange)
        if key not in self._timed:
            self._timed[key] = self._simulate(groups.nodes, program)
        return self._timed[key]

    def _simulate(self, groups: list[tuple[str, ...]], program: MirroredCollective) -> tuple[float, int, int]:
        """Each group alone first; if on every link the groups' flows together stay within its rate, that is
        also their time together, else they run again, all at once, flow by flow."""
        if len(groups) == 1:  # alone is all there is: no load to compare
            seconds, nbytes, staging, _ = self._run(groups, program, exclusive=True, load=False)
            return seconds, nbytes, staging
        alone = [self._alone(nodes, program) for nodes in groups]
        _, nbytes, staging, _ = alone[0]
        if self._within_rates([load for _, _, _, load in alone]):
            return max(seconds for seconds, _, _, _ in alone), nbytes, staging
        seconds, _, _, _ = self._run(groups, program, exclusive=False, load=False)
        return seconds, nbytes, staging

    def _alone(self, nodes: tuple[str, ...], program: MirroredCollective) -> tuple[float, int, int, dict]:
        """`_run` of one group alone, run once for every group of the same shape (`_shape`: the tp groups of a
        stage's replicas, each on its own host, are one shape), its load carried over to each group's own links."""
        shape = self._shape(nodes, ring=program.kind not in ("all_reduce", "all_to_all"))
        if shape is None:
            return self._run([nodes], program, exclusive=True)
        key, hops = shape
        key = (key, program.kind, program.buf.numel(), program.buf.dtype, program.counts, program.exchange)
        if key not in self._alone_by_shape:
            seconds, nbytes, staging, load = self._run([nodes], program, exclusive=True)
            self._alone_by_shape[key] = seconds, nbytes, staging, [load.get(hop, 0.0) for hop in hops]
        seconds, nbytes, staging, rates = self._alone_by_shape[key]
        return seconds, nbytes, staging, {hop: rate for hop, rate in zip(hops, rates) if rate}

    def _shape(self, nodes: tuple[str, ...], ring: bool) -> tuple[tuple, list[tuple[str, str]]] | None:
        """What a group's collective alone on an idle network depends on, given the pairs of members its flows
        may join (`_pairs`): each pair's route as its directed links, each named by its first appearance, and
        each link's bandwidth, latency, efficiency and whether its ends reduce (NVLink SHARP); with the links in
        that order. Two groups of one shape run the same flows over links alike, shared alike. None: a group too
        large to look for its shape. Worked out once a group."""
        if (nodes, ring) not in self._shapes:
            pairs = _pairs(ring, nodes)
            self._shapes[nodes, ring] = None if pairs is None else self._shape_of(pairs)
        return self._shapes[nodes, ring]

    def _shape_of(self, pairs: list[tuple[str, str]]) -> tuple[tuple, list[tuple[str, str]]]:
        path = self._topology.path
        number: dict[tuple[str, str], int] = {}
        routes = []
        for a, b in pairs:
            route = path(a, b)
            routes.append(tuple(number.setdefault(hop, len(number)) for hop in zip(route, route[1:])))
        hops = list(number)
        links = tuple(self._link(hop) for hop in hops)
        return (tuple(routes), links), hops

    def _link(self, hop: tuple[str, str]) -> tuple[float, float, bool, bool]:
        """A directed link as a group's shape names it: its rate, its latency, whether each end reduces."""
        if hop not in self._links:
            attrs, reducing = self._topology.link(*hop), self._topology.reducing
            self._links[hop] = (attrs["bandwidth"] * attrs.get("efficiency", 1.0), attrs["latency"],
                                hop[0] in reducing, hop[1] in reducing)
        return self._links[hop]

    def _program(self, collective: MirroredCollective, nodes: list[str]):
        """fn(rank, world, buf) -> the per-rank program of `collective` over `nodes`: the job's all-reduce, an MoE
        layer's all-to-all as parallel.moe_dispatch runs it (strategies/expert_groups.py), or the rings the
        distributed optimizer runs (sharded_replica.py: the reduce-scatter the other way round)."""
        kind = collective.kind
        if kind == "all_reduce":
            return self._all_reduce(nodes)
        if kind == "all_to_all":
            counts, all_to_all = collective.counts, self._all_to_all(nodes)
            label, node_rows = collective.exchange or ("", ())

            def program(rank, world, buf):
                rows = sum(row[rank] for row in counts)
                ids = buf.new_empty(len(buf), dtype=torch.long) if node_rows else None
                return all_to_all(rank, world, buf, buf.new_empty((rows, *buf.shape[1:])),
                                  ExpertExchange(label, counts, rows, node_rows, ids))
            return program
        if kind in RING_STEPS:  # one step of ring attention's key/value ring, or of its gradients' way back
            return lambda rank, world, buf: RING_STEPS[kind](rank, world, buf)[0]
        # a ring (timed as a group where it is one, comm/ring_schedule.py), the reduce-scatter's in reverse rank order
        order = tuple(range(len(nodes)))
        order = order[::-1] if kind == "reduce_scatter" else order
        return lambda rank, world, buf: RingPhase(kind, rank, order, buf)

    def _within_rates(self, loads: list[dict]) -> bool:
        """Whether every directed link crossed by several groups has the rate for all their flows at once:
        the sum of the groups' loads (each an upper bound of what its flows push through the link at any
        moment) within the link's rate. Then no group's bottleneck is another's link, each flow keeps the rate
        max-min sharing gave it alone, and the groups together take the time the slowest takes alone."""
        crossing: dict[tuple[str, str], list[float]] = {}
        for load in loads:
            for hop, rate in load.items():
                crossing.setdefault(hop, []).append(rate)
        return all(sum(rates) <= self._rate(hop) for hop, rates in crossing.items() if len(rates) > 1)

    def _rate(self, hop: tuple[str, str]) -> float:
        return self._link(hop)[0]

    def _run(self, groups: list[tuple[str, ...]], collective: MirroredCollective, exclusive: bool,
             load: bool = True) -> tuple[float, int, int, dict]:
        """(seconds, bytes the first group sent, its first rank's largest staging buffer, load) of the groups'
        collectives; load: directed link -> an upper bound of the bytes/s their flows pushed through it at any
        moment (per route, the most flows it carried at once times its slowest link's rate, summed), worked out
        from the transfers' records where `load` asks for it (else empty: a ring of N ranks that is not timed
        as a group leaves 2N(N-1) records)."""
        env, network = self._env, self._network
        started, finished, comms = env.now, [], []
        network.record = load
        first_record = len(network.records)
        staging = MemoryLedger("staging", float("inf"))
        for index, nodes in enumerate(groups):
            ledgers = [staging if index == rank == 0 else MemoryLedger("staging", float("inf")) for rank in
                       range(len(nodes))]
            comm = SimCommunicator(network, list(nodes), ledgers=ledgers, exclusive=exclusive)
            program, buffer = self._program(collective, list(nodes)), collective.buf
            for rank in range(len(nodes)):
                meta = torch.empty(buffer.shape, dtype=buffer.dtype, device="meta")
                comm.run(rank, program(rank, len(nodes), meta), collective.kind).callbacks.append(
                    lambda _: finished.append(env.now))
            comms.append(comm)
        run_to_end(env)
        network.record = False
        spans: dict[tuple[str, ...], list[tuple[float, float]]] = {}  # a ring's few routes, each many times
        for record in network.records[first_record:]:
            spans.setdefault(record.path, []).append((record.start, record.end))
        del network.records[first_record:]
        load: dict[tuple[str, str], float] = {}
        for path, intervals in spans.items():
            hops = list(zip(path, path[1:]))
            rate = _most_at_once(intervals) * min(self._rate(hop) for hop in hops)
            for hop in hops:
                load[hop] = load.get(hop, 0.0) + rate
        return (max(finished) - started, comms[0].bytes_by_label.get(collective.kind, 0),
                staging.peak.get("comm_buffers", 0), load)


_SHAPED_GROUP_MAX = 64  # a larger group whose flows may join any two members is run alone without looking for
# its shape: its pairs' routes would cost more than its run


def _pairs(ring: bool, nodes: tuple[str, ...]) -> list[tuple[str, str]] | None:
    """The ordered pairs of a group's members that a collective may send between (`_program`): a ring's
    neighbours in group-rank order, either way (a reduce-scatter's ring runs in reverse); any two members for an
    all-reduce (its algorithm's channels order the ring) or an all-to-all, at most `_SHAPED_GROUP_MAX` members
    (None above)."""
    if ring:
        after = nodes[1:] + nodes[:1]
        return [*zip(nodes, after), *zip(after, nodes)]
    if len(nodes) > _SHAPED_GROUP_MAX:
        return None
    return [(a, b) for a in nodes for b in nodes if a != b]


def _most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most of the [start, end) intervals that overlap at one moment."""
    ends: list[float] = []
    most = 0
    for start, end in sorted(intervals):
        while ends and ends[0] <= start:
            heapq.heappop(ends)
        heapq.heappush(ends, end)
        most = max(most, len(ends))
    return most
