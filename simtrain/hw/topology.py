"""Topology: which nodes (GPUs, switches) exist and which links join them.

A topology is an undirected networkx graph whose edges carry `bandwidth`
(bytes/s, per direction: links are full duplex), `latency` (seconds per hop)
and optionally `efficiency` (the achievable fraction of `bandwidth`, default 1),
plus the list of GPU nodes in rank order, and the switches that can reduce (`reducing`: an
NVSwitch of the H100 generation sums what GPUs send it and multicasts the result, NVLink SHARP). Routing is static: a transfer takes the
path of least total latency, then fewest hops; ties are broken by the order in
which nodes were added to the graph, so the same topology always routes the same
way. A failed link leaves the graph (`remove_link`, hw/faults.py) and routes are
recomputed on what remains; no route left is `NoRoute`. A builder whose
graph is a tree above the hosts (clos3) passes `router`, the closed form of
those same least-latency routes between two GPUs, so that a 16,384-GPU cluster
does not run Dijkstra over its whole graph for every pair; it gives None for a
pair it does not know, and leaves with the first failed link. Builders
(`ring`, `switch`, ...) and YAML files live in topology_builders.py.

A builder passes the function that makes its graph rather than the graph: the
graph is made, and checked, when it is first read (to route, to build the
network), so that what needs only the devices (`simtrain validate` of a
builder's cluster) does not import networkx.
"""
from __future__ import annotations

from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Callable

from ..errors import NoRoute, TopologyError

if TYPE_CHECKING:
    import networkx as nx

# Added to every hop's latency when routing, so that among paths of equal
# latency the one with fewest hops wins (and zero-latency links still route).
_HOP_TIEBREAK_S = 1e-15


class Topology:
    """A validated graph of GPUs and switches with static shortest-path routing."""

    def __init__(self, graph: nx.Graph | Callable[[], nx.Graph], devices: list[str], name: str = "custom",
                 private: frozenset[str] = frozenset(), reducing: frozenset[str] = frozenset(), router=None):
        self.devices = list(devices)
        self.name = name
        # Nodes that carry only traffic to or from private nodes (a shared-memory store and the
        # host bridge in front of it): GPU-to-GPU routes never cross them.
        self.private = frozenset(private)
        # Switches that reduce what GPUs send them and multicast the result (NVLink SHARP, NCCL's NVLS).
        self.reducing = frozenset(reducing)
        self._router = router  # (src, dst) -> the least-latency route between two GPUs, or None: Dijkstra's
        self._check_devices()
        if callable(graph):
            self._make_graph = graph  # a builder's: `graph` makes and checks it when first read
        else:
            self._check_graph(graph)
            self.graph = graph  # in the cached property's place
        self.path = lru_cache(maxsize=None)(self._route)
        self.link_rates = lru_cache(maxsize=None)(self._link_rates)

    @cached_property
    def graph(self) -> nx.Graph:
        """The networkx graph of GPUs and switches; a builder's is made (and checked) here, when first read."""
        make, self._make_graph = self._make_graph, None  # the builder's edge lists go with it
        graph = make()
        self._check_graph(graph)
        return graph

    def _check_devices(self) -> None:
        if not self.devices:
            raise TopologyError(f"topology {self.name}: has no devices")
        if len(set(self.devices)) != len(self.devices):
            raise TopologyError(f"topology {self.name}: a device is listed twice")

    def _check_graph(self, graph: nx.Graph) -> None:
        import networkx as nx

        for node in self.devices:
            if node not in graph:
                raise TopologyError(f"topology {self.name}: unknown node {node!r}")
        for node in sorted(self.reducing):
            if node not in graph or node in self.devices:
                raise TopologyError(f"topology {self.name}: reducing switch {node!r} is not a switch of the graph")
        for a, b, attrs in graph.edges(data=True):
            for key in ("bandwidth", "latency"):
                if key not in attrs:
                    raise TopologyError(f"topology {self.name}: link {a}-{b} has no {key}")
            if attrs["bandwidth"] <= 0:
                raise TopologyError(f"topology {self.name}: link {a}-{b} bandwidth must be positive")
            if attrs["latency"] < 0:
                raise TopologyError(f"topology {self.name}: link {a}-{b} latency must not be negative")
            if not 0 < attrs.get("efficiency", 1.0) <= 1:
                raise TopologyError(f"topology {self.name}: link {a}-{b} efficiency must be in (0, 1]")
        if not nx.is_connected(graph):
            parts = sorted(sorted(c)[0] for c in nx.connected_components(graph))
            raise TopologyError(
                f"topology {self.name}: disconnected ({len(parts)} parts, e.g. around {parts[0]!r} and {parts[1]!r})"
            )

    def _route(self, src: str, dst: str) -> tuple[str, ...]:
        """Nodes from src to dst, both included: least latency, then fewest hops; through
        private nodes only if src or dst is one."""
        for node in (src, dst):
            if node not in self.graph:
                raise TopologyError(f"topology {self.name}: unknown node {node!r}")
        if self._router is not None and (route := self._router(src, dst)) is not None:
            return route
        private = self.private if src not in self.private and dst not in self.private else frozenset()

        def weight(a, b, attrs):
            if a in private or b in private:
                return None  # networkx: edge hidden
            return attrs["latency"] + _HOP_TIEBREAK_S

        import networkx as nx

        try:
            return tuple(nx.dijkstra_path(self.graph, src, dst, weight=weight))
        except nx.NetworkXNoPath:
            raise NoRoute(f"no route left from {src} to {dst} (failed links)") from None

    def _link_rates(self) -> frozenset[float]:
        """The achievable bytes/s (bandwidth x efficiency) of the links between nodes that are not private."""
        private = self.private
        return frozenset(attrs["bandwidth"] * attrs.get("efficiency", 1.0) for a, b, attrs in
                         self.graph.edges(data=True) if a not in private and b not in private)

    def remove_link(self, a: str, b: str) -> None:
        """The link a-b fails: it leaves routing, and every route is recomputed on the remaining graph."""
        self.graph.remove_edge(a, b)
        self._router = None
        self.path.cache_clear()
        self.link_rates.cache_clear()

    def link(self, a: str, b: str) -> dict:
        """Attributes (bandwidth, latency) of the link between a and b."""
        return self.graph.edges[a, b]

    @property
    def num_devices(self) -> int:
        return len(self.devices)
