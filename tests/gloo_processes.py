"""Run a function in N real gloo processes: the reference simulated results are compared with.

`run_on_gloo(fn, world)` spawns `world` CPU processes that rendezvous through a
file in a temporary directory (no network ports), initializes gloo in each,
calls `fn(rank, world)` and returns every rank's return value, in rank order.
`fn` must be a module-level function (it is pickled by name). The ranks meet at
a barrier before tearing gloo down, so none leaves while a peer still talks to it.

    results = run_on_gloo(my_collectives, 4)      # [rank 0's value, ..., rank 3's]
"""
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_on_gloo(fn, world: int) -> list:
    """Every rank's `fn(rank, world)` over a gloo process group of `world` processes."""
    with tempfile.TemporaryDirectory(prefix="gloo_") as workdir:
        mp.start_processes(_worker, args=(fn, world, workdir), nprocs=world, join=True, start_method="spawn")
        return [torch.load(os.path.join(workdir, f"rank{rank}.pt")) for rank in range(world)]


def _worker(rank: int, fn, world: int, workdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(workdir, 'rendezvous')}", rank=rank,
                            world_size=world)
    try:
        torch.save(fn(rank, world), os.path.join(workdir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
