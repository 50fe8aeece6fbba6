"""A real data-parallel reference: torch DistributedDataParallel over gloo.

`train_ddp(world_size, seed=..., steps=..., hidden=..., batch_size=..., lr=...)`
spawns `world_size` CPU processes that rendezvous through a file in a temporary
directory (no network ports) and train the digits MLP exactly as a real job
would: `build_model(ModelSpec(name="mlp", hidden=hidden), info, seed)` wrapped in
DistributedDataParallel, the real DataLoader with
DistributedSampler(shuffle=True, seed=seed, drop_last=True) and set_epoch each
epoch, SGD from `build_optimizer`, mean cross-entropy, `steps` optimizer steps
in all. It returns rank 0's final state_dict (keys without DDP's "module."
prefix). Tests compare simulated runs against it; it is not a test itself.

    state = train_ddp(2, seed=0, steps=5, hidden=[32], batch_size=32, lr=0.1)
"""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

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
    with tempfile.TemporaryDirectory(prefix="gloo_ddp_") as workdir:
        result_path = os.path.join(workdir, "rank0_state.pt")
        mp.start_processes(
            _worker,
            args=(world_size, workdir, result_path, seed, steps, list(hidden), batch_size, optimizer_options),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        return torch.load(result_path)


def _worker(
    rank: int,
    world_size: int,
    workdir: str,
    result_path: str,
    seed: int,
    steps: int,
    hidden: list[int],
    batch_size: int,
    optimizer_options: dict,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(workdir, 'rendezvous')}",
        rank=rank,
        world_size=world_size,
    )
    try:
        splits = load_dataset("digits", {}, seed)
        model = build_model(ModelSpec(name="mlp", hidden=hidden), splits.info, seed)
        ddp_model = DistributedDataParallel(model)
        optimizer = build_optimizer(ddp_model.parameters(), OptimizerSpec(name="sgd", **optimizer_options))
        sampler = DistributedSampler(
            splits.train, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
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
        if rank == 0:
            torch.save(ddp_model.module.state_dict(), result_path)
        dist.barrier()  # no rank tears gloo down while a peer still talks to it
    finally:
        dist.destroy_process_group()
