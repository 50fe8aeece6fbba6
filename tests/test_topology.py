"""Topology builders and files: closed-form sizes, routing, shipped files, every error."""
import itertools
from pathlib import Path

import networkx as nx
import pytest
import simpy

from simtrain.errors import ScenarioError, TopologyError
from simtrain.hw.network import Network
from simtrain.hw.topology import Topology
from simtrain.hw.topology_builders import LinkClass, build_topology, load_topology_file, parse_link

REPO = Path(__file__).resolve().parents[1]
DGX_FILE = REPO / "topologies" / "dgx-a100-2node.yaml"
TORUS_FILE = REPO / "topologies" / "torus-4x4.yaml"

NVLINK = LinkClass(bandwidth=300e9, latency=0.25e-6)
IB = LinkClass(bandwidth=25e9, latency=1.35e-6)


def hops(topology, a, b):
    return len(topology.path(a, b)) - 1


def assert_one_line_error(error_type, call, *parts):
    with pytest.raises(error_type) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"
    return message


# ---- builders: sizes against closed forms ----


@pytest.mark.parametrize("n, edges", [(1, 0), (2, 1), (3, 3), (5, 5), (8, 8)])
def test_ring(n, edges):
    topo = build_topology("ring", n, NVLINK)
    assert topo.devices == [f"gpu{i}" for i in range(n)]
    assert topo.graph.number_of_nodes() == n
    assert topo.graph.number_of_edges() == edges
    if n >= 3:
        assert all(degree == 2 for _, degree in topo.graph.degree())
        assert topo.graph.has_edge(f"gpu{n - 1}", "gpu0")
        assert hops(topo, "gpu0", f"gpu{n // 2}") == n // 2


@pytest.mark.parametrize("n", [1, 2, 4, 7])
def test_fully_connected(n):
    topo = build_topology("fully_connected", n, NVLINK)
    assert topo.graph.number_of_edges() == n * (n - 1) // 2
    assert all(degree == n - 1 for _, degree in topo.graph.degree())
    for a, b in itertools.combinations(topo.devices, 2):
        assert topo.path(a, b) == (a, b)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_switch(n):
    topo = build_topology("switch", n, NVLINK)
    assert topo.graph.number_of_nodes() == n + 1
    assert topo.graph.number_of_edges() == n
    assert topo.graph.degree("switch") == n
    assert topo.devices == [f"gpu{i}" for i in range(n)]
    if n > 1:
        assert topo.path("gpu0", f"gpu{n - 1}") == ("gpu0", "switch", f"gpu{n - 1}")


def wrap_manhattan(a, b, rows, cols):
    dr, dc = abs(a // cols - b // cols), abs(a % cols - b % cols)
    return min(dr, rows - dr) + min(dc, cols - dc)


@pytest.mark.parametrize("rows, cols", [(3, 3), (4, 4), (3, 5), (4, 6)])
def test_torus_sizes_and_path_lengths(rows, cols):
    n = rows * cols
    topo = build_topology("torus2d", n, NVLINK, torus_shape=(rows, cols))
    assert topo.name == f"torus2d-{rows}x{cols}"
    assert topo.graph.number_of_edges() == 2 * n
    assert all(degree == 4 for _, degree in topo.graph.degree())
    assert topo.graph.has_edge("gpu0", f"gpu{cols - 1}")  # row wrap-around
    assert topo.graph.has_edge("gpu0", f"gpu{(rows - 1) * cols}")  # column wrap-around
    for a, b in itertools.combinations(range(n), 2):
        assert hops(topo, f"gpu{a}", f"gpu{b}") == wrap_manhattan(a, b, rows, cols)


@pytest.mark.parametrize(
    "n, shape, edges",
    [(16, "4x4", 32), (12, "3x4", 24), (8, "2x4", 12), (7, "1x7", 7), (2, "1x2", 1), (1, "1x1", 0)],
)
def test_torus_default_shape_is_most_square(n, shape, edges):
    topo = build_topology("torus2d", n, NVLINK)
    assert topo.name == f"torus2d-{shape}"
    assert topo.graph.number_of_edges() == edges  # a dimension of 2 has one link per pair, of 1 none


@pytest.mark.parametrize("nodes, per_node", [(1, 4), (2, 8), (4, 2), (3, 1)])
def test_hierarchical_sizes(nodes, per_node):
    n = nodes * per_node
    topo = build_topology("hierarchical", n, NVLINK, inter_link=IB, gpus_per_node=per_node)
    graph = topo.graph
    assert topo.name == f"hierarchical-{nodes}x{per_node}"
    assert graph.number_of_nodes() == n + nodes + 1
    assert graph.number_of_edges() == nodes * per_node + n
    assert graph.degree("spine") == n
    for k in range(nodes):
        assert graph.degree(f"node{k}-switch") == per_node
    assert all(graph.degree(gpu) == 2 for gpu in topo.devices)
    assert graph.edges["gpu0", "node0-switch"] == {"bandwidth": 300e9, "latency": 0.25e-6, "efficiency": 1.0}
    assert graph.edges["gpu0", "spine"] == {"bandwidth": 25e9, "latency": 1.35e-6, "efficiency": 1.0}


def test_hierarchical_routes_nvswitch_inside_and_spine_across():
    topo = build_topology("hierarchical", 16, NVLINK, inter_link=IB, gpus_per_node=8)
    for a, b in itertools.permutations(topo.devices, 2):
        na, nb = int(a[3:]) // 8, int(b[3:]) // 8
        via = f"node{na}-switch" if na == nb else "spine"
        assert topo.path(a, b) == (a, via, b)


def test_hierarchical_equal_latency_still_prefers_the_node_switch():
    same = LinkClass(bandwidth=25e9, latency=NVLINK.latency)
    topo = build_topology("hierarchical", 8, NVLINK, inter_link=same, gpus_per_node=4)
    assert topo.path("gpu0", "gpu3") == ("gpu0", "node0-switch", "gpu3")
    assert topo.path("gpu3", "gpu0") == ("gpu3", "node0-switch", "gpu0")
    assert topo.path("gpu0", "gpu4") == ("gpu0", "spine", "gpu4")


# ---- builder errors ----


def test_fat_tree_rails_leaves_and_core():
    # 8 nodes of 4 GPUs, 2 nodes per leaf: 4 leaf groups of 4 rails
    topo = build_topology("fat_tree", 32, NVLINK, inter_link=IB, gpus_per_node=4, nodes_per_leaf=2,
                          oversubscription=2)
    leaves = [node for node in topo.graph if node.startswith("leaf")]
    assert len(leaves) == 16 and all(topo.graph.has_edge(leaf, "core") for leaf in leaves)
    assert topo.link("leaf0-rail0", "core")["bandwidth"] == 2 * IB.bandwidth / 2
    assert topo.path("gpu0", "gpu1") == ("gpu0", "node0-switch", "gpu1")
    assert topo.path("gpu0", "gpu4") == ("gpu0", "leaf0-rail0", "gpu4")  # same rail, same leaf
    assert topo.path("gpu0", "gpu5") == ("gpu0", "node0-switch", "gpu1", "leaf0-rail1", "gpu5")  # rail first
    assert topo.path("gpu0", "gpu8") == ("gpu0", "leaf0-rail0", "core", "leaf1-rail0", "gpu8")


@pytest.mark.parametrize("devices,gpus_per_node,nodes_per_leaf,nic", [
    (32, 4, 2, IB), (24, 4, 4, IB), (48, 8, 2, IB),  # 24: a leaf group left part-full
    (32, 4, 2, LinkClass(25e9, NVLINK.latency)),  # host links as slow as the network's: Dijkstra breaks the ties
])
def test_fat_tree_closed_form_routes_are_dijkstras(devices, gpus_per_node, nodes_per_leaf, nic):
    topo = build_topology("fat_tree", devices, NVLINK, inter_link=nic, gpus_per_node=gpus_per_node,
                          nodes_per_leaf=nodes_per_leaf)
    dijkstra = Topology(topo.graph, topo.devices)
    for src, dst in itertools.permutations(topo.devices, 2):
        assert topo.path(src, dst) == dijkstra.path(src, dst)


def test_fat_tree_oversubscribed_uplink_is_shared():
    # 2 nodes per leaf at 2:1: a leaf's uplink carries one NIC's bandwidth, so the two rail-0
    # GPUs of leaf 0 sending across it at once get half of it each: alpha + 2 S / B
    topo = build_topology("fat_tree", 16, NVLINK, inter_link=IB, gpus_per_node=4, nodes_per_leaf=2,
                          oversubscription=2)
    env = simpy.Environment()
    network = Network(env, topo)
    size = 25 * 10**6
    flows = [network.start_flow(src, dst, size) for src, dst in (("gpu0", "gpu8"), ("gpu4", "gpu12"))]
    env.run()
    for flow in flows:
        assert flow.end == pytest.approx(4 * IB.latency + 2 * size / IB.bandwidth, rel=1e-12)
    alone = build_topology("fat_tree", 16, NVLINK, inter_link=IB, gpus_per_node=4, nodes_per_leaf=2)
    env = simpy.Environment()
    network = Network(env, alone)
    flows = [network.start_flow(src, dst, size) for src, dst in (("gpu0", "gpu8"), ("gpu4", "gpu12"))]
    env.run()
    for flow in flows:  # non-blocking: each at its NIC's rate
        assert flow.end == pytest.approx(4 * IB.latency + size / IB.bandwidth, rel=1e-12)


@pytest.mark.parametrize(
    "kwargs, parts",
    [
        (dict(topology="ring", devices=None, link=NVLINK), ["cluster.devices: required by the ring builder"]),
        (dict(topology="switch", devices=0, link=NVLINK), ["cluster.devices: must be an integer >= 1, got 0"]),
        (dict(topology="ring", devices=2.5, link=NVLINK), ["cluster.devices: must be an integer"]),
        (dict(topology="torus2d", devices=4, link=None), ["cluster.link: required by the torus2d builder"]),
        (dict(topology="rnig", devices=4, link=NVLINK), ["cluster.topology: unknown topology 'rnig'", "ring, "]),
        (dict(topology="torus2d", devices=16, link=NVLINK, torus_shape=(4, 3)),
         ["cluster.torus_shape: 4x3 = 12 GPUs does not match cluster.devices 16"]),
        (dict(topology="torus2d", devices=16, link=NVLINK, torus_shape=(16,)),
         ["cluster.torus_shape: expected two integers >= 1"]),
        (dict(topology="torus2d", devices=16, link=NVLINK, torus_shape=(0, 16)),
         ["cluster.torus_shape: expected two integers >= 1"]),
        (dict(topology="hierarchical", devices=16, link=NVLINK, inter_link=IB),
         ["cluster.gpus_per_node: required by the hierarchical builder"]),
        (dict(topology="hierarchical", devices=16, link=NVLINK, inter_link=IB, gpus_per_node=0),
         ["cluster.gpus_per_node: must be an integer >= 1"]),
        (dict(topology="hierarchical", devices=12, link=NVLINK, inter_link=IB, gpus_per_node=8),
         ["cluster.gpus_per_node: 12 devices do not split into nodes of 8"]),
        (dict(topology="hierarchical", devices=16, link=NVLINK, gpus_per_node=8),
         ["cluster.inter_node_link: required by the hierarchical builder"]),
        (dict(topology="hierarchical", devices=16, link=IB, inter_link=NVLINK, gpus_per_node=8),
         ["cluster.inter_node_link: latency 0.25 us is below the intra-node link's 1.35 us"]),
        (dict(topology="fat_tree", devices=16, link=NVLINK, inter_link=IB),
         ["cluster.gpus_per_node: required by the fat_tree builder"]),
        (dict(topology="fat_tree", devices=16, link=NVLINK, inter_link=IB, gpus_per_node=8, nodes_per_leaf=2,
              oversubscription=3), ["cluster.oversubscription: 3 leaves a leaf's uplink below one NIC's bandwidth"]),
    ],
)
def test_builder_errors_name_the_field(kwargs, parts):
    assert_one_line_error(TopologyError, lambda: build_topology(**kwargs), *parts)


def test_every_name_an_unknown_topology_is_offered_builds_its_own_network():
    """The names the one-line error offers are builders: each builds 8 GPUs with a route between every two,
    and no two of them build the same network (as graphs, up to naming)."""
    message = assert_one_line_error(TopologyError, lambda: build_topology("mesh", 8, NVLINK), "unknown topology 'mesh'")
    offered = message.split("expected one of ")[1].removesuffix(" or a YAML file").split(", ")
    graphs = []
    for name in offered:
        topology = build_topology(name, 8, NVLINK, inter_link=IB, gpus_per_node=2)
        assert topology.num_devices == 8
        assert all(len(topology.path(a, b)) >= 2 for a, b in itertools.permutations(topology.devices, 2))
        graphs.append(topology.graph)
    assert len(offered) == 7 and not any(nx.is_isomorphic(a, b) for a, b in itertools.combinations(graphs, 2))


def test_parse_link():
    assert parse_link({"bandwidth": "300 GB/s", "latency": "0.7 us"}, "cluster.link") == LinkClass(3e11, 0.7e-6)
    assert parse_link({"latency": 2e-6}, "x", default=IB) == LinkClass(25e9, 2e-6)
    assert_one_line_error(ScenarioError, lambda: parse_link({"bandwidth": "1 GB/s"}, "cluster.link"),
                          "cluster.link: missing latency")
    assert_one_line_error(ScenarioError, lambda: parse_link({"bandwidth": 400, "latency": 0}, "cluster.link"),
                          'cluster.link.bandwidth: 400 has no unit: give one, e.g. "400 GB/s"')
    assert_one_line_error(ScenarioError, lambda: parse_link({"bandwidth": 0, "latency": 0}, "cluster.link"),
                          "cluster.link.bandwidth: must be positive")
    assert_one_line_error(ScenarioError, lambda: parse_link({"bw": 1}, "cluster.link"),
                          "cluster.link: unknown key 'bw'")
    assert_one_line_error(ScenarioError, lambda: parse_link("fast", "cluster.link"), "cluster.link: expected a mapping")


# ---- shipped files ----


def test_dgx_file_is_a_two_node_hierarchical_cluster():
    topo = load_topology_file(DGX_FILE)
    assert topo.name == "dgx-a100-2node"
    assert topo.devices == [f"n{k}g{j}" for k in range(2) for j in range(8)]
    rename = {f"n{k}g{j}": f"gpu{8 * k + j}" for k in range(2) for j in range(8)}
    rename.update({"n0-nvswitch": "node0-switch", "n1-nvswitch": "node1-switch", "ib-spine": "spine"})
    nvlink, hdr = LinkClass(300e9, 0.25e-6, efficiency=0.8), LinkClass(25e9, 1.35e-6, efficiency=0.96)
    built = build_topology("hierarchical", 16, nvlink, inter_link=hdr, gpus_per_node=8)
    assert nx.utils.edges_equal(nx.relabel_nodes(topo.graph, rename).edges(data=True), built.graph.edges(data=True))
    assert topo.link("n0g0", "n0-nvswitch") == {"bandwidth": 300e9, "latency": pytest.approx(0.25e-6),
                                                "efficiency": 0.8}
    assert topo.link("n1g7", "ib-spine") == {"bandwidth": 25e9, "latency": pytest.approx(1.35e-6),
                                             "efficiency": 0.96}  # 200 Gb/s HDR
    assert topo.path("n0g0", "n0g7") == ("n0g0", "n0-nvswitch", "n0g7")
    assert topo.path("n0g3", "n1g3") == ("n0g3", "ib-spine", "n1g3")


def test_torus_file_equals_the_torus_builder():
    topo = load_topology_file(TORUS_FILE)
    assert topo.name == "torus-4x4"
    built = build_topology("torus2d", 16, LinkClass(bandwidth=75e9, latency=0.5e-6))
    assert topo.devices == built.devices
    assert nx.utils.edges_equal(topo.graph.edges(data=True), built.graph.edges(data=True))
    for a, b in itertools.combinations(range(16), 2):
        assert hops(topo, f"gpu{a}", f"gpu{b}") == wrap_manhattan(a, b, 4, 4)


def test_superpod_file_equals_the_fat_tree_builder():
    topo = load_topology_file(Path(__file__).parent.parent / "topologies" / "dgx-a100-superpod-su.yaml")
    built = build_topology("fat_tree", 160, LinkClass(300e9, 0.25e-6, 0.8), inter_link=LinkClass(25e9, 1.35e-6, 0.96),
                           gpus_per_node=8, nodes_per_leaf=20)
    assert topo.devices == built.devices
    assert nx.utils.edges_equal(topo.graph.edges(data=True), built.graph.edges(data=True))
    for a, b in [(0, 1), (0, 8), (0, 9), (5, 159), (17, 130)]:
        assert topo.path(f"gpu{a}", f"gpu{b}") == built.path(f"gpu{a}", f"gpu{b}")


def test_file_topology_device_count(monkeypatch):
    monkeypatch.chdir(REPO)
    assert build_topology("topologies/torus-4x4.yaml", None, None).num_devices == 16
    assert build_topology("topologies/torus-4x4.yaml", 16, NVLINK).num_devices == 16
    with pytest.raises(TopologyError) as info:
        build_topology("topologies/torus-4x4.yaml", 8, None)
    assert str(info.value) == ("cluster.devices: 8 does not match the 16 GPUs of topologies/torus-4x4.yaml; "
                               "`cluster.devices: null` takes the file's count")


def test_file_paths_resolve_against_base_dir_then_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert build_topology("topologies/dgx-a100-2node.yaml", None, None, base_dir=REPO).num_devices == 16
    (tmp_path / "mine.yaml").write_text("gpus: [a, b]\nlinks: [{between: [a, b], bandwidth: 1e9, latency: 0}]\n")
    assert build_topology("mine.yaml", 2, None, base_dir=REPO).name == "mine"
    assert build_topology(str(TORUS_FILE), None, None, base_dir=tmp_path).num_devices == 16
    assert_one_line_error(TopologyError, lambda: build_topology("topologies/nope.yaml", None, None, base_dir=REPO),
                          "topology file topologies/nope.yaml: not found")


# ---- file errors ----

GOOD = """\
gpus: [g0, g1]
switches: [sw]
link_classes:
  fast: {bandwidth: "100 GB/s", latency: "1 us"}
links:
  - {between: [g0, sw], class: fast}
  - {between: [g1, sw], bandwidth: "50 GB/s", latency: "2 us"}
"""


def test_good_file_with_classes_and_overrides(tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text(GOOD + "  - {between: [g0, g1], class: fast, latency: 3 us, efficiency: 0.5}\n")
    topo = load_topology_file(path)
    assert topo.name == "small" and topo.devices == ["g0", "g1"]
    assert topo.link("g0", "sw") == {"bandwidth": 1e11, "latency": 1e-6, "efficiency": 1.0}
    assert topo.link("g1", "sw") == {"bandwidth": 5e10, "latency": 2e-6, "efficiency": 1.0}
    assert topo.link("g0", "g1") == {"bandwidth": 1e11, "latency": 3e-6, "efficiency": 0.5}


@pytest.mark.parametrize(
    "text, parts",
    [
        (GOOD + "  - {between: [g0, g9], bandwidth: 1 GB/s, latency: 0}\n",
         ["links[2].between: unknown node 'g9'"]),
        (GOOD.replace("switches: [sw]", "switches: [sw, island]"), ["disconnected (2 parts"]),
        (GOOD.replace("switches: [sw]", "switches: [sw, g1]"), ["switches[1]: node 'g1' listed twice (also in gpus)"]),
        (GOOD.replace("gpus: [g0, g1]", "gpus: [g0, g1, g0]"), ["gpus[2]: node 'g0' listed twice (also in gpus)"]),
        (GOOD + "  - {between: [sw, g0], bandwidth: 1 GB/s, latency: 0}\n",
         ["links[2]: link sw-g0 listed twice (also links[0])"]),
        (GOOD.replace('bandwidth: "50 GB/s", ', ""), ["links[1] (g1-sw): missing bandwidth"]),
        (GOOD.replace('"50 GB/s"', "-5"), ["links[1] (g1-sw).bandwidth: must not be negative"]),
        (GOOD.replace('"50 GB/s"', '"-5 GB/s"'), ["links[1] (g1-sw).bandwidth: must not be negative"]),
        (GOOD.replace('"50 GB/s"', "0"), ["links[1] (g1-sw).bandwidth: must be positive"]),
        (GOOD.replace('"50 GB/s"', '"50 GB"'), ["links[1] (g1-sw).bandwidth: unit 'GB'"]),
        (GOOD + "colour: blue\n", ["unknown key 'colour'; allowed: name, gpus"]),
        (GOOD.replace("class: fast}", "class: fast, speed: 1}"), ["links[0]: unknown key 'speed'"]),
        (GOOD.replace("class: fast}", "class: slow}"), ["links[0].class: unknown link class 'slow'; known: fast"]),
        (GOOD.replace('latency: "1 us"}', 'latency: "1 us", jitter: 0}'), ["link_classes.fast: unknown key 'jitter'"]),
        (GOOD + "  - {between: [g0], bandwidth: 1 GB/s, latency: 0}\n", ["links[2].between: expected two node names"]),
        (GOOD + "  - {between: [g0, g0], bandwidth: 1 GB/s, latency: 0}\n", ["links[2].between: a link joins two"]),
        (GOOD + "  - [g0, g1]\n", ["links[2]: expected a mapping"]),
        (GOOD.replace("gpus: [g0, g1]", "gpus: []"), ["gpus: must list at least one GPU"]),
        (GOOD.replace("gpus: [g0, g1]", "gpus: [0, 1]"), ["gpus[0]: expected a node name, got 0"]),
        (GOOD.replace("gpus: [g0, g1]\n", ""), ["gpus: missing"]),
        (GOOD.replace("gpus: [g0, g1]", "gpus: [g0, g1]\nname: 5"), ["name: expected a non-empty string"]),
        ("- just\n- a list\n", ["expected a mapping with keys name, gpus"]),
        ("", ["expected a mapping"]),
        ("gpus: [g0, g1\nlinks: []\n", ["not valid YAML at line"]),
        ("gpus: [a]\n  links: {\n", ["not valid YAML"]),
    ],
)
def test_file_errors_name_the_file_and_field(tmp_path, text, parts):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    message = assert_one_line_error(TopologyError, lambda: load_topology_file(path), *parts)
    assert message.startswith(f"topology file {path}: ")


def test_missing_file(tmp_path):
    missing = tmp_path / "absent.yaml"
    assert_one_line_error(TopologyError, lambda: load_topology_file(missing), f"topology file {missing}: not found")


def test_a_single_gpu_file_needs_no_links(tmp_path):
    path = tmp_path / "one.yaml"
    path.write_text("name: solo\ngpus: [g0]\n")
    topo = load_topology_file(path)
    assert (topo.name, topo.devices, topo.graph.number_of_edges()) == ("solo", ["g0"], 0)
