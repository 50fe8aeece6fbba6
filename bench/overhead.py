"""Simulation overhead: simtrain against a bare torch loop doing the same numerics.

8 devices, ring all-reduce, mlp [128, 128] on digits, 200 steps. The bare loop
holds 8 model copies in one process and, per step, runs each copy's forward and
backward on its own shard, averages the gradients and steps each optimizer:
the arithmetic simtrain does, without clocks, networks or chunked collectives.
It also measures what simtrain's report holds and a training script would log:
each step's mean batch loss, and every `report.every` (10) steps and after the
last the loss over the whole training set and each layer's weight norm (one
more forward over the 1,437 training samples each time), then the final loss
and the test accuracy. Both run on one torch thread. Target: ratio <= 1.15.

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
from simtrain.evaluation import evaluate
from simtrain.scenario import ModelSpec
from simtrain.scenario import validate_scenario
from simtrain.train.data import ShardLoader, load_dataset
from simtrain.train.models import build_model, weight_norms

DEVICES, STEPS, BATCH, HIDDEN, LR, SEED = 8, 200, 32, [128, 128], 0.1, 0
EVERY = 10  # the scenario's report.every (its default)
REPEATS = 3


def bare_loop() -> tuple[float, float, tuple[float, float]]:
    """(wall, CPU) seconds of the bare loop, and its final (training-set loss, test accuracy)."""
    torch.set_num_threads(1)
    data = load_dataset("digits", {}, SEED)
    model = build_model(ModelSpec(name="mlp", hidden=HIDDEN), data.info, SEED)
    start, cpu_start = time.perf_counter(), time.process_time()
    models = [copy.deepcopy(model) for _ in range(DEVICES)]
    loaders = [ShardLoader(data.train, DEVICES, rank, BATCH, SEED) for rank in range(DEVICES)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR, foreach=False) for m in models]
    step_losses, train_losses, norms = [], [], []  # what simtrain's report holds
    for step in range(STEPS):
        losses = []
        for m, loader in zip(models, loaders):
            x, y = loader.next_batch()
            m.zero_grad(set_to_none=False)
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            losses.append(loss.item())
        step_losses.append(sum(losses) / DEVICES)
        with torch.no_grad():
            for params in zip(*(m.parameters() for m in models)):
                mean = torch.stack([p.grad for p in params]).mean(dim=0)
                for p in params:
                    p.grad.copy_(mean)
        for optimizer in optimizers:
            optimizer.step()
        if (step + 1) % EVERY == 0 or step + 1 == STEPS:
            train_losses.append(evaluate(models[0], data.train)[0])
            norms.append(weight_norms(models[0]))
    final = (evaluate(models[0], data.train)[0], evaluate(models[0], data.test)[1])
    return time.perf_counter() - start, time.process_time() - cpu_start, final


def simulated(trace: bool) -> tuple[float, float, tuple[float, float]]:
    """(wall, CPU) seconds of the simulated run, and its final (training-set loss, test accuracy)."""
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
    final = (report.data["final_loss"], report.data["final_accuracy"])
    return time.perf_counter() - start, time.process_time() - cpu_start, final


def main() -> None:
    bare_loop(), simulated(False)  # warm up imports, allocator and caches
    runs = {"bare": [], "sim": [], "sim_trace": []}
    for _ in range(REPEATS):  # alternated, so that a change of the machine's load falls on all three
        runs["bare"].append(bare_loop())
        runs["sim"].append(simulated(False))
        runs["sim_trace"].append(simulated(True))
    (bare, bare_cpu), (sim, sim_cpu), (trace, trace_cpu) = (
        (min(wall for wall, _, _ in times), min(cpu for _, cpu, _ in times)) for times in runs.values())
    print(f"best of {REPEATS}, load average {os.getloadavg()[0]:.1f}      wall          CPU")
    print(f"bare torch loop            {bare:7.3f} s      {bare_cpu:7.3f} s")
    print(f"simtrain (no trace)        {sim:7.3f} s {sim / bare:4.2f}x {sim_cpu:7.3f} s {sim_cpu / bare_cpu:4.2f}x")
    print(f"simtrain (trace recorded)  {trace:7.3f} s {trace / bare:4.2f}x {trace_cpu:7.3f} s "
          f"{trace_cpu / bare_cpu:4.2f}x")
    (bare_loss, bare_accuracy), (sim_loss, sim_accuracy) = runs["bare"][0][2], runs["sim"][0][2]
    print(f"the same training: final loss {bare_loss:.6f} (bare) {sim_loss:.6f} (simtrain), test accuracy "
          f"{bare_accuracy:.4f} {sim_accuracy:.4f}")
    print(f"target: ratio <= 1.15 -> {'met' if sim / bare <= 1.15 else 'NOT met'} (wall), "
          f"{'met' if sim_cpu / bare_cpu <= 1.15 else 'NOT met'} (CPU)")


if __name__ == "__main__":
    main()
