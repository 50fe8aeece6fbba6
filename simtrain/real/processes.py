"""Start one process per rank of a torch.distributed group and call a function in each.

`spawn(fn, world, args)` starts `world` CPU processes (the forkserver start
method: each is forked from one server process, started on the first spawn with
torch and its distributed APIs imported, so a rank does not import torch afresh;
it imports `fn`'s module from the same PYTHONPATH) that rendezvous through
a file in a temporary folder (no network port), initialize `backend`, call
`fn(rank, world, *args)` with torch on one host thread, meet at a barrier (so
no rank tears the group down while a peer still talks to it) and return; the
parent gets every rank's return value, in rank order (each saved with
torch.save, so tensors travel as they are).

`torchrun_world()` reads the group torchrun describes in its environment
variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR); `join(backend)` joins it.

    values = spawn(my_function, 4, args=(scenario_path,))      # [rank 0's value, ..., rank 3's]
    if torchrun_world(): join("gloo"); ...
"""
import gc
import os
import sys
import tempfile
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SERVER_IMPORTS = ["torch", "torch.distributed.fsdp", "torch.distributed.pipelining", "torch.distributed.tensor"]
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")


class World(NamedTuple):
    rank: int
    world: int
    local_rank: int


def torchrun_world() -> World | None:
    """The group torchrun started this process in, or None when its variables are not all set."""
    if not all(name in os.environ for name in TORCHRUN_VARIABLES):
        return None
    return World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))


def join(backend: str) -> World:
    """Join torchrun's group (env:// rendezvous) with torch on one host thread."""
    world = torchrun_world()
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method="env://", rank=world.rank, world_size=world.world)
    return world


def spawn(fn, world: int, args: tuple = (), backend: str = "gloo") -> list:
    """Every rank's `fn(rank, world, *args)` over a `backend` group of `world` spawned processes.

    `fn` must be a module-level function (it is pickled by name)."""
    mp.set_forkserver_preload(SERVER_IMPORTS)  # imported once, by the server, not once per rank
    with tempfile.TemporaryDirectory(prefix="simtrain_ranks_") as workdir:
        mp.start_processes(_worker, args=(fn, world, args, backend, workdir), nprocs=world, join=True,
                           start_method="forkserver")
        return [torch.load(os.path.join(workdir, f"rank{rank}.pt"), weights_only=False) for rank in range(world)]


def _worker(rank: int, fn, world: int, args: tuple, backend: str, workdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{os.path.join(workdir, 'rendezvous')}", rank=rank,
                            world_size=world)
    try:
        torch.save(fn(rank, world, *args), os.path.join(workdir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        gc.collect()  # objects in reference cycles that hold the group (a DDP reducer) go while it is alive
        dist.destroy_process_group()
    # Saved and torn down: the process ends here. Python's own exit would finalize what still holds the group
    # with gloo's C++ threads running, and on a loaded host one could be destroyed still joinable:
    # std::terminate, SIGABRT ("terminate called without an active exception", issue 31).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
