"""Network: flow-level transfers with max-min fair bandwidth sharing.

The model is the flow model SimGrid validated against packet-level simulation.
Every undirected edge of a `Topology` is two directed links (full duplex), each
with the edge's `bandwidth` (bytes/s) times its `efficiency` (default 1); `latency`
(s) is paid once per hop. A
transfer src -> dst follows `topology.path(src, dst)`: it first waits the sum of
the hop latencies, then becomes an *active flow* whose bytes move at the rate
that max-min fair sharing (progressive filling, hw/max_min.py) gives it over
the directed links it crosses. When a flow starts or ends, rates are recomputed only inside
its connected component (flows linked through shared directed links); a flow
whose rate changes has its remaining bytes settled at the old rate up to now
and gets a new finish time.

Usage, on one simpy Environment:

    net = Network(env, topology)
    flow = yield net.transfer("gpu0", "gpu1", 4 << 20)      # inside a process
    net.start_flow("gpu0", "gpu1", 4 << 20, on_done=callback) # callback style
    net.route("gpu0", "gpu1").latency_s                     # a Route: path, links, bottleneck, latency
    net.at(net.now + 1e-3, callback)                          # the clock: callback() at exactly that time

The network is the one owner of the simpy clock's internals: callers read
`now` and schedule with `at`, never simpy's private attributes.

The group-timed ring: a ring all-reduce whose routes share no directed link
(`ring(nodes)` returns them, else None) and whose links carry nothing else is
timed for the whole group at once by `time_ring` (hw/ring_timing.py), with the
times, link figures and records the flows would have given, to the bit.

Cost: no simpy process and no simpy event per flow. All flows whose latency ends
at the same time are activated by one timeout, and all flows finishing at the
same time complete in one timeout. A flow's `due` (the finish time it is entered
under) is its version: an entry under any other time is stale and skipped. A
flow alone on its links skips the sharing computation entirely. `bytes` in
`link_stats` counts flows when they complete.

Faults (hw/faults.py) change links while flows run, all off the hot path:
`set_link_bandwidth` settles and re-shares the flows crossing a link (a
degraded or healed link); `fail_link` takes a link out of routing and moves
every flow crossing it (moving, or still in its latency) onto its new route
with the bytes it had left, which first wait the new route's latency, as a
transport resending the unacknowledged rest would (`NoRoute` if none is left);
`cancel_flows` drops the flows of a lost device or of an aborted job. A moved
flow's bytes count on each route's links for the part that crossed them; its
`TransferRecord` names the route it finished on.
"""
from heapq import heappush
from math import inf
from typing import Callable, NamedTuple

import simpy

from .max_min import max_min_rates
from .ring_timing import RingTimes, ring_times
from .topology import Topology


class TransferRecord(NamedTuple):
    """One completed transfer."""

    src: str
    dst: str
    label: str
    start: float
    end: float
    nbytes: int
    path: tuple[str, ...]  # the route it finished on


class Route(NamedTuple):
    """How transfers src -> dst go: the nodes they cross, the directed links between them, the slowest
    link's rate and the latency paid once, before the bytes move."""

    path: tuple[str, ...]
    links: tuple["_Link", ...]
    bandwidth_Bps: float  # the bottleneck: the smallest rate of `links` (inf for no link)
    latency_s: float  # the sum of the hop latencies


class _Link:
    """One direction of an edge: its flows (an insertion-ordered dict used as a
    set) and online counters for `Network.link_stats`."""

    __slots__ = ("src", "dst", "bandwidth", "flows", "bytes", "busy_s", "busy_since", "cap", "unfixed")

    def __init__(self, src: str, dst: str, bandwidth: float):
        self.src = src
        self.dst = dst
        self.bandwidth = bandwidth
        self.flows: dict[Flow, None] = {}
        self.bytes = 0
        self.busy_s = 0.0
        self.busy_since = 0.0
        self.cap = 0.0  # scratch for progressive filling: capacity not yet given out
        self.unfixed = 0  # scratch for progressive filling: flows without a rate yet


class Flow:
    """A transfer: requested at `start`, completed at `end` (None until then).
    While active, `rate` is its current max-min fair rate in bytes/s."""

    __slots__ = (
        "src", "dst", "nbytes", "label", "start", "end", "path",
        "on_done", "links", "min_bandwidth", "remaining", "rate", "settled_at", "due", "carried",
    )

    def __init__(self, src, dst, nbytes, label, start, route, on_done):
        self.src = src
        self.dst = dst
        self.nbytes = nbytes
        self.label = label
        self.start = start
        self.end = None
        self.path, self.links, self.min_bandwidth, _ = route
        self.on_done = on_done
        self.remaining = nbytes  # bytes left as of `settled_at`
        self.rate = 0.0
        self.settled_at = start + route.latency_s  # activation time, exactly as scheduled
        self.due = None  # the finish time it is entered under; entries under other times are stale
        self.carried = 0  # bytes it moved on earlier routes (a failed link moved it), counted there

    def __repr__(self) -> str:
        return f"Flow({self.src}->{self.dst}, {self.nbytes} B, start={self.start}, end={self.end})"


class Network:
    """Flow-level network on a simpy Environment over a Topology."""

    def __init__(self, env: simpy.Environment, topology: Topology, record: bool = True):
        self.env = env
        self.topology = topology
        self.record = record
        self.records: list[TransferRecord] = []
        self._links: dict[tuple[str, str], _Link] = {}
        for u, v, attrs in topology.graph.edges(data=True):
            rate = attrs["bandwidth"] * attrs.get("efficiency", 1.0)  # nominal_bandwidth's
            self._links[u, v] = _Link(u, v, rate)
            self._links[v, u] = _Link(v, u, rate)
        self._routes: dict[str, dict[str, Route]] = {}  # src -> dst -> route
        self._activating: dict[float, list[Flow]] = {}  # activation time -> flows
        self._finishing: dict[float, list[Flow]] = {}  # finish time -> flows entered under it

    # ---- public API -------------------------------------------------------

    def start_flow(
        self,
        src: str,
        dst: str,
        nbytes: int,
        on_done: Callable[[Flow], None] | None = None,
        label: str = "",
    ) -> Flow:
        """Start a transfer now. on_done(flow) is called at the completion time,
        from inside a simpy callback, after the network's state is updated."""
        if nbytes < 0:
            raise ValueError(f"transfer {src}->{dst}: negative size {nbytes}")
        try:
            route = self._routes[src][dst]
        except KeyError:
            route = self._route(src, dst)
        now = self.env._now  # env.now without the property call, on the hot path
        flow = Flow(src, dst, nbytes, label, now, route, on_done)
        self._enter_activation(flow, now, route.latency_s)
        return flow

    def _enter_activation(self, flow: Flow, now: float, latency: float) -> None:
        at = now + latency
        batch = self._activating.get(at)
        if batch is None:
            self._activating[at] = [flow]
            self.env.timeout(latency).callbacks.append(self._activate)
        else:
            batch.append(flow)

    def transfer(self, src: str, dst: str, nbytes: int, label: str = "") -> simpy.Event:
        """An Event that succeeds with the Flow when the transfer completes."""
        done = self.env.event()
        self.start_flow(src, dst, nbytes, done.succeed, label)
        return done

    def route(self, src: str, dst: str) -> Route:
        """The route of transfers src -> dst."""
        try:
            return self._routes[src][dst]
        except KeyError:
            return self._route(src, dst)

    # ---- the clock ----------------------------------------------------------

    @property
    def now(self) -> float:
        """The simulated time, in seconds."""
        return self.env._now

    def at(self, when: float, callback: Callable[[], None]) -> None:
        """Call `callback()` at exactly `when` (not before now), as the network's own timeouts fire.
        simpy's timeout takes a delay, and now + (when - now) need not be `when`."""
        env = self.env
        event = env.event()
        event._ok, event._value = True, None
        event.callbacks.append(lambda _: callback())
        heappush(env._queue, (when, simpy.core.NORMAL, next(env._eid), event))

    # ---- the group-timed ring (hw/ring_timing.py) ----------------------------

    def ring(self, nodes: list[str]) -> tuple[Route, ...] | None:
        """The routes of a ring over `nodes`, each to the next and the last to the first, when it can be
        timed as a group: every route crosses a link and no two share a directed link. Else None."""
        routes = tuple(self.route(node, nodes[(position + 1) % len(nodes)]) for position, node in enumerate(nodes))
        links = [link for route in routes for link in route.links]
        return routes if len(set(links)) == len(links) and all(route.links for route in routes) else None

    def time_ring(self, routes: tuple[Route, ...], posts: list[float], chunk_bytes: list[int],
                  labels: list[str], steps: int | None = None, reducing: int | None = None) -> RingTimes:
        """A ring all-reduce over `routes` (from `ring`) whose links carry nothing else while it runs:
        position p posts it at posts[p] and sends chunks of `chunk_bytes`, labelled labels[p] (`steps` and
        `reducing`: a reduce-scatter or all-gather alone, as ring_timing.ring_times takes them). Its links'
        bytes, busy time and transfer records are counted as its flows would have been; returns the
        ring's times (its ends, the ranks' spans, the staging buffers' landings)."""
        times = ring_times(posts, [route.latency_s for route in routes], [route.bandwidth_Bps for route in routes],
                           chunk_bytes, [route.links[0].busy_s for route in routes], keep_transfers=self.record,
                           steps=steps, reducing=reducing)
        if self.record:
            new_record = tuple.__new__  # TransferRecord without its Python-level __new__
            by_sender = [[] for _ in routes]
            for position, start, end, nbytes in times.transfers:
                path = routes[position].path
                by_sender[position].append(new_record(TransferRecord, (
                    path[0], path[-1], labels[position], start, end, nbytes, path)))
            self.records.extend(record for records in by_sender for record in records)
        for route, nbytes, busy_s in zip(routes, times.sent_bytes, times.link_busy_s):
            for link in route.links:  # crossed alone, one flow after another
                link.bytes += nbytes
                link.busy_s = busy_s
        return times

    def link_stats(self) -> list[dict]:
        """Per directed link, in graph edge order (u->v, then v->u): bytes of the
        completed flows that crossed it, and the time it carried at least one
        active flow (an ongoing busy period counts up to now)."""
        now = self.env.now
        return [
            {
                "src": link.src,
                "dst": link.dst,
                "bytes": link.bytes,
                "busy_s": link.busy_s + (now - link.busy_since if link.flows else 0.0),
            }
            for link in self._links.values()
        ]

    # ---- faults (hw/faults.py) ---------------------------------------------

    def nominal_bandwidth(self, u: str, v: str) -> float:
        """The rate link u-v moves bytes at when healthy: its bandwidth times its efficiency."""
        attrs = self.topology.graph.edges[u, v]
        return attrs["bandwidth"] * attrs.get("efficiency", 1.0)

    def set_link_bandwidth(self, u: str, v: str, bandwidth: float) -> int:
        """Both directions of link u-v move bytes at `bandwidth` from now on: the flows moving across it
        are settled at their old rates and re-shared, and those still in their latency will cross it at
        the new rate. Returns how many flows were crossing it (moving or in their latency)."""
        now = self.env._now
        changed = (self._links[u, v], self._links[v, u])
        for link in changed:
            link.bandwidth = bandwidth
        self._routes.clear()  # their bottleneck bandwidths
        waiting = [flow for batch in self._activating.values() for flow in batch
                   if changed[0] in flow.links or changed[1] in flow.links]
        for flow in waiting:
            flow.min_bandwidth = min(link.bandwidth for link in flow.links)
        moving = [flow for link in changed for flow in link.flows]
        if moving:
            self._schedule(self._reshare(moving, now), now)
        return len(waiting) + len(moving)

    def fail_link(self, u: str, v: str) -> list[Flow]:
        """Link u-v fails now: it leaves routing, and every flow crossing it moves to its new route with
        the bytes it had left, after that route's latency. Returns the moved flows; `NoRoute` if a
        flow has no route left."""
        now = self.env._now
        failed = (self._links[u, v], self._links[v, u])
        self.topology.remove_link(u, v)
        self._routes.clear()
        moving = self._take_out([flow for link in failed for flow in link.flows], failed, now)
        for flow in moving:
            route = self._route(flow.src, flow.dst)
            flow.path, flow.links, flow.min_bandwidth, latency = route
            flow.settled_at = now + latency
            self._enter_activation(flow, now, latency)
        return moving

    def cancel_flows(self, nodes) -> list[Flow]:
        """Drop every flow from or to one of `nodes` now (a lost device's, an aborted job's): its bytes stop
        moving and its on_done is never called. Returns the dropped flows."""
        nodes = set(nodes)

        def ours(flow: Flow) -> bool:
            return flow.src in nodes or flow.dst in nodes

        waiting = []
        for batch in self._activating.values():  # an emptied batch stays: its timeout pops it
            waiting += [flow for flow in batch if ours(flow)]
            batch[:] = [flow for flow in batch if not ours(flow)]
        active = [flow for link in self._links.values() for flow in link.flows if ours(flow)]
        return waiting + self._take_out(active, (), self.env._now)

    def _take_out(self, active: list[Flow], crossing: tuple, now: float) -> list[Flow]:
        """Take `active` flows (and flows in their latency that cross the `crossing` links) off their
        links: settled up to now, the bytes they moved counted on those links, their neighbours
        re-shared. Returns them, each once, in order."""
        flows = list(dict.fromkeys(active))
        for batch in self._activating.values():
            for flow in [flow for flow in batch if any(link in crossing for link in flow.links)]:
                batch.remove(flow)  # an emptied batch stays: its timeout pops it
                flows.append(flow)
        neighbours = []
        for flow in flows:
            if flow.due is None:  # still in its latency: nothing moved yet
                continue
            flow.remaining = max(0.0, flow.remaining - flow.rate * (now - flow.settled_at))
            moved = round(flow.nbytes - flow.remaining) - flow.carried
            flow.carried += moved
            for link in flow.links:
                del link.flows[flow]
                link.bytes += moved
                if link.flows:
                    neighbours.extend(link.flows)
                else:
                    link.busy_s += now - link.busy_since
            flow.due = None  # its finish entry goes stale
            flow.rate = 0.0
        taken = set(flows)
        neighbours = [flow for flow in dict.fromkeys(neighbours) if flow not in taken]
        if neighbours:
            self._schedule(self._reshare(neighbours, now), now)
        return flows

    # ---- internals --------------------------------------------------------

    def _route(self, src: str, dst: str) -> Route:
        path = self.topology.path(src, dst)  # raises TopologyError for unknown nodes
        links = tuple(self._links[a, b] for a, b in zip(path, path[1:]))
        latency = 0.0
        for a, b in zip(path, path[1:]):
            latency += self.topology.graph.edges[a, b]["latency"]
        min_bandwidth = min((link.bandwidth for link in links), default=inf)
        route = self._routes.setdefault(src, {})[dst] = Route(path, links, min_bandwidth, latency)
        return route

    def _activate(self, _event) -> None:
        """Timeout callback: every flow whose latency ends now becomes active."""
        now = self.env._now
        instant, alone_flows, contended = [], [], []
        for flow in self._activating.pop(now):
            links = flow.links
            if not links or not flow.nbytes:
                flow.end = now
                instant.append(flow)
                continue
            alone = True
            for link in links:
                flows = link.flows
                if flows:
                    alone = False
                else:
                    link.busy_since = now
                flows[flow] = None
            if not alone:
                contended.append(flow)
                continue
            # Fast path: alone on its links, the flow runs at its path's bottleneck.
            flow.rate = flow.min_bandwidth
            alone_flows.append(flow)
        self._schedule(alone_flows, now)
        if contended:
            # May also change the rate of a fast-path flow of this batch: its
            # entry above then goes stale.
            self._schedule(self._reshare(contended, now), now)
        if instant:
            self._complete(instant, now)

    def _schedule(self, flows: list[Flow], now: float) -> None:
        """Enter each flow under its new finish time; its older entry goes stale."""
        finishing = self._finishing
        for flow in flows:
            delay = flow.remaining / flow.rate
            flow.due = at = now + delay
            entries = finishing.get(at)
            if entries is None:
                finishing[at] = [flow]
                self.env.timeout(delay).callbacks.append(self._finish)
            else:
                entries.append(flow)

    def _finish(self, _event) -> None:
        """Timeout callback: complete the flows due now, reshare their neighbours."""
        now = self.env._now
        done = []
        neighbours = []
        for flow in self._finishing.pop(now):
            if flow.due != now:  # stale: rescheduled, or already completed
                continue
            flow.due = None
            flow.end = now
            nbytes = flow.nbytes - flow.carried
            for link in flow.links:
                flows = link.flows
                del flows[flow]
                link.bytes += nbytes
                if flows:
                    neighbours.extend(flows)
                else:
                    link.busy_s += now - link.busy_since
            done.append(flow)
        if neighbours:
            self._schedule(self._reshare([f for f in neighbours if f.end is None], now), now)
        self._complete(done, now)

    def _complete(self, flows: list[Flow], now: float) -> None:
        """Record the flows (their `end` is set), then call their on_done, in order."""
        if self.record:
            new_record = tuple.__new__  # TransferRecord without its Python-level __new__
            self.records.extend(
                [new_record(TransferRecord, (f.src, f.dst, f.label, f.start, now, f.nbytes, f.path)) for f in flows]
            )
        for flow in flows:
            on_done = flow.on_done
            if on_done is not None:
                on_done(flow)

    def _reshare(self, seeds: list[Flow], now: float) -> list[Flow]:
        """Max-min fair rates for the components of `seeds` (hw/max_min.py); settles and returns the flows
        whose rate changed."""
        changed = []
        for flow, rate in max_min_rates(seeds):
            if rate != flow.rate:
                flow.remaining = max(0.0, flow.remaining - flow.rate * (now - flow.settled_at))
                flow.settled_at = now
                flow.rate = rate
                changed.append(flow)
        return changed
