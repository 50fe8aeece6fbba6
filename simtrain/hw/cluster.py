"""A cluster: devices, topology and network on one simpy clock and event log.

    cluster = build_cluster(scenario.cluster, base_dir=scenario.base_dir)
    cluster.devices[0].compute(...); cluster.network.transfer(...); cluster.env.run()

Several jobs may share one cluster (its links and clock); each takes a group of
its devices.
"""
import gc
from pathlib import Path

import simpy

from ..scenario import ClusterSpec
from .catalog import DeviceSpec, resolve_device
from .device import Device
from .eventlog import EventLog
from .network import Network
from .topology import Topology
from .topology_builders import LinkClass, build_topology


class Cluster:
    """Simulated GPUs joined by a network, sharing one virtual clock."""

    def __init__(self, topology: Topology, specs: list[DeviceSpec], record: bool = True):
        if len(specs) != topology.num_devices:
            raise ValueError(f"{len(specs)} device specs for {topology.num_devices} devices")
        self.env = simpy.Environment()
        self.topology = topology
        self.log = EventLog(record)
        self.network = Network(self.env, topology, record=record)
        self.devices = [Device(self.env, rank, node, spec, self.log)
                        for rank, (node, spec) in enumerate(zip(topology.devices, specs))]

    @property
    def size(self) -> int:
        return len(self.devices)


def run_to_end(env: simpy.Environment) -> None:
    """Run the clock until nothing is left to happen, with Python's cycle collector paused.

    A big simulation holds millions of live objects (tensor views, flows); each
    automatic cycle collection would walk all of them, making run time grow
    faster than the number of events. Reference counting still frees what the
    simulation drops, and the collector takes any cycles once it is back on.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        env.run()
    finally:
        if enabled:
            gc.enable()


def _link_class(spec) -> LinkClass | None:
    return None if spec is None else LinkClass(bandwidth=spec.bandwidth, latency=spec.latency)


def build_topology_from_spec(spec: ClusterSpec, base_dir: Path = Path(".")) -> Topology:
    """The topology a scenario's cluster section describes."""
    return build_topology(
        spec.topology, spec.devices, _link_class(spec.link),
        inter_link=_link_class(spec.inter_node_link), gpus_per_node=spec.gpus_per_node,
        torus_shape=spec.torus_shape, base_dir=base_dir)


def build_cluster(spec: ClusterSpec, base_dir: Path = Path("."), record: bool = True) -> Cluster:
    """The cluster a scenario's cluster section describes."""
    topology = build_topology_from_spec(spec, base_dir)
    device = resolve_device(spec.device)
    return Cluster(topology, [device] * topology.num_devices, record=record)
