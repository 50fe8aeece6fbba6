"""All-to-all programs: the blocks land where a direct split-and-concatenate (and gloo's all_to_all_single)
puts them; times equal the closed forms of comm/all_to_all.py and, with uneven sizes, a direct max-min
computation of the flows; nccl-tests' busbw convention; the CLI's --op all_to_all."""
import json

import pytest
import simpy
import torch
import torch.distributed as dist

from gloo_processes import run_on_gloo
from simtrain.cli import main
from simtrain.comm.all_to_all import ALL_TO_ALL, hierarchical_all_to_all, pairwise_all_to_all
from simtrain.comm.bench import benchmark_all_to_all
from simtrain.comm.gloo import run_program
from simtrain.comm.simulated import SimCommunicator
from simtrain.errors import ScenarioError
from simtrain.hw.network import Network
from simtrain.hw.topology_builders import LinkClass, build_topology

ALPHA, B = 5e-6, 100e9
LINK = LinkClass(bandwidth=B, latency=ALPHA)
S = 64 * 2**20  # bytes of each rank's send buffer


def uneven_counts(world, seed=0, high=6):
    """A seeded rows matrix with zeros in it: counts[src][dst]."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (world, world), generator=generator).tolist()


def inputs(counts, width=3, seed=0):
    """Rank r's send buffer: sum(counts[r]) rows of `width` seeded numbers."""
    return [torch.randn(sum(row), width, generator=torch.Generator().manual_seed(seed * 100 + r))
            for r, row in enumerate(counts)]


def expected_outputs(counts, sends):
    """Directly: rank r receives block r of every rank's buffer, in source order."""
    world = len(counts)
    blocks = [send.split(counts[src]) for src, send in enumerate(sends)]
    return [torch.cat([blocks[src][dst] for src in range(world)]) for dst in range(world)]


def run_simulated(algorithm, counts, sends, topology, hosts=None):
    world = len(counts)
    env = simpy.Environment()
    comm = SimCommunicator(Network(env, topology), topology.devices)
    recvs = [send.new_empty((sum(counts[src][dst] for src in range(world)), *send.shape[1:]))
             for dst, send in enumerate(sends)]
    ends = {}
    for rank in range(world):
        options = {"hosts": hosts} if algorithm == "hierarchical" else {}
        program = ALL_TO_ALL[algorithm](rank, world, sends[rank], recvs[rank], counts, **options)
        comm.run(rank, program).callbacks.append(lambda _, rank=rank: ends.setdefault(rank, env.now))
    env.run()
    assert comm.stuck() == []
    return recvs, [ends[rank] for rank in range(world)]


def two_level(hosts, gpus):
    return build_topology("hierarchical", hosts * gpus, LinkClass(B, 1e-6), inter_link=LinkClass(25e9, 5e-6),
                          gpus_per_node=gpus)


@pytest.mark.parametrize("world,seed", [(1, 0), (2, 1), (5, 2), (8, 3)])
def test_pairwise_puts_every_block_where_split_and_cat_do(world, seed):
    counts = uneven_counts(world, seed)
    sends = inputs(counts, seed=seed)
    recvs, _ = run_simulated("pairwise", counts, sends, build_topology("switch", world, LINK))
    for got, want in zip(recvs, expected_outputs(counts, sends)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("hosts,gpus,seed", [(2, 2, 0), (2, 4, 1), (3, 2, 2), (1, 4, 3), (4, 1, 4)])
def test_hierarchical_puts_every_block_where_split_and_cat_do(hosts, gpus, seed):
    counts = uneven_counts(hosts * gpus, seed)
    sends = inputs(counts, seed=seed)
    groups = [list(range(h * gpus, (h + 1) * gpus)) for h in range(hosts)]
    topology = two_level(hosts, gpus) if hosts > 1 else build_topology("switch", gpus, LINK)
    recvs, _ = run_simulated("hierarchical", counts, sends, topology, groups)
    for got, want in zip(recvs, expected_outputs(counts, sends)):
        assert torch.equal(got, want)


def test_a_rank_with_nothing_to_send_or_receive_ends_at_once():
    counts = [[1, 0, 2], [0, 0, 0], [3, 0, 1]]
    sends = inputs(counts)
    recvs, ends = run_simulated("pairwise", counts, sends, build_topology("switch", 3, LINK))
    assert ends[1] == 0 and recvs[1].shape[0] == 0 and ends[0] > 0


def programs_and_torch(rank, world):
    """Both programs over gloo and dist.all_to_all_single, on uneven splits of this rank's seeded rows."""
    counts = uneven_counts(world, seed=7)
    send = inputs(counts, seed=7)[rank]
    rows_in = [counts[src][rank] for src in range(world)]
    results = {}
    hosts = [list(range(world // 2)), list(range(world // 2, world))]
    for name, program in (("pairwise", pairwise_all_to_all(rank, world, send, send.new_empty(sum(rows_in), 3),
                                                           counts)),
                          ("hierarchical", hierarchical_all_to_all(rank, world, send, send.new_empty(sum(rows_in), 3),
                                                                   counts, hosts=hosts))):
        results[name] = run_program(program).clone()
    reference = send.new_empty(sum(rows_in), 3)
    dist.all_to_all_single(reference, send, output_split_sizes=rows_in, input_split_sizes=counts[rank])
    results["torch"] = reference
    return results


@pytest.mark.gloo
@pytest.mark.parametrize("world", [2, 4])
def test_programs_over_gloo_equal_torch_all_to_all_single(world):
    results = run_on_gloo(programs_and_torch, world)
    counts = uneven_counts(world, seed=7)
    expected = expected_outputs(counts, inputs(counts, seed=7))
    for rank in range(world):
        assert torch.equal(results[rank]["torch"], expected[rank])
        assert torch.equal(results[rank]["pairwise"], expected[rank])
        assert torch.equal(results[rank]["hierarchical"], expected[rank])


def simulated_time(topology, algorithm="pairwise"):
    (row,) = benchmark_all_to_all(topology, algorithm, [S], numerics=False)
    return row


@pytest.mark.parametrize("world", [2, 4, 9])
def test_pairwise_on_a_switch_matches_its_closed_form(world):
    row = simulated_time(build_topology("switch", world, LINK))
    assert row.time_s == pytest.approx(2 * ALPHA + (world - 1) / world * row.nbytes / B, rel=0.01)


@pytest.mark.parametrize("world", [3, 5, 7, 11])
def test_pairwise_on_an_odd_ring_matches_its_closed_form(world):
    row = simulated_time(build_topology("ring", world, LINK))
    assert row.time_s == pytest.approx(ALPHA + (world**2 - 1) / 8 * row.nbytes / (world * B), rel=0.01)


@pytest.mark.parametrize("hosts,gpus", [(2, 4), (4, 2), (3, 4)])
def test_both_forms_on_two_levels_match_their_closed_forms(hosts, gpus):
    world, inside, outside = hosts * gpus, LinkClass(B, 1e-6), LinkClass(25e9, 5e-6)
    topology = two_level(hosts, gpus)
    pairwise, hierarchical = simulated_time(topology), simulated_time(topology, "hierarchical")
    size = pairwise.nbytes
    assert pairwise.time_s == pytest.approx(
        max(2 * inside.latency + (gpus - 1) / world * size / inside.bandwidth,
            2 * outside.latency + (world - gpus) / world * size / outside.bandwidth), rel=0.01)
    assert hierarchical.time_s == pytest.approx(
        2 * inside.latency + (gpus - 1) / gpus * size / inside.bandwidth
        + 2 * outside.latency + (hosts - 1) / hosts * size / outside.bandwidth, rel=0.01)


def max_min_finish_times(nbytes, start_s, bandwidth):
    """Directly: flows {(src, dst): bytes} through a non-blocking switch (src's uplink, dst's downlink, each
    `bandwidth`), all moving from `start_s`, rates max-min fair (progressive filling) until each ends."""
    remaining = {pair: float(size) for pair, size in nbytes.items() if size > 0}
    finish, now = {}, start_s
    while remaining:
        rates, capacity = {}, {}
        for src, dst in remaining:
            capacity[("up", src)] = capacity[("down", dst)] = bandwidth
        while len(rates) < len(remaining):
            def unfixed(link):
                return [p for p in remaining if p not in rates and link in (("up", p[0]), ("down", p[1]))]
            share, link = min((capacity[link] / len(unfixed(link)), link) for link in capacity if unfixed(link))
            for pair in unfixed(link):
                rates[pair] = share
                capacity[("up", pair[0])] -= share
                capacity[("down", pair[1])] -= share
        step = min(remaining[pair] / rates[pair] for pair in remaining)
        now += step
        for pair in list(remaining):
            remaining[pair] -= rates[pair] * step
            if remaining[pair] <= 1e-9 * nbytes[pair]:
                finish[pair] = now
                del remaining[pair]
    return finish


@pytest.mark.parametrize("world,seed", [(4, 0), (6, 1)])
def test_uneven_sizes_on_a_switch_match_a_direct_max_min_computation(world, seed):
    counts = uneven_counts(world, seed, high=2000)
    sends = [torch.empty(sum(row), 256, device="meta") for row in counts]
    _, ends = run_simulated("pairwise", counts, sends, build_topology("switch", world, LINK))
    row_bytes = 256 * 4
    finish = max_min_finish_times({(s, d): counts[s][d] * row_bytes for s in range(world) for d in range(world)
                                   if s != d}, 2 * ALPHA, B)
    for rank in range(world):
        mine = [end for (src, dst), end in finish.items() if rank in (src, dst)]
        assert ends[rank] == pytest.approx(max(mine, default=0.0), rel=1e-9)


def test_busbw_is_nccl_tests_alltoall_convention():
    # nccl-tests doc/PERFORMANCE.md: AlltoAll busbw = algbw * (n-1)/n, the size being each rank's whole buffer.
    (row,) = benchmark_all_to_all(build_topology("switch", 8, LINK), "pairwise", [S], numerics=True)
    assert row.wrong == 0 and row.nbytes == S
    assert row.algbw_GBps == pytest.approx(S / row.time_s / 1e9)
    assert row.busbw_GBps == pytest.approx(row.algbw_GBps * 7 / 8)


def cli(*args):
    try:
        main(list(args))
    except SystemExit as exit_:
        return exit_.code
    return 0


def test_collective_op_all_to_all_prints_json_lines(capsys):
    assert cli("collective", "--op", "all_to_all", "--topology", "switch", "--devices", "4", "--bandwidth",
               "100 GB/s", "--latency", "5 us", "--sizes", "1M:2M", "--json") == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(row["op"], row["algorithm"], row["bytes"]) for row in rows] == [
        ("all_to_all", "pairwise", 2**20), ("all_to_all", "pairwise", 2**21)]
    for row in rows:
        assert row["time_s"] == pytest.approx(2 * 5e-6 + 3 / 4 * row["bytes"] / 100e9, rel=1e-9)


@pytest.mark.parametrize("args,expected", [
    (["--algo", "ring"], "--algo: ring is not an all_to_all algorithm"),
    (["--channels", "2"], "--channels"),
])
def test_bad_all_to_all_options_print_one_line_and_exit_2(capsys, args, expected):
    assert cli("collective", "--op", "all_to_all", "--devices", "4", *args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and expected in err


def test_hierarchical_needs_hosts_of_equal_size(tmp_path):
    (tmp_path / "uneven.yaml").write_text(
        "gpus: [a, b, c]\nswitches: [nvswitch, spine]\nlinks:\n"
        "  - {between: [a, nvswitch], bandwidth: 100 GB/s, latency: 1 us}\n"
        "  - {between: [b, nvswitch], bandwidth: 100 GB/s, latency: 1 us}\n"
        + "".join(f"  - {{between: [{gpu}, spine], bandwidth: 10 GB/s, latency: 2 us}}\n" for gpu in "abc"))
    topology = build_topology(str(tmp_path / "uneven.yaml"), 3, LINK)
    with pytest.raises(ScenarioError, match="--algo: hierarchical needs the same number of ranks on every host"):
        list(benchmark_all_to_all(topology, "hierarchical", [S], numerics=False))


def test_the_command_line_names_every_algorithm_the_collectives_have():
    # The CLI names them without importing the collectives (simtrain --help starts without torch).
    from simtrain.cli_collective import ALL_REDUCE_ALGORITHMS, ALL_TO_ALL_ALGORITHMS
    from simtrain.comm import ALGORITHMS
    from simtrain.comm.all_to_all import ALL_TO_ALL

    assert ALL_TO_ALL_ALGORITHMS == tuple(ALL_TO_ALL) and ALL_REDUCE_ALGORITHMS == tuple(ALGORITHMS)
