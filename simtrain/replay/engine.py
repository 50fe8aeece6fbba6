"""A Chakra execution trace replayed on a simulated cluster: each rank's nodes in dependency order.

Rank r of the traces runs on device r of the cluster. A node starts once the
nodes it depends on have ended, then:

- a compute node (and a memory or metadata node) runs on the device's stream
  for its recorded duration, or, with none, its FLOPs (`num_ops`) through the
  device's compute model in the scenario's `train.precision`; logged under
  its `kind` (what simtrain logged it as; "compute" for another tool's
  trace). A node marked `is_cpu_op` is the host's: it takes its duration
  beside the stream;
- a collective runs as simtrain's program of its type among the ranks of its
  group, on a meta buffer of `comm_size` bytes: an all-reduce by the
  scenario's `parallel.all_reduce` (and `parallel.channels`), an all-gather
  or reduce-scatter as a ring phase (or NCCL's choice under `nccl`), a
  broadcast or reduce as NCCL runs it, an all-to-all pairwise, a barrier as
  an all-reduce of one float. A rank's collectives on one group run one after
  another in node-id order, as a process group's stream runs them (the
  checks in trace_file.py hold each group's ranks to the same order);
- a send or receive moves `comm_size` bytes to or from its peer, matched by
  (source, destination, tag) in the one mailbox.

The step time is the simulated time over the steps the traces hold; each
rank's time splits, as report.json's does, into its kinds, its exposed
communication (its collectives' union outside its other work: two groups'
collectives side by side count once; a collective from its first transfer
to its last, a wait for a peer within it included) and idle (a rank's: over every step;
`breakdown_s`: per step, the ranks' mean). simtrain's own run counts a
collective posted ahead (ZeRO-3's prefetch) or a message (a pipeline's) only
while awaited, and a pipeline's wait for its peer as `bubble`, so the two
communication figures may differ where the step times agree. Where the trace carries its own times (`start_s`
and `duration_s`, or the schema's microseconds), the trace's step time is
the last end over its steps, to compare with.

    traces = read_traces(["runs/quickstart/chakra"])
    result = replay(traces, load_scenario("scenarios/quickstart.yaml"))
    result.data["step_time_s"], result.data["trace_step_time_s"]
"""
import math
from dataclasses import dataclass

import torch

from ..comm import build_all_reduce
from ..comm.all_to_all import pairwise_all_to_all
from ..comm.nccl import NcclGroup
from ..comm.ops import Recv, Send
from ..comm.ring_schedule import RingPhase
from ..comm.simulated import SimCommunicator
from ..errors import ScenarioError
from ..hw.cluster import Cluster, build_cluster, run_to_end
from ..hw.eventlog import exposed, union
from ..scenario import Scenario
from .trace_file import TraceNode, Traces

ELEMENT_BYTES = 4  # the replayed buffers are float32 meta tensors: comm_size bytes, rounded up to whole elements
NCCL_ROOTED = {"BROADCAST": "broadcast", "REDUCE": "reduce"}
UNSUPPORTED = ("GATHER", "SCATTER", "REDUCE_SCATTER_BLOCK")


@dataclass
class ReplayResult:
    """`data`: JSON-ready figures (step time, the trace's own, per-rank breakdown and bytes); `cluster`: the
    cluster it ran on, its event log kept (for a trace view)."""

    data: dict
    cluster: Cluster


def replay(traces: Traces, scenario: Scenario) -> ReplayResult:
    """Run `traces` on the cluster of `scenario` (at least as many devices as the traces have ranks)."""
    for nodes in traces.ranks.values():
        for node in nodes:
            if node.comm_type in UNSUPPORTED:
                raise ScenarioError(f"{traces.files[0].parent}: node {node.id} ({node.name!r}): simtrain does not "
                                    f"replay {node.comm_type} collectives yet")
    cluster = build_cluster(scenario.cluster, base_dir=scenario.base_dir, seed=scenario.seed)
    if cluster.size < traces.world:
        raise ScenarioError(f"cluster.devices: the traces have {traces.world} ranks, the cluster {cluster.size} "
                            f"devices")
    ranks = list(range(traces.world))
    cluster.add_job("replay", ranks)
    run = _Run(cluster, traces, scenario)
    for rank, nodes in traces.ranks.items():
        run.start(rank, nodes)
    run_to_end(cluster.env)
    never = [(rank, node) for rank, nodes in traces.ranks.items() for node in nodes if not run.ended[rank, node.id]]
    if never:
        rank, node = never[0]
        raise ScenarioError(f"{traces.files[rank]}: node {node.id} ({node.name!r}) never ran: its ranks wait for "
                            f"each other ({len(never)} nodes left; collectives on two groups in opposite orders?)")
    return ReplayResult(_figures(traces, cluster), cluster)


class _Run:
    """The ranks' nodes as simpy processes on the cluster, with the groups' communicators and programs."""

    def __init__(self, cluster: Cluster, traces: Traces, scenario: Scenario):
        self.cluster, self.traces, self.scenario = cluster, traces, scenario
        self.env = cluster.env
        self.ended: dict[tuple[int, int], bool] = {}
        self.events: dict[tuple[int, int], object] = {}
        self._comms: dict[str, SimCommunicator] = {}
        self._all_reduce: dict[str, object] = {}
        self._nccl: dict[str, NcclGroup] = {}
        used = {node.group for nodes in traces.ranks.values() for node in nodes if node.type == "COMM_COLL_NODE"}
        p2p = any(node.type in ("COMM_SEND_NODE", "COMM_RECV_NODE") for nodes in traces.ranks.values()
                  for node in nodes)
        self._exclusive = len(used) == 1 and not p2p  # one group's collectives alone on the links

    def start(self, rank: int, nodes: list[TraceNode]) -> None:
        for node in nodes:
            self.events[rank, node.id] = self.env.event()
            self.ended[rank, node.id] = False
        previous: dict[str, object] = {}  # a group's last collective of this rank, in node-id order
        for node in sorted(nodes, key=lambda node: node.id):
            after = [self.events[rank, dep] for dep in node.deps]
            if node.type == "COMM_COLL_NODE":
                if node.group in previous:
                    after.append(previous[node.group])
                previous[node.group] = self.events[rank, node.id]
            self.env.process(self._node(rank, node, after))

    def _node(self, rank: int, node: TraceNode, after: list):
        if after:
            yield self.env.all_of(after)
        device = self.cluster.devices[rank]
        if node.type == "COMM_COLL_NODE":
            members = self.traces.groups[node.group]
            comm = self._comm(node.group)
            index = members.index(rank)
            yield comm.run(index, self._program(node, index, len(members)), label=node.name)
        elif node.type in ("COMM_SEND_NODE", "COMM_RECV_NODE"):
            comm = self._comm(None)
            buf = _buffer(node.comm_size)
            program = (_send(node.peer, buf, node.tag) if node.type == "COMM_SEND_NODE"
                       else _receive(node.peer, buf, node.tag))
            yield comm.wait(comm.post(rank, program, node.name))
        elif node.cpu:
            yield self.env.timeout(node.duration_s)
        elif node.duration_s or not node.flops:
            yield device.run_for(node.duration_s, node.name, node.kind)
        else:
            yield device.compute(node.flops, self.scenario.train.precision, node.name, kind=node.kind)
        self.ended[rank, node.id] = True
        self.events[rank, node.id].succeed()

    def _comm(self, group: str | None) -> SimCommunicator:
        """The communicator of `group` (None: every rank, for sends and receives)."""
        if group not in self._comms:
            members = self.traces.groups[group] if group is not None else tuple(range(self.traces.world))
            devices = [self.cluster.devices[rank] for rank in members]
            self._comms[group] = SimCommunicator(
                self.cluster.network, [device.node for device in devices], log=self.cluster.log,
                ledgers=[device.memory for device in devices], global_ranks=list(members),
                exclusive=self._exclusive and group is not None, host=self.cluster.host_messages)
        return self._comms[group]

    def _program(self, node: TraceNode, index: int, world: int):
        """Group rank `index`'s program of the collective `node` on a meta buffer of its size."""
        parallel = self.scenario.parallel
        nodes = self._comm(node.group).nodes
        kind = node.comm_type
        if world == 1:  # a group of one rank moves nothing (NCCL returns at once)
            return _nothing()
        if kind in ("ALL_REDUCE", "BARRIER"):
            if node.group not in self._all_reduce:
                self._all_reduce[node.group] = build_all_reduce(parallel.all_reduce, self.cluster.topology, nodes,
                                                                parallel.channels, "parallel.all_reduce",
                                                                "parallel.channels")
            size = ELEMENT_BYTES if kind == "BARRIER" else node.comm_size
            return self._all_reduce[node.group](index, world, _buffer(size))
        if kind in ("ALL_GATHER", "REDUCE_SCATTER") and parallel.all_reduce != "nccl":
            return RingPhase(kind.lower(), index, tuple(range(world)), _buffer(node.comm_size, world))
        if kind == "ALL_TO_ALL":
            block = max(1, math.ceil(node.comm_size / ELEMENT_BYTES / world))
            send = torch.empty(block * world, dtype=torch.float32, device="meta")
            return pairwise_all_to_all(index, world, send, torch.empty_like(send), [[block] * world] * world)
        if node.group not in self._nccl:
            self._nccl[node.group] = NcclGroup(self.cluster.topology, nodes)
        collective = NCCL_ROOTED.get(kind, kind.lower())
        return self._nccl[node.group].call(collective, index, _buffer(node.comm_size, world))


def _buffer(nbytes: int, multiple: int = 1) -> torch.Tensor:
    """A float32 meta tensor of `nbytes` bytes, in whole elements (a multiple of `multiple` of them)."""
    elements = max(multiple, math.ceil(math.ceil(nbytes / ELEMENT_BYTES) / multiple) * multiple)
    return torch.empty(elements, dtype=torch.float32, device="meta")


def _nothing():
    return
    yield  # a program that ends at once


def _send(peer: int, buf: torch.Tensor, tag: int):
    yield [Send(peer, buf, tag)]


def _receive(peer: int, buf: torch.Tensor, tag: int):
    yield [Recv(peer, buf, tag=tag)]


def exposed_s(spans: list) -> float:
    """Seconds during which a rank had a collective running and nothing else: its collectives' union (two groups'
    side by side count once) outside its other spans."""
    communication = union(sorted((span.start, span.end) for span in spans if span.kind == "communication"))
    other = [(span.start, span.end) for span in spans if span.kind != "communication"]
    return sum(end - start for start, end in exposed(communication, other))


def _figures(traces: Traces, cluster: Cluster) -> dict:
    """The replay's figures beside the trace's own: step time, per-rank breakdown (per step) and bytes."""
    log = cluster.log
    sim_time_s = log.last_end_s
    steps = traces.steps
    kinds = sorted({kind for rank, kind in log.totals if kind != "communication"})
    spans_by_rank: dict[int, list] = {}
    for span in log.spans:
        spans_by_rank.setdefault(span.rank, []).append(span)
    devices = []
    for rank, nodes in traces.ranks.items():
        spent = {kind: log.total(rank, kind) for kind in kinds}  # seconds of every step, as report.json's devices
        spent["communication"] = exposed_s(spans_by_rank.get(rank, []))
        spent["idle"] = max(0.0, sim_time_s - sum(spent.values()))
        ends = [node.end_s for node in nodes if node.end_s is not None]
        devices.append({
            "rank": rank,
            "breakdown_s": spent,
            "bytes_sent_by_label": log.bytes_by_label(rank, "communication"),
            "trace_time_s": max(ends) if ends else None,
            "trace_compute_s": sum(node.duration_s for node in nodes if not node.type.startswith("COMM")),
        })
    trace_ends = [device["trace_time_s"] for device in devices if device["trace_time_s"] is not None]
    trace_step_s = max(trace_ends) / steps if trace_ends else None
    step_time_s = sim_time_s / steps
    bytes_by_type: dict[str, int] = {}
    for nodes in traces.ranks.values():
        for node in nodes:
            if node.type == "COMM_COLL_NODE":
                bytes_by_type[node.comm_type] = bytes_by_type.get(node.comm_type, 0) + node.comm_size
    return {
        "ranks": traces.world,
        "nodes": traces.nodes,
        "steps": steps,
        "sim_time_s": sim_time_s,
        "step_time_s": step_time_s,
        "trace_step_time_s": trace_step_s,
        "difference": (step_time_s - trace_step_s) / trace_step_s if trace_step_s else None,
        "breakdown_s": {kind: sum(device["breakdown_s"][kind] for device in devices) / len(devices) / steps
                        for kind in devices[0]["breakdown_s"]},  # per step, the ranks' mean, as report.json's
        "collective_bytes_by_type": dict(sorted(bytes_by_type.items())),  # the collectives' buffers, every rank's
        "devices": devices,
    }
