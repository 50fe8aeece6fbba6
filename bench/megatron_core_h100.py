"""Megatron-Core's H100 weak-scaling table against simtrain: TFLOP/s per GPU for GPT 1.7B to 462B.

Megatron-LM's README ("Performance Benchmarking", images/model_table.png) trains GPT models of 1.7B to 462B
parameters on 48 to 6,144 H100s (s = 4096, V = 131,072, dp 48 throughout) and reports each one's TFLOP/s per
GPU and MFU. Megatron-LM counts a step's model FLOPs (no recomputation) as 72 B s l h² (1 + s/(6h) +
V/(12 l h)) (megatron/training/training.py, num_floating_point_operations, for a GPT of 4h MLP). This runs
scenarios/megatron-core-h100/*.yaml (numerics off), divides those FLOPs by the simulated step time and the
GPU count, and prints each row beside the README's, with the simulation's own wall time.

    python bench/megatron_core_h100.py                    # every row
    python bench/megatron_core_h100.py --rows gpt-1.7b gpt-177b
    python bench/megatron_core_h100.py --calibrate gpt-1.7b    # the H100 efficiency that matches that row
"""
import argparse
import sys
import time
from pathlib import Path

import simtrain
from simtrain.scenario import load_scenario

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "scenarios" / "megatron-core-h100"
# The README's table: TFLOP/s per GPU, by scenario name
README_TFLOPS = {"gpt-1.7b": 408.8, "gpt-7.1b": 465.9, "gpt-16b": 489.1, "gpt-32b": 459.6, "gpt-70b": 419.7,
                 "gpt-119b": 420.5, "gpt-177b": 432.8, "gpt-314b": 474.4, "gpt-462b": 459.9}
FITTED_ROW = "gpt-1.7b"


def model_flops(scenario) -> float:
    """Megatron-LM's FLOPs of one step: 72 B s l h² (1 + s/(6h) + V/(12 l h)), B the global batch."""
    layout = scenario.parallel
    batch = scenario.data.batch_size * scenario.cluster.devices // (layout.pp * layout.tp)
    s, layers, hidden, vocab = scenario.data.seq_len, scenario.model.layers, scenario.model.width, scenario.data.vocab
    return 72 * batch * s * layers * hidden**2 * (1 + s / (6 * hidden) + vocab / (12 * layers * hidden))


def with_efficiency(scenario, efficiency: float):
    device = scenario.cluster.device.model_copy(update={"efficiency": efficiency})
    return scenario.model_copy(update={"cluster": scenario.cluster.model_copy(update={"device": device})})


def simulate(name: str, efficiency: float | None = None) -> tuple[float, float]:
    """(TFLOP/s per GPU, wall seconds) of one row, at its scenario's efficiency or the one given."""
    scenario = load_scenario(SCENARIOS / f"{name}.yaml")
    if efficiency is not None:
        scenario = with_efficiency(scenario, efficiency)
    started = time.perf_counter()
    report = simtrain.run(scenario)
    wall = time.perf_counter() - started
    return model_flops(scenario) / report.data["step_time_s"] / scenario.cluster.devices / 1e12, wall


def calibrate(name: str) -> float:
    """The efficiency at which row `name` reaches the README's TFLOP/s (to 0.01%), by the secant method."""
    target = README_TFLOPS[name]
    low, high = 0.5, 0.7
    f_low, f_high = simulate(name, low)[0] - target, simulate(name, high)[0] - target
    for _ in range(10):
        guess = high - f_high * (high - low) / (f_high - f_low)
        f_guess = simulate(name, guess)[0] - target
        print(f"efficiency {guess:.6f}: {f_guess + target:.2f} TFLOP/s", file=sys.stderr)
        if abs(f_guess) < 1e-4 * target:
            return guess
        low, f_low, high, f_high = high, f_high, guess, f_guess
    return guess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", default=list(README_TFLOPS))
    parser.add_argument("--calibrate", metavar="ROW")
    args = parser.parse_args()
    if args.calibrate:
        print(f"{args.calibrate}: efficiency {calibrate(args.calibrate):.4f}")
        return
    print("| model | tp x pp x dp | GPUs | README TFLOP/s per GPU | simtrain | error | simulated in |")
    print("|---|---|---|---|---|---|---|")
    for name in args.rows:
        tflops, wall = simulate(name)
        published = README_TFLOPS[name]
        scenario = load_scenario(SCENARIOS / f"{name}.yaml")
        layout, devices = scenario.parallel, scenario.cluster.devices
        print(f"| {name} | {layout.tp} x {layout.pp} x {devices // (layout.tp * layout.pp)} | {devices:,} | "
              f"{published} | {tflops:.1f} | {100 * (tflops - published) / published:+.1f}% | {wall:.1f} s |",
              flush=True)


if __name__ == "__main__":
    main()
