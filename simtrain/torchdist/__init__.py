"""Users' own torch.distributed code on simulated ranks: the `simtrain` backend, `spawn` and a test decorator.

Imported by users as `simtrain.dist` (simtrain/dist.py).

    import torch.distributed as dist
    import simtrain.dist

    def train(rank, world):
        dist.init_process_group("simtrain")
        ...
    results = simtrain.dist.spawn(train, world=8, scenario="scenarios/quickstart.yaml")

Importing this package registers the backend. Files: launcher.py (spawn, the
decorator, the report), run.py (one spawn's shared state), scheduler.py (rank
threads taking turns on the clock), world.py (torch.distributed's global state
per rank thread), process_group.py (the backend), call_arguments.py (what a
rank hands the backend's calls, checked), programs.py (its collective
programs), arriving.py (a collective's output that waits when first read),
op_meter.py (the FLOPs and memory of the rank's torch ops), memory_categories.py
(weights, gradients, optimizer state and activations told apart from hooks),
numerics_off.py (fake floating-point tensors: `spawn(..., numerics=False)`),
fake_collectives.py (torch's functional collectives on fake tensors, posted on
the group) and representatives.py (ranks alike along a mesh dimension run once:
`spawn(..., representatives=Representatives(mesh_shape, alike_dims))`).
"""
from ..errors import (CollectiveMismatch, Deadlock, NumericsOffUnsupported, RankBlocked, RankFailed,
                      RepresentativesDiverge, RepresentativesUnsupported)
from .launcher import DistReport, SpawnResult, compute, distributed, now_s, spawn
from .representatives import Representatives

__all__ = ["spawn", "distributed", "compute", "Representatives", "SpawnResult", "DistReport", "RankFailed",
           "Deadlock", "CollectiveMismatch", "RankBlocked", "NumericsOffUnsupported", "RepresentativesDiverge",
           "RepresentativesUnsupported", "now_s"]
