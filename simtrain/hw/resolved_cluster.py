"""A scenario's cluster section resolved before anything is built: the typed device specs, the topology.

    resolved = resolve_cluster(scenario.cluster, scenario.base_dir)
    check_scenario_fits_host(scenario, resolved)
    cluster = Cluster.from_resolved(resolved, seed=scenario.seed)   # cluster.py

Validation (preflight.py) reads a resolved cluster and its topology without
building the simulated cluster: this module imports neither the network
(network.py, with its ring timing's numpy) nor the cluster, which cluster.py
builds from it.
"""
from dataclasses import dataclass
from pathlib import Path

from ..errors import ScenarioError, TopologyError
from ..scenario import TOPOLOGY_BUILDERS, ClusterSpec
from .catalog import DeviceSpec, override_device, resolve_device
from .shared_memory import SharedMemory, attach_shared_memory
from .topology import Topology
from .topology_builders import LinkClass, build_topology


def _link_class(spec) -> LinkClass | None:
    return None if spec is None else LinkClass(bandwidth=spec.bandwidth, latency=spec.latency)


@dataclass(frozen=True)
class ResolvedCluster:
    """A scenario's cluster section resolved once, before anything is built: the topology file loaded and
    validated (None for a builder, whose graph `topology()` makes), the device count, and every rank's typed
    DeviceSpec and slowdown. The host-memory check and the cluster read the same objects."""

    spec: ClusterSpec
    base_dir: Path
    topology_file: Topology | None  # the file's topology; None: a builder's, made by `topology()`
    devices: int  # spares included
    device_specs: list[DeviceSpec]
    slowdowns: list[float]

    def topology(self) -> Topology:
        """The topology the section describes: a copy of the file's, as loaded once (a failed link leaves a
        cluster's graph, not this one's); a builder's, built now."""
        if self.topology_file is not None:
            loaded = self.topology_file
            return Topology(loaded.graph.copy(), loaded.devices, loaded.name, private=loaded.private,
                            reducing=loaded.reducing)
        spec = self.spec
        return build_topology(
            spec.topology, spec.devices, _link_class(spec.link),
            inter_link=_link_class(spec.inter_node_link), gpus_per_node=spec.gpus_per_node,
            torus_shape=spec.torus_shape, nodes_per_leaf=spec.nodes_per_leaf, oversubscription=spec.oversubscription,
            leaves_per_pod=spec.leaves_per_pod, base_dir=self.base_dir)

    def network_parts(self) -> tuple[Topology, SharedMemory | None]:
        """The topology with `cluster.shared_memory`'s store attached, and the store (None without one): what
        the cluster's network is built on, and what the checks before a run read."""
        topology = self.topology()
        if self.spec.shared_memory is None:
            return topology, None
        return attach_shared_memory(topology, self.spec.shared_memory)


def resolve_cluster(spec: ClusterSpec, base_dir: Path = Path(".")) -> ResolvedCluster:
    """The cluster section resolved: a topology file read and validated once, device specs typed."""
    topology_file = None
    if spec.topology in TOPOLOGY_BUILDERS:
        if spec.devices is None:
            raise TopologyError(f"cluster.devices: required by the {spec.topology} builder")
        count = spec.devices
    else:
        topology_file = build_topology(spec.topology, spec.devices, None, base_dir=base_dir)
        count = topology_file.num_devices
    specs, slowdowns = device_specs(spec, count, base_dir)
    return ResolvedCluster(spec, Path(base_dir), topology_file, count, specs, slowdowns)


def device_specs(spec: ClusterSpec, count: int, base_dir: Path = Path(".")) -> tuple[list[DeviceSpec], list[float]]:
    """Each rank's DeviceSpec and slowdown: `cluster.device` with `cluster.overrides` applied."""
    for rank in spec.overrides:
        if rank >= count:
            raise ScenarioError(f"cluster.overrides.{rank}: no such rank (the cluster has {count} devices)")
    base = resolve_device(spec.device, base_dir=base_dir, compute_model=spec.compute_model)
    specs, slowdowns = [], []
    for rank in range(count):
        override = spec.overrides.get(rank)
        if override is None:
            specs.append(base)
            slowdowns.append(1.0)
            continue
        field = f"cluster.overrides.{rank}"
        device = base if override.device is None else resolve_device(override.device, f"{field}.device", base_dir)
        changes = override.device_fields()
        specs.append(override_device(device, changes) if changes else device)
        slowdowns.append(override.slowdown)
    return specs, slowdowns
