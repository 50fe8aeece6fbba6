"""Fleet mode: weeks of a job on thousands of GPUs with the failures real fleets see, in seconds of host time.

A scenario with a `fleet` section (scenario/fleet.py) runs its steps on the
simulated cluster as always; their mean is the fault-free step time. Then
a simpy clock runs `fleet.horizon` around that step: failures of every
component with their blast radius on the topology (inventory.py), planned
stops and silent data corruptions among them, detection, waiting for spare
hosts, relaunch, communicator initialisation and checkpoint load (costs.py),
sync or async checkpoints, replicas in peers' memory, slow GPUs, some of
which then fail (simulation.py); what the failure model expects in closed
form, and the spare-pool warning (expected.py); report.json gains `fleet`
(section.py) and `simtrain run` draws fleet.png (plot.py). The failure mixes
come from published runs (scenario/fleet_presets.py).

    simtrain run scenarios/fleet.yaml
    simtrain sweep scenarios/fleet.yaml --grid "fleet.checkpoint.interval=10 min,30 min,1 h" \\
        --metric effective_training_time
"""
