"""The same scenario for real: training on torch.distributed, and measurements of the machine it runs on.

- processes.py: start N processes of one function over a process group (spawned with a file
  rendezvous, or the group torchrun started);
- backend.py: the real backend a job runs on: its own rank, gloo communicators, the real interpreter;
- interpreter.py: runs a rank's step program (simtrain/step_ops.py) for real, timing it by the host clock;
- launch.py: `simtrain launch`, one process per rank of a scenario's job, and its
  measured report.json;
- calibrate.py and fit.py: `simtrain calibrate`, point-to-point, all-reduce and compute measurements
  fitted into a device file and a topology file that `simtrain run` takes;
- step_timing.py and step_fit.py: a data-parallel step's parts timed as a launched run runs them, and
  their fits (compute, optimizer, the ring exchange, jitter);
- machine_load.py: whether the machine was quiet enough for host-clock timings to be trusted.
"""
