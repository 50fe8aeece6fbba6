"""Simulation overhead: simtrain against a bare torch loop doing the same numerics.

8 devices, ring all-reduce, mlp [128, 128] on digits, 200 steps. The bare loop
holds 8 model copies in one process and, per step, runs each copy's forward and
backward on its own shard, averages the gradients and steps each optimizer:
the arithmetic simtrain does, without clocks, networks or chunked collectives.
Both run on one torch thread. Target: ratio <= 1.15.

Each is timed by the wall clock and by the process's CPU time (`time.process_time`),
which a machine shared with other work disturbs less; the load average is printed.

    .venv/bin/python bench/overhead.py
"""
import copy
import os
import time

import torch
import torch.nn.functional as F

import simtrain
from simtrain.scenario import ModelSpec
from simtrain.scenario import validate_scenario
from simtrain.train.data import ShardLoader, load_dataset
from simtrain.train.models import build_model

DEVICES, STEPS, BATCH, HIDDEN, LR, SEED = 8, 200, 32, [128, 128], 0.1, 0
REPEATS = 3


def bare_loop() -> tuple[float, float]:
    """(wall, CPU) seconds of the bare loop."""
    torch.set_num_threads(1)
    data = load_dataset("digits", {}, SEED)
    model = build_model(ModelSpec(name="mlp", hidden=HIDDEN), data.info, SEED)
    start, cpu_start = time.perf_counter(), time.process_time()
    models = [copy.deepcopy(model) for _ in range(DEVICES)]
    loaders = [ShardLoader(data.train, DEVICES, rank, BATCH, SEED) for rank in range(DEVICES)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR, foreach=False) for m in models]
    for _ in range(STEPS):
        for m, loader in zip(models, loaders):
            x, y = loader.next_batch()
            m.zero_grad(set_to_none=False)
            F.cross_entropy(m(x), y).backward()
        with torch.no_grad():
            for params in zip(*(m.parameters() for m in models)):
                mean = torch.stack([p.grad for p in params]).mean(dim=0)
                for p in params:
                    p.grad.copy_(mean)
        for optimizer in optimizers:
            optimizer.step()
    return time.perf_counter() - start, time.process_time() - cpu_start


def simulated(trace: bool) -> tuple[float, float]:
    """(wall, CPU) seconds of the simulated run."""
    scenario = validate_scenario({
        "name": "overhead", "seed": SEED,
        "cluster": {"topology": "ring", "devices": DEVICES},
        "model": {"name": "mlp", "hidden": HIDDEN},
        "data": {"name": "digits", "batch_size": BATCH},
        "train": {"steps": STEPS, "optimizer": {"name": "sgd", "lr": LR}},
        "parallel": {"all_reduce": "ring"},
        "report": {"trace": trace},
    })
    start, cpu_start = time.perf_counter(), time.process_time()
    report = simtrain.run(scenario)
    if trace:
        report.to_json()
    return time.perf_counter() - start, time.process_time() - cpu_start


def main() -> None:
    bare_loop(), simulated(False)  # warm up imports, allocator and caches
    runs = {"bare": [], "sim": [], "sim_trace": []}
    for _ in range(REPEATS):  # alternated, so that a change of the machine's load falls on all three
        runs["bare"].append(bare_loop())
        runs["sim"].append(simulated(False))
        runs["sim_trace"].append(simulated(True))
    (bare, bare_cpu), (sim, sim_cpu), (trace, trace_cpu) = (
        (min(wall for wall, _ in times), min(cpu for _, cpu in times)) for times in runs.values())
    print(f"best of {REPEATS}, load average {os.getloadavg()[0]:.1f}      wall          CPU")
    print(f"bare torch loop            {bare:7.3f} s      {bare_cpu:7.3f} s")
    print(f"simtrain (no trace)        {sim:7.3f} s {sim / bare:4.2f}x {sim_cpu:7.3f} s {sim_cpu / bare_cpu:4.2f}x")
    print(f"simtrain (trace recorded)  {trace:7.3f} s {trace / bare:4.2f}x {trace_cpu:7.3f} s "
          f"{trace_cpu / bare_cpu:4.2f}x")
    print(f"target: ratio <= 1.15 -> {'met' if sim / bare <= 1.15 else 'NOT met'} (wall), "
          f"{'met' if sim_cpu / bare_cpu <= 1.15 else 'NOT met'} (CPU)")


if __name__ == "__main__":
    main()
