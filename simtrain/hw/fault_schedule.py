"""The faults a scenario gives at fixed times (`cluster.faults`), as events, checked against its topology.

Validation (preflight.py) reads them without a cluster; the injector (faults.py) applies them on the clock.
"""
from ..errors import ScenarioError
from ..scenario import Scenario
from .topology import Topology


def scheduled_faults(scenario: Scenario, topology: Topology) -> list[tuple[float, dict]]:
    """`cluster.faults` as (time, event) pairs, a healed link's `until` its own event; their links and
    devices checked against the cluster's topology (ScenarioErrors naming the field), as is `cluster.spares`."""
    spares, size = scenario.cluster.spares, topology.num_devices
    if spares >= size:
        raise ScenarioError(f"cluster.spares: {spares} leaves no device for the job (the topology has "
                            f"{size})")
    events = []
    for index, fault in enumerate(scenario.cluster.faults):
        field = f"cluster.faults.{index}"
        if fault.link is not None:
            u, v = fault.link
            if not topology.graph.has_edge(u, v):
                raise ScenarioError(f"{field}.link: no link {u}-{v} in the topology {topology.name}")
            if fault.fail:
                events.append((fault.at, {"kind": "link_failed", "link": [u, v]}))
            else:
                events.append((fault.at, {"kind": "link_degraded", "link": [u, v],
                                          "bandwidth_factor": fault.bandwidth_factor}))
                if fault.until is not None:
                    events.append((fault.until, {"kind": "link_healed", "link": [u, v]}))
        elif fault.device >= size:
            raise ScenarioError(f"{field}.device: no device {fault.device} (the cluster has {size}, "
                                f"0 to {size - 1})")
        else:
            events.append((fault.at, {"kind": "device_lost", "device": fault.device}))
    return events
