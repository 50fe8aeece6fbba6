"""Network: flow timings against closed forms, link counters, determinism."""
import networkx as nx
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from simtrain.errors import TopologyError
from simtrain.hw.network import Flow, Network, TransferRecord
from simtrain.hw.topology import Topology


def make_topology(edges, devices=None):
    """edges: (u, v, bandwidth, latency); devices default to every node."""
    graph = nx.Graph()
    for u, v, bandwidth, latency in edges:
        graph.add_edge(u, v, bandwidth=bandwidth, latency=latency)
    return Topology(graph, devices or list(graph.nodes), "test")


def run_flows(topology, flows, record=True):
    """flows: (start_s, src, dst, nbytes); returns (network, their Flows in that order)."""
    env = simpy.Environment()
    net = Network(env, topology, record=record)
    started = [None] * len(flows)

    def start(index):
        _, src, dst, nbytes = flows[index]
        started[index] = net.start_flow(src, dst, nbytes, label=f"{index}")

    for index, spec in enumerate(flows):
        env.timeout(spec[0]).callbacks.append(lambda _event, index=index: start(index))
    env.run()
    return net, started


def test_one_flow_multi_hop():
    topo = make_topology([("a", "b", 100.0, 1e-3), ("b", "c", 40.0, 2e-3), ("c", "d", 80.0, 0.5e-3)])
    net, (flow,) = run_flows(topo, [(0.0, "a", "d", 1000)])
    assert flow.path == ("a", "b", "c", "d")
    assert flow.end == pytest.approx(3.5e-3 + 1000 / 40.0, rel=1e-12)


def test_two_flows_on_one_link_share_it():
    topo = make_topology([("a", "b", 100.0, 0.5)])
    _, flows = run_flows(topo, [(0.0, "a", "b", 1000), (0.0, "a", "b", 1000)])
    for flow in flows:
        assert flow.end == pytest.approx(0.5 + 2 * 1000 / 100.0, rel=1e-12)


def test_opposite_directions_do_not_share():
    topo = make_topology([("a", "b", 100.0, 0.5)])
    _, flows = run_flows(topo, [(0.0, "a", "b", 1000), (0.0, "b", "a", 1000)])
    for flow in flows:
        assert flow.end == pytest.approx(0.5 + 1000 / 100.0, rel=1e-12)


def test_disjoint_links_do_not_slow_each_other():
    topo = make_topology([("a", "b", 100.0, 0.5), ("b", "c", 50.0, 0.25)])
    _, (ab, cb, bc) = run_flows(topo, [(0.0, "a", "b", 1000), (0.0, "c", "b", 1000), (1.0, "b", "c", 500)])
    assert ab.end == pytest.approx(0.5 + 1000 / 100.0, rel=1e-12)
    assert cb.end == pytest.approx(0.25 + 1000 / 50.0, rel=1e-12)
    assert bc.end == pytest.approx(1.0 + 0.25 + 500 / 50.0, rel=1e-12)


def test_flow_joining_mid_flight():
    # A alone from L to t1+L, then both at B/2 until A ends, then B alone.
    bandwidth, size, latency, t1 = 100.0, 1000, 1.0, 4.0
    topo = make_topology([("a", "b", bandwidth, latency)])
    _, (first, second) = run_flows(topo, [(0.0, "a", "b", size), (t1, "a", "b", size)])
    first_end = t1 + latency + 2 * (size - bandwidth * t1) / bandwidth
    assert first.end == pytest.approx(first_end, rel=1e-12)  # 17
    assert second.end == pytest.approx(first_end + t1, rel=1e-12)  # 21: B*t1 bytes left at full rate


def test_max_min_fairness_unequal_rates():
    # Line a-b-c: a->b link 10 B/s, b->c link 4 B/s, no latency.
    # f1 a->c and f2 b->c share b->c: 2 B/s each (bottleneck); f3 a->b gets the
    # leftover of a->b: 10 - 2 = 8 B/s. f1 (4 B) ends at 2; then f2 runs at 4 and
    # f3 at 10: f2 has 12 - 4 = 8 B left -> ends 4; f3 has 40 - 16 = 24 B left -> 4.4.
    topo = make_topology([("a", "b", 10.0, 0.0), ("b", "c", 4.0, 0.0)])
    env = simpy.Environment()
    net = Network(env, topo)
    f1 = net.start_flow("a", "c", 4)
    f2 = net.start_flow("b", "c", 12)
    f3 = net.start_flow("a", "b", 40)
    env.run(until=1.0)
    assert (f1.rate, f2.rate, f3.rate) == (pytest.approx(2.0), pytest.approx(2.0), pytest.approx(8.0))
    env.run()
    assert f1.end == pytest.approx(2.0, rel=1e-12)
    assert f2.end == pytest.approx(4.0, rel=1e-12)
    assert f3.end == pytest.approx(4.4, rel=1e-12)


def test_zero_bytes_completes_after_latency_without_using_links():
    topo = make_topology([("a", "b", 100.0, 1e-3), ("b", "c", 100.0, 2e-3)])
    net, (flow,) = run_flows(topo, [(0.0, "a", "c", 0)])
    assert flow.end == pytest.approx(3e-3, rel=1e-12)
    assert all(stat["bytes"] == 0 and stat["busy_s"] == 0.0 for stat in net.link_stats())


def test_local_transfer_completes_through_the_event_loop():
    topo = make_topology([("a", "b", 100.0, 1e-3)])
    env = simpy.Environment()
    net = Network(env, topo)
    seen = []
    env.run(until=2.0)
    flow = net.start_flow("a", "a", 10**9, on_done=lambda f: seen.append((env.now, f)))
    assert flow.end is None and seen == []  # never completed synchronously
    env.run()
    assert seen == [(2.0, flow)] and flow.end == 2.0


def test_transfer_event_and_chained_on_done():
    topo = make_topology([("a", "b", 100.0, 0.5)])
    env = simpy.Environment()
    net = Network(env, topo)
    results = []

    def process():
        flow = yield net.transfer("a", "b", 100, label="x")
        results.append((env.now, flow))

    def chain(flow):  # on_done may start new flows
        if flow.end < 5:
            net.start_flow("b", "a", 100, on_done=chain)

    env.process(process())
    net.start_flow("b", "a", 100, on_done=chain)
    env.run()
    (now, flow), = results
    assert isinstance(flow, Flow) and flow.label == "x" and now == flow.end == pytest.approx(1.5)
    assert [r.end for r in net.records if r.src == "b"] == pytest.approx([1.5, 3.0, 4.5, 6.0])


def test_link_stats_and_records():
    topo = make_topology([("a", "b", 100.0, 0.0), ("b", "c", 100.0, 0.0)])
    env = simpy.Environment()
    net = Network(env, topo)
    net.start_flow("a", "b", 1000, label="first")  # busy 0..10
    env.run(until=15.0)
    net.start_flow("a", "b", 500, label="second")  # busy 15..20, a gap of 5 s
    env.run(until=17.0)
    ab = net.link_stats()[0]
    assert (ab["src"], ab["dst"], ab["bytes"]) == ("a", "b", 1000)
    assert ab["busy_s"] == pytest.approx(12.0)  # ongoing busy period counts up to now
    env.run()
    stats = net.link_stats()
    assert [(s["src"], s["dst"]) for s in stats] == [("a", "b"), ("b", "a"), ("b", "c"), ("c", "b")]
    assert stats[0]["bytes"] == 1500 and stats[0]["busy_s"] == pytest.approx(15.0)
    assert all(s["bytes"] == 0 and s["busy_s"] == 0.0 for s in stats[1:])
    assert net.records == [
        TransferRecord("a", "b", "first", 0.0, 10.0, 1000, ("a", "b")),
        TransferRecord("a", "b", "second", 15.0, 20.0, 500, ("a", "b")),
    ]
    assert net.records[1].label == "second"


def test_record_false_keeps_no_records_but_counts_links():
    topo = make_topology([("a", "b", 100.0, 0.0)])
    net, _ = run_flows(topo, [(0.0, "a", "b", 1000)], record=False)
    assert net.records == []
    assert net.link_stats()[0]["bytes"] == 1000


def test_bad_requests():
    topo = make_topology([("a", "b", 100.0, 0.0)])
    net = Network(simpy.Environment(), topo)
    with pytest.raises(TopologyError):
        net.start_flow("a", "nowhere", 10)
    with pytest.raises(TopologyError):
        net.start_flow("nowhere", "nowhere", 10)
    with pytest.raises(ValueError):
        net.start_flow("a", "b", -1)


@st.composite
def scenarios(draw):
    n = draw(st.integers(2, 5))
    nodes = [f"n{i}" for i in range(n)]
    edges = {}
    for i in range(1, n):  # a random spanning tree, then extra edges
        edges[nodes[draw(st.integers(0, i - 1))], nodes[i]] = None
    for _ in range(draw(st.integers(0, 3))):
        i, j = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
        if i != j and (nodes[j], nodes[i]) not in edges:
            edges[nodes[i], nodes[j]] = None
    links = [
        (u, v, float(draw(st.integers(1, 100))), draw(st.sampled_from([0.0, 0.25, 1.0])))
        for u, v in edges
    ]
    flows = draw(
        st.lists(
            st.tuples(
                st.sampled_from([0.0, 0.5, 1.0, 3.7]),
                st.sampled_from(nodes),
                st.sampled_from(nodes),
                st.integers(0, 1000),
            ),
            min_size=1,
            max_size=12,
        )
    )
    return links, flows


def reference_ends(topology, flows):
    """Completion times from a plain fluid simulation that recomputes global
    max-min rates (progressive filling) at every event."""
    pending = []  # [activation time, directed links, bytes left, index, bytes]
    for index, (start, src, dst, nbytes) in enumerate(flows):
        path = topology.path(src, dst)
        hops = list(zip(path, path[1:]))
        latency = sum(topology.link(a, b)["latency"] for a, b in hops)
        pending.append([start + latency, hops if nbytes else [], float(nbytes), index, nbytes])
    ends = [None] * len(flows)
    active, now = [], 0.0
    while pending or active:
        arrivals = [f for f in pending if f[0] <= now]
        pending = [f for f in pending if f[0] > now]
        for flow in arrivals:
            if flow[1]:
                active.append(flow)
            else:
                ends[flow[3]] = now
        if not active:
            if pending:
                now = min(f[0] for f in pending)
            continue
        rates, cap = {}, {}
        while len(rates) < len(active):  # progressive filling over all links
            users = {}
            for flow in active:
                if flow[3] not in rates:
                    for a, b in flow[1]:
                        users.setdefault((a, b), []).append(flow)
            share, link = min((cap.get(l, topology.link(*l)["bandwidth"]) / len(u), l) for l, u in users.items())
            for flow in users[link]:
                rates[flow[3]] = share
                for hop in flow[1]:
                    cap[hop] = cap.get(hop, topology.link(*hop)["bandwidth"]) - share
        step = min([f[2] / rates[f[3]] for f in active] + [f[0] - now for f in pending])
        for flow in active:
            flow[2] -= rates[flow[3]] * step
        now += step
        for flow in active:
            if flow[2] <= 1e-9 * flow[4]:
                ends[flow[3]] = now
        active = [f for f in active if ends[f[3]] is None]
    return ends


@settings(max_examples=150, deadline=None, derandomize=True)
@given(scenarios())
def test_random_flows_respect_capacity_and_are_deterministic(scenario):
    links, flows = scenario
    topo = make_topology(links)
    net, started = run_flows(topo, flows)
    for (start, src, dst, nbytes), flow in zip(flows, started):
        path = topo.path(src, dst)
        hops = [topo.link(a, b) for a, b in zip(path, path[1:])]
        latency = sum(h["latency"] for h in hops)
        transfer = nbytes / min(h["bandwidth"] for h in hops) if hops and nbytes else 0.0
        assert flow.end >= start + (latency + transfer) * (1 - 1e-9)
    bandwidth = {}
    for u, v, bw, _ in links:
        bandwidth[u, v] = bandwidth[v, u] = bw
    for stat in net.link_stats():
        if stat["bytes"]:
            assert stat["bytes"] / stat["busy_s"] <= bandwidth[stat["src"], stat["dst"]] * (1 + 1e-9)
    assert len(net.records) == len(flows)
    assert [flow.end for flow in started] == pytest.approx(reference_ends(topo, flows), rel=1e-7, abs=1e-9)
    again, _ = run_flows(topo, flows)
    assert again.records == net.records
    assert again.link_stats() == net.link_stats()


def test_a_route_names_its_path_links_bottleneck_and_latency():
    topo = make_topology([("a", "b", 100.0, 1e-3), ("b", "c", 40.0, 2e-3), ("c", "d", 80.0, 0.5e-3)])
    route = Network(simpy.Environment(), topo).route("a", "d")
    assert route.path == ("a", "b", "c", "d") and len(route.links) == 3
    assert route.bandwidth_Bps == 40.0 and route.latency_s == pytest.approx(3.5e-3, rel=1e-15)


def test_at_calls_back_at_exactly_the_time_asked():
    env = simpy.Environment()
    net = Network(env, make_topology([("a", "b", 100.0, 0.0)]))
    env.run(until=0.2)
    seen = []
    net.at(0.9, lambda: seen.append(net.now))
    env.timeout(0.9 - 0.2).callbacks.append(lambda _: seen.append(env.now))  # a delay: lands off 0.9
    env.run()
    assert seen == [0.2 + (0.9 - 0.2), 0.9] and seen[0] != 0.9


def test_ring_gives_the_routes_of_a_ring_whose_routes_share_no_link():
    from simtrain.hw.topology_builders import LinkClass, build_topology

    ring = build_topology("ring", 6, LinkClass(50e9, 1e-6))
    net = Network(simpy.Environment(), ring)
    routes = net.ring(ring.devices)
    nodes = ring.devices
    assert [route.path for route in routes] == [(nodes[i], nodes[(i + 1) % 6]) for i in range(6)]
    # An order that skips round the ring sends over links that its other sends use too; a rank twice on
    # one node sends over no link: neither is timed as a group.
    assert net.ring([nodes[i] for i in (0, 3, 1, 4, 2, 5)]) is None
    assert net.ring([nodes[0], nodes[0]]) is None
    switch = build_topology("switch", 4, LinkClass(50e9, 1e-6))
    assert all(len(route.path) == 3 for route in Network(simpy.Environment(), switch).ring(switch.devices))


def test_time_ring_on_an_idle_ring_equals_the_closed_form():
    """N ranks posting at 0, N equal chunks of c bytes: 2(N-1) steps of latency plus c / B each, on
    every link the ring uses c bytes per step; every transfer recorded."""
    from simtrain.hw.topology_builders import LinkClass, build_topology

    world, chunk, bandwidth, latency = 5, 4096, 50e9, 1e-6
    ring = build_topology("ring", world, LinkClass(bandwidth, latency))
    env = simpy.Environment()
    net = Network(env, ring)
    routes = net.ring(ring.devices)
    times = net.time_ring(routes, [0.0] * world, [chunk] * world, ["all_reduce"] * world)
    steps = 2 * (world - 1)
    assert times.end == pytest.approx([steps * (latency + chunk / bandwidth)] * world, rel=1e-12)
    used = {(route.path[0], route.path[1]) for route in routes}
    for stat in net.link_stats():
        crossed = (stat["src"], stat["dst"]) in used
        assert stat["bytes"] == (steps * chunk if crossed else 0)
        assert stat["busy_s"] == pytest.approx(steps * chunk / bandwidth if crossed else 0.0, rel=1e-12)
    assert len(net.records) == world * steps and {record.label for record in net.records} == {"all_reduce"}
