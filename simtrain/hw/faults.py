"""Faults of a cluster's hardware, on its clock: degraded and failed links, lost devices.

`cluster.faults` lists faults at given simulated times; `cluster.random_faults`
draws them as they come. `FaultInjector` applies both, in time order, while
its job runs, and records what each did (report.json's `faults.events`):

- **degraded link** `{at, link: [u, v], bandwidth_factor: f, until}`: both
  directions of the link move bytes at f times their rate from `at` (and at
  their rate again from `until`); the flows crossing it are re-shared at
  that instant (network.py `set_link_bandwidth`; `flows_crossing` counts
  them, those still in their latency included);
- **failed link** `{at, link: [u, v], fail: true}`: the link leaves routing;
  routes are recomputed on the remaining graph and the flows crossing it move
  to their new routes with the bytes they had left (network.py `fail_link`;
  `flows_rerouted` and `bytes_rerouted` count them and those bytes). No
  route left between two nodes that must exchange bytes ends the job
  (`NoRoute`, reported as `status: failed`), now or when they next send;
- **lost device** `{at, device: N, fail: true}`: the device stops: its
  program ends where it stands, the span on its stream is cut, its flows in
  flight are dropped (hw/device.py `abort`, network.py `cancel_flows`); what
  its job does then is recovery.py's (`on_device_lost`). Its links fail with
  it, so traffic that went through it (the ring and torus builders route
  through GPUs) goes around, as after a failed link.

**Random faults**: every device of the job fails after an exponential time
of mean `device_mtbf`, and every link after one of mean `link_mtbf` (a
failure, not a degradation), independently and memorylessly. So the next
device failure comes after an exponential time of mean `device_mtbf / n`
with n devices still up, and strikes one of them uniformly; likewise for
links. Both are drawn from one numpy Generator seeded with
`[random_faults.seed (default: the scenario's seed), 0x6661756c74]`, only
when the previous one happened, so a run draws exactly the faults it meets.
Idle spares do not fail.

The injector stops when its job has finished: faults given for later times
are listed as not having happened. Times, names and indices were validated
against the topology when the injector was built (one-line ScenarioErrors
naming the field).

    injector = FaultInjector(cluster, scenario, job_ranks, on_device_lost)
    injector.start(job.finished)
    ...; injector.events          # what each fault did
"""
from heapq import heappop, heappush

import numpy as np

from ..scenario import Scenario
from .cluster import Cluster
from .fault_schedule import scheduled_faults

_RANDOM_STREAM = 0x6661756C74  # "fault": keeps the draws apart from every other stream of the seed


class FaultInjector:
    """Applies a scenario's faults to a cluster while a job runs, and records what each did."""

    def __init__(self, cluster: Cluster, scenario: Scenario, job_ranks: list[int], on_device_lost):
        self.cluster = cluster
        self.env = cluster.env
        self.network = cluster.network
        self.job_ranks = job_ranks  # the job's global ranks as they are now (a spare may join)
        self.on_device_lost = on_device_lost  # (global rank, event dict) -> None: the job's reaction
        self.events: list[dict] = []
        self._pending = []  # heap of (at_s, order, event dict)
        self._order = 0
        self._failed_links: list[tuple[str, str]] = []
        for at_s, event in scheduled_faults(scenario, cluster.topology):
            self._add(at_s, event)
        random = scenario.cluster.random_faults
        self.random = random
        if random is not None:
            seed = scenario.seed if random.seed is None else random.seed
            self.rng = np.random.default_rng([seed, _RANDOM_STREAM])
            self._links = [edge for edge in cluster.topology.graph.edges if edge[0] not in cluster.topology.private
                           and edge[1] not in cluster.topology.private]
            if random.device_mtbf is not None:
                self._draw("device_lost")
            if random.link_mtbf is not None:
                self._draw("link_failed")

    def _add(self, at_s: float, event: dict, source: str = "scenario") -> None:
        self._order += 1  # breaks ties of time: the order the faults were given (or drawn) in
        heappush(self._pending, (at_s, self._order, {"at_s": at_s, "source": source, **event}))

    def _draw(self, kind: str) -> None:
        """The next random fault of `kind`, after now."""
        if kind == "device_lost":
            up = [rank for rank in self.job_ranks if rank not in self._lost_ranks()]
            if not up:
                return
            at = self.env.now + self.rng.exponential(self.random.device_mtbf / len(up))
            self._add(at, {"kind": kind, "device": up[int(self.rng.integers(len(up)))]}, "random")
        else:
            up = [edge for edge in self._links if edge not in self._failed_links]
            if not up:
                return
            at = self.env.now + self.rng.exponential(self.random.link_mtbf / len(up))
            self._add(at, {"kind": kind, "link": list(up[int(self.rng.integers(len(up)))])}, "random")

    def _lost_ranks(self) -> list[int]:
        return [event["device"] for event in self.events if event["kind"] == "device_lost"]

    def start(self, job_finished) -> None:
        """Apply the faults in time order until `job_finished` fires."""
        self.env.process(self._run(job_finished))

    def _run(self, job_finished):
        env = self.env
        while self._pending:
            at_s = self._pending[0][0]
            if at_s > env.now:
                yield env.timeout(at_s - env.now) | job_finished
            if job_finished.triggered:
                break
            _, _, event = heappop(self._pending)
            self.events.append(event)
            self._apply(event)
            if event["source"] == "random":
                self._draw(event["kind"])
        for _, _, event in sorted(self._pending, key=lambda entry: entry[:2]):
            if event["source"] == "scenario":
                self.events.append({**event, "effect": "none: the job had ended"})

    def _fail(self, u: str, v: str) -> list:
        self._failed_links.append((u, v))
        return self.network.fail_link(u, v)

    def _apply(self, event: dict) -> None:
        kind = event["kind"]
        if kind == "device_lost":
            self.on_device_lost(event["device"], event)
            # Its links go with it: traffic that went through it (GPUs route on the ring and torus
            # builders) goes around.
            node = self.cluster.devices[event["device"]].node
            links = [(node, neighbour) for neighbour in self.cluster.topology.graph.neighbors(node)]
            moved = [flow for u, v in links for flow in self._fail(u, v)]
            event["links_failed"] = len(links)
            if moved:
                event["flows_rerouted"] = len(moved)
            return
        u, v = event["link"]
        if (u, v) in self._failed_links or (v, u) in self._failed_links:
            event["effect"] = "none: the link had failed"
            return
        if kind == "link_failed":
            moved = self._fail(u, v)
            event["flows_rerouted"] = len(moved)
            event["bytes_rerouted"] = sum(round(flow.remaining) for flow in moved)
            return
        factor = event.get("bandwidth_factor", 1.0)
        event["flows_crossing"] = self.network.set_link_bandwidth(u, v, self.network.nominal_bandwidth(u, v) * factor)
