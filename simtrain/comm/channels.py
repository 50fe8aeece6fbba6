"""Channels: how a group's ranks sit on hosts and rails, and the rank order each channel runs in.

NCCL splits a collective's buffer into channels and runs one ring (or pair of
trees) per channel, each crossing between hosts through a different NIC, so
that every rail of a rail-optimized cluster carries traffic. This module keeps
that as plain data and pure functions, tested on their own:

- `Layout(hosts, rails)`: the group ranks on each host (in rank order) and, per
  host, the ranks that own a NIC (their rails, in rank order);
- `channel_order(layout, channel)`: the ring of one channel, host after host,
  each host's ranks rotated so that the ring enters the host at the GPU of rail
  `channel` (mod the rails) and leaves it from the GPU before it; with one rail
  per GPU and as many channels as rails, every NIC carries one channel in each
  direction (NCCL builds its rings the same way from the detected topology);
- `default_channels(layout, algorithm)`: one channel per rail when the group
  spans hosts (NCCL forms its rings so that an all-reduce uses every NIC,
  NVIDIA/nccl-tests #277), one on a single host or a single-path topology,
  where more channels over the same links buy no bandwidth in a flow model;
  `hierarchical` takes one, as its inter-host phase already runs one ring per rail.

`layout_of(topology, nodes)` reads the layout from the topology graph, with no
hints in the file: hosts are what stays connected when the topology's slowest
link class (its inter-host NIC links) is taken out, and a GPU with such a link
of its own owns a rail. A topology whose links are all alike is one host.

    layout = layout_of(topology, topology.devices)
    rings = [channel_order(layout, c) for c in range(default_channels(layout, "ring"))]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ScenarioError
from ..hw.topology import Topology
from ..limits import MAX_CHANNELS

if TYPE_CHECKING:
    import networkx as nx


@dataclass(frozen=True)
class Layout:
    """Group ranks per host, hosts ordered by their lowest rank; per host the ranks with a NIC."""

    hosts: tuple[tuple[int, ...], ...]
    rails: tuple[tuple[int, ...], ...]


ONE_CHANNEL = ("naive", "tree")  # all-reduce algorithms that run on one channel


def check_channels(algorithm: str, channels: int, channels_field: str = "channels") -> None:
    """A one-line error naming `channels_field` unless all-reduce `algorithm` can run on `channels` channels (given,
    not the topology's default)."""
    if algorithm == "nccl":
        raise ScenarioError(f"{channels_field}: nccl opens NCCL's own channels; leave it null, got {channels!r}")
    if isinstance(channels, bool) or not isinstance(channels, int) or not 1 <= channels <= MAX_CHANNELS:
        raise ScenarioError(f"{channels_field}: must be an integer from 1 to {MAX_CHANNELS}, got {channels!r}")
    if channels > 1 and algorithm in ONE_CHANNEL:
        raise ScenarioError(f"{channels_field}: {algorithm} runs on one channel, got {channels}")


def channel_order(layout: Layout, channel: int) -> list[int]:
    """The ring of `channel`: hosts in order, each rotated to start at its rail `channel` GPU."""
    order = []
    for ranks, rails in zip(layout.hosts, layout.rails):
        first = rails[channel % len(rails)] if rails else ranks[channel % len(ranks)]
        start = ranks.index(first)
        order.extend(ranks[start:] + ranks[:start])
    return order


def default_channels(layout: Layout, algorithm: str) -> int:
    """What NCCL would open here: one channel per NIC rail across hosts, else one."""
    if len(layout.hosts) < 2 or algorithm == "hierarchical":
        return 1
    return max(1, min(len(rails) for rails in layout.rails))


def layout_of(topology: Topology, nodes: list[str]) -> Layout:
    """The Layout of the group whose rank r runs on network node nodes[r]."""
    graph, private = topology.graph, topology.private
    rates = topology.link_rates()
    slowest = min(rates) if rates else None
    hosts: dict[str, list[int]] = {}  # a node of each host (the group's first there) -> its group ranks
    host_of: dict[str, str] = {}
    for rank, node in enumerate(nodes):
        if node not in host_of:
            host = _host(graph, node, slowest, private) if len(rates) > 1 else graph.nodes
            host_of.update(dict.fromkeys(host, node))
        hosts.setdefault(host_of[node], []).append(rank)
    if len(hosts) == 1:
        return Layout(hosts=(tuple(range(len(nodes))),), rails=((),))
    groups = sorted(hosts.values())
    rails = tuple(
        tuple(rank for rank in ranks
              if any(_rate(attrs) == slowest for _, other, attrs in graph.edges(nodes[rank], data=True)
                     if other not in private))
        for ranks in groups)
    return Layout(hosts=tuple(tuple(ranks) for ranks in groups), rails=rails)


def _host(graph: nx.Graph, node: str, slowest: float, private: frozenset[str]) -> set[str]:
    """The nodes `node` reaches over links faster than the slowest (its host), private nodes left out."""
    host, frontier = {node}, [node]
    while frontier:
        here = frontier.pop()
        for other, attrs in graph[here].items():
            if other not in host and other not in private and _rate(attrs) != slowest:
                host.add(other)
                frontier.append(other)
    return host


def _rate(attrs: dict) -> float:
    """A link's achievable bytes/s: line rate times its efficiency."""
    return attrs["bandwidth"] * attrs.get("efficiency", 1.0)
