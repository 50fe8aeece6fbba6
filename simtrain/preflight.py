"""Every check a run makes before its clock starts, without simulating: `simtrain validate` is this.

    resolved = preflight(scenario)   # a ScenarioError (one line naming the field), or the checked cluster
    cluster = Cluster.from_resolved(resolved, record=False, seed=scenario.seed)

It resolves the cluster (topology, devices, shared memory) and checks that the
host has the memory a run needs; builds its topology (a builder's refusals;
a builder's graph is made only if a check reads it: a link's fault, a fleet's
hosts, a shared-memory store) and checks the faults' names and spares against
it, without building the network and the devices on it; then
makes every check the job's build makes:
the layout (dp x pp x tp against the devices), the data, each rank's share of
the model (pipeline stages, tensor-parallel slices, the vocabulary split),
the replicas and the scheme. For the built-in models and data sets these are
checks on the scenario's numbers (job_checks.py: the model's architecture as
data), so validation imports no torch; for a user's model or data set, and
the few checks job_checks.covered names, it builds the job as a run would, on
meta tensors (no arithmetic, no clock) on the cluster built then, which imports
torch. With a `pbt`
section, one member's job on its share of the devices; with a `fleet` section,
its hosts and replayed failures against the topology. What only the clock
can tell (running out of device memory mid-step, a fault stopping the job) it
cannot.

`simtrain.run` and `run_population` call it before they build their own
cluster, so `simtrain validate` and `simtrain run` refuse a scenario with the
same line.
"""
from .errors import ScenarioError
from .fleet.inventory import job_inventory
from .host_memory import check_scenario_fits_host
from .hw.catalog import require_rate
from .hw.fault_schedule import scheduled_faults
from .hw.resolved_cluster import ResolvedCluster, resolve_cluster
from .job_checks import check_job, covered
from .scenario import Scenario


def preflight(scenario: Scenario) -> ResolvedCluster:
    """Check the scenario as a run would before simulating; return its resolved cluster."""
    resolved = resolve_cluster(scenario.cluster, scenario.base_dir)
    if scenario.train.precision == "fp8":  # its GEMMs are charged at the fp8 rate
        require_rate(resolved.device_specs, "fp8", "train.precision")
    check_scenario_fits_host(scenario, resolved)
    parts = topology, shared_memory = resolved.network_parts()  # a builder's refusals; no network, no devices
    scheduled_faults(scenario, topology)  # the faults' names and the spares against the topology
    world = topology.num_devices - scenario.cluster.spares
    if scenario.pbt is not None:
        population = scenario.pbt.population
        if world % population:
            besides = " besides its spares" if scenario.cluster.spares else ""
            raise ScenarioError(f"pbt.population: {population} members do not split the cluster's {world} "
                                f"devices{besides} into equal groups")
        world //= population  # one member's group: every member's job is built alike
    if covered(scenario):
        check_job(scenario, shared_memory, world)
    else:
        # the simulator and torch: the user's model or data, or a check only the built job can make
        from .hw.cluster import Cluster
        from .job import Job

        cluster = Cluster.from_resolved(resolved, record=False, seed=scenario.seed, enforce_capacity=False,
                                        parts=parts)
        Job(scenario, cluster, range(world), numerics=False)
    if scenario.fleet is not None:
        job_inventory(scenario, topology)  # hosts and the failures' units against the topology
    return resolved
