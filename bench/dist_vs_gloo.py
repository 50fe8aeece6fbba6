"""Wall time of one DDP test on 8 simulated ranks (simtrain.dist.spawn) against 8 gloo processes.

The same function trains an MLP (64 -> 256 -> 10, batch 32 per rank, SGD) for
10 steps under DistributedDataParallel, once on simtrain's backend (8 rank
threads in this process) and once as a test would run it under gloo: 8 spawned
processes that rendezvous through a file. Each is timed from the call to the
results in hand: the first call in this process and the best of `--repeat`; the
parameters of the two runs are compared.

    PYTHONPATH=. .venv/bin/python bench/dist_vs_gloo.py --repeat 3
"""
import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import simtrain.dist

WORLD, STEPS = 8, 10


def train(rank, world):
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = torch.randn(32, 64, generator=data), torch.randint(0, 10, (32,), generator=data)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.module.state_dict()


def on_simtrain(rank, world):
    dist.init_process_group("simtrain")
    return train(rank, world)


def _gloo_worker(rank, world, workdir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world)
    state = train(rank, world)
    if rank == 0:
        torch.save(state, os.path.join(workdir, "rank0.pt"))
    dist.barrier()
    dist.destroy_process_group()


def on_gloo() -> dict:
    with tempfile.TemporaryDirectory(prefix="dist_vs_gloo_") as workdir:
        mp.start_processes(_gloo_worker, args=(WORLD, workdir), nprocs=WORLD, join=True, start_method="spawn")
        return torch.load(os.path.join(workdir, "rank0.pt"))


def timed(repeat: int, fn):
    """(first call's seconds, best call's seconds, the last value)."""
    times, value = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - started)
    return times[0], min(times), value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    repeat = parser.parse_args().repeat
    torch.set_num_threads(1)
    first_s, simulated_s, results = timed(repeat, lambda: simtrain.dist.spawn(on_simtrain, world=WORLD))
    gloo_first_s, gloo_s, gloo_state = timed(repeat, on_gloo)
    difference = max((results[0][name] - value).abs().max().item() for name, value in gloo_state.items())
    print(f"DDP, {WORLD} ranks, {STEPS} steps, first call / best of {repeat}: simtrain.dist {first_s:.2f} / "
          f"{simulated_s:.2f} s (simulated {results.report.data['sim_time_s'] * 1e6:.1f} us), gloo processes "
          f"{gloo_first_s:.2f} / {gloo_s:.2f} s, best against best {gloo_s / simulated_s:.0f}x, "
          f"largest parameter difference {difference:.2e}")


if __name__ == "__main__":
    main()
