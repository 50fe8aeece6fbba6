"""Collectives as NCCL runs them: its algorithms as programs on a topology, its protocols as a view of the links.

`nccl_tuning.py` predicts; this module runs. For a topology it gives

- `fabric_of(topology, generation)`: the `Fabric` NCCL's tuner sees (ranks,
  nodes, each GPU's achievable NVLink bandwidth, each node's NIC bandwidth,
  whether its NVSwitch reduces);
- `protocol_view(topology, algorithm, protocol)`: the same topology as the
  protocol sees it: every link's efficiency times the protocol's (LL carries 8
  bytes of data per 16-byte line: 1/2; LL128 120 of 128 bytes; Simple all;
  NVLS on Hopper 0.85 of the NVLink rate, NCCL's nvlsEfficiency), and for
  ring and tree every hop slower by half the step latency the protocol adds
  over ring/LL (NCCL's hwLatencies; a GPU-to-GPU step is two hops, the
  topology files' latencies being ring/LL's); not for broadcast and reduce,
  whose pipelined chain NCCL charges that latency once;
- `launch_latency_s(fabric, collective, algorithm, protocol)`: the fixed cost
  NCCL's model charges once per call (its base latency; for NVLS and
  NVLS-tree, whose steps NCCL does not count, its whole latency);
- `nccl_programs(topology, collective, algorithm, buffers)`: the per-rank
  programs and the network nodes they run on; a reducing switch joins the
  communicator as one more rank with its own program.

Buffers follow nccl-tests: all-gather's and reduce-scatter's are the whole
N-shard buffer on every rank (rank r's own shard r); broadcast and reduce have
root 0. Ring collectives run on one channel per NIC rail across nodes
(channels.py), each rank's shard split over the channels.

    view = protocol_view(topology, "ring", "LL")
    nodes, programs = nccl_programs(view, "all_reduce", "ring", buffers)
"""
import math

import networkx as nx
import torch

from ..hw.topology import Topology
from .all_reduce import build_all_reduce
from .channels import channel_order, default_channels, layout_of
from .nccl_tree import nccl_tree_all_reduce
from .nccl_tuning import (BASE_LATENCY_US, HW_LATENCY_US, NVLS_EFFICIENCY, PROTOCOLS, Fabric,
                          call_latency_us)
from .nvls import nvls_all_reduce, nvls_switch, nvls_tree_all_reduce
from .ops import Concurrently, Recv, Send
from .ring import ring_all_gather, ring_reduce_scatter

CHAIN_MAX_PIECES = 1024  # a rooted ring's pieces (chain_pieces)
ROOTED = ("broadcast", "reduce")
PROTOCOL_EFFICIENCY = {"LL": 0.5, "LL128": 120 / 128, "Simple": 1.0}
# The algorithms with a program here, per collective (NCCL's PAT and CollNet are not among them).
PROGRAMS = {"all_reduce": ("ring", "tree", "nvls", "nvls_tree"), "all_gather": ("ring", "nvls"),
            "reduce_scatter": ("ring", "nvls"), "broadcast": ("ring",), "reduce": ("ring",)}


def fabric_of(topology: Topology, generation: str | None = None) -> Fabric:
    """What NCCL's search would tell its tuner; `generation` None: hopper with a reducing switch, else ampere."""
    layout = layout_of(topology, topology.devices)
    kinds = link_kinds(topology)
    first = topology.devices[0]
    intra = max(_rate(topology, first, peer) for peer in topology.graph[first]
                if kinds[frozenset((first, peer))] == "nvlink")
    nics = sum(_rate(topology, topology.devices[rank], peer) for rank in layout.hosts[0]
               for peer in topology.graph[topology.devices[rank]]
               if kinds[frozenset((topology.devices[rank], peer))] == "net")
    generation = generation or ("hopper" if topology.reducing else "ampere")
    return Fabric(ranks=topology.num_devices, nodes=len(layout.hosts), generation=generation,
                  intra_GBps=intra / 1e9, inter_GBps=(nics if len(layout.hosts) > 1 else intra) / 1e9,
                  nvls=bool(topology.reducing))


def link_kinds(topology: Topology) -> dict:
    """Each link's kind for NCCL's latency table: `net` for the NIC links between hosts, else `nvlink`."""
    layout = layout_of(topology, topology.devices)
    rates = [_rate(topology, a, b) for a, b in topology.graph.edges]
    slowest = min(rates)
    multi = len(layout.hosts) > 1
    return {frozenset((a, b)): "net" if multi and rate == slowest else "nvlink"
            for (a, b), rate in zip(topology.graph.edges, rates)}


def protocol_view(topology: Topology, algorithm: str, protocol: str, generation: str | None = None,
                  collective: str = "all_reduce") -> Topology:
    """The topology as `protocol` moves bytes over it for `algorithm` running `collective` (module docstring)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}")
    generation = fabric_of(topology, generation).generation
    kinds = link_kinds(topology)
    graph = nx.Graph()
    graph.add_nodes_from(topology.graph.nodes(data=True))
    p = PROTOCOLS.index(protocol)
    for a, b, attrs in topology.graph.edges(data=True):
        kind = kinds[frozenset((a, b))]
        efficiency = attrs.get("efficiency", 1.0) * PROTOCOL_EFFICIENCY[protocol]
        latency = attrs["latency"]
        if algorithm in ("nvls", "nvls_tree") and kind == "nvlink":
            efficiency *= NVLS_EFFICIENCY[generation]
        if algorithm in ("ring", "tree") and collective not in ROOTED:
            extra_us = HW_LATENCY_US[kind][algorithm][p] - HW_LATENCY_US[kind]["ring"][0]
            latency += max(0.0, extra_us) * 1e-6 / 2
        graph.add_edge(a, b, **{**attrs, "efficiency": efficiency, "latency": latency})
    return Topology(graph, topology.devices, topology.name, private=topology.private, reducing=topology.reducing)


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


def nccl_programs(topology: Topology, collective: str, algorithm: str, buffers: list[torch.Tensor]):
    """(network nodes, one program per rank) of `algorithm` running `collective` on every rank's buffer."""
    if algorithm not in PROGRAMS.get(collective, ()):
        raise ValueError(f"no {algorithm} program for {collective}")
    world = topology.num_devices
    nodes = list(topology.devices)
    layout = layout_of(topology, nodes)
    hosts = [list(ranks) for ranks in layout.hosts]
    if algorithm in ("nvls", "nvls_tree"):
        switches = [_reducing_switch(topology, [nodes[rank] for rank in ranks]) for ranks in hosts]
        switch_rank = {switch: world + index for index, switch in enumerate(switches)}
        programs = []
        for rank in range(world):
            host = next(index for index, ranks in enumerate(hosts) if rank in ranks)
            switch = switch_rank[switches[host]]
            if algorithm == "nvls":
                programs.append(nvls_all_reduce(rank, buffers[rank], gpus=hosts[host], switch=switch,
                                                reduce=collective != "all_gather",
                                                gather=collective != "reduce_scatter"))
            else:
                programs.append(nvls_tree_all_reduce(rank, world, buffers[rank], hosts=hosts, switch=switch))
        for host, switch in enumerate(switches):
            accumulator = torch.zeros_like(buffers[0])
            if algorithm == "nvls":
                programs.append(nvls_switch(accumulator, gpus=hosts[host], reduce=collective != "all_gather",
                                            gather=collective != "reduce_scatter"))
            else:
                programs.append(nvls_switch(accumulator, gpus=hosts[host], across_nodes=True))
        return nodes + switches, programs
    channels = default_channels(layout, "ring")
    orders = [channel_order(layout, c) for c in range(channels)]
    if collective == "all_reduce" and algorithm == "ring":
        program = build_all_reduce("ring", topology, nodes, channels)
        return nodes, [program(rank, world, buffers[rank]) for rank in range(world)]
    if collective == "all_reduce":  # NCCL's tree, one pair of trees per channel
        return nodes, [_over_channels(rank, buffers[rank], [
            lambda part, c, rank=rank: nccl_tree_all_reduce(rank, world, part, hosts=_chains(hosts, orders[c]),
                                                            tags=(2 * c, 2 * c + 1))
            for c in range(channels)]) for rank in range(world)]
    if collective in ("all_gather", "reduce_scatter"):
        return nodes, [_ring_shards(collective, rank, buffers[rank], orders) for rank in range(world)]
    route = view_route(topology, nodes[orders[0][0]], nodes[orders[0][1]])
    pieces = chain_pieces(world, buffers[0].nbytes // channels, *route)
    return nodes, [_over_channels(rank, buffers[rank], [
        lambda part, c, rank=rank: _chain(collective, rank, part, orders[c], c, pieces) for c in range(channels)])
        for rank in range(world)]


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


def _over_channels(rank: int, buf, channel_programs):
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

