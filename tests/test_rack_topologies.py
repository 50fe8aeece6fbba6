"""The shipped rack-scale topology files: GB200 and GB300 NVL72 racks, eight GB200 racks, a DGX H100 SuperPOD SU.

References: the files' own figures (72 GPUs a rack on one NVLink switch at 900 GB/s per direction, one NIC per
GPU), the fat_tree builder the SuperPOD SU and eight-rack files must equal, and the flow model's per-link byte
counts, which show what an all-reduce inside a rack crosses.
"""
import functools
import itertools
from pathlib import Path

import networkx as nx
import pytest
import simpy
import torch

from simtrain.cli import main
from simtrain.comm.channels import layout_of
from simtrain.comm.nccl import NcclGroup, fabric_of
from simtrain.comm.simulated import SimCommunicator
from simtrain.hw.cluster import run_to_end
from simtrain.hw.network import Network
from simtrain.hw.topology_builders import LinkClass, build_topology, load_topology_file

TOPOLOGIES = Path(__file__).resolve().parents[1] / "topologies"
NVLINK5 = 900e9  # bytes/s per direction: NVLink 5's 1.8 TB/s both directions


@functools.cache
def shipped(name: str):
    return load_topology_file(TOPOLOGIES / f"{name}.yaml")


@pytest.mark.parametrize("path", sorted(TOPOLOGIES.glob("*.yaml")), ids=lambda path: path.stem)
def test_every_shipped_topology_loads(path):
    topology = shipped(path.stem)
    assert topology.name == path.stem
    assert nx.is_connected(topology.graph)


@pytest.mark.parametrize("name, nic_Bps", [("gb200-nvl72", 50e9), ("gb300-nvl72", 100e9)])
def test_an_nvl72_rack_is_72_gpus_in_one_nvlink_domain(name, nic_Bps):
    rack = shipped(name)
    assert rack.num_devices == 72 and rack.reducing == {"nvlink-switch"}
    for gpu in rack.devices:
        assert rack.link(gpu, "nvlink-switch")["bandwidth"] == NVLINK5
        assert rack.link(gpu, "ib-leaf")["bandwidth"] == nic_Bps  # ConnectX-7 400 Gb/s, ConnectX-8 800 Gb/s
    assert layout_of(rack, rack.devices).hosts == (tuple(range(72)),)
    fabric = fabric_of(rack)
    assert (fabric.nodes, fabric.nvls, fabric.intra_GBps) == (1, True, pytest.approx(900 * 0.8))
    for a, b in itertools.combinations(rack.devices, 2):
        assert rack.path(a, b) == (a, "nvlink-switch", b)


def test_a_scenario_on_a_gb200_rack_validates(tmp_path, capsys):
    scenario = tmp_path / "gb200.yaml"
    scenario.write_text(f"""\
cluster: {{topology: {TOPOLOGIES / "gb200-nvl72.yaml"}, devices: null, device: gb200}}
model: {{name: mlp, hidden: [32]}}
data: {{name: digits, batch_size: 8}}
train: {{steps: 1, precision: fp8, optimizer: {{name: sgd, lr: 0.1}}}}
parallel: {{all_reduce: nccl}}
""")
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(scenario)])
    assert exit_info.value.code == 0
    assert "72 x gb200-186gb" in capsys.readouterr().out


@pytest.mark.parametrize("algorithm", ["auto", "ring", "nvls"])
def test_an_all_reduce_in_the_rack_never_leaves_nvlink(algorithm):
    rack = shipped("gb200-nvl72")
    group = NcclGroup(rack, rack.devices)
    algorithm, protocol = group.choose("all_reduce", 4 << 20, algorithm, "auto")
    env = simpy.Environment()
    network = Network(env, rack, record=False)
    comm = SimCommunicator(network, rack.devices, exclusive=True)
    for rank in range(72):
        comm.run(rank, group.call("all_reduce", rank, torch.empty(1 << 20, device="meta"), algorithm, protocol))
    run_to_end(env)
    carried = {}
    for stat in network.link_stats():
        kind = "nic" if "ib-leaf" in (stat["src"], stat["dst"]) else "nvlink"
        carried[kind] = carried.get(kind, 0) + stat["bytes"]
    assert carried["nic"] == 0 and carried["nvlink"] >= 2 * 71 / 72 * (4 << 20) * 72


def test_eight_racks_are_the_fat_tree_builder_with_a_reducing_switch_a_rack():
    pod = shipped("gb200-nvl72-8rack")
    built = build_topology("fat_tree", 576, LinkClass(NVLINK5, 0.25e-6, 0.8), inter_link=LinkClass(50e9, 1.35e-6, 0.96),
                           gpus_per_node=72, nodes_per_leaf=8)
    assert pod.devices == built.devices
    assert nx.utils.edges_equal(pod.graph.edges(data=True), built.graph.edges(data=True))
    assert pod.reducing == {f"node{r}-switch" for r in range(8)}
    layout = layout_of(pod, pod.devices)
    assert layout.hosts == tuple(tuple(range(72 * r, 72 * (r + 1))) for r in range(8))
    assert layout.rails == layout.hosts  # every GPU has its own NIC
    assert pod.path("gpu3", "gpu70") == ("gpu3", "node0-switch", "gpu70")
    assert pod.path("gpu3", "gpu363") == ("gpu3", "leaf0-rail3", "gpu363")  # rack 5's GPU 3: the same rail
    # Another rail: over NVLink to this rack's GPU on the destination's rail first (NCCL's PXN), not the core.
    assert pod.path("gpu3", "gpu365") == ("gpu3", "node0-switch", "gpu5", "leaf0-rail5", "gpu365")


def test_the_h100_superpod_unit_is_the_fat_tree_builder_with_nvls():
    unit = shipped("dgx-h100-superpod-su")
    built = build_topology("fat_tree", 256, LinkClass(450e9, 0.25e-6, 0.8), inter_link=LinkClass(50e9, 1.35e-6, 0.96),
                           gpus_per_node=8, nodes_per_leaf=32)
    assert unit.devices == built.devices
    assert nx.utils.edges_equal(unit.graph.edges(data=True), built.graph.edges(data=True))
    assert unit.reducing == {f"node{k}-switch" for k in range(32)}  # NVLink SHARP in each DGX H100's NVSwitch
    for a, b in [(0, 7), (0, 8), (3, 250), (17, 130)]:
        assert unit.path(f"gpu{a}", f"gpu{b}") == built.path(f"gpu{a}", f"gpu{b}")
