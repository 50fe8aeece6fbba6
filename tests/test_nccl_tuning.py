"""NCCL's tuning model and the programs it chooses: closed forms, NCCL's own tables, numerics against torch.

References: NCCL 2.30.7's src/graph/tuning.cc, its figures worked by hand for
DGX H100 and A100 (comm/nccl_tuning.py); closed forms of each program's time on
a switch under each protocol's view of the links; the collective computed
directly with torch; inside training (`parallel.all_reduce: nccl`), the
tuner's choice at each call's size, the chosen program's closed form, and the
ring's training (itself checked against torch in test_sync_training.py).
"""
from functools import cache

import networkx as nx
import pytest
import torch

from simtrain.cli import main
from simtrain.cli_collective import NCCL_ALGORITHMS, NCCL_COLLECTIVES
from simtrain.comm.bench import benchmark_collective
from simtrain.comm.nccl import PROGRAMS, chain_pieces, fabric_of
from simtrain.comm.nccl_tuning import ALGORITHMS, PROTOCOLS, Fabric, tune
from simtrain.errors import ScenarioError
from simtrain.hw.topology import Topology
from simtrain.hw.topology_builders import LinkClass, build_topology, load_topology_file
from simtrain.runner import run
from simtrain.scenario import validate_scenario

H100 = Fabric(ranks=8, nodes=1, generation="hopper", intra_GBps=360.0, inter_GBps=360.0, nvls=True)
A = 0.25e-6  # s per NVLink hop
B = 360e9  # B/s per GPU link
US = 1e-6


def switch(world: int, reducing: bool = True) -> Topology:
    """GPUs on one NVSwitch that reduces (NVLS), links of B and A."""
    built = build_topology("switch", world, LinkClass(bandwidth=B, latency=A))
    return Topology(built.graph, built.devices, built.name, reducing=frozenset({"switch"} if reducing else ()))


def two_nodes(g: int, nic_Bps: float = 50e9, nic_s: float = 1.5e-6) -> Topology:
    built = build_topology("hierarchical", 2 * g, LinkClass(bandwidth=B, latency=A),
                           inter_link=LinkClass(bandwidth=nic_Bps, latency=nic_s), gpus_per_node=g)
    return Topology(built.graph, built.devices, built.name, reducing=frozenset({"node0-switch", "node1-switch"}))


def one_gpu_per_node(n: int, nic_Bps: float = 50e9, nic_s: float = 1.5e-6) -> Topology:
    """n nodes of one GPU each, every GPU's NIC on one switch (a route: GPU -> switch -> GPU)."""
    return build_topology("hierarchical", n, LinkClass(bandwidth=B, latency=A),
                          inter_link=LinkClass(bandwidth=nic_Bps, latency=nic_s), gpus_per_node=1)


def time_s(topology, collective, algorithm, protocol, nbytes):
    (row,) = benchmark_collective(topology, collective, algorithm, [nbytes], numerics=False, protocol=protocol)
    assert (row.algorithm, row.protocol) == (algorithm, protocol)
    return row.time_s


# ---- the tuning model: NCCL's tables, worked by hand ----


def test_all_reduce_latencies_and_bandwidths_on_one_h100_node():
    tuning = tune(H100)
    lat, bw = tuning.latency_us, tuning.bandwidth_GBps
    ratio = 8 / 14  # nRanks / nsteps: bus to algorithm bandwidth
    assert lat["all_reduce", "ring", "LL"] == pytest.approx(6.6 + 14 * 0.6)
    assert lat["all_reduce", "ring", "Simple"] == pytest.approx(8.4 + 14 * 3.4)
    assert bw["all_reduce", "ring", "LL"] == pytest.approx(141.0 * ratio)  # LL capped by llMaxBw, Hopper one node
    assert bw["all_reduce", "ring", "LL128"] == pytest.approx(360 * 0.92 * ratio)
    assert bw["all_reduce", "ring", "Simple"] == pytest.approx(360 * ratio)
    assert bw["all_reduce", "tree", "LL128"] == pytest.approx(360 * 0.92 * 7 / 9 * 0.5)
    assert lat["all_reduce", "tree", "LL128"] == pytest.approx(14.0 + 2 * 7 * 1.25)
    # NVLS: min(the switch's 0.85 x (15/16 channels) x 2 pipelined operations, the graph's bwInter = bwIntra)
    assert bw["all_reduce", "nvls", "Simple"] == pytest.approx(min(360 * 0.85 * 15 / 16 * 2, 360) * ratio)
    assert lat["all_reduce", "nvls", "Simple"] == 25
    assert ("all_reduce", "nvls_tree", "Simple") not in bw  # one node: NVLS, never NVLS-tree
    assert ("all_reduce", "nvls", "LL") not in bw  # NVLS runs Simple only


def test_multi_node_latencies_charge_the_network_steps():
    fabric = Fabric(ranks=16, nodes=2, generation="ampere", intra_GBps=240.0, inter_GBps=192.0)
    lat = tune(fabric).latency_us
    # ring: 30 steps, 2 of them between nodes; LL's intra step at least the 1 us network overhead
    assert lat["all_reduce", "ring", "LL"] == pytest.approx(6.6 + 28 * 1.0 + 2 * 2.7)
    assert lat["all_reduce", "ring", "Simple"] == pytest.approx(8.4 + 28 * 3.4 + 2 * 14.0)
    # tree: a chain of 7 inside each node, log2(2) = 1 level between them, up and down
    assert lat["all_reduce", "tree", "LL"] == pytest.approx(6.8 + 2 * (7 * 0.6 + 1 * 5.0))
    assert ("all_reduce", "nvls", "Simple") not in lat  # Ampere has no NVLS


def test_the_tree_correction_and_the_ring_plateau_enter_the_time():
    fabric = Fabric(ranks=16, nodes=2, generation="ampere", intra_GBps=240.0, inter_GBps=192.0)
    tuning = tune(fabric)
    nbytes = 1 << 20  # 64 B * 2^14: the Simple tree's correction is 0.5
    tree = tuning.latency_us["all_reduce", "tree", "Simple"] + nbytes / (1000 * 0.5 * tuning.bandwidth_GBps[
        "all_reduce", "tree", "Simple"])
    assert tuning.time_us("all_reduce", "tree", "Simple", nbytes) == pytest.approx(tree)
    ring = 1.4 * tuning.latency_us["all_reduce", "ring", "Simple"] + nbytes / (
        1000 * tuning.bandwidth_GBps["all_reduce", "ring", "Simple"])
    assert tuning.time_us("all_reduce", "ring", "Simple", nbytes) == pytest.approx(ring)


def test_nvls_tree_latency_is_nccls_and_blackwell_corrects_its_bandwidth():
    """NCCL 2.30.7's tuning.cc by hand. NVLS-tree's latency: baseLatencies 0, plus hwLatencies[NVLINK][NVLS_TREE]
    [Simple] = 25 us inside the node, plus 2 log2i(nodes) network steps of hwLatencies[NET][NVLS_TREE][Simple] =
    20.9 us each (plus 2 latencyInter, 0 on InfiniBand): 25 + 2 x 1 x 20.9 = 66.8 us on 2 and on 3 nodes,
    25 + 2 x 2 x 20.9 = 108.6 us on 4, on Hopper as on Blackwell. ncclTopoGetAlgoTime then multiplies a Blackwell
    NVLS-tree all-reduce's bandwidth (minCompCap >= 100, x86) by the tree's correction: Simple at 1 MiB
    (64 B x 2^14) by 0.5, at 1 GiB (2^24, past the table) by nothing; Hopper's never. And the ring's plateau
    multiplies its Simple latency across nodes by 1.9 before Ampere (Volta), 1.4 from Ampere on."""
    for nodes, latency_us in ((2, 66.8), (3, 66.8), (4, 108.6)):
        for generation in ("hopper", "blackwell"):
            fabric = Fabric(ranks=8 * nodes, nodes=nodes, generation=generation, intra_GBps=360.0,
                            inter_GBps=400.0, nvls=True)
            assert tune(fabric).latency_us["all_reduce", "nvls_tree", "Simple"] == pytest.approx(latency_us)
    for generation, factor_1mib in (("blackwell", 0.5), ("hopper", 1.0)):
        tuning = tune(Fabric(ranks=16, nodes=2, generation=generation, intra_GBps=360.0, inter_GBps=400.0,
                             nvls=True))
        key = ("all_reduce", "nvls_tree", "Simple")
        latency, bandwidth = tuning.latency_us[key], tuning.bandwidth_GBps[key]
        assert tuning.time_us(*key, 1 << 20) == pytest.approx(latency + (1 << 20) / (1000 * factor_1mib * bandwidth))
        assert tuning.time_us(*key, 1 << 30) == pytest.approx(latency + (1 << 30) / (1000 * bandwidth))
    volta = tune(Fabric(ranks=16, nodes=2, generation="volta", intra_GBps=130.0, inter_GBps=100.0))
    key = ("all_reduce", "ring", "Simple")
    assert volta.time_us(*key, 1 << 20) == pytest.approx(1.9 * volta.latency_us[key]
                                                         + (1 << 20) / (1000 * volta.bandwidth_GBps[key]))


def test_the_choice_is_the_least_predicted_time_and_crosses_over_where_the_lines_meet():
    tuning = tune(H100)
    assert tuning.choose("all_reduce", 8) == ("ring", "LL")
    assert tuning.choose("all_reduce", 1 << 30) == ("nvls", "Simple")
    # ring/LL against NVLS: 15 us + S/bw_LL = 25 us + S/bw_NVLS at S* (bytes); LL below it, NVLS above
    bw_ll = tuning.bandwidth_GBps["all_reduce", "ring", "LL"] * 1000
    bw_nvls = tuning.bandwidth_GBps["all_reduce", "nvls", "Simple"] * 1000
    crossing = (25 - 15) / (1 / bw_ll - 1 / bw_nvls)
    below, above = int(crossing * 0.9), int(crossing * 1.1)
    for nbytes in (below, above):
        best = min(((a, p) for a in ALGORITHMS for p in PROTOCOLS),
                   key=lambda pair: tuning.time_us("all_reduce", *pair, nbytes))
        assert tuning.choose("all_reduce", nbytes) == best
    assert tuning.choose("all_reduce", below)[0] in ("ring", "tree")
    assert tuning.choose("all_reduce", above) == ("nvls", "Simple")
    ampere = tune(Fabric(ranks=8, nodes=1, generation="ampere", intra_GBps=240.0, inter_GBps=240.0))
    assert ampere.choose("all_reduce", 1 << 30) == ("ring", "Simple")
    assert ampere.choose("broadcast", 1 << 30) == ("ring", "Simple")


def test_pat_needs_one_gpu_per_node():
    assert ("all_gather", "pat", "Simple") not in tune(H100).bandwidth_GBps
    flat = tune(Fabric(ranks=8, nodes=8, generation="hopper", intra_GBps=50.0, inter_GBps=50.0))
    assert flat.bandwidth_GBps["all_gather", "pat", "Simple"] == pytest.approx(50.0 * 0.75)
    assert flat.latency_us["all_gather", "pat", "Simple"] == pytest.approx(8.0 + 3 * 14.0 / 3.5 + 8 * 2.8)


def test_the_fabric_is_read_from_the_shipped_topologies():
    h100 = fabric_of(load_topology_file("topologies/dgx-h100-1node.yaml"))
    assert (h100.ranks, h100.nodes, h100.generation, h100.nvls, h100.intra_GBps) == (8, 1, "hopper", True, 360.0)
    a100 = fabric_of(load_topology_file("topologies/dgx-a100-2node.yaml"))
    assert (a100.nodes, a100.generation, a100.nvls) == (2, "ampere", False)
    assert a100.inter_GBps == pytest.approx(8 * 25 * 0.96)
    assert fabric_of(load_topology_file("topologies/dgx-h100-2node.yaml")).nvls


# ---- each program under each protocol: closed forms on the flow model ----

EXTRA_HOP_S = {"LL": 0.0, "LL128": (1.9 - 0.6) / 2 * US, "Simple": (3.4 - 0.6) / 2 * US}  # ring, NVLink
PROTOCOL = {"LL": 0.5, "LL128": 120 / 128, "Simple": 1.0}
BASE_S = {"LL": 6.6 * US, "LL128": 14.0 * US, "Simple": 8.4 * US}


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("collective, steps, per_step", [("all_reduce", 14, 1 / 8), ("all_gather", 7, 1 / 8),
                                                         ("reduce_scatter", 7, 1 / 8)])
def test_ring_under_each_protocol(protocol, collective, steps, per_step):
    nbytes = 8 << 20
    hop = A + EXTRA_HOP_S[protocol]
    expected = BASE_S[protocol] + steps * (2 * hop + nbytes * per_step / (B * PROTOCOL[protocol]))
    # rel 1e-6: a flow carries whole bytes on the wire (LL128's 128/120 of a chunk, rounded up)
    assert time_s(switch(8, reducing=False), collective, "ring", protocol, nbytes) == pytest.approx(expected,
                                                                                                   rel=1e-6)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_ring_across_nodes_under_each_protocol(protocol):
    """Two nodes of one GPU, every hop a network one: NCCL's base latency, then 2(N - 1) steps of two hops, each
    slower by half what the protocol's network step adds over ring/LL (hwLatencies[NET][RING]: 2.7, 4.0, 14.0
    us), and a chunk of n/N bytes at the protocol's share of the NIC's rate."""
    world, nbytes, nic_Bps, nic_s = 2, 8 << 20, 50e9, 1.5e-6
    extra_hop_s = {"LL": 0.0, "LL128": (4.0 - 2.7) / 2 * US, "Simple": (14.0 - 2.7) / 2 * US}[protocol]
    expected = BASE_S[protocol] + 2 * (world - 1) * (2 * (nic_s + extra_hop_s)
                                                     + nbytes / world / (nic_Bps * PROTOCOL[protocol]))
    assert time_s(one_gpu_per_node(world, nic_Bps, nic_s), "all_reduce", "ring", protocol, nbytes) == pytest.approx(
        expected, rel=1e-6)  # flows carry whole bytes


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("collective", ["broadcast", "reduce"])
def test_rooted_ring_is_a_pipelined_chain(protocol, collective):
    nbytes, world = 64 << 20, 4
    step = 2 * A  # the protocol's extra step latency is charged once, at launch, as NCCL's model does
    rate = B * PROTOCOL[protocol]
    pieces = chain_pieces(world, nbytes, rate, step)
    # P pieces down a chain of N ranks (N - 1 links): P + N - 2 steps of one piece each (pieces of unequal
    # elements by at most one: rel 1e-6)
    expected = BASE_S[protocol] + 2 * EXTRA_HOP_S[protocol] + (pieces + world - 2) * (step + nbytes / pieces / rate)
    assert time_s(switch(world, reducing=False), collective, "ring", protocol, nbytes) == pytest.approx(
        expected, rel=1e-6)


def test_chain_pieces_minimize_the_chain_time():
    def chain_s(pieces, world=8, nbytes=1 << 30, rate=360e9, step=3.3e-6):
        return (pieces + world - 2) * (step + nbytes / pieces / rate)

    best = chain_pieces(8, 1 << 30, 360e9, 3.3e-6)
    assert chain_s(best) <= min(chain_s(best - 1), chain_s(best + 1))
    assert chain_pieces(2, 1 << 30, 360e9, 3.3e-6) == 1  # two ranks: one transfer, nothing to pipeline
    assert chain_pieces(8, 1 << 40, 360e9, 3.3e-6) == 1024  # at most 1,024


def test_nvls_reduces_in_the_switch_and_multicasts():
    world, nbytes = 8, 8 << 20  # one 1 MiB piece per shard; rel 1e-6: flows carry whole bytes (wire bytes, rounded up)
    rate = B * 0.85  # NCCL's NVLS efficiency on Hopper
    # up S (every shard read), down S/N (its sum to the owner), up S/N (the owner's store), down S (multicast)
    expected = 25 * US + 4 * A + 2 * nbytes * (1 + 1 / world) / rate
    assert time_s(switch(world), "all_reduce", "nvls", "Simple", nbytes) == pytest.approx(expected, rel=1e-6)
    # reduce-scatter alone: up S, down S/N; all-gather alone: up S/N, down S (launch: NCCL's 25 us)
    half = 25 * US + 2 * A + nbytes * (1 + 1 / world) / rate
    assert time_s(switch(world), "reduce_scatter", "nvls", "Simple", nbytes) == pytest.approx(half, rel=1e-6)
    assert time_s(switch(world), "all_gather", "nvls", "Simple", nbytes) == pytest.approx(half, rel=1e-6)


def test_nvls_tree_is_nvls_in_each_node_and_an_exchange_between_nodes():
    g, nbytes, nic_Bps, nic_s = 4, 4 << 20, 50e9, 1.5e-6  # one 1 MiB piece per shard
    rate = B * 0.85
    intra = 4 * A + 2 * nbytes * (1 + 1 / g) / rate  # read, return, store, multicast through each node switch
    between = 2 * nic_s + nbytes / g / nic_Bps  # the owners' node sums cross, each way, GPU -> spine -> GPU
    launch = (25 + 2 * 1 * 20.9) * US  # NCCL's NVLS-tree latency on two nodes
    expected = launch + intra + between
    assert time_s(two_nodes(g), "all_reduce", "nvls_tree", "Simple", nbytes) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("world, steps", [(8, 3), (6, 3), (2, 1)])
def test_pat_takes_log2_steps_and_sends_n_minus_1_blocks(collective, world, steps):
    nbytes, nic_Bps, nic_s = world * (1 << 20), 50e9, 1.5e-6  # blocks of 1 MiB
    # NCCL's PAT launch (8 us), then log2 steps of one network hop each way, each rank's NIC sending N - 1
    # blocks in all (6 ranks: 1, 1 and 3 blocks at distances 4, 2, 1) at NCCL's 0.75 of its rate for PAT
    expected = 8 * US + steps * 2 * nic_s + (world - 1) * (1 << 20) / (nic_Bps * 0.75)
    assert time_s(one_gpu_per_node(world, nic_Bps, nic_s), collective, "pat", "Simple", nbytes) == pytest.approx(
        expected, rel=1e-6)  # flows carry whole bytes


def test_the_tuner_chooses_pat_on_the_64_node_fat_tree():
    topology = load_topology_file("topologies/fat-tree-64x1.yaml")
    assert fabric_of(topology).nodes == fabric_of(topology).ranks == 64
    for collective in ("all_gather", "reduce_scatter"):
        (row,) = benchmark_collective(topology, collective, "auto", [1 << 20], numerics=False)
        assert (row.algorithm, row.protocol) == ("pat", "Simple")
        (ring,) = benchmark_collective(topology, collective, "ring", [1 << 20], numerics=False)
        assert ring.busbw_GBps < row.busbw_GBps / 4  # 63 steps of latency against 6


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_nccl_tree_on_one_node_is_a_pipelined_chain(protocol):
    world, nbytes = 4, 4 << 20  # two halves of 2 MiB, 2 pieces each, both down the same chain of depth 3
    hop = A + {"LL": 0.0, "LL128": (1.25 - 0.6) / 2, "Simple": (4.0 - 0.6) / 2}[protocol] * US
    piece_s = 2 * hop + 2 * (1 << 20) / (B * PROTOCOL[protocol])  # the two trees' pieces share each link
    base = {"LL": 6.8, "LL128": 14.0, "Simple": 8.4}[protocol] * US
    expected = base + 2 * (2 + 3 - 1) * piece_s  # 2(P + D - 1) steps, up and down (dbtree.py)
    assert time_s(switch(world, reducing=False), "all_reduce", "tree", protocol, nbytes) == pytest.approx(
        expected, rel=1e-6)


# ---- numerics: the reduced values are torch's ----

CASES = [(collective, algorithm) for collective, algorithms in PROGRAMS.items() for algorithm in algorithms]


@pytest.mark.parametrize("collective, algorithm", CASES)
@pytest.mark.parametrize("numel", [1 << 10, 37 * 24 + 8])
def test_every_program_computes_what_torch_computes(collective, algorithm, numel):
    topology = (two_nodes(4) if algorithm in ("nvls_tree", "tree") else one_gpu_per_node(6) if algorithm == "pat"
                else switch(8))
    rows = list(benchmark_collective(topology, collective, algorithm, [numel * 4], numerics=True))
    assert rows[0].wrong == 0 and rows[0].algorithm == algorithm


def test_auto_runs_what_the_tuner_chooses_on_dgx_h100():
    topology = load_topology_file("topologies/dgx-h100-1node.yaml")
    rows = list(benchmark_collective(topology, "all_reduce", "auto", [8, 1 << 30], numerics=False))
    assert [(row.algorithm, row.protocol) for row in rows] == [("ring", "LL"), ("nvls", "Simple")]
    assert 432 <= rows[1].busbw_GBps <= 528  # about 480 GB/s published (docs/validation/nccl-busbw.md)


def test_the_command_line_names_match_the_programs():
    assert set(NCCL_COLLECTIVES) == set(PROGRAMS)
    assert {"nvls", "nvls_tree"} <= set(NCCL_ALGORITHMS)


@pytest.mark.parametrize("args, expected", [
    (["--op", "broadcast", "--algo", "nvls"], "--algo: NCCL's broadcast runs ring or auto"),
    (["--algo", "dbtree", "--protocol", "LL"], "--protocol: dbtree is simtrain's"),
    (["--protocol", "Simple", "--channels", "2"], "--channels: NCCL's algorithms"),
    (["--op", "reduce", "--algo", "nccl_tree"], "--algo: nccl_tree runs all_reduce, not reduce"),
])
def test_bad_nccl_options_are_one_line_errors(capsys, args, expected):
    with pytest.raises(SystemExit) as exit_info:
        main(["collective", "--topology", "topologies/dgx-h100-1node.yaml", "--sizes", "1K", *args])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_nvls_needs_a_reducing_switch():
    with pytest.raises(ScenarioError, match="--algo: NCCL does not run nvls"):
        list(benchmark_collective(switch(4, reducing=False), "all_reduce", "nvls", [1024], numerics=False))


def test_a_reducing_switch_must_be_a_switch(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("gpus: [a, b]\nswitches: [s]\nreducing_switches: [a]\n"
                    "links: [{between: [a, s], bandwidth: 1 GB/s, latency: 1 us},"
                    " {between: [b, s], bandwidth: 1 GB/s, latency: 1 us}]\n")
    with pytest.raises(Exception, match="reducing_switches\\[0\\]: 'a' is not listed under switches"):
        load_topology_file(path)
    assert nx.is_connected(switch(2).graph)


def test_one_device_moves_nothing(capsys):
    (row,) = benchmark_collective(switch(1), "all_reduce", "auto", [1024], numerics=True)
    assert (row.time_s, row.wrong, row.algorithm) == (0.0, 0, "local")
    with pytest.raises(SystemExit) as exit_info:
        main(["collective", "--devices", "1", "--sizes", "1K", "--json"])
    assert exit_info.value.code == 0 and '"busbw_GBps": null' in capsys.readouterr().out


# ---- inside training: parallel.all_reduce: nccl ----

H100_NODE = "topologies/dgx-h100-1node.yaml"  # 8 GPUs on a reducing NVSwitch, links of 450 GB/s x 0.8, 0.25 us


@cache
def train_mlp(all_reduce: str, hidden: tuple[int, ...]):
    """Two steps of an mlp on 8 x H100, one all-reduce of the whole gradient after the backward (no overlap)."""
    return run(validate_scenario({
        "name": "t", "seed": 3, "cluster": {"topology": H100_NODE, "devices": 8},
        "model": {"name": "mlp", "hidden": list(hidden)}, "data": {"name": "digits", "batch_size": 16},
        "train": {"steps": 2, "optimizer": {"name": "sgd", "lr": 0.1}},
        "parallel": {"all_reduce": all_reduce, "overlap": False}, "report": {"trace": True}}))


def ring_ll_s(nbytes: int, world: int = 8, link_Bps: float = 450e9 * 0.8, hop_s: float = 0.25e-6) -> float:
    """NCCL's ring/LL all-reduce on one switch: its base latency, then 2(N-1) steps of two hops and a chunk at
    half the link's rate."""
    return 6.6 * US + 2 * (world - 1) * (2 * hop_s + nbytes / world / (link_Bps * 0.5))


def nvls_s(nbytes: int, world: int = 8, link_Bps: float = 450e9 * 0.8, hop_s: float = 0.25e-6) -> float:
    """NVLS/Simple, every shard one piece: NCCL's 25 us, then up S, down S/N, up S/N, down S at 0.85 of the rate."""
    return 25 * US + 4 * hop_s + 2 * nbytes * (1 + 1 / world) / (link_Bps * 0.85)


@pytest.mark.parametrize("hidden, choice, closed_form", [((128, 128), ("ring", "LL"), ring_ll_s),
                                                          ((1024, 1024), ("nvls", "Simple"), nvls_s)])
def test_training_runs_the_tuners_choice_for_each_call(hidden, choice, closed_form):
    report = train_mlp("nccl", hidden)
    tuning = tune(fabric_of(load_topology_file(H100_NODE)))
    spans = [event for event in report.trace["traceEvents"] if event.get("ph") == "X"]
    calls = [event for event in spans if event["name"].startswith("nccl ")]
    assert len(calls) == 8 * 2  # every rank, every step: one call, named by NCCL's choice
    for call in calls:
        _, pair, nbytes, _ = call["name"].split()
        assert tuple(pair.split("/")) == tuning.choose("all_reduce", int(nbytes)) == choice
    nbytes = int(calls[0]["name"].split()[2])
    gradient = 4 * sum(a * b + b for a, b in zip([64, *hidden], [*hidden, 10]))  # the mlp's fp32 gradient
    assert nbytes == gradient
    # rank 0's second step: the call from its launch to its last transfer is the chosen program's closed form
    launch = [event for event in calls if event["tid"] == 0][1]
    (collective,) = [event for event in spans if event["tid"] == 0 and event["name"] == "dp_allreduce"
                     and event["ts"] > launch["ts"]]
    expected_s = closed_form(nbytes)  # shards differ by one element: rel 1e-4
    assert (collective["ts"] + collective["dur"] - launch["ts"]) * 1e-6 == pytest.approx(expected_s, rel=1e-4)
    # nothing overlaps it: a step is its compute, the call and the optimizer
    breakdown = report.data["breakdown_s"]
    assert breakdown["communication"] == pytest.approx(expected_s, rel=1e-4)
    assert report.data["step_time_s"] == pytest.approx(breakdown["compute"] + expected_s + breakdown["optimizer"],
                                                       rel=1e-4)


def test_training_with_nvls_computes_what_the_ring_computes():
    nccl, ring = train_mlp("nccl", (1024, 1024)), train_mlp("ring", (1024, 1024))
    assert nccl.data["final_loss"] == pytest.approx(ring.data["final_loss"], rel=1e-6)
    for ours, theirs in zip(nccl.final_models[0].parameters(), ring.final_models[0].parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_one_device_on_a_ring_trains_with_nccl_and_sends_nothing():
    """A topology of one device has no link: NCCL's tuner reads no link kind, the step communicates nothing (was a
    ValueError from min() over no link rates)."""
    report = run(validate_scenario({
        "name": "t", "seed": 3, "cluster": {"topology": "ring", "devices": 1},
        "model": {"name": "mlp", "hidden": [8]}, "data": {"name": "digits", "batch_size": 16},
        "train": {"steps": 2, "optimizer": {"name": "sgd", "lr": 0.1}},
        "parallel": {"all_reduce": "nccl"}, "report": {"trace": False}}))
    assert report.data["breakdown_s"]["communication"] == 0.0 and report.data["steps"] == 2
