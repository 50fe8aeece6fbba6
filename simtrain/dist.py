"""`simtrain.dist`: users' own torch.distributed code on simulated ranks (the package is simtrain/torchdist/).

    import torch.distributed as dist
    import simtrain.dist

    def train(rank, world):
        dist.init_process_group("simtrain")
        ...
    results = simtrain.dist.spawn(train, world=8, scenario="scenarios/quickstart.yaml")

The short import name users type; the package folder is not named `dist/`,
which the standard Python .gitignore treats as build output at any depth.
Importing it registers the `simtrain` torch.distributed backend.
"""
from .torchdist import (CollectiveMismatch, Deadlock, DistReport, NumericsOffUnsupported, RankBlocked, RankFailed,
                        Representatives, RepresentativesDiverge, RepresentativesUnsupported, SpawnResult, compute,
                        distributed, now_s, spawn)

__all__ = ["spawn", "distributed", "compute", "Representatives", "SpawnResult", "DistReport", "RankFailed",
           "Deadlock", "CollectiveMismatch", "RankBlocked", "NumericsOffUnsupported", "RepresentativesDiverge",
           "RepresentativesUnsupported", "now_s"]
