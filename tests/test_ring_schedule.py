"""The ring all-reduce, and a ring reduce-scatter or all-gather alone, timed as a group (comm/ring_schedule.py)
against the flow-by-flow path.

Many small random cases: ring orders, topologies, link figures, buffer sizes (fewer elements
than ranks too), ranks posting at different times and two all-reduces back to back. The
group-timed path must give what moving every transfer through the network gives: each rank's
end times, its communication spans, the bytes by label, every link's bytes and busy time, the
transfer records and the staging peaks on the ledgers.
"""
import random

import pytest
import simpy
import torch

import simtrain
from simtrain.hw.cluster import build_cluster, run_to_end
from simtrain.job import Job
from simtrain.runner import single_thread
from simtrain.comm.ring_schedule import RingAllReduce, RingPhase
from simtrain.comm.group_rings import GROUP_MAX_CHUNK
from simtrain.comm.simulated import SimCommunicator
from simtrain.hw.device import MemoryLedger
from simtrain.hw.eventlog import EventLog
from simtrain.hw.network import Network
from simtrain.hw.topology_builders import LinkClass, build_topology


def random_case(rng: random.Random):
    world = rng.randint(2, 9)
    link = LinkClass(rng.choice([10e9, 50e9, 300e9]), rng.choice([0.0, 1e-6, 5e-6]), rng.choice([1.0, 0.8]))
    topology = rng.choice(["ring", "switch", "fully_connected", "hierarchical"])
    if topology == "hierarchical":
        world = 2 * rng.randint(1, 4)
        built = build_topology("hierarchical", world, link, inter_link=LinkClass(25e9, 5e-6, 0.96), gpus_per_node=2)
    else:
        built = build_topology(topology, world, link)
    order = list(range(world))
    if rng.random() < 0.5:
        rng.shuffle(order)
    collectives = [[rng.choice([0.0, 0.0, rng.uniform(0, 2e-5)]) for _ in range(world)],
                   [rng.uniform(0, 1e-5) for _ in range(world)]]  # post times, then gaps before the second
    sizes = [rng.choice([1, world - 1, rng.randint(1, 5000), rng.randint(1, 10**6)]) for _ in collectives]
    dtype = rng.choice([None, None, torch.float32, torch.float16, torch.bfloat16])  # None: meta (numerics off)
    return built, order, collectives, sizes, dtype


def simulate(topology, order, collectives, sizes, dtype, exclusive: bool, kind: str = "all_reduce",
             rows: bool = False):
    """The collectives on the topology; with `rows`, each one's buffers are rows of one tensor (spaced wider than
    they are, as a job's gradient buckets are: train/replica.py's share_gradient_rows)."""
    env = simpy.Environment()
    network = Network(env, topology, record=True)
    log = EventLog()
    ledgers = [MemoryLedger(f"gpu{rank}", 1 << 40) for rank in range(len(topology.devices))]
    comm = SimCommunicator(network, topology.devices, log=log, ledgers=ledgers, exclusive=exclusive)
    world, ends, results = len(order), [], []
    timed = count_group_timings(network)

    def rank_process(rank):
        for index, (delays, numel) in enumerate(zip(collectives, sizes)):
            yield env.timeout(delays[rank])
            if dtype is None:
                buffer = torch.empty(numel, device="meta")
            else:
                generator = torch.Generator().manual_seed(1000 * index + rank)
                buffer = torch.randn(numel, generator=generator).to(dtype)
                if rows:
                    buffer = joint[index][rank, 1:numel + 1].copy_(buffer)
            ring = None if order == sorted(order) else order
            program = (RingAllReduce(rank, world, buffer, index == 0, ring=ring) if kind == "all_reduce"
                       else RingPhase(kind, rank, tuple(order), buffer))
            yield comm.run(rank, program, label=kind)
            ends.append((rank, env.now))
            results.append((rank, index, buffer))

    joint = [torch.zeros(world, numel + 2, dtype=dtype) for numel in sizes] if rows else None
    for rank in range(world):
        env.process(rank_process(rank))
    env.run()
    assert not comm.stuck()
    return {
        "timed_as_group": timed,
        "ends": sorted(ends),
        "spans": sorted(log.spans),
        "totals": sorted(log.totals.items()),
        "bytes_by_label": comm.bytes_by_label,
        "links": network.link_stats(),
        "records": sorted(network.records),
        "staging": [ledger.peak_breakdown.get("comm_buffers", 0) for ledger in ledgers],
        "sums": [buffer for _, _, buffer in sorted(results, key=lambda result: result[:2])],
    }


def count_group_timings(network: Network) -> list:
    """A list that gets one entry each time `network` times a ring as a group (a spy on its public method)."""
    timed, time_ring = [], network.time_ring
    network.time_ring = lambda *args: timed.append(1) or time_ring(*args)
    return timed


@pytest.mark.parametrize("seed", range(60))
def test_group_timing_equals_flow_by_flow(seed):
    case = random_case(random.Random(seed))
    rows = seed % 2 == 0 and case[-1] is not None  # half the real-tensor cases sum a job's rows where they lie
    flows = simulate(*case, exclusive=False, rows=rows)
    grouped = simulate(*case, exclusive=True, rows=rows)
    topology, order, sizes, dtype = case[0], case[1], case[3], case[4]
    assert not flows["timed_as_group"]
    eligible = [dtype is None or size <= GROUP_MAX_CHUNK * len(order) for size in sizes]
    if order == sorted(order) and not topology.name.startswith("hierarchical"):
        # a ring in rank order on these topologies shares no link: timed as a group when its chunks are small
        assert len(grouped["timed_as_group"]) == sum(eligible)
    for key in ("spans", "bytes_by_label", "records", "staging"):
        assert grouped[key] == flows[key], key
    if case[-1] is not None:  # the sums, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(grouped["sums"], flows["sums"]))
    for key in ("ends", "totals", "links"):  # the same floating-point operations: exact, checked to 1e-9
        assert flat(grouped[key]) == pytest.approx(flat(flows[key]), rel=1e-9, abs=0), key


@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather"])
@pytest.mark.parametrize("seed", range(30))
def test_a_reduce_scatter_or_all_gather_alone_timed_as_a_group_equals_flow_by_flow(kind, seed):
    """Their N-1 steps of the ring's schedule, the all-gather's chunks one further round, staging only where
    the reduce-scatter sums: the same as flow by flow, on meta tensors (numerics off)."""
    topology, order, collectives, sizes, _ = random_case(random.Random(seed))
    case = (topology, order, collectives, sizes, None)
    flows = simulate(*case, exclusive=False, kind=kind)
    grouped = simulate(*case, exclusive=True, kind=kind)
    if order == sorted(order) and not topology.name.startswith("hierarchical"):
        assert len(grouped["timed_as_group"]) == 2
    for key in ("spans", "bytes_by_label", "records", "staging"):
        assert grouped[key] == flows[key], key
    for key in ("ends", "totals", "links"):
        assert flat(grouped[key]) == pytest.approx(flat(flows[key]), rel=1e-9, abs=0), key


@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather"])
def test_a_reduce_scatter_or_all_gather_of_numbers_moves_flow_by_flow(kind):
    """On real tensors only an all-reduce's sums are done for the group: a reduce-scatter's or all-gather's
    numbers move chunk by chunk, and come out as they do alone."""
    topology, order = build_topology("ring", 4, LinkClass(50e9, 1e-6)), [0, 1, 2, 3]
    case = (topology, order, [[0.0] * 4, [0.0] * 4], [4096, 1000], torch.float32)
    grouped = simulate(*case, exclusive=True, kind=kind)
    flows = simulate(*case, exclusive=False, kind=kind)
    assert grouped["timed_as_group"] == []
    assert all(torch.equal(a, b) for a, b in zip(grouped["sums"], flows["sums"]))


def flat(value) -> list:
    """Every number in a nest of lists, tuples and dicts, in order (dict keys included, as numbers)."""
    if isinstance(value, dict):
        return [number for key, item in value.items() for number in flat(key) + flat(item)]
    if isinstance(value, (list, tuple)):
        return [number for item in value for number in flat(item)]
    return [value] if isinstance(value, (int, float)) else [hash(value)]


def test_rings_that_share_a_link_move_flow_by_flow():
    # On a ring topology, a ring order that skips around sends over links its other sends use too.
    topology, order = build_topology("ring", 6, LinkClass(50e9, 1e-6)), [0, 3, 1, 4, 2, 5]
    grouped = simulate(topology, order, [[0.0] * 6, [0.0] * 6], [4096, 4096], None, exclusive=True)
    assert grouped["timed_as_group"] == []
    flows = simulate(topology, order, [[0.0] * 6, [0.0] * 6], [4096, 4096], None, exclusive=False)
    assert {key: value for key, value in grouped.items() if key != "sums"} == {
        key: value for key, value in flows.items() if key != "sums"}


def run_job(scenario, alone: bool):
    """The scenario's job on its cluster, as the runner runs it; `alone` lets it time rings as a group."""
    with single_thread():
        cluster = build_cluster(scenario.cluster, scenario.base_dir, record=True, seed=scenario.seed)
        job = Job(scenario, cluster, range(cluster.size), numerics=scenario.numerics, alone=alone)
        job.start()
        run_to_end(cluster.env)
        job.finish()
    return cluster, job


@pytest.mark.parametrize("numerics", [True, False])
def test_a_job_alone_times_its_ring_all_reduces_as_a_group(numerics, monkeypatch):
    """Bucketed all-reduces overlapping the backward: the same run either way, to the bit."""
    timed, time_ring = [], Network.time_ring
    monkeypatch.setattr(Network, "time_ring", lambda *args: timed.append(1) or time_ring(*args))
    scenario = simtrain.load_scenario("scenarios/compute_vs_comm.yaml", [
        "train.steps=3", "data.samples=2048", "model.hidden=[128,128,128,128]", "parallel.bucket_cap_mb=0.05",
        f"numerics={str(numerics).lower()}"])
    flows, flow_job = run_job(scenario, alone=False)
    assert not timed
    grouped, grouped_job = run_job(scenario, alone=True)
    buckets = grouped_job.scheme.report_sections()["parallel"]["buckets"]
    assert buckets > 1 and len(timed) == 3 * buckets  # every bucket, every step
    assert grouped.log.last_end_s == flows.log.last_end_s
    assert sorted(grouped.log.totals.items()) == sorted(flows.log.totals.items())
    assert sorted(grouped.log.spans) == sorted(flows.log.spans)
    assert grouped.network.link_stats() == flows.network.link_stats()
    for a, b in zip(grouped.devices, flows.devices):
        assert a.memory.peak_breakdown == b.memory.peak_breakdown
    if numerics:
        for a, b in zip(grouped_job.scheme.final_models(), flow_job.scheme.final_models()):
            assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("world", [2, 3, 8, 33])
@pytest.mark.parametrize("chunk", [0, 1, 4096, 12345])
def test_a_ring_of_alike_positions_is_timed_in_lockstep_to_the_bit(world, chunk):
    """One position's scalar recurrence (O(N) work) gives what every position's does (O(N^2)): the same numbers."""
    from simtrain.hw.ring_timing import RingTimes, lockstep_ring_times, ring_times_by_position

    post, latency, rate, busy = 1.0 / 3, 5e-6 / 7, 50e9 / 3, 2.0 / 7
    for steps, reducing in ((None, None), (world - 1, world - 1), (world - 1, 0)):  # all-reduce, its phases alone
        same = lockstep_ring_times(world, post, latency, rate, chunk, busy, steps, reducing)
        every = ring_times_by_position([post] * world, [latency] * world, [rate] * world, [chunk] * world,
                                       [busy] * world, False, steps, reducing)
        for field in RingTimes._fields:  # the same numbers, of the same Python types
            assert getattr(same, field) == getattr(every, field), field
            assert list(map(type, getattr(same, field))) == list(map(type, getattr(every, field))), field


def test_a_small_ring_timed_in_python_floats_equals_numpy_to_the_bit():
    """ring_times_in_scalars (small rings) against ring_times_by_position (numpy) on random rings: uneven
    chunks, empty ones, ranks posting apart (spans that close at gaps), links busy before, transfers kept."""
    from simtrain.hw.ring_timing import ring_times_by_position, ring_times_in_scalars

    for seed in range(300):
        rng = random.Random(seed)
        world = rng.randint(2, 12)
        posts = [rng.choice([0.0, rng.uniform(0, 1e-4), 1.0 / 3]) for _ in range(world)]
        latency = [rng.choice([0.0, 5e-6, rng.uniform(0, 1e-5)]) for _ in range(world)]
        rate = [rng.choice([50e9, 1e9 / 3, rng.uniform(1e8, 1e11)]) for _ in range(world)]
        numel, element = rng.choice([0, 1, world - 1, rng.randint(1, 10**6)]), rng.choice([1, 2, 4])
        chunk = [(numel // world + (position < numel % world)) * element for position in range(world)]
        busy = [rng.choice([0.0, rng.uniform(0, 1)]) for _ in range(world)]
        keep = rng.random() < 0.5
        steps, reducing = rng.choice([(None, None), (world - 1, world - 1), (world - 1, 0)])  # or a phase alone
        scalars = ring_times_in_scalars(posts, latency, rate, chunk, busy, keep, steps, reducing)
        vectors = ring_times_by_position(posts, latency, rate, chunk, busy, keep, steps, reducing)
        for field in ("end", "link_busy_s", "sent_bytes"):  # the same numbers, of the same Python types
            assert getattr(scalars, field) == getattr(vectors, field), (seed, field)
            assert list(map(type, getattr(scalars, field))) == list(map(type, getattr(vectors, field))), (seed, field)
        for field in ("spans", "staging", "transfers"):  # in the same order, with the same Python types
            assert getattr(scalars, field) == getattr(vectors, field), (seed, field)
            assert [list(map(type, row)) for row in getattr(scalars, field)] == [
                list(map(type, row)) for row in getattr(vectors, field)], (seed, field)
