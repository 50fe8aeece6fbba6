"""Calibration's spans against a launched step's, and what a kernel's dispatch and an update cost on this host.

1. In one process per rank (2 ranks, gloo), on one replica of bench/fidelity.py's
   base model: launch's own step program (the Job a `simtrain launch` builds,
   real/backend.py, spans by real/interpreter.py) for the base's steps, then
   calibration's `time_steps` (real/step_timing.py) for as many rounds, the
   all-reduce on the gradient's own size, `--turns` times in turn; the median of
   each span per rank, both ways.
   calibrate.py fits calibration's spans, so they should be what launch measures.
2. Dispatch: forward and backward of a chain of k Linear(8, 8) + ReLU layers, on
   a batch of 4 and one thread, for k = 1 and 32; the slope per kernel (the
   operators torch dispatches, counted as the simulator counts them:
   op_cost.py). What a pass costs beyond its kernels is calibration's
   `pass_overhead` (docs/validation/fidelity.md).
3. The update by its size: the base's optimizer (SGD with momentum) stepping
   one tensor of 32 thousand to 800 thousand parameters on one thread, its
   median step fitted to t = a + bytes / B (real/fit.py fit_alpha_beta, bytes
   as train/precision.py update_bytes counts them): the same fit calibration
   makes (real/fit.py fit_update_costs) over its three widths' updates, here
   over sizes from a quarter of the base's update to six times it.

    PYTHONPATH=. .venv/bin/python bench/step_spans.py
"""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

import simtrain
from simtrain.op_cost import OperatorRecorder
from simtrain.real.fit import AlphaBeta, fit_alpha_beta
from simtrain.real.processes import spawn
from simtrain.train.precision import update_bytes

WORLD = 2
WARMUP = 5
UPDATE_PARAMETERS = (32_000, 133_000, 266_000, 400_000, 800_000)  # the base's update has 133 thousand


def rank_spans(rank: int, world: int, scenario_file: str, turns: int) -> dict:
    """{"launch" | "calibration": {span: median µs}}: this rank's."""
    from simtrain.hw.cluster import build_cluster
    from simtrain.job import Job
    from simtrain.real.backend import RealBackend
    from simtrain.real.interpreter import Meter
    from simtrain.real.launch import scenario_for
    from simtrain.real.step_timing import StepCase, time_steps
    from simtrain.train.precision import update_bytes

    spans = {"launch": {}, "calibration": {}}
    for _ in range(turns):
        scenario = scenario_for(scenario_file, [], world)
        cluster = build_cluster(scenario.cluster, scenario.base_dir, record=True, seed=scenario.seed,
                                enforce_capacity=False)
        meter = Meter()

        def between_steps(rank_, step):
            if step == WARMUP:
                dist.barrier()
                meter.start_recording()
            meter.boundary()
            return True
            yield  # a step program (job.py before_step)
        job = Job(scenario, cluster, range(world), between_steps=between_steps, backend=RealBackend(rank, meter))
        job.backend.start(job, rank, job.scheme.program(rank))
        for span in meter.spans:
            spans["launch"].setdefault(span.name, []).append(span.end - span.start)
        replica = job.replicas[rank]
        case = StepCase("base", replica, scenario.data.batch_size,
                        update_bytes(replica.params, scenario.train.precision, scenario.train.optimizer))
        samples = time_steps(rank, world, [case], [replica.grad_buffer.numel() * 4], scenario.train.steps - WARMUP,
                             "cpu")
        for name, part in (("forward", "forward"), ("backward", "backward"), ("optimizer step", "optimizer")):
            spans["calibration"].setdefault(name, []).extend(samples[part][0])
        spans["calibration"].setdefault("all_reduce", []).extend(samples["all_reduce"][0][0])
    return {way: {name: statistics.median(times) * 1e6 for name, times in by_name.items()}
            for way, by_name in spans.items()}


def dispatch_us_per_kernel() -> tuple[float, float]:
    """(forward, backward) µs a kernel: the slope between chains of 1 and 32 small layers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    points = []
    for depth in (1, 32):
        model = torch.nn.Sequential(*[layer for _ in range(depth) for layer in (torch.nn.Linear(8, 8), torch.nn.ReLU())])
        x = torch.randn(4, 8)
        with OperatorRecorder() as forward_ops:
            loss = model(x).sum()
        with OperatorRecorder() as backward_ops:
            loss.backward()
        forward, backward = [], []
        for repeat in range(320):
            start = time.perf_counter()
            loss = model(x).sum()
            middle = time.perf_counter()
            loss.backward()
            end = time.perf_counter()
            if repeat >= 20:
                forward.append(middle - start)
                backward.append(end - middle)
        points.append((forward_ops.kernels, backward_ops.kernels, statistics.median(forward),
                       statistics.median(backward)))
    torch.set_num_threads(threads)
    (kf1, kb1, f1, b1), (kf2, kb2, f2, b2) = points
    return (f2 - f1) / (kf2 - kf1) * 1e6, (b2 - b1) / (kb2 - kb1) * 1e6


def update_cost_by_size(optimizer) -> tuple[list[tuple[int, float]], AlphaBeta]:
    """[(bytes, median seconds)] of one-tensor updates of each size, and their fit t = a + bytes / B."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    points = []
    for count in UPDATE_PARAMETERS:
        parameter = torch.nn.Parameter(torch.randn(count))
        parameter.grad = torch.randn(count)
        step = torch.optim.SGD([parameter], lr=optimizer.lr, momentum=optimizer.momentum)
        times = []
        for repeat in range(220):
            start = time.perf_counter()
            step.step()
            if repeat >= 20:
                times.append(time.perf_counter() - start)
        points.append((update_bytes([parameter], "fp32", optimizer), statistics.median(times)))
    torch.set_num_threads(threads)
    return points, fit_alpha_beta(*zip(*points))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    from fidelity import BASE_BATCH, scenario_dict  # bench/fidelity.py's base scenario
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average "
          f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    with tempfile.TemporaryDirectory() as folder:
        scenario_file = Path(folder) / "base.yaml"
        scenario_file.write_text(yaml.safe_dump(scenario_dict({})))
        ranks = spawn(rank_spans, WORLD, args=(str(scenario_file), args.turns))
        optimizer = simtrain.load_scenario(scenario_file).train.optimizer
    print(f"\nmedian spans in µs, base model (batch {BASE_BATCH}), {args.turns} turns, rank 0 / rank 1")
    print("| span | launch's step program | calibration (time_steps) |\n|---|---|---|")
    for name in ("forward", "backward", "optimizer step", "all_reduce"):
        launched = " / ".join(f"{r['launch'][name]:,.0f}" for r in ranks)
        calibrated = " / ".join(f"{r['calibration'][name]:,.0f}" for r in ranks)
        print(f"| {name} | {launched} | {calibrated} |")
    forward, backward = dispatch_us_per_kernel()
    print(f"\ndispatch: {forward:.1f} µs a kernel forward, {backward:.1f} µs backward (chains of 1 and 32 "
          "Linear(8, 8) + ReLU, one thread)")
    points, fit = update_cost_by_size(optimizer)
    print("\nupdate (the base's SGD with momentum, one tensor, one thread): "
          + ", ".join(f"{count:,} parameters {seconds * 1e6:.1f} µs" for count, (_, seconds) in
                      zip(UPDATE_PARAMETERS, points))
          + f"; t = {fit.latency_s * 1e6:.1f} µs + bytes / {fit.bandwidth_Bps / 1e9:.1f} GB/s, largest residual "
          f"{fit.max_residual:.0%}")


if __name__ == "__main__":
    main()
