"""Collectives: uncontended closed forms, numerics against torch, staging memory, deadlocks."""
import math

import pytest
import simpy
import torch

from simtrain.comm import ALL_REDUCE
from simtrain.comm.bench import benchmark_all_reduce
from simtrain.comm.ops import Recv, Send
from simtrain.comm.simulated import SimCommunicator
from simtrain.errors import CollectiveMismatch
from simtrain.hw.device import MemoryLedger
from simtrain.hw.eventlog import EventLog
from simtrain.hw.network import Network
from simtrain.hw.topology_builders import LinkClass, build_topology

ALPHA, B = 5e-6, 100e9
LINK = LinkClass(bandwidth=B, latency=ALPHA)
S = 64 * 2**20  # bytes


def simulated_time(topology_kind, algorithm, world, nbytes):
    topology = build_topology(topology_kind, world, LINK)
    (row,) = benchmark_all_reduce(topology, algorithm, [nbytes], numerics=False)
    return row.time_s


@pytest.mark.parametrize("world", [2, 4, 7, 16])
def test_ring_on_ring_matches_closed_form(world):
    expected = 2 * (world - 1) * (ALPHA + S / (world * B))
    assert simulated_time("ring", "ring", world, S) == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("world", [2, 3, 5, 8, 13])
def test_tree_on_fully_connected_matches_closed_form(world):
    expected = 2 * math.floor(math.log2(world)) * (ALPHA + S / B)
    assert simulated_time("fully_connected", "tree", world, S) == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("world", [2, 4, 9])
def test_naive_on_switch_is_bound_by_the_root_port(world):
    # Each phase: N-1 whole buffers through the root's port, after two hops of latency.
    expected = 2 * ((world - 1) * S / B + 2 * ALPHA)
    assert simulated_time("switch", "naive", world, S) == pytest.approx(expected, rel=0.01)


def test_ring_chunks_that_do_not_divide_are_timed_by_the_largest():
    world, numel = 4, 1001  # chunks of 251, 250, 250, 250 floats
    expected = 2 * (world - 1) * (ALPHA + 251 * 4 / B)
    assert simulated_time("ring", "ring", world, numel * 4) == pytest.approx(expected, rel=1e-9)


def run_simulated(algorithm, inputs, topology_kind="ring", average=False, ledgers=None):
    world = len(inputs)
    env = simpy.Environment()
    network = Network(env, build_topology(topology_kind, world, LINK))
    log = EventLog()
    comm = SimCommunicator(network, [f"gpu{r}" for r in range(world)], log=log, ledgers=ledgers)
    buffers = [t.clone() for t in inputs]
    for rank in range(world):
        comm.run(rank, ALL_REDUCE[algorithm](rank, world, buffers[rank], average=average))
    env.run()
    assert comm.stuck() == []
    return buffers, env.now, log


def seeded_inputs(world, numel, seed=0):
    return [torch.randn(numel, generator=torch.Generator().manual_seed(seed * 100 + r)) for r in range(world)]


@pytest.mark.parametrize("algorithm", sorted(ALL_REDUCE))
@pytest.mark.parametrize("world,numel", [(1, 10), (2, 7), (3, 1001), (5, 3), (8, 4096)])
def test_all_reduce_sums_like_torch_and_ranks_agree_bitwise(algorithm, world, numel):
    inputs = seeded_inputs(world, numel)
    expected = torch.stack(inputs).sum(dim=0)
    outputs, _, _ = run_simulated(algorithm, inputs)
    for out in outputs:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(out, outputs[0])


@pytest.mark.parametrize("algorithm", sorted(ALL_REDUCE))
def test_mean_divides_by_world(algorithm):
    inputs = seeded_inputs(6, 333, seed=3)
    outputs, _, _ = run_simulated(algorithm, inputs, average=True)
    torch.testing.assert_close(outputs[2], torch.stack(inputs).mean(dim=0), rtol=1e-5, atol=1e-6)


def test_the_three_algorithms_agree():
    inputs = seeded_inputs(7, 5000, seed=1)
    results = {a: run_simulated(a, inputs, average=True)[0][0] for a in ALL_REDUCE}
    torch.testing.assert_close(results["ring"], results["naive"], rtol=0, atol=1e-5)
    torch.testing.assert_close(results["tree"], results["naive"], rtol=0, atol=1e-5)


def test_reducing_receives_are_staged_in_comm_buffers():
    world, numel = 4, 1000
    ledgers = [MemoryLedger(f"rank {r}", 1e12) for r in range(world)]
    run_simulated("ring", seeded_inputs(world, numel), ledgers=ledgers)
    # Ring reduce-scatter lands one chunk (numel / world floats) at a time.
    assert [ledger.peak["comm_buffers"] for ledger in ledgers] == [numel // world * 4] * world
    assert all(ledger.current["comm_buffers"] == 0 for ledger in ledgers)
    ledgers = [MemoryLedger(f"rank {r}", 1e12) for r in range(world)]
    run_simulated("naive", seeded_inputs(world, numel), topology_kind="switch", ledgers=ledgers)
    # The naive root holds the N-1 incoming buffers at once.
    assert ledgers[0].peak["comm_buffers"] == (world - 1) * numel * 4


def test_communication_time_is_logged_per_rank_as_one_span_when_nobody_waits():
    _, elapsed, log = run_simulated("ring", seeded_inputs(4, 4000))
    for rank in range(4):
        spans = [s for s in log.spans if s.rank == rank]
        assert len(spans) == 1 and spans[0].kind == "communication"
        assert spans[0].end - spans[0].start == pytest.approx(elapsed)
        assert spans[0].nbytes == 2 * 3 * 1000 * 4  # 2(N-1) chunks of 1000 floats sent


def test_a_late_rank_makes_the_others_wait_and_that_wait_is_not_communication():
    world, delay = 4, 1e-3
    env = simpy.Environment()
    network = Network(env, build_topology("ring", world, LINK))
    log = EventLog()
    comm = SimCommunicator(network, [f"gpu{r}" for r in range(world)], log=log)
    buffers = seeded_inputs(world, 4000)

    def late_start(rank):
        yield env.timeout(delay if rank == 3 else 0.0)
        yield comm.run(rank, ALL_REDUCE["ring"](rank, world, buffers[rank]))

    for rank in range(world):
        env.process(late_start(rank))
    env.run()
    alone = run_simulated("ring", seeded_inputs(world, 4000))[1]
    assert env.now == pytest.approx(delay + alone, rel=1e-9)
    assert log.total(3, "communication") == pytest.approx(alone, rel=1e-9)
    assert log.total(0, "communication") < env.now - delay * 0.99


def test_a_missing_peer_is_reported_as_stuck():
    env = simpy.Environment()
    network = Network(env, build_topology("ring", 2, LINK))
    comm = SimCommunicator(network, ["gpu0", "gpu1"])

    def waits_forever(rank):
        yield Recv(1 - rank, torch.zeros(3))

    comm.run(0, waits_forever(0))
    env.run()
    assert comm.stuck() == [0]


def test_mismatched_sizes_are_a_program_bug():
    env = simpy.Environment()
    comm = SimCommunicator(Network(env, build_topology("ring", 2, LINK)), ["gpu0", "gpu1"])

    def sender():
        yield Send(1, torch.zeros(4))

    def receiver():
        yield Recv(0, torch.zeros(5))

    comm.run(0, sender())
    with pytest.raises(CollectiveMismatch, match=r"rank 0 sends 16 B to rank 1 \(tag 0\), which receives 20 B"):
        comm.run(1, receiver())


def test_benchmark_checks_numerics_and_reports_busbw():
    topology = build_topology("ring", 4, LINK)
    rows = list(benchmark_all_reduce(topology, "ring", [1024, 1 << 20], numerics=True))
    assert [row.wrong for row in rows] == [0, 0]
    big = rows[1]
    assert big.algbw_GBps == pytest.approx(big.nbytes / big.time_s / 1e9)
    assert big.busbw_GBps == pytest.approx(big.algbw_GBps * 2 * 3 / 4)
