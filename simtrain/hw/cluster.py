"""A cluster: devices, topology and network on one simpy clock and event log.

    cluster = build_cluster(scenario.cluster, base_dir=scenario.base_dir)
    cluster.devices[0].compute(...); cluster.network.transfer(...); cluster.env.run()

What a scenario's cluster section resolves to before anything is built (the
typed device specs, the topology file) is resolved_cluster.py's, which
validation reads without building a cluster; `Cluster.from_resolved` builds it.

Several jobs may share one cluster (its links and clock); each takes a group of
its devices (`add_job`), and the event log tags their spans with the job's index.
With `enforce_capacity=False` the ledgers record peaks past a device's
capacity instead of raising OutOfMemory (the memory plan measures that way).

Devices need not be alike: `cluster.overrides` gives a rank another device, some
changed device fields, or a `slowdown`; `cluster.compute_jitter` (and
`compute_jitter_fixed`) gives every compute span a lognormal time factor drawn
from the rank's own Generator, seeded with (scenario seed, rank).
`cluster.shared_memory` adds the store of shared_memory.py to the network.
`cluster.compute_model` (flops, roofline or kernels) is every device's compute model
(device.py). `cluster.host_cores` makes the
devices processes of one host whose CPU cores they share (hw/host_cores.py),
and `cluster.host_message_work` each message's software work on those cores
(`host_messages`, which the simulated backend's communicators take).
"""
import gc
import math
from pathlib import Path

import numpy as np
import simpy

from ..scenario import ClusterSpec
from .catalog import DeviceSpec
from .device import Device
from .eventlog import EventLog
from .host_cores import HostCores, HostDevice, HostMessages
from .network import Network
from .resolved_cluster import ResolvedCluster, resolve_cluster
from .shared_memory import SharedMemory
from .topology import Topology


class Cluster:
    """Simulated GPUs joined by a network, sharing one virtual clock."""

    def __init__(self, topology: Topology, specs: list[DeviceSpec], record: bool = True,
                 slowdowns: list[float] | None = None, compute_jitter: float = 0.0, compute_jitter_fixed: float = 0.0,
                 seed: int = 0,
                 shared_memory: SharedMemory | None = None, enforce_capacity: bool = True,
                 compute_model: str = "flops", host_cores: int | None = None,
                 host_message_work: tuple[float, float] | None = None):
        if len(specs) != topology.num_devices:
            raise ValueError(f"{len(specs)} device specs for {topology.num_devices} devices")
        slowdowns = slowdowns or [1.0] * len(specs)
        self.env = simpy.Environment()
        self.topology = topology
        self.log = EventLog(record)
        self.network = Network(self.env, topology, record=record)
        self.shared_memory = shared_memory
        cores = {} if host_cores is None else {"cores": HostCores(self.env, host_cores)}
        # (latency_s, s_per_byte) of each message a rank sends, on the cores; None: the links alone
        self.host_messages = (HostMessages(cores["cores"], *host_message_work) if host_message_work is not None
                              else None)
        self.devices = [
            (HostDevice if cores else Device)(
                self.env, rank, node, spec, self.log, slowdown=slowdowns[rank], jitter=compute_jitter,
                jitter_fixed=compute_jitter_fixed,
                rng=np.random.default_rng([seed, rank]) if compute_jitter or compute_jitter_fixed else None,
                compute_model=compute_model, **cores)
            for rank, (node, spec) in enumerate(zip(topology.devices, specs))
        ]
        if not enforce_capacity:
            for device in self.devices:
                device.memory.capacity_bytes = math.inf
        self.jobs: list[tuple[str, list[int]]] = []  # (name, global ranks) of each job, by index

    @classmethod
    def from_resolved(cls, resolved: ResolvedCluster, record: bool = True, seed: int = 0,
                      enforce_capacity: bool = True,
                      parts: tuple[Topology, SharedMemory | None] | None = None) -> "Cluster":
        """The cluster a resolved section describes (on `parts`, its network_parts() made before, if given);
        `seed` seeds the compute jitter."""
        spec = resolved.spec
        topology, store = parts if parts is not None else resolved.network_parts()
        return cls(topology, resolved.device_specs, record=record, slowdowns=resolved.slowdowns,
                   compute_jitter=spec.compute_jitter, compute_jitter_fixed=spec.compute_jitter_fixed, seed=seed,
                   shared_memory=store,
                   enforce_capacity=enforce_capacity, compute_model=spec.compute_model,
                   host_cores=spec.host_cores, host_message_work=_message_work(spec.host_message_work))

    def add_job(self, name: str, ranks: list[int]) -> int:
        """A job takes devices `ranks`: its index, which the event log puts on their spans."""
        taken = {rank for _, held in self.jobs for rank in held}
        clash = sorted(taken.intersection(ranks))
        if clash:
            raise ValueError(f"job {name!r}: devices {clash} belong to another job")
        self.jobs.append((name, list(ranks)))
        self.log.assign(ranks, len(self.jobs) - 1)
        return len(self.jobs) - 1

    def join_job(self, job: int, rank: int) -> None:
        """Device `rank` (a spare) joins job `job` in a lost device's place: its spans carry the job's index."""
        self.jobs[job][1].append(rank)
        self.log.assign([rank], job)

    def record_memory_changes(self) -> None:
        """Every device keeps each change of its memory from now on, with its time (MemoryLedger.changes): a
        scenario's trace draws them as counters (report/trace.py)."""
        for device in self.devices:
            device.memory.record_changes(self.env)

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


def _message_work(spec) -> tuple[float, float] | None:
    """(seconds per message, seconds per byte) of `cluster.host_message_work`, or None."""
    if spec is None:
        return None
    return spec.latency, 0.0 if spec.bandwidth is None else 1.0 / spec.bandwidth


def build_cluster(spec: ClusterSpec, base_dir: Path = Path("."), record: bool = True, seed: int = 0,
                  enforce_capacity: bool = True) -> Cluster:
    """The cluster a scenario's cluster section describes; `seed` seeds the compute jitter."""
    return Cluster.from_resolved(resolve_cluster(spec, base_dir), record=record, seed=seed,
                                 enforce_capacity=enforce_capacity)
