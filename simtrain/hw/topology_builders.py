"""Topology builders and topology files: the shapes a cluster's network can take.

`build_topology(name_or_path, devices, link, ...)` returns a `Topology`
(topology.py) either from a builder or from a YAML file. GPUs are named
`gpu0`, `gpu1`, ... in rank order by every builder:

- `ring`: gpu i to gpu i+1 (mod N); N=2 is one link, N=1 a lone GPU.
- `fully_connected`: a link between every pair, N(N-1)/2 links.
- `switch`: every GPU to one non-blocking node named `switch`.
- `torus2d`: a rows x cols grid with wrap-around in both dimensions,
  rank = r*cols + c; `torus_shape`, or the most square factorization with
  rows <= cols. A dimension of 2 has one link per pair, not two.
- `hierarchical`: nodes of `gpus_per_node` GPUs. Inside node k every GPU links
  to `node{k}-switch` with `link` (an NVSwitch fabric); every GPU also has its
  own NIC linked with `inter_link` to one `spine` switch (rail-optimized, one NIC
  per GPU, as in DGX clusters). Intra-node traffic stays on the node switch,
  inter-node traffic goes gpu -> spine -> gpu.
- `fat_tree`: nodes of `gpus_per_node` GPUs on a node switch (`link`), each
  GPU's NIC (`inter_link`) to the leaf switch of its rail: the GPUs of local
  index r of every `nodes_per_leaf` consecutive nodes share `leaf{g}-rail{r}`
  (rail-optimized, as a DGX SuperPOD scalable unit of 20 nodes). Every leaf
  has one uplink to the `core`, of `nodes_per_leaf` NICs' bandwidth divided
  by `oversubscription` (1: non-blocking). The uplink stands for the leaf's
  many cables to many spine switches, over which ECMP spreads flows: in a
  flow model, one link of their summed bandwidth. Traffic between rails goes
  through the node switch to the GPU of the destination's rail first when
  that is quicker (as NCCL's PXN does), else through the core.

A topology file describes any other network:

    name: dgx-a100-2node           # optional; default: the file's stem
    gpus: [n0g0, n0g1, ...]        # required, rank order
    switches: [n0-nvswitch, ...]   # optional, nodes that are not GPUs
    reducing_switches: [n0-nvswitch]  # optional, switches that reduce and multicast (NVLS)
    link_classes:                  # optional, named link kinds for `class:`
      nvlink3: {bandwidth: "300 GB/s", latency: "0.25 us", efficiency: 0.8}
    links:                         # undirected, full duplex
      - {between: [n0g0, n0-nvswitch], class: nvlink3}
      - {between: [n0g0, spine], bandwidth: "200 Gb/s", latency: "1.35 us"}

`bandwidth` is per direction; a link gives either a `class` or both `bandwidth`
and `latency` (given with a `class`, they override it). `efficiency` (optional,
default 1.0, in (0, 1]) is the fraction of the line rate that transfers reach
on that link, as the device `efficiency` is the fraction of peak FLOP/s; the
network moves bytes at bandwidth x efficiency. Quantities are strings
with units (units.py) or plain SI numbers. Every mistake raises TopologyError
naming the file and the field: unknown keys, unknown or repeated nodes, a link
listed twice, a missing or negative bandwidth, a disconnected graph.
"""
from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ScenarioError, TopologyError
from ..limits import MAX_DEVICES, MAX_LINKS
from ..scenario import TOPOLOGY_BUILDERS
from ..units import parse_quantity
from ..user_files import load_yaml_file, user_path
from .topology import Topology

if TYPE_CHECKING:
    import networkx as nx


_FILE_KEYS = ("name", "gpus", "switches", "reducing_switches", "link_classes", "links")
_LINK_KEYS = ("between", "class", "bandwidth", "latency", "efficiency")


@dataclass(frozen=True)
class LinkClass:
    """One kind of link: bytes/s per direction (line rate), seconds per hop, achievable fraction of the rate."""

    bandwidth: float
    latency: float
    efficiency: float = 1.0


def parse_link(value, field: str, default: LinkClass | None = None) -> LinkClass:
    """A LinkClass from {bandwidth: "300 GB/s", latency: "1 us", efficiency: 0.8}; ScenarioError naming `field`.

    With `default`, any key may be left out and is taken from it; efficiency defaults to 1.0.
    """
    if not isinstance(value, Mapping):
        raise ScenarioError(f"{field}: expected a mapping with bandwidth and latency, got {value!r}")
    for key in value:
        if key not in ("bandwidth", "latency", "efficiency"):
            raise ScenarioError(f"{field}: unknown key {key!r}; allowed: bandwidth, latency, efficiency")
    parsed = {}
    for key, kind in (("bandwidth", "bandwidth"), ("latency", "time")):
        if key in value:
            parsed[key] = parse_quantity(value[key], kind, f"{field}.{key}")
        elif default is not None:
            parsed[key] = getattr(default, key)
        else:
            raise ScenarioError(f"{field}: missing {key}")
    if parsed["bandwidth"] == 0:
        raise ScenarioError(f"{field}.bandwidth: must be positive, got {value['bandwidth']!r}")
    parsed["efficiency"] = default.efficiency if default is not None else 1.0
    if "efficiency" in value:
        efficiency = value["efficiency"]
        if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)) or not 0 < efficiency <= 1:
            raise ScenarioError(f"{field}.efficiency: expected a number in (0, 1], got {efficiency!r}")
        parsed["efficiency"] = float(efficiency)
    return LinkClass(**parsed)


def build_topology(
    topology: str | Path,
    devices: int | None,
    link: LinkClass | None,
    *,
    inter_link: LinkClass | None = None,
    gpus_per_node: int | None = None,
    torus_shape: tuple[int, int] | None = None,
    nodes_per_leaf: int = 20,
    oversubscription: float = 1.0,
    leaves_per_pod: int = 192,
    base_dir: str | Path | None = None,
) -> Topology:
    """A builder's topology, or a file's (links then come from the file, not `link`).

    For a file, `devices` None means the file's GPU count; any other count must match it.
    """
    if isinstance(topology, str) and topology in TOPOLOGY_BUILDERS:
        devices = _device_count(devices, topology)
        if link is None:
            raise TopologyError(f"cluster.link: required by the {topology} builder")
        if topology == "ring":
            return _ring(devices, link)
        if topology == "fully_connected":
            return _fully_connected(devices, link)
        if topology == "switch":
            return _switch(devices, link)
        if topology == "torus2d":
            return _torus2d(devices, link, torus_shape)
        if topology == "hierarchical":
            return _hierarchical(devices, link, inter_link, gpus_per_node)
        if topology == "clos3":
            return _clos3(devices, link, inter_link, gpus_per_node, nodes_per_leaf, leaves_per_pod, oversubscription)
        return _fat_tree(devices, link, inter_link, gpus_per_node, nodes_per_leaf, oversubscription)
    result = load_topology_file(_find_file(topology, base_dir))
    if devices is not None and devices != result.num_devices:
        raise TopologyError(f"cluster.devices: {devices} does not match the {result.num_devices} GPUs of {topology}; "
                            "`cluster.devices: null` takes the file's count")
    return result


def _device_count(devices, builder: str) -> int:
    if devices is None:
        raise TopologyError(f"cluster.devices: required by the {builder} builder")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise TopologyError(f"cluster.devices: must be an integer >= 1, got {devices!r}")
    return devices


def _find_file(topology: str | Path, base_dir: str | Path | None) -> Path:
    """The topology file: a relative path is looked up in base_dir, then the cwd."""
    path = user_path(topology, "cluster.topology", TopologyError)
    candidates = [path] if path.is_absolute() or base_dir is None else [Path(base_dir) / path, path]
    for candidate in candidates:
        if os.path.exists(candidate):  # load_topology_file says what is wrong with one that is no file
            return candidate
    if path.suffix in (".yaml", ".yml") or len(path.parts) > 1:
        raise TopologyError(f"topology file {topology}: not found")
    raise TopologyError(
        f"cluster.topology: unknown topology {str(topology)!r}; expected one of {', '.join(TOPOLOGY_BUILDERS)} "
        "or a YAML file"
    )


def _gpus(devices: int) -> list[str]:
    return [f"gpu{rank}" for rank in range(devices)]


def _graph(nodes: list[str], edges, link: LinkClass) -> nx.Graph:
    """The graph of `nodes` joined by `edges` of one link class (a builder's graph, made when first read)."""
    import networkx as nx

    graph = nx.Graph()
    graph.add_nodes_from(nodes)
    graph.add_edges_from(edges, bandwidth=link.bandwidth, latency=link.latency, efficiency=link.efficiency)
    return graph


def _ring(devices: int, link: LinkClass) -> Topology:
    gpus = _gpus(devices)
    count = devices if devices > 2 else devices - 1
    edges = [(gpus[i], gpus[(i + 1) % devices]) for i in range(count)]
    return Topology(lambda: _graph(gpus, edges, link), gpus, name=f"ring-{devices}")


def _fully_connected(devices: int, link: LinkClass) -> Topology:
    links = devices * (devices - 1) // 2
    if links > MAX_LINKS:
        raise TopologyError(f"cluster.devices: fully_connected on {devices} GPUs has {links:,} links; at most "
                            f"{MAX_LINKS:,} are simulated (switch or hierarchical scale further)")
    gpus = _gpus(devices)
    return Topology(lambda: _graph(gpus, itertools.combinations(gpus, 2), link), gpus,
                    name=f"fully_connected-{devices}")


def _switch(devices: int, link: LinkClass) -> Topology:
    gpus = _gpus(devices)
    return Topology(lambda: _graph(gpus + ["switch"], [(gpu, "switch") for gpu in gpus], link), gpus,
                    name=f"switch-{devices}")


def _torus2d(devices: int, link: LinkClass, torus_shape) -> Topology:
    rows, cols = _torus_shape(devices, torus_shape)
    gpus = _gpus(devices)
    edges = []
    for r in range(rows):
        for c in range(cols):
            here = gpus[r * cols + c]
            if cols > 1:
                edges.append((here, gpus[r * cols + (c + 1) % cols]))
            if rows > 1:
                edges.append((here, gpus[((r + 1) % rows) * cols + c]))
    return Topology(lambda: _graph(gpus, edges, link), gpus, name=f"torus2d-{rows}x{cols}")


def _torus_shape(devices: int, torus_shape) -> tuple[int, int]:
    if torus_shape is None:
        rows = max(r for r in range(1, math.isqrt(devices) + 1) if devices % r == 0)
        return rows, devices // rows
    if (
        not isinstance(torus_shape, (tuple, list))
        or len(torus_shape) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in torus_shape)
    ):
        raise TopologyError(f"cluster.torus_shape: expected two integers >= 1 (rows, cols), got {torus_shape!r}")
    rows, cols = torus_shape
    if rows * cols != devices:
        raise TopologyError(
            f"cluster.torus_shape: {rows}x{cols} = {rows * cols} GPUs does not match cluster.devices {devices}"
        )
    return rows, cols


def _check_nodes(devices: int, link: LinkClass, inter_link, gpus_per_node, builder: str) -> None:
    """The refusals of a builder of nodes of `gpus_per_node` GPUs."""
    if gpus_per_node is None:
        raise TopologyError(f"cluster.gpus_per_node: required by the {builder} builder")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise TopologyError(f"cluster.gpus_per_node: must be an integer >= 1, got {gpus_per_node!r}")
    if devices % gpus_per_node:
        raise TopologyError(f"cluster.gpus_per_node: {devices} devices do not split into nodes of {gpus_per_node}")
    if inter_link is None:
        raise TopologyError(f"cluster.inter_node_link: required by the {builder} builder")
    if inter_link.latency < link.latency:
        raise TopologyError(
            f"cluster.inter_node_link: latency {inter_link.latency * 1e6:g} us is below the intra-node "
            f"link's {link.latency * 1e6:g} us; intra-node traffic would route through the network"
        )


def _node_graph(gpus: list[str], link: LinkClass, gpus_per_node: int) -> nx.Graph:
    """The GPUs of nodes of `gpus_per_node`, each node's joined by its switch `node{k}-switch`."""
    import networkx as nx

    graph = nx.Graph()
    graph.add_nodes_from(gpus)
    # Intra-node edges first: at equal latency, routing prefers the earlier-added neighbour.
    graph.add_edges_from(
        ((gpu, f"node{rank // gpus_per_node}-switch") for rank, gpu in enumerate(gpus)),
        bandwidth=link.bandwidth, latency=link.latency, efficiency=link.efficiency,
    )
    return graph


def _hierarchical(devices: int, link: LinkClass, inter_link, gpus_per_node) -> Topology:
    _check_nodes(devices, link, inter_link, gpus_per_node, "hierarchical")
    gpus = _gpus(devices)

    def make_graph() -> nx.Graph:
        graph = _node_graph(gpus, link, gpus_per_node)
        graph.add_edges_from(((gpu, "spine") for gpu in gpus), bandwidth=inter_link.bandwidth,
                             latency=inter_link.latency, efficiency=inter_link.efficiency)
        return graph

    return Topology(make_graph, gpus, name=f"hierarchical-{devices // gpus_per_node}x{gpus_per_node}")


def _fat_tree(devices: int, link: LinkClass, inter_link, gpus_per_node, nodes_per_leaf: int,
              oversubscription: float) -> Topology:
    _check_nodes(devices, link, inter_link, gpus_per_node, "fat_tree")
    if oversubscription > nodes_per_leaf:
        raise TopologyError(f"cluster.oversubscription: {oversubscription:g} leaves a leaf's uplink below one NIC's "
                            f"bandwidth (nodes_per_leaf {nodes_per_leaf})")
    gpus = _gpus(devices)

    def make_graph() -> nx.Graph:
        graph = _node_graph(gpus, link, gpus_per_node)
        leaf_of = [f"leaf{rank // (gpus_per_node * nodes_per_leaf)}-rail{rank % gpus_per_node}"
                   for rank in range(devices)]
        graph.add_edges_from(zip(gpus, leaf_of), bandwidth=inter_link.bandwidth, latency=inter_link.latency,
                             efficiency=inter_link.efficiency)
        graph.add_edges_from(((leaf, "core") for leaf in dict.fromkeys(leaf_of)),
                             bandwidth=nodes_per_leaf * inter_link.bandwidth / oversubscription,
                             latency=inter_link.latency, efficiency=inter_link.efficiency)
        return graph

    nodes = devices // gpus_per_node
    return Topology(make_graph, gpus, router=_FatTreeRoutes(gpus, gpus_per_node, nodes_per_leaf, link, inter_link),
                    name=f"fat_tree-{nodes}x{gpus_per_node}-{nodes_per_leaf}per-leaf-{oversubscription:g}to1")


class _FatTreeRoutes:
    """fat_tree's least-latency route between two GPUs, in closed form: through their host's switch; through
    their rail's leaf; between rails under one leaf group, over NVLink to the source host's GPU on the
    destination's rail, then its leaf (PXN's path: two host hops are cheaper than two more network hops); across
    leaf groups, up to the core and down. With the host's links as slow as the network's that last case ties
    with other paths, and Dijkstra's choice stands (None)."""

    def __init__(self, gpus: list[str], gpus_per_node: int, nodes_per_leaf: int, link: LinkClass, inter_link):
        self._gpus, self._rank = gpus, {gpu: rank for rank, gpu in enumerate(gpus)}
        self._per_node, self._per_leaf = gpus_per_node, gpus_per_node * nodes_per_leaf
        self._relay = link.latency < inter_link.latency

    def __call__(self, src: str, dst: str) -> tuple[str, ...] | None:
        a, b = self._rank.get(src), self._rank.get(dst)
        if a is None or b is None or a == b:
            return None
        node_a, node_b, rail_a, rail_b = a // self._per_node, b // self._per_node, a % self._per_node, b % self._per_node
        if node_a == node_b:
            return src, f"node{node_a}-switch", dst
        leaf_a, leaf_b = a // self._per_leaf, b // self._per_leaf
        if leaf_a != leaf_b:
            return src, f"leaf{leaf_a}-rail{rail_a}", "core", f"leaf{leaf_b}-rail{rail_b}", dst
        if rail_a == rail_b:
            return src, f"leaf{leaf_a}-rail{rail_a}", dst
        if not self._relay:
            return None
        relay = self._gpus[node_a * self._per_node + rail_b]
        return src, f"node{node_a}-switch", relay, f"leaf{leaf_a}-rail{rail_b}", dst


def _clos3(devices: int, link: LinkClass, inter_link, gpus_per_node, nodes_per_leaf: int, leaves_per_pod: int,
           oversubscription: float) -> Topology:
    _check_nodes(devices, link, inter_link, gpus_per_node, "clos3")
    rack_gpus = gpus_per_node * nodes_per_leaf
    pod_gpus = rack_gpus * leaves_per_pod
    if oversubscription > pod_gpus:
        raise TopologyError(f"cluster.oversubscription: {oversubscription:g} leaves a pod's uplink below one NIC's "
                            f"bandwidth ({pod_gpus} GPUs a pod)")
    gpus = _gpus(devices)

    def make_graph() -> nx.Graph:
        graph = _node_graph(gpus, link, gpus_per_node)
        racks = -(-devices // rack_gpus)
        nic = {"latency": inter_link.latency, "efficiency": inter_link.efficiency}
        graph.add_edges_from(((gpu, f"rack{rank // rack_gpus}") for rank, gpu in enumerate(gpus)),
                             bandwidth=inter_link.bandwidth, **nic)
        graph.add_edges_from(((f"rack{rack}", f"pod{rack // leaves_per_pod}") for rack in range(racks)),
                             bandwidth=rack_gpus * inter_link.bandwidth, **nic)
        pods = -(-racks // leaves_per_pod)
        if pods > 1:
            graph.add_edges_from(((f"pod{pod}", "aggregation") for pod in range(pods)),
                                 bandwidth=pod_gpus * inter_link.bandwidth / oversubscription, **nic)
        return graph

    return Topology(make_graph, gpus, router=_Clos3Routes(gpus, gpus_per_node, nodes_per_leaf, leaves_per_pod),
                    name=f"clos3-{devices // gpus_per_node}x{gpus_per_node}-{nodes_per_leaf}per-rack-"
                                      f"{leaves_per_pod}racks-per-pod-{oversubscription:g}to1")


class _Clos3Routes:
    """clos3's least-latency route between two GPUs, in closed form: through their host's switch, their rack's,
    their pod's or the aggregation, whichever is the lowest they share (a detour through a node switch only adds
    hops of at least the same latency)."""

    def __init__(self, gpus: list[str], gpus_per_node: int, nodes_per_leaf: int, leaves_per_pod: int):
        self._rank = {gpu: rank for rank, gpu in enumerate(gpus)}
        self._per_node, self._per_rack = gpus_per_node, gpus_per_node * nodes_per_leaf
        self._per_pod = self._per_rack * leaves_per_pod

    def __call__(self, src: str, dst: str) -> tuple[str, ...] | None:
        a, b = self._rank.get(src), self._rank.get(dst)
        if a is None or b is None or a == b:
            return None
        if a // self._per_node == b // self._per_node:
            return src, f"node{a // self._per_node}-switch", dst
        rack_a, rack_b = f"rack{a // self._per_rack}", f"rack{b // self._per_rack}"
        if rack_a == rack_b:
            return src, rack_a, dst
        pod_a, pod_b = f"pod{a // self._per_pod}", f"pod{b // self._per_pod}"
        if pod_a == pod_b:
            return src, rack_a, pod_a, rack_b, dst
        return src, rack_a, pod_a, "aggregation", pod_b, rack_b, dst


def load_topology_file(path) -> Topology:
    """The Topology a YAML file describes (format in the module docstring)."""
    path = Path(path)
    data = load_yaml_file(path, f"topology file {path}", TopologyError)
    try:
        name, graph, gpus, reducing = _parse_file(data, default_name=path.stem)
    except ScenarioError as exc:
        raise TopologyError(f"topology file {path}: {exc}") from None
    # Built under the file's path so that graph errors (disconnected, ...) name the file.
    topology = Topology(graph, gpus, name=f"file {path}", reducing=reducing)
    topology.name = name
    return topology


def _parse_file(data, default_name: str) -> tuple[str, nx.Graph, list[str], frozenset[str]]:
    """(name, graph, gpus, reducing switches) from a loaded YAML document; ScenarioError naming the field."""
    if not isinstance(data, Mapping):
        raise ScenarioError(f"expected a mapping with keys {', '.join(_FILE_KEYS)}, got {type(data).__name__}")
    for key in data:
        if key not in _FILE_KEYS:
            raise ScenarioError(f"unknown key {key!r}; allowed: {', '.join(_FILE_KEYS)}")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise ScenarioError(f"name: expected a non-empty string, got {name!r}")
    if "gpus" not in data:
        raise ScenarioError("gpus: missing (the list of GPU names in rank order)")
    seen: dict[str, str] = {}
    gpus = _node_list(data["gpus"], "gpus", seen)
    if not gpus:
        raise ScenarioError("gpus: must list at least one GPU")
    if len(gpus) > MAX_DEVICES:
        raise ScenarioError(f"gpus: {len(gpus)} GPUs; at most {MAX_DEVICES} are simulated")
    switches = _node_list(data.get("switches", []), "switches", seen)
    reducing = _node_list(data.get("reducing_switches", []), "reducing_switches", {})
    for index, node in enumerate(reducing):
        if node not in switches:
            raise ScenarioError(f"reducing_switches[{index}]: {node!r} is not listed under switches")
    classes = _link_classes(data.get("link_classes", {}))

    import networkx as nx  # a file's graph is made at once: its checks (connected, links) are validation's

    graph = nx.Graph()
    graph.add_nodes_from(gpus + switches)
    links = data.get("links", [])
    if not isinstance(links, list):
        raise ScenarioError(f"links: expected a list, got {type(links).__name__}")
    first_listed = {}
    for index, entry in enumerate(links):
        a, b, link = _file_link(entry, f"links[{index}]", graph, classes)
        pair = frozenset((a, b))
        if pair in first_listed:
            raise ScenarioError(f"links[{index}]: link {a}-{b} listed twice (also links[{first_listed[pair]}])")
        first_listed[pair] = index
        graph.add_edge(a, b, bandwidth=link.bandwidth, latency=link.latency, efficiency=link.efficiency)
    return name, graph, gpus, frozenset(reducing)


def _node_list(value, field: str, seen: dict[str, str]) -> list[str]:
    """Node names from a YAML list; `seen` maps names already listed to the field listing them."""
    if not isinstance(value, list):
        raise ScenarioError(f"{field}: expected a list of node names, got {type(value).__name__}")
    for index, node in enumerate(value):
        if not isinstance(node, str) or not node:
            raise ScenarioError(f"{field}[{index}]: expected a node name, got {node!r}")
        if node in seen:
            raise ScenarioError(f"{field}[{index}]: node {node!r} listed twice (also in {seen[node]})")
        seen[node] = field
    return list(value)


def _link_classes(value) -> dict[str, LinkClass]:
    if not isinstance(value, Mapping):
        raise ScenarioError(f"link_classes: expected a mapping of name to link, got {type(value).__name__}")
    return {str(name): parse_link(spec, f"link_classes.{name}") for name, spec in value.items()}


def _file_link(entry, field: str, graph: nx.Graph, classes: dict[str, LinkClass]) -> tuple[str, str, LinkClass]:
    if not isinstance(entry, Mapping):
        raise ScenarioError(f"{field}: expected a mapping like {{between: [a, b], bandwidth: ..., latency: ...}}")
    for key in entry:
        if key not in _LINK_KEYS:
            raise ScenarioError(f"{field}: unknown key {key!r}; allowed: {', '.join(_LINK_KEYS)}")
    between = entry.get("between")
    if not isinstance(between, list) or len(between) != 2:
        raise ScenarioError(f"{field}.between: expected two node names, got {between!r}")
    a, b = between
    for node in (a, b):
        if not isinstance(node, str) or node not in graph:
            raise ScenarioError(f"{field}.between: unknown node {node!r}; list it under gpus or switches")
    if a == b:
        raise ScenarioError(f"{field}.between: a link joins two different nodes, got {a!r} twice")
    default = None
    if "class" in entry:
        if not isinstance(entry["class"], str):
            raise ScenarioError(f"{field}.class: expected the name of a link class, got "
                                f"{type(entry['class']).__name__} {entry['class']!r}")
        if entry["class"] not in classes:
            known = ", ".join(classes) or "none defined"
            raise ScenarioError(f"{field}.class: unknown link class {entry['class']!r}; known: {known}")
        default = classes[entry["class"]]
    own = {key: entry[key] for key in ("bandwidth", "latency", "efficiency") if key in entry}
    return a, b, parse_link(own, f"{field} ({a}-{b})", default)
