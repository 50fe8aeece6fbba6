"""NCCL-style collectives: channel layout as data, uncontended closed forms, numerics against torch.

References: hand-built channel rings; closed forms for K channels over K rails,
hierarchical all-reduce and pipelined double binary trees; the directly summed
buffers (torch); the command line's one-line errors.
"""
import json

import pytest
import simpy
import torch

from simtrain.cli import main
from simtrain.comm import ALGORITHMS, build_all_reduce
from simtrain.comm.bench import benchmark_all_reduce
from simtrain.comm.channels import Layout, channel_order, default_channels, layout_of
from simtrain.comm.dbtree import dbtree_all_reduce, double_trees, pieces_for, pipelined_tree
from simtrain.comm.ops import Concurrently, Recv, Send
from simtrain.comm.simulated import SimCommunicator
from simtrain.errors import ScenarioError
from simtrain.scenario import SharedMemorySpec
from simtrain.hw.eventlog import EventLog
from simtrain.hw.network import Network
from simtrain.hw.shared_memory import attach_shared_memory
from simtrain.hw.topology_builders import LinkClass, build_topology, parse_link

ALPHA_INTRA, B_INTRA = 0.25e-6, 300e9
ALPHA_INTER, B_INTER = 1.5e-6, 25e9
INTRA = LinkClass(bandwidth=B_INTRA, latency=ALPHA_INTRA)
INTER = LinkClass(bandwidth=B_INTER, latency=ALPHA_INTER)
ALPHA, B = 5e-6, 100e9
FLAT = LinkClass(bandwidth=B, latency=ALPHA)


def hosts(n, g, intra=INTRA, inter=INTER):
    return build_topology("hierarchical", n * g, intra, inter_link=inter, gpus_per_node=g)


def simulated_time(topology, algorithm, nbytes, channels=None):
    (row,) = benchmark_all_reduce(topology, algorithm, [nbytes], numerics=False, channels=channels)
    return row.time_s


# ---- channel layout: plain data ----


def test_channel_rings_rotate_each_host_to_enter_at_its_rail():
    layout = Layout(hosts=((0, 1, 2, 3), (4, 5, 6, 7)), rails=((0, 1, 2, 3), (4, 5, 6, 7)))
    assert channel_order(layout, 0) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert channel_order(layout, 1) == [1, 2, 3, 0, 5, 6, 7, 4]
    assert channel_order(layout, 5) == channel_order(layout, 1)  # channels beyond the rails wrap around
    # Only ranks 1 and 3 own a NIC: channels enter at them in turn.
    sparse = Layout(hosts=((0, 1, 2, 3),), rails=((1, 3),))
    assert [channel_order(sparse, c) for c in range(3)] == [[1, 2, 3, 0], [3, 0, 1, 2], [1, 2, 3, 0]]


def test_g_channels_use_every_nic_once_in_each_direction():
    layout = layout_of(hosts(3, 4), hosts(3, 4).devices)
    exits, entries = [], []
    for channel in range(4):
        ring = channel_order(layout, channel)
        for index, rank in enumerate(ring):
            nxt = ring[(index + 1) % len(ring)]
            if rank // 4 != nxt // 4:  # crosses hosts
                exits.append(rank)
                entries.append(nxt)
    assert sorted(exits) == sorted(entries) == list(range(12))


def test_layout_is_read_from_the_graph():
    dgx = build_topology("topologies/dgx-a100-2node.yaml", None, None)
    layout = layout_of(dgx, dgx.devices)
    assert layout.hosts == (tuple(range(8)), tuple(range(8, 16)))
    assert layout.rails == layout.hosts
    assert default_channels(layout, "ring") == default_channels(layout, "dbtree") == 8
    assert default_channels(layout, "hierarchical") == 1
    # A job on a subset: group ranks are renumbered, hosts follow the devices.
    subset = layout_of(dgx, ["n1g2", "n0g5", "n1g3"])
    assert subset.hosts == ((0, 2), (1,))
    for builder in ("ring", "switch", "fully_connected", "torus2d"):
        flat = build_topology(builder, 8, FLAT)
        single = layout_of(flat, flat.devices)
        assert single.hosts == (tuple(range(8)),) and default_channels(single, "ring") == 1


def test_a_shared_memory_store_is_not_the_host_boundary():
    # The store's host links, slower than the NICs, carry no GPU-to-GPU traffic: the NICs still split the hosts.
    topology = hosts(2, 2)
    spec = SharedMemorySpec(bandwidth=10e9, host_link={"bandwidth": 1e9, "latency": 1e-6})
    with_store, _ = attach_shared_memory(topology, spec)
    assert layout_of(with_store, with_store.devices) == layout_of(topology, topology.devices)
    assert layout_of(with_store, with_store.devices).hosts == ((0, 1), (2, 3))


def test_double_trees_make_every_leaf_interior_in_the_other_tree():
    for size in range(2, 41):
        (parent1, kids1), (parent2, kids2) = double_trees(size)
        for parent, kids in ((parent1, kids1), (parent2, kids2)):
            assert parent.count(None) == 1 and max(len(k) for k in kids) <= 2
            root = parent.index(None)
            seen, frontier = {root}, [root]
            while frontier:  # every position is reached from the root exactly once
                frontier = [k for p in frontier for k in kids[p]]
                assert not seen & set(frontier)
                seen |= set(frontier)
            assert seen == set(range(size))
        both_interior = [p for p in range(size) if kids1[p] and kids2[p]]
        both_leaves = [p for p in range(size) if not kids1[p] and not kids2[p]]
        assert both_leaves == [] and len(both_interior) == size % 2


# ---- uncontended closed forms ----


@pytest.mark.parametrize("channels", [1, 2, 4])
def test_k_channels_on_k_rails_divide_the_bandwidth_term_by_k(channels):
    # 2 hosts of 4 GPUs; NVLink so fast that every ring step waits for its InfiniBand hop.
    fast = LinkClass(bandwidth=1e6 * B_INTER, latency=ALPHA_INTRA)
    topology = hosts(2, 4, intra=fast)
    world, nbytes = 8, 8 * 4 * 2**20
    step_latency = 2 * ALPHA_INTER  # GPU -> spine -> GPU
    single_ring_bandwidth_term = 2 * (world - 1) * nbytes / (world * B_INTER)
    expected = 2 * (world - 1) * step_latency + single_ring_bandwidth_term / channels
    assert simulated_time(topology, "ring", nbytes, channels) == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("n,g", [(2, 4), (3, 2), (4, 4)])
def test_hierarchical_matches_its_closed_form(n, g):
    nbytes = 3 * 5 * 7 * 2**16 * 4  # divides by every g and n here
    expected = (2 * (g - 1) / g * nbytes / B_INTRA + 2 * (n - 1) / n * nbytes / (g * B_INTER)
                + 2 * (g - 1) * 2 * ALPHA_INTRA + 2 * (n - 1) * 2 * ALPHA_INTER)
    assert simulated_time(hosts(n, g), "hierarchical", nbytes) == pytest.approx(expected, rel=1e-9)


def test_hierarchical_gains_nothing_from_channels_on_the_same_links():
    one = simulated_time(hosts(2, 4), "hierarchical", 2**24, channels=1)
    assert simulated_time(hosts(2, 4), "hierarchical", 2**24, channels=4) == pytest.approx(one, rel=1e-3)


# Heights of the trees: N=8: 0 -> 4 -> {2, 6} -> {1, 3, 5, 7}, 3; N=16: 4; N=5: 0 -> 4 -> 2 -> {1, 3}, 3.
@pytest.mark.parametrize("world,height", [(8, 3), (16, 4), (5, 3)])
def test_dbtree_is_one_pipelined_tree_on_half_the_buffer(world, height):
    topology = build_topology("fully_connected", world, FLAT)
    numel, pieces = 2**22, 16
    piece_bytes = numel * 4 / 2 / pieces
    expected = 2 * (pieces + height - 1) * (ALPHA + piece_bytes / B)
    both = _time_programs(topology, lambda rank: dbtree_all_reduce(
        rank, world, torch.empty(numel, device="meta"), pieces=pieces))
    assert both == pytest.approx(expected, rel=1e-9)
    (parent, kids), _ = double_trees(world)  # tree one alone, on its half
    one = _time_programs(topology, lambda rank: pipelined_tree(
        parent[rank], kids[rank], torch.empty(numel // 2, device="meta"), pieces, tag=0))
    assert one == pytest.approx(expected, rel=1e-9)


def test_dbtree_pipelines_in_pieces_of_1_mib_up_to_64():
    assert [pieces_for(n) for n in (4, 2**20, 3 * 2**20 + 1, 2**30)] == [1, 1, 4, 64]


def _time_programs(topology, program_of):
    env = simpy.Environment()
    comm = SimCommunicator(Network(env, topology, record=False), topology.devices)
    finished_s = []
    for rank in range(topology.num_devices):
        comm.run(rank, program_of(rank)).callbacks.append(lambda _: finished_s.append(env.now))
    env.run()
    assert comm.stuck() == []
    return max(finished_s)


def test_link_efficiency_scales_the_rate():
    slow = LinkClass(bandwidth=B, latency=ALPHA, efficiency=0.5)
    world, nbytes = 4, 2**24
    expected = 2 * (world - 1) * (ALPHA + nbytes / (world * B * 0.5))
    assert simulated_time(build_topology("ring", world, slow), "ring", nbytes) == pytest.approx(expected, rel=1e-9)
    assert parse_link({"latency": 1e-6, "efficiency": 0.8}, "x", default=INTER).efficiency == 0.8
    with pytest.raises(ScenarioError, match=r"^x\.efficiency: expected a number in \(0, 1\], got 1\.5$"):
        parse_link({"bandwidth": "1 GB/s", "latency": 0, "efficiency": 1.5}, "x")


# ---- numerics ----


def seeded_inputs(world, numel):
    return [torch.randn(numel, generator=torch.Generator().manual_seed(7 * world + r)) for r in range(world)]


CASES = [(hosts(2, 2), [1, 2, 3]), (hosts(3, 3), [1, 2]), (hosts(2, 4), [1, 4]),
         (build_topology("switch", 5, FLAT), [1, 3]), (build_topology("ring", 7, FLAT), [1, 2]),
         (build_topology("switch", 1, FLAT), [1])]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("numel", [1001, 2])
def test_every_algorithm_and_channel_count_sums_like_torch(algorithm, case, numel):
    topology, channel_counts = CASES[case]
    world = topology.num_devices
    inputs = seeded_inputs(world, numel)
    expected = torch.stack(inputs).double().sum(dim=0)
    for channels in [None] if algorithm == "nccl" else channel_counts if algorithm not in ("naive", "tree") else [1]:
        all_reduce = build_all_reduce(algorithm, topology, topology.devices, channels)
        buffers = [t.clone() for t in inputs]
        env = simpy.Environment()
        comm = SimCommunicator(Network(env, topology, record=False), topology.devices)
        for rank in range(world):
            comm.run(rank, all_reduce(rank, world, buffers[rank], average=True))
        env.run()
        assert comm.stuck() == []
        for out in buffers:
            torch.testing.assert_close(out.double(), expected / world, rtol=1e-5, atol=1e-5)
            assert torch.equal(out, buffers[0])


# ---- channels progress on their own ----


def test_a_slow_channel_does_not_hold_a_fast_one_and_tags_never_cross():
    topology = build_topology("fully_connected", 3, FLAT)
    small, big = torch.zeros(1000), torch.zeros(10**7)

    def sender():
        fast = (Send(1, small, 0) for _ in range(10))
        yield Concurrently([fast, _one(Send(2, big, 1)), _one(Send(1, big, 1))])

    def receiver(rank):
        if rank == 1:  # the big message with tag 1 is posted first: it must not match the small ones
            yield Concurrently([_one(Recv(0, torch.zeros(10**7), tag=1)),
                                (Recv(0, torch.zeros(1000)) for _ in range(10))])
        else:
            yield Recv(0, torch.zeros(10**7), tag=1)

    env = simpy.Environment()
    log = EventLog()
    comm = SimCommunicator(Network(env, topology), topology.devices, log=log)
    done = [comm.run(0, sender()), comm.run(1, receiver(1)), comm.run(2, receiver(2))]
    finished_s = []
    for event in done:
        event.callbacks.append(lambda _: finished_s.append(env.now))
    env.run()
    assert comm.stuck() == []
    # 0 -> 2 carries the big message alone; 0 -> 1 carries a big one and ten small ones after each other,
    # sharing the link while both move: the link is never idle, so it moves all bytes at B.
    assert max(finished_s) == pytest.approx(ALPHA + (4e7 + 10 * 4000) / B, rel=1e-3)
    assert len([s for s in log.spans if s.rank == 0]) == 1  # the rank's sub-programs make one span


def _one(op):
    yield op


# ---- where users meet it ----


def cli(*args):
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    return exit_info.value.code


def test_collective_channels_and_new_algorithms_on_the_command_line(capsys):
    assert cli("collective", "--algo", "hierarchical", "--topology", "topologies/dgx-a100-2node.yaml",
               "--sizes", "1M:2M", "--json") == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(row["algorithm"], row["channels"], row["bytes"]) for row in rows] == [
        ("hierarchical", 1, 2**20), ("hierarchical", 1, 2**21)]
    assert cli("collective", "--algo", "ring", "--channels", "3", "--devices", "4", "--sizes", "1K", "--json") == 0
    assert json.loads(capsys.readouterr().out)["channels"] == 3


@pytest.mark.parametrize("args,expected", [
    (["--algo", "ring", "--channels", "0", "--devices", "4"], "--channels: must be an integer from 1 to 64, got 0"),
    (["--algo", "tree", "--channels", "2", "--devices", "4"], "--channels: tree runs on one channel, got 2"),
])
def test_bad_channels_are_one_line_errors(capsys, args, expected):
    assert cli("collective", *args) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {expected}"


def test_hierarchical_needs_hosts_of_equal_size():
    dgx = build_topology("topologies/dgx-a100-2node.yaml", None, None)
    with pytest.raises(ScenarioError, match="^parallel.all_reduce: hierarchical needs the same number of ranks on "
                                            "every host, got 2, 1$"):
        build_all_reduce("hierarchical", dgx, ["n0g0", "n0g1", "n1g0"], None, "parallel.all_reduce")
    with pytest.raises(ScenarioError, match="^parallel.channels: nccl opens NCCL's own channels; leave it null, "
                                            "got 2$"):
        build_all_reduce("nccl", dgx, dgx.devices, 2, "parallel.all_reduce", "parallel.channels")


def test_scenarios_train_alike_with_every_algorithm(tmp_path, capsys):
    cluster = ["--set", "cluster.topology=hierarchical", "--set", "cluster.devices=8", "--set",
               "cluster.gpus_per_node=4", "--set", 'cluster.inter_node_link={bandwidth: "25 GB/s", latency: "5 us"}',
               "--set", "train.steps=5", "--set", "report.trace=false"]
    losses = {}
    for algorithm, channels in [("ring", "null"), ("hierarchical", "null"), ("dbtree", "2"), ("nccl", "null")]:
        out = tmp_path / algorithm
        assert cli("run", "scenarios/quickstart.yaml", *cluster, "--set", f"parallel.all_reduce={algorithm}",
                   "--set", f"parallel.channels={channels}", "--out", str(out), "-q") == 0
        report = json.loads((out / "report.json").read_text())
        assert report["scheme"] == "data_parallel" and report["all_reduce"] == algorithm
        losses[algorithm] = report["final_loss"]
    assert losses["hierarchical"] == pytest.approx(losses["ring"], rel=1e-5)
    assert losses["dbtree"] == pytest.approx(losses["ring"], rel=1e-5)
    assert losses["nccl"] == pytest.approx(losses["ring"], rel=1e-5)  # NCCL's ring and tree, its protocols
    assert cli("run", "scenarios/quickstart.yaml", *cluster, "--set", "parallel.all_reduce=tree",
               "--set", "parallel.channels=2", "--out", str(tmp_path / "bad"), "-q") == 2
    assert capsys.readouterr().err.strip() == ("error: scenarios/quickstart.yaml: parallel.channels: tree runs on "
                                               "one channel, got 2")
