"""Llama 3's cluster (the clos3 builder) and its 405B scenarios, checked at sizes that run in seconds.

- The 16,384-GPU cluster has the Llama 3 paper's shape (section 3.3.1): 2,048
  hosts of 8 GPUs, each GPU with its own NIC on its rack's switch, 16 GPUs a
  rack, 192 racks a pod; its bisection, by networkx's maximum flow, is full
  inside a pod and 1/7 of the NICs' across pods.
- The closed-form routes equal Dijkstra's least-latency routes (Topology
  without a router) for every pair of GPUs, and a failed link falls back to
  Dijkstra.
- Mirrored rings that share a rack's uplink take their time alone when the
  uplink has the rate for all of them: equal to running them together flow by
  flow; past its rate, they do run together, and take longer.
- Representatives against the full simulation of a shrunken Llama 3 layout on
  a shrunken clos3 (tp 4 x pp 2 x dp 8 over two pods).
- The shipped scenarios are Table 4's layouts: 16M tokens a step; the 16k
  one's host-memory lower bound counts the rings it runs.
"""
import itertools
from pathlib import Path
from types import SimpleNamespace

import networkx as nx
import pytest
import torch

import simtrain
from simtrain.host_memory import scenario_host_bytes
from simtrain.hw.resolved_cluster import resolve_cluster
from simtrain.hw.topology import Topology
from simtrain.hw.topology_builders import LinkClass, build_topology
from simtrain.scenario import load_scenario, validate_scenario
from simtrain.strategies.representatives import MirroredCollective, MirroredCollectives

ROOT = Path(__file__).resolve().parent.parent
NVLINK, NIC = LinkClass(360e9, 0.25e-6), LinkClass(48e9, 1.35e-6)


def clos3(devices, gpus_per_node=8, nodes_per_leaf=2, leaves_per_pod=192, oversubscription=7.0, nic=NIC):
    return build_topology("clos3", devices, NVLINK, inter_link=nic, gpus_per_node=gpus_per_node,
                          nodes_per_leaf=nodes_per_leaf, leaves_per_pod=leaves_per_pod,
                          oversubscription=oversubscription)


def test_the_16k_cluster_has_the_papers_hosts_racks_and_pods():
    topology = clos3(16384)
    graph = topology.graph
    hosts = [node for node in graph if node.endswith("-switch")]
    racks = [node for node in graph if node.startswith("rack")]
    pods = [node for node in graph if node.startswith("pod")]
    assert (len(hosts), len(racks), len(pods)) == (2048, 1024, 6)  # 5 full pods of 3,072 GPUs and one of 1,024
    for rank, gpu in enumerate(topology.devices):  # one NVLink port and one NIC of its own
        assert sorted(graph[gpu]) == sorted([f"node{rank // 8}-switch", f"rack{rank // 16}"])
        assert graph.edges[gpu, f"rack{rank // 16}"]["bandwidth"] == NIC.bandwidth
    assert all(len(graph[rack]) == 16 + 1 for rack in racks)  # 16 GPUs and the pod
    assert sum(len(graph[pod]) - 1 for pod in pods) == len(racks)
    assert [len(graph[pod]) - 1 for pod in pods] == [192] * 5 + [64]


def bisection_Bps(topology, left, right) -> float:
    """The maximum flow from the GPUs `left` to the GPUs `right`, every link's bandwidth its capacity."""
    graph = nx.DiGraph()
    for a, b, attrs in topology.graph.edges(data=True):
        graph.add_edge(a, b, capacity=attrs["bandwidth"])
        graph.add_edge(b, a, capacity=attrs["bandwidth"])
    for gpu in left:
        graph.add_edge("source", gpu, capacity=float("inf"))
    for gpu in right:
        graph.add_edge(gpu, "sink", capacity=float("inf"))
    return nx.maximum_flow_value(graph, "source", "sink")


def test_bisection_is_full_inside_a_pod_and_one_seventh_across_pods():
    topology = clos3(256, leaves_per_pod=8)  # pods of 8 racks, 128 GPUs: two pods
    gpus = topology.devices
    # Inside a pod, half the racks to the other half: every NIC of a half at full rate (NVLink does not help:
    # a host sits in one rack).
    assert bisection_Bps(topology, gpus[:64], gpus[64:128]) == pytest.approx(64 * NIC.bandwidth)
    # Across pods: the pod's uplink, its 128 NICs' bandwidth / 7.
    assert bisection_Bps(topology, gpus[:128], gpus[128:]) == pytest.approx(128 * NIC.bandwidth / 7)


@pytest.mark.parametrize("nic", [NIC, LinkClass(48e9, NVLINK.latency)])  # equal latencies: ties broken alike
def test_closed_form_routes_are_dijkstras(nic):
    topology = clos3(32, gpus_per_node=2, leaves_per_pod=2, nic=nic)  # hosts of 2, racks of 4, four pods of 8
    dijkstra = Topology(topology.graph, topology.devices)
    for src, dst in itertools.permutations(topology.devices, 2):
        assert topology.path(src, dst) == dijkstra.path(src, dst)
    assert topology.path("gpu0", "gpu31") == ("gpu0", "rack0", "pod0", "aggregation", "pod3", "rack7", "gpu31")


def test_a_failed_link_routes_around_it_by_dijkstra():
    topology = clos3(32, gpus_per_node=4, leaves_per_pod=2)
    assert topology.path("gpu0", "gpu5") == ("gpu0", "rack0", "gpu5")
    topology.remove_link("gpu0", "rack0")  # gpu0's NIC: out through a host neighbour's
    assert topology.path("gpu0", "gpu5") == ("gpu0", "node0-switch", "gpu1", "rack0", "gpu5")


def mirrored_rings(oversubscription: float):
    """The dp rings of four tp ranks (GPUs 0-3, 4-7 ... of 4 pods of 16: each ring crosses every rack and pod),
    timed by representatives' MirroredCollectives, and their time run together flow by flow."""
    topology = clos3(64, gpus_per_node=4, leaves_per_pod=2, oversubscription=oversubscription)
    job = SimpleNamespace(scenario=SimpleNamespace(parallel=SimpleNamespace(all_reduce="ring", channels=None)),
                          cluster=SimpleNamespace(topology=topology))
    groups = [tuple(f"gpu{8 * replica + tp}" for replica in range(8)) for tp in range(4)]
    all_reduce = MirroredCollective("all_reduce", torch.empty(2**20, dtype=torch.bfloat16, device="meta"))
    timing = MirroredCollectives(job)
    alone = max(timing._run([group], all_reduce, exclusive=True)[0] for group in groups)
    return timing.collective(timing.groups(groups), all_reduce)[0], alone, timing._run(groups, all_reduce, exclusive=False)[0]


def test_mirrored_rings_within_a_shared_uplinks_rate_take_their_time_alone():
    timed, alone, together = mirrored_rings(oversubscription=1)  # a rack's uplink: 8 NICs for 4 rings
    assert timed == alone == pytest.approx(together, rel=1e-12)


def test_mirrored_rings_past_an_uplinks_rate_run_together():
    timed, alone, together = mirrored_rings(oversubscription=8)  # a pod's uplink: 2 NICs for 4 rings
    # equal but for rounding: each run starts where the idle network's clock stands
    assert timed == pytest.approx(together, rel=1e-12) and together > 1.3 * alone  # cross-pod hops at half rate


def llama3_small(representatives: bool) -> dict:
    return simtrain.run(validate_scenario({
        "name": "llama3-small", "seed": 0, "numerics": False,
        "cluster": {"topology": "clos3", "devices": 64, "gpus_per_node": 4, "nodes_per_leaf": 2,
                    "leaves_per_pod": 4, "oversubscription": 2, "device": "h100-80gb", "compute_model": "roofline",
                    "link": {"bandwidth": "360 GB/s", "latency": "0.25 us"},
                    "inter_node_link": {"bandwidth": "48 GB/s", "latency": "1.35 us"}},
        "model": {"name": "llama", "hidden": 256, "layers": 6, "heads": 8, "kv_heads": 4, "ffn_hidden": 512},
        "data": {"name": "tokens", "batch_size": 4, "seq_len": 64, "vocab": 512},
        "train": {"steps": 1, "precision": "bf16", "optimizer": {"name": "adam", "lr": 1e-4}},
        "parallel": {"all_reduce": "ring", "tp": 4, "pp": 2, "representatives": representatives,
                     "pipeline": {"schedule": "interleaved", "microbatches": 4, "virtual_stages": 2}},
        "report": {"trace": False},
    })).data


def test_representatives_match_the_full_simulation_of_a_shrunken_llama3_layout():
    """tp 4 x pp 2 x dp 8: a replica a rack, four replicas a pod, two pods. Each stage's dp rings cross the
    aggregation, timed with their mirrors (the stage's other tp ranks) and without the other stage's: within 1%
    where the pod's uplink is not the bottleneck, as in the 405B scenarios (128 rings enter and leave a pod
    whose uplink carries 439 NICs' worth); here 8 rings on 16 NICs' worth (1:2)."""
    full, represented = llama3_small(False), llama3_small(True)
    assert represented["parallel"]["representatives"] and not full["parallel"]["representatives"]
    assert represented["parallel"]["bytes_by_kind"] == full["parallel"]["bytes_by_kind"]
    assert [d["peak_memory_bytes"] for d in represented["devices"]] == [d["peak_memory_bytes"]
                                                                         for d in full["devices"]]
    assert represented["step_time_s"] == pytest.approx(full["step_time_s"], rel=0.01)


@pytest.mark.parametrize("name, dp", [("llama3-405b-8k", 64), ("llama3-405b-16k", 128)])
def test_the_shipped_scenarios_are_table_4s_layouts(name, dp):
    scenario = load_scenario(ROOT / "scenarios" / f"{name}.yaml")
    layout, data = scenario.parallel, scenario.data
    assert (layout.tp, layout.pp, scenario.cluster.devices // (layout.tp * layout.pp)) == (8, 16, dp)
    assert data.batch_size * dp * data.seq_len == 16 * 2**20  # 16M tokens a step, sequences of 8,192
    assert sum(layout.pipeline.split) == scenario.model.layers + 2  # embedding and head are units of the split


def test_the_16k_scenarios_host_memory_bound_counts_the_rings_it_runs():
    """Ring chunks are counted per ring (dp 128, one stage's ranks in 16 with representatives), not as one ring
    of 16,384 ranks (150 GiB, which refused the run on any laptop)."""
    scenario = load_scenario(ROOT / "scenarios" / "llama3-405b-16k.yaml")
    needs = scenario_host_bytes(scenario, resolve_cluster(scenario.cluster, scenario.base_dir))
    assert needs["ring chunks"] == 600 * (16384 // 16) * 128
    assert sum(needs.values()) < 2**30
