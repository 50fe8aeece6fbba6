"""Fleet mode: weeks of a job on thousands of GPUs with the failures real fleets see, in seconds of host time.

A scenario with a `fleet` section (scenario/fleet.py) runs its steps on the
simulated cluster as always; their mean is the fault-free step time. Then
a simpy clock runs `fleet.horizon` around that step: failures of every
component with their blast radius on the topology (inventory.py),
detection, waiting for spare hosts, relaunch, communicator initialisation
and checkpoint load (costs.py), sync or async checkpoints, replicas in
peers' memory, slow GPUs (simulation.py); report.json gains `fleet`
(section.py) and `simtrain run` draws fleet.png (plot.py).

    simtrain run scenarios/fleet.yaml
    simtrain sweep scenarios/fleet.yaml --grid "fleet.checkpoint.interval=10 min,30 min,1 h" \\
        --metric effective_training_time
"""
