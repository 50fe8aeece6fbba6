"""The ring all-reduce timed as a group (comm/ring_schedule.py) against the flow-by-flow path.

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
from simtrain.comm.ring_schedule import RingAllReduce, ring_times
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
    return built, order, collectives, sizes


def simulate(topology, order, collectives, sizes, exclusive: bool):
    env = simpy.Environment()
    network = Network(env, topology, record=True)
    log = EventLog()
    ledgers = [MemoryLedger(f"gpu{rank}", 1 << 40) for rank in range(len(topology.devices))]
    comm = SimCommunicator(network, topology.devices, log=log, ledgers=ledgers, exclusive=exclusive)
    world, ends = len(order), []

    def rank_process(rank):
        for (delays, numel) in zip(collectives, sizes):
            yield env.timeout(delays[rank])
            buffer = torch.empty(numel, device="meta")
            ring = None if order == sorted(order) else order
            yield comm.run(rank, RingAllReduce(rank, world, buffer, True, ring=ring), label="all_reduce")
            ends.append((rank, env.now))

    for rank in range(world):
        env.process(rank_process(rank))
    env.run()
    assert not comm.stuck()
    return {
        "ends": sorted(ends),
        "spans": sorted(log.spans),
        "totals": sorted(log.totals.items()),
        "bytes_by_label": comm.bytes_by_label,
        "links": network.link_stats(),
        "records": sorted(network.records),
        "staging": [ledger.peak_breakdown.get("comm_buffers", 0) for ledger in ledgers],
    }, comm


@pytest.mark.parametrize("seed", range(60))
def test_group_timing_equals_flow_by_flow(seed):
    case = random_case(random.Random(seed))
    flows, _ = simulate(*case, exclusive=False)
    grouped, comm = simulate(*case, exclusive=True)
    topology, order = case[0], case[1]
    if order == sorted(order) and not topology.name.startswith("hierarchical"):
        assert comm._ring_routes[tuple(order)] is not None  # a ring in rank order: timed as a group
    for key in ("spans", "bytes_by_label", "records", "staging"):
        assert grouped[key] == flows[key], key
    for key in ("ends", "totals", "links"):  # the same floating-point operations: exact, checked to 1e-9
        assert flat(grouped[key]) == pytest.approx(flat(flows[key]), rel=1e-9, abs=0), key


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
    grouped, comm = simulate(topology, order, [[0.0] * 6, [0.0] * 6], [4096, 4096], exclusive=True)
    assert list(comm._ring_routes.values()) == [None]
    assert grouped == simulate(topology, order, [[0.0] * 6, [0.0] * 6], [4096, 4096], exclusive=False)[0]


def test_a_job_alone_times_its_ring_all_reduces_as_a_group(monkeypatch):
    """Numerics off, the job's bucketed all-reduces are timed as a group; numerics on, flow by flow."""
    import simtrain.comm.simulated as simulated
    timed = []
    monkeypatch.setattr(simulated, "ring_times", lambda *args, **kw: timed.append(1) or ring_times(*args, **kw))
    overrides = ["train.steps=3", "report.trace=false", "data.samples=2048", "model.hidden=[512,512,512,512]",
                 "parallel.bucket_cap_mb=1"]
    on = simtrain.run(simtrain.load_scenario("scenarios/compute_vs_comm.yaml", overrides)).data
    assert not timed
    off = simtrain.run(simtrain.load_scenario("scenarios/compute_vs_comm.yaml", [*overrides, "numerics=false"])).data
    assert len(timed) == 3 * off["parallel"]["buckets"] > 3
    assert off["step_time_s"] == pytest.approx(on["step_time_s"], rel=1e-12)
    assert off["breakdown_s"] == pytest.approx(on["breakdown_s"], rel=1e-9)
    for device_off, device_on in zip(off["devices"], on["devices"]):
        assert device_off["peak_memory_bytes_by_category"] == device_on["peak_memory_bytes_by_category"]
    assert flat(off["links"]) == pytest.approx(flat(on["links"]), rel=1e-12)
