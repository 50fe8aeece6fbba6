"""PBT against random search on scenarios/pbt.yaml: the same population and device budget, over seeds.

Random search is the same scenario with `pbt.quantile_fraction: 0`: the members
draw the same initial hyperparameters (same seed) and never copy or explore.
For each seed and each kind it prints the best validation loss any member
reached (at a round or at the end), the best member's final validation loss
and test accuracy, the simulated time at which some member first reached each
target, and the simulated time of the whole run.

    .venv/bin/python bench/pbt_vs_random_search.py [SEEDS] [TARGETS]   # default 0-4, 0.2,0.15,0.13
"""
import sys
from pathlib import Path

import simtrain

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "pbt.yaml"


def measure(seed: int, overrides: list[str], targets: list[float]) -> dict:
    report = simtrain.run_population(simtrain.load_scenario(SCENARIO, [f"seed={seed}", "report.trace=false",
                                                                        *overrides]))
    section = report.data["pbt"]
    points = sorted((time_s, metric) for member in section["members"] for _, time_s, metric in member["metrics"])
    best = section["members"][section["best"]]
    return {
        "best_reached": min(metric for _, metric in points),
        "best_final": best["final_metric"],
        "test_accuracy": report.data["final_accuracy"],
        "to_target_ms": [next((time_s * 1e3 for time_s, metric in points if metric <= target), None)
                         for target in targets],
        "sim_time_ms": report.data["sim_time_s"] * 1e3,
        "exploits": len(section["events"]),
    }


def main() -> None:
    seeds = [int(s) for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else list(range(5))
    targets = [float(t) for t in sys.argv[2].split(",")] if len(sys.argv) > 2 else [0.2, 0.15, 0.13]
    print("| seed | run | best val_loss reached | best member: final val_loss, test accuracy | "
          + " | ".join(f"time to {t:g}" for t in targets) + " | sim time | exploits |")
    print("|---|---|---|---|" + "---|" * len(targets) + "---|---|")
    for seed in seeds:
        for label, overrides in (("PBT", []), ("random search", ["pbt.quantile_fraction=0"])):
            row = measure(seed, overrides, targets)
            times = " | ".join("never" if t is None else f"{t:.2f} ms" for t in row["to_target_ms"])
            print(f"| {seed} | {label} | {row['best_reached']:.4f} | {row['best_final']:.4f}, "
                  f"{row['test_accuracy']:.2%} | {times} | {row['sim_time_ms']:.2f} ms | {row['exploits']} |",
                  flush=True)


if __name__ == "__main__":
    main()
