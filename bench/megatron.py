"""Table 1 of Narayanan et al. 2021 against simtrain: achieved TFLOP/s per GPU for GPT 1.7B to 1T.

The paper ("Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC'21) trains GPT models with s = 2048, V = 51,200,
interleaved 1F1B and full activation recomputation on DGX A100 nodes, and
counts a step's model FLOPs as 96 B s l h^2 (1 + s/(6h) + V/(16 l h)). This
runs scenarios/megatron/*.yaml (numerics off), divides those FLOPs by the
simulated step time and the GPU count, and prints each row beside the
paper's, with the simulation's own wall time.

    python bench/megatron.py                      # every row
    python bench/megatron.py --rows gpt-1.7b gpt-1008b
    python bench/megatron.py --calibrate gpt-145.6b   # the device efficiency that matches that row

`--calibrate` solves for `cluster.device.efficiency` on one row (secant on
the simulated TFLOP/s, which rises with the efficiency); the scenarios carry
the value it gave.
"""
import argparse
import sys
import time
from pathlib import Path

import simtrain
from simtrain.scenario import load_scenario

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "scenarios" / "megatron"
# Table 1 (Narayanan et al. 2021): achieved TFLOP/s per GPU, by scenario name
PAPER_TFLOPS = {"gpt-1.7b": 137, "gpt-3.6b": 138, "gpt-7.5b": 142, "gpt-18.4b": 135, "gpt-39.1b": 138,
                "gpt-76.1b": 140, "gpt-145.6b": 148, "gpt-310.1b": 155, "gpt-529.6b": 163, "gpt-1008b": 163}


def model_flops(scenario) -> float:
    """The paper's FLOPs of one step (forward, backward and the recomputed forward)."""
    layout = scenario.parallel
    devices = scenario.cluster.devices
    batch = scenario.data.batch_size * devices // (layout.pp * layout.tp)
    s, layers, hidden, vocab = scenario.data.seq_len, scenario.model.layers, scenario.model.width, scenario.data.vocab
    return 96 * batch * s * layers * hidden**2 * (1 + s / (6 * hidden) + vocab / (16 * layers * hidden))


def simulate(name: str, efficiency: float | None = None) -> tuple[float, float]:
    """(TFLOP/s per GPU, wall seconds) of one row, at its scenario's efficiency or the one given."""
    scenario = load_scenario(SCENARIOS / f"{name}.yaml")
    if efficiency is not None:
        device = {**scenario.cluster.device, "efficiency": efficiency}
        scenario = scenario.model_copy(update={"cluster": scenario.cluster.model_copy(update={"device": device})})
    started = time.perf_counter()
    report = simtrain.run(scenario)
    wall = time.perf_counter() - started
    return model_flops(scenario) / report.data["step_time_s"] / scenario.cluster.devices / 1e12, wall


def calibrate(name: str) -> float:
    """The efficiency at which row `name` reaches the paper's TFLOP/s (to 0.1%)."""
    target = PAPER_TFLOPS[name]
    low, high = 0.5, 0.7
    f_low, f_high = simulate(name, low)[0] - target, simulate(name, high)[0] - target
    for _ in range(8):
        guess = high - f_high * (high - low) / (f_high - f_low)
        f_guess = simulate(name, guess)[0] - target
        print(f"efficiency {guess:.4f}: {f_guess + target:.1f} TFLOP/s", file=sys.stderr)
        if abs(f_guess) < 1e-3 * target:
            return guess
        low, f_low, high, f_high = high, f_high, guess, f_guess
    return guess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", default=list(PAPER_TFLOPS))
    parser.add_argument("--calibrate", metavar="ROW")
    args = parser.parse_args()
    if args.calibrate:
        print(f"{args.calibrate}: efficiency {calibrate(args.calibrate):.4f}")
        return
    print("| model | GPUs | paper TFLOP/s per GPU | simtrain | error | simulated in |")
    print("|---|---|---|---|---|---|")
    for name in args.rows:
        tflops, wall = simulate(name)
        paper = PAPER_TFLOPS[name]
        devices = load_scenario(SCENARIOS / f"{name}.yaml").cluster.devices
        print(f"| {name} | {devices:,} | {paper} | {tflops:.1f} | {100 * (tflops - paper) / paper:+.1f}% | "
              f"{wall:.1f} s |", flush=True)


if __name__ == "__main__":
    main()
