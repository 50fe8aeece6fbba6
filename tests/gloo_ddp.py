"""A real data-parallel reference: torch DistributedDataParallel over gloo.

`train_ddp(world_size, seed=..., steps=..., hidden=..., batch_size=..., lr=...)`
spawns `world_size` CPU processes (simtrain.real.processes.spawn: a file
rendezvous in a temporary directory, no network ports) that train the digits MLP exactly as a real job
would: `build_model(ModelSpec(name="mlp", hidden=hidden), info, seed)` wrapped in
DistributedDataParallel, the real DataLoader with
DistributedSampler(shuffle=True, seed=seed, drop_last=True) and set_epoch each
epoch, SGD from `build_optimizer`, mean cross-entropy, `steps` optimizer steps
in all. It returns rank 0's final state_dict (keys without DDP's "module."
prefix). Tests compare simulated runs against it; it is not a test itself.

    state = train_ddp(2, seed=0, steps=5, hidden=[32], batch_size=32, lr=0.1)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from simtrain.real.processes import spawn
from simtrain.scenario import ModelSpec, OptimizerSpec
from simtrain.train.data import load_dataset
from simtrain.train.models import build_model
from simtrain.train.optim import build_optimizer


def train_ddp(
    world_size: int,
    *,
    seed: int,
    steps: int,
    hidden: list[int],
    batch_size: int,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
) -> dict[str, torch.Tensor]:
    """Rank 0's final parameters after `steps` DDP steps on digits over `world_size` gloo ranks."""
    optimizer_options = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
    return spawn(_train, world_size, args=(seed, steps, list(hidden), batch_size, optimizer_options))[0]


def _train(rank: int, world_size: int, seed: int, steps: int, hidden: list[int], batch_size: int,
           optimizer_options: dict) -> dict[str, torch.Tensor] | None:
    splits = load_dataset("digits", {}, seed)
    model = build_model(ModelSpec(name="mlp", hidden=hidden), splits.info, seed)
    ddp_model = DistributedDataParallel(model)
    optimizer = build_optimizer(ddp_model.parameters(), OptimizerSpec(name="sgd", **optimizer_options))
    sampler = DistributedSampler(splits.train, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                 drop_last=True)
    loader = DataLoader(splits.train, batch_size=batch_size, sampler=sampler, drop_last=True)
    step, epoch = 0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(ddp_model(x), y).backward()
            optimizer.step()
            step += 1
            if step == steps:
                break
        epoch += 1
    return ddp_model.module.state_dict() if rank == 0 else None
