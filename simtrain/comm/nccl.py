"""Collectives as NCCL runs them: its algorithms as programs on a topology, its protocols as the wire they use.

`nccl_tuning.py` predicts; this module runs. For a communicator (its ranks on
some nodes of a topology) an `NcclGroup` gives

- `fabric`: the `Fabric` NCCL's tuner sees (ranks, nodes, each GPU's
  achievable NVLink bandwidth, each node's NIC bandwidth, whether its NVSwitch
  reduces), and `tuning`, NCCL's predictions on it;
- `choose(collective, nbytes, algorithm, protocol)`: the (algorithm, protocol)
  to run, "auto" for the least predicted time among the algorithms with a
  program here (`PROGRAMS`);
- `call(collective, rank, buf, algorithm, protocol)`: rank `rank`'s part of one
  call, an `NcclCall`, which a SimCommunicator (simulated.py) runs as NCCL
  would: first the launch latency NCCL's model charges once per call (its base
  latency; for NVLS and NVLS-tree, whose steps NCCL does not count, its whole
  latency), shown in the event log as a span named by the choice; then the
  algorithm's program, its switches' programs beside it (a reducing switch
  runs as one more rank of the communicator), every transfer moving as the
  protocol moves it (`Wire`).

A protocol is a view of the links (`Wire`): every link's rate times the
protocol's efficiency (LL carries 8 bytes of data per 16-byte line: 1/2;
LL128 120 of 128 bytes; Simple all; NVLS on Hopper 0.85 of the NVLink rate,
NCCL's nvlsEfficiency; PAT 0.75 of every link's, the part of the bandwidth
NCCL's model gives it, standing for the steps it adds when it aggregates less
than pat.py's schedule), so a transfer's flow carries its bytes divided by that
fraction (rounded up to a whole byte: the bytes on the wire); and for ring and
tree every hop slower by half the step latency the protocol adds over ring/LL
(NCCL's hwLatencies; a GPU-to-GPU step is two hops, the topology files'
latencies being ring/LL's), not for broadcast and reduce, whose pipelined
chain NCCL charges that latency once, at launch.

Buffers follow nccl-tests: all-gather's and reduce-scatter's are the whole
N-shard buffer on every rank (rank r's own shard r); broadcast and reduce have
root 0. Ring collectives run on one channel per NIC rail across nodes
(channels.py), each rank's shard split over the channels.

    group = NcclGroup(topology, topology.devices)
    algorithm, protocol = group.choose("all_reduce", 1 << 20)
    comm.run(rank, group.call("all_reduce", rank, buf))       # "auto": NCCL's choice for buf's size

`parallel.all_reduce: nccl` runs every all-reduce of a training step this way
(`nccl_all_reduce`, through all_reduce.build_all_reduce).
"""
import math

import torch

from ..errors import ScenarioError
from ..hw.topology import Topology
from .channels import channel_order, default_channels, layout_of
from .nccl_tree import nccl_tree_all_reduce
from .nccl_tuning import (BASE_LATENCY_US, HW_LATENCY_US, NVLS_EFFICIENCY, PAT_EFFICIENCY, PROTOCOLS, Fabric,
                          call_latency_us, tune)
from .nvls import nvls_all_reduce, nvls_switch, nvls_tree_all_reduce
from .ops import Concurrently, Recv, Send, WrappedProgram
from .pat import pat_all_gather, pat_reduce_scatter
from .ring import ring_all_gather, ring_reduce_scatter
from .ring_schedule import RingAllReduce

CHAIN_MAX_PIECES = 1024  # a rooted ring's pieces (chain_pieces)
ROOTED = ("broadcast", "reduce")
PROTOCOL_EFFICIENCY = {"LL": 0.5, "LL128": 120 / 128, "Simple": 1.0}
# The algorithms with a program here, per collective (NCCL's CollNet is not among them).
PROGRAMS = {"all_reduce": ("ring", "tree", "nvls", "nvls_tree"), "all_gather": ("ring", "nvls", "pat"),
            "reduce_scatter": ("ring", "nvls", "pat"), "broadcast": ("ring",), "reduce": ("ring",)}


def fabric_of(topology: Topology, generation: str | None = None, nodes: list[str] | None = None) -> Fabric:
    """What NCCL's search would tell its tuner about the ranks on `nodes` (None: every device);
    `generation` None: hopper with a reducing switch, else ampere."""
    nodes = list(topology.devices if nodes is None else nodes)
    layout = layout_of(topology, nodes)
    kinds = link_kinds(topology)
    nics = sum(_rate(topology, nodes[rank], peer) for rank in layout.hosts[0] for peer in topology.graph[nodes[rank]]
               if kinds[frozenset((nodes[rank], peer))] == "net")
    intra = max((_rate(topology, nodes[0], peer) for peer in topology.graph[nodes[0]]
                 if kinds[frozenset((nodes[0], peer))] == "nvlink"), default=nics)
    generation = generation or ("hopper" if topology.reducing else "ampere")
    return Fabric(ranks=len(nodes), nodes=len(layout.hosts), generation=generation,
                  intra_GBps=intra / 1e9, inter_GBps=(nics if len(layout.hosts) > 1 else intra) / 1e9,
                  nvls=bool(topology.reducing))


def link_kinds(topology: Topology) -> dict:
    """Each link's kind for NCCL's latency table: `net` for the NIC links between hosts, else `nvlink` (none on a
    topology of one device)."""
    layout = layout_of(topology, topology.devices)
    rates = [_rate(topology, a, b) for a, b in topology.graph.edges]
    slowest = min(rates, default=None)
    multi = len(layout.hosts) > 1
    return {frozenset((a, b)): "net" if multi and rate == slowest else "nvlink"
            for (a, b), rate in zip(topology.graph.edges, rates)}


class Wire:
    """How a protocol moves one algorithm's bytes over a route: `of(path)` is (the fraction of the route's rate
    its data gets, the seconds its hops add to the route's latency), the module docstring's view of the links."""

    def __init__(self, topology: Topology, kinds: dict, efficiency: dict, extra_hop_s: dict):
        self._topology, self._kinds = topology, kinds
        self._efficiency, self._extra_hop_s = efficiency, extra_hop_s  # by link kind
        self._paths: dict[tuple, tuple[float, float]] = {}

    def of(self, path: tuple[str, ...]) -> tuple[float, float]:
        cost = self._paths.get(path)
        if cost is None:
            hops = list(zip(path, path[1:]))
            kinds = [self._kinds[frozenset(hop)] for hop in hops]
            rates = [_rate(self._topology, *hop) for hop in hops]
            fraction = (min(rate * self._efficiency[kind] for rate, kind in zip(rates, kinds)) / min(rates)
                        if hops else 1.0)
            cost = self._paths[path] = (fraction, sum(self._extra_hop_s[kind] for kind in kinds))
        return cost


class NcclCall(WrappedProgram):
    """One rank's part of one NCCL call: its program, and how a communicator runs it (the module docstring).

    `helpers()`, for an algorithm with reducing switches, gives (their nodes, their programs), started once
    per call by the communicator. It runs as the program it wraps (ops.WrappedProgram; over gloo, the program
    alone)."""

    __slots__ = ("name", "launch_s", "wire", "helpers", "collective")

    def __init__(self, program, name: str, launch_s: float, wire: Wire, helpers=None, collective: str = ""):
        self.program, self.name, self.launch_s, self.wire, self.helpers = program, name, launch_s, wire, helpers
        self.collective = collective  # "all_reduce", "all_gather", ...: what the call runs


class NcclGroup:
    """NCCL's algorithms and protocols for the communicator whose rank r runs on nodes[r] (module docstring)."""

    def __init__(self, topology: Topology, nodes: list[str], generation: str | None = None):
        self.topology, self.nodes, self.world = topology, list(nodes), len(nodes)
        self.fabric = fabric_of(topology, generation, self.nodes)
        self.tuning = tune(self.fabric) if self.world > 1 else None  # NCCL has no tables for one rank
        layout = layout_of(topology, self.nodes)
        self.hosts = [list(ranks) for ranks in layout.hosts]
        self.channels = default_channels(layout, "ring")
        self.orders = [channel_order(layout, c) for c in range(self.channels)]
        identity = list(range(self.world))
        self._rings = [None if order == identity else order for order in self.orders]
        self._kinds = link_kinds(topology)
        self._wires: dict[tuple, Wire] = {}
        self._choices: dict[tuple, tuple[str, str]] = {}

    def choose(self, collective: str, nbytes: int, algorithm: str = "auto", protocol: str = "auto") -> tuple[str, str]:
        """The (algorithm, protocol) to run: as given, or where "auto" the least predicted time among the
        algorithms with a program (NCCL's choice where it has them all)."""
        key = (collective, nbytes, algorithm, protocol)
        if key not in self._choices:
            candidates = [(a, p) for a in (PROGRAMS[collective] if algorithm == "auto" else (algorithm,))
                          for p in (PROTOCOLS if protocol == "auto" else (protocol,))]
            times = {pair: self.tuning.time_us(collective, *pair, nbytes) for pair in candidates}
            best = min(times, key=times.get)
            if times[best] == math.inf:
                raise ScenarioError(f"--algo: NCCL does not run {algorithm} with protocol {protocol} for {collective} "
                                    "on this topology")
            self._choices[key] = best
        return self._choices[key]

    def wire(self, collective: str, algorithm: str, protocol: str) -> Wire:
        """The protocol's view of the links for `algorithm` running `collective`."""
        key = (collective, algorithm, protocol)
        if key not in self._wires:
            p = PROTOCOLS.index(protocol)
            efficiency, extra_hop_s = {}, {}
            for kind in ("nvlink", "net"):
                efficiency[kind] = PROTOCOL_EFFICIENCY[protocol]
                if algorithm in ("nvls", "nvls_tree") and kind == "nvlink":
                    efficiency[kind] *= NVLS_EFFICIENCY[self.fabric.generation]
                if algorithm == "pat":
                    efficiency[kind] *= PAT_EFFICIENCY
                extra_us = HW_LATENCY_US[kind][algorithm][p] - HW_LATENCY_US[kind]["ring"][0]
                extra_hop_s[kind] = (max(0.0, extra_us) * 1e-6 / 2
                                     if algorithm in ("ring", "tree") and collective not in ROOTED else 0.0)
            self._wires[key] = Wire(self.topology, self._kinds, efficiency, extra_hop_s)
        return self._wires[key]

    def call(self, collective: str, rank: int, buf, algorithm: str = "auto", protocol: str = "auto",
             average: bool = False) -> NcclCall:
        """Rank `rank`'s part of `collective` on `buf` (all-reduce: then divided by the ranks if `average`)."""
        algorithm, protocol = self.choose(collective, buf.nbytes, algorithm, protocol)
        program = self.program(collective, algorithm, protocol, rank, buf)
        if average:
            program = _averaged(program, buf, self.world)
        helpers = ((lambda: self.switches(collective, algorithm, buf))
                   if algorithm in ("nvls", "nvls_tree") else None)
        return NcclCall(program, f"nccl {algorithm}/{protocol} {buf.nbytes} B",
                        launch_latency_s(self.fabric, collective, algorithm, protocol),
                        self.wire(collective, algorithm, protocol), helpers, collective)

    def program(self, collective: str, algorithm: str, protocol: str, rank: int, buf):
        """Rank `rank`'s program of `algorithm` running `collective` on `buf`."""
        if algorithm not in PROGRAMS.get(collective, ()):
            raise ValueError(f"no {algorithm} program for {collective}")
        world, hosts, orders = self.world, self.hosts, self.orders
        if algorithm in ("nvls", "nvls_tree"):
            host = next(index for index, ranks in enumerate(hosts) if rank in ranks)
            if algorithm == "nvls":
                return nvls_all_reduce(rank, buf, gpus=hosts[host], switch=world + host,
                                       reduce=collective != "all_gather", gather=collective != "reduce_scatter")
            return nvls_tree_all_reduce(rank, world, buf, hosts=hosts, switch=world + host)
        if algorithm == "pat":  # one GPU per node: one NIC, one channel
            return (pat_all_gather if collective == "all_gather" else pat_reduce_scatter)(rank, world, buf)
        if collective == "all_reduce" and algorithm == "ring":
            if self.channels == 1:
                return RingAllReduce(rank, world, buf, ring=self._rings[0])
            return _over_channels(buf, [lambda part, c: RingAllReduce(rank, world, part, ring=self._rings[c], tag=c)
                                        for c in range(self.channels)])
        if collective == "all_reduce":  # NCCL's tree, one pair of trees per channel
            return _over_channels(buf, [
                lambda part, c: nccl_tree_all_reduce(rank, world, part, hosts=_chains(hosts, orders[c]),
                                                     tags=(2 * c, 2 * c + 1))
                for c in range(self.channels)])
        if collective in ("all_gather", "reduce_scatter"):
            return _ring_shards(collective, rank, buf, orders)
        first, second = self.nodes[orders[0][0]], self.nodes[orders[0][1]]
        rate_Bps, step_s = view_route(self.topology, first, second)
        fraction, _ = self.wire(collective, algorithm, protocol).of(tuple(self.topology.path(first, second)))
        pieces = chain_pieces(world, buf.nbytes // self.channels, rate_Bps * fraction, step_s)
        return _over_channels(buf, [lambda part, c: _chain(collective, rank, part, orders[c], c, pieces)
                                    for c in range(self.channels)])

    def switches(self, collective: str, algorithm: str, like) -> tuple[list[str], list]:
        """(the reducing switch of each node, its program) for NVLS or NVLS-tree on buffers like `like`."""
        switches = [_reducing_switch(self.topology, [self.nodes[rank] for rank in ranks]) for ranks in self.hosts]
        programs = []
        for host in range(len(switches)):
            accumulator = torch.zeros_like(like)
            if algorithm == "nvls":
                programs.append(nvls_switch(accumulator, gpus=self.hosts[host], reduce=collective != "all_gather",
                                            gather=collective != "reduce_scatter"))
            else:
                programs.append(nvls_switch(accumulator, gpus=self.hosts[host], across_nodes=True))
        return switches, programs


def nccl_all_reduce(topology: Topology, nodes: list[str]):
    """fn(rank, world, buf, average=False) -> the NcclCall of NCCL's choice for buf's size, for the group whose
    rank r is on nodes[r]: `parallel.all_reduce: nccl`."""
    group = NcclGroup(topology, nodes)

    def all_reduce(rank: int, world: int, buf, average: bool = False):
        if world != group.world:
            raise ValueError(f"all-reduce built for {group.world} ranks, called with world {world}")
        if world == 1:  # nothing to move: NCCL returns at once
            return _averaged(iter(()), buf, 1)
        return group.call("all_reduce", rank, buf, average=average)

    return all_reduce


def launch_latency_s(fabric: Fabric, collective: str, algorithm: str, protocol: str) -> float:
    """Seconds NCCL's model charges once per call beyond the steps the programs time."""
    p = PROTOCOLS.index(protocol)
    if collective in ROOTED:  # NCCL charges a rooted ring's protocol latency once, its pipeline hiding the rest
        kind = fabric.intra_link if fabric.nodes == 1 else "net"
        extra_us = max(0.0, HW_LATENCY_US[kind]["ring"][p] - HW_LATENCY_US[kind]["ring"][0])
        return (BASE_LATENCY_US[algorithm][p] + extra_us) * 1e-6
    if algorithm in ("nvls", "nvls_tree"):
        ranks = fabric.ranks
        steps = 2 * (ranks - 1) if collective == "all_reduce" else ranks - 1
        return call_latency_us(collective, algorithm, protocol, fabric, steps, ranks / fabric.nodes) * 1e-6
    return BASE_LATENCY_US[algorithm][p] * 1e-6


def _averaged(program, buf, world: int):
    """`program`, then `buf` divided by `world`."""
    yield from program
    buf.div_(world)
    return buf


def chain_pieces(world: int, nbytes: int, rate_Bps: float, step_s: float) -> int:
    """Pieces of a rooted ring (a chain of `world` ranks) that minimize its time (P + N - 2)(step + S/(P·B)):
    P = sqrt((N-2)·S / (B·step)), between 1 and CHAIN_MAX_PIECES. Few pieces leave the chain's far end idle
    while the pipeline fills; many pay the step latency once per piece, as NCCL's chunk size trades them."""
    if world <= 2 or nbytes == 0:
        return 1
    best = math.sqrt((world - 2) * nbytes / (rate_Bps * step_s)) if step_s > 0 else CHAIN_MAX_PIECES
    return max(1, min(CHAIN_MAX_PIECES, round(best)))


def view_route(topology: Topology, src: str, dst: str) -> tuple[float, float]:
    """(bottleneck rate in bytes/s, total latency in s) of the route from src to dst."""
    path = topology.path(src, dst)
    links = [topology.graph.edges[a, b] for a, b in zip(path, path[1:])]
    return (min(attrs["bandwidth"] * attrs.get("efficiency", 1.0) for attrs in links),
            sum(attrs["latency"] for attrs in links))


def _over_channels(buf, channel_programs):
    """Channel c runs its program on part c of the buffer, all side by side."""
    parts = buf.tensor_split(len(channel_programs))
    yield Concurrently([make(part, c) for c, (make, part) in enumerate(zip(channel_programs, parts))])
    return buf


def _chains(hosts, order: list[int]) -> list[list[int]]:
    """Each host's ranks in the channel's ring order: the chain, its rail GPU at the head."""
    return [[rank for rank in order if rank in ranks] for ranks in hosts]


def _ring_shards(collective: str, rank: int, buf, orders):
    """Ring all-gather or reduce-scatter: rank r's shard r (nccl-tests' layout), split over the channels."""
    world = len(orders[0])
    shards = buf.tensor_split(world)
    programs = []
    for c, order in enumerate(orders):
        parts = [shard.tensor_split(len(orders))[c] for shard in shards]
        position = order.index(rank)
        # Position p ends the reduce-scatter holding (and starts the all-gather from) chunk p+1: make it its own.
        chunks = [None] * world
        for p, member in enumerate(order):
            chunks[(p + 1) % world] = parts[member]
        right, left = order[(position + 1) % world], order[position - 1]
        step = ring_reduce_scatter if collective == "reduce_scatter" else ring_all_gather
        programs.append(step(position, right, left, chunks, c))
    yield Concurrently(programs)
    return buf


def _chain(collective: str, rank: int, buf, order: list[int], tag: int, count: int):
    """NCCL's ring broadcast (root 0 sends down the ring) or reduce (the ring sums into root 0), pipelined."""
    start = order.index(0)
    chain = order[start:] + order[:start]  # root first
    if collective == "reduce":
        chain = chain[:1] + chain[1:][::-1]  # the sum flows towards the root, which ends it
    position = chain.index(rank)
    pieces = buf.tensor_split(count)
    before = chain[position - 1] if position > 0 else None
    after = chain[position + 1] if position + 1 < len(chain) else None
    if collective == "reduce":
        before, after = after, before  # receive from the far end, send towards the root
    for i in range(len(pieces) + 1):
        ops = []
        if i < len(pieces) and before is not None:
            ops.append(Recv(before, pieces[i], collective == "reduce", tag))
        if i > 0 and after is not None:
            ops.append(Send(after, pieces[i - 1], tag))
        if ops:
            yield ops
    return buf


def _reducing_switch(topology: Topology, gpus: list[str]) -> str:
    """The reducing switch every GPU of a node links to."""
    common = set.intersection(*(set(topology.graph[gpu]) for gpu in gpus)) & topology.reducing
    if not common:
        raise ValueError(f"topology {topology.name}: no reducing switch joins {gpus[0]}'s node")
    return sorted(common)[0]


def _rate(topology: Topology, a: str, b: str) -> float:
    attrs = topology.graph.edges[a, b]
    return attrs["bandwidth"] * attrs.get("efficiency", 1.0)

