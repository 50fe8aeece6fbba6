"""Shared memory: the store that asynchronous workers read parameters from and write updates to.

`cluster.shared_memory` places one store on the cluster's network, in one of two places:

- `location: host`: host DRAM, as in Hogwild! and A3C. Two nodes join the
  topology: `host` (the host bridge, a PCIe root complex) and `shared_memory`
  (the DRAM). Every device gets its own `host_link` to `host` (PCIe-like, per
  direction), and `host` reaches `shared_memory` over one link with the
  store's `bandwidth` and `latency`.
- `location: <node>`: a parameter server. The `shared_memory` node hangs off
  that topology node (a switch, a server of a topology file, even a GPU) by a
  link with the store's `bandwidth` and `latency`.

A read or a write is a `network.transfer` between a device's node and
`shared_memory`, so concurrent readers and writers share the store's link (and,
on the host, nothing else: each device has its own host link) by the network's
max-min fair flow model. `host` and `shared_memory` are private nodes of the
topology: GPU-to-GPU routes never cross them, so adding a store never changes
how a collective runs.

The store keeps a `MemoryLedger` (bytes per category and their peak) whose
capacity is `capacity`, unlimited when not given; the scheme that uses the
store allocates what it keeps there, and the report shows it as
`shared_memory`.

    topology, store = attach_shared_memory(topology, scenario.cluster.shared_memory)
    yield network.transfer(store.node, "gpu3", nbytes)     # a read of rank 3
"""
from dataclasses import dataclass
from math import inf

from ..errors import ScenarioError
from ..scenario import SharedMemorySpec
from .device import MemoryLedger
from .topology import Topology

STORE_NODE = "shared_memory"
HOST_NODE = "host"
_FIELD = "cluster.shared_memory"


@dataclass
class SharedMemory:
    """Where the shared store sits on the network and what it holds."""

    location: str  # "host" or the topology node it hangs off
    node: str  # the store's network node: transfers go to and from it
    bandwidth: float  # bytes/s of the store's own link
    latency: float  # seconds of the store's own link
    memory: MemoryLedger

    @property
    def capacity_bytes(self) -> float | None:
        return None if self.memory.capacity_bytes == inf else self.memory.capacity_bytes


def attach_shared_memory(topology: Topology, spec: SharedMemorySpec) -> tuple[Topology, SharedMemory]:
    """A copy of `topology` with the store's nodes and links added, and the store."""
    graph = topology.graph.copy()
    for name in (STORE_NODE, HOST_NODE):
        if name in graph:
            raise ScenarioError(f"{_FIELD}: the topology already has a node named {name!r}")
    graph.add_node(STORE_NODE)
    if spec.location == HOST_NODE:
        graph.add_node(HOST_NODE)
        for device in topology.devices:
            graph.add_edge(device, HOST_NODE, bandwidth=spec.host_link.bandwidth, latency=spec.host_link.latency)
        graph.add_edge(HOST_NODE, STORE_NODE, bandwidth=spec.bandwidth, latency=spec.latency)
        private = frozenset((HOST_NODE, STORE_NODE))
    else:
        if spec.location not in topology.graph:
            nodes = ", ".join(str(node) for node in topology.graph.nodes)
            raise ScenarioError(f"{_FIELD}.location: unknown node {spec.location!r}; "
                                f"host or a node of the topology ({nodes})")
        graph.add_edge(spec.location, STORE_NODE, bandwidth=spec.bandwidth, latency=spec.latency)
        private = frozenset((STORE_NODE,))
    capacity = inf if spec.capacity is None else spec.capacity
    store = SharedMemory(location=spec.location, node=STORE_NODE, bandwidth=spec.bandwidth, latency=spec.latency,
                         memory=MemoryLedger(f"shared memory ({spec.location})", capacity))
    return Topology(graph, topology.devices, topology.name, private=topology.private | private,
                    reducing=topology.reducing), store
