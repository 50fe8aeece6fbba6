"""A job's components, counted on its topology, and each one's blast radius: the hosts its failure takes out.

Hosts are `gpus_per_host` consecutive ranks (host k holds ranks k*g to
k*g+g-1). Reading the topology's graph once:

- a **host switch** (an NVSwitch fabric) is a switch whose links all go to
  GPUs of one host; a link with both ends in one host is inside it (NVLink),
  not a cable;
- a **cable** is every other link; it takes the hosts of the GPUs at its ends
  (a NIC's cable to its leaf: that host; a switch-to-switch cable: none);
- a **leaf** is any other switch cabled to a GPU: it takes every host with a
  GPU on it (a rail-optimized leaf takes one rail of each of its hosts, and so
  those hosts); a **spine** is a switch cabled to no GPU: routing goes
  around it, the job restarts on the same hosts;
- gpu, hbm, nic and sdc units are GPUs (one NIC per GPU, as in DGX systems),
  nvswitch, host and software units are hosts, storage and maintenance (the
  job's planned stops) are one unit; gpu, hbm, nic, sdc, nvswitch and host
  take their host; software, storage and maintenance take none.

    inventory = Inventory(cluster.topology, gpus_per_host=8)
    inventory.count("leaf"), inventory.hosts_lost("leaf", 0)   # 8, (0, 1, ..., 19)
"""
import math

from ..errors import ScenarioError
from ..scenario.fleet import COMPONENTS

_PER_GPU, _PER_HOST = ("gpu", "hbm", "nic", "sdc"), ("nvswitch", "host", "software")


class Inventory:
    """What a job is made of, in units per component, and which hosts each unit's failure takes."""

    def __init__(self, topology, gpus_per_host: int):
        gpus = topology.devices
        if len(gpus) % gpus_per_host:
            raise ScenarioError(f"fleet.gpus_per_host: {len(gpus)} GPUs do not split into hosts of {gpus_per_host}")
        self.gpus, self.hosts, self.gpus_per_host = len(gpus), len(gpus) // gpus_per_host, gpus_per_host
        host_of = {gpu: rank // gpus_per_host for rank, gpu in enumerate(gpus)}
        is_gpu = frozenset(gpus)
        graph = topology.graph
        switches = [node for node in graph.nodes if node not in host_of and node not in topology.private]
        for switch in switches:
            hosts = {host_of.get(neighbour) for neighbour in graph.neighbors(switch)}
            if len(hosts) == 1 and None not in hosts:
                host_of[switch] = hosts.pop()  # a host switch: inside its host
        self._cables: list[tuple[int, ...]] = []  # each cable's hosts lost, in the graph's edge order
        for u, v in graph.edges:
            if u in topology.private or v in topology.private:
                continue
            if host_of.get(u) is not None and host_of.get(u) == host_of.get(v):
                continue  # inside one host
            self._cables.append(tuple(sorted({host_of[node] for node in (u, v) if node in is_gpu})))
        self._leaves: list[tuple[int, ...]] = []
        self._spines = 0
        for switch in switches:
            if switch in host_of:
                continue
            hosts = sorted({host_of[neighbour] for neighbour in graph.neighbors(switch) if neighbour in is_gpu})
            if hosts:
                self._leaves.append(tuple(hosts))
            else:
                self._spines += 1

    def count(self, component: str) -> int:
        """Units of `component` in the job."""
        if component in _PER_GPU:
            return self.gpus
        if component in _PER_HOST:
            return self.hosts
        return {"cable": len(self._cables), "leaf": len(self._leaves), "spine": self._spines, "storage": 1,
                "maintenance": 1}[component]

    def hosts_lost(self, component: str, unit: int) -> tuple[int, ...]:
        """The hosts (0 to hosts - 1) that unit `unit` of `component` takes out of the job when it fails."""
        if component in _PER_GPU:
            return (unit // self.gpus_per_host,)
        if component in ("nvswitch", "host"):
            return (unit,)
        if component == "cable":
            return self._cables[unit]
        if component == "leaf":
            return self._leaves[unit]
        return ()

    def check_unit(self, component: str, unit: int, field: str) -> None:
        """ScenarioError naming `field` if the job has no unit `unit` of `component`."""
        count = self.count(component)
        if unit >= count:
            raise ScenarioError(f"{field}: no {component} {unit} (the job has {count}"
                                + (f", 0 to {count - 1})" if count else ")"))

    def counts(self) -> dict[str, int]:
        return {component: self.count(component) for component in COMPONENTS}



def job_inventory(scenario, topology) -> Inventory:
    """The inventory of a scenario's fleet job on its cluster's topology, `fleet.failures` checked against it (one-line
    ScenarioErrors naming the field). Hosts: fleet.gpus_per_host, else cluster.gpus_per_node, else of 8 (of the
    greatest common divisor of 8 and the GPUs when 8 does not divide them)."""
    fleet = scenario.fleet
    inventory = Inventory(topology, fleet.gpus_per_host or scenario.cluster.gpus_per_node
                          or math.gcd(8, topology.num_devices))
    for index, failure in enumerate(fleet.failures):
        inventory.check_unit(failure.component, failure.unit, f"fleet.failures.{index}.unit")
    return inventory
