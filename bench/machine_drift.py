"""How this host's speed drifts, whether the guest sees it, and whether a longer calibration averages it out.

1. A fixed piece of work (60 products of 512 x 512 matrices on the host's
   threads) timed every half second for `--seconds`, each with the share of
   CPU time /proc/stat counts as stolen by the hypervisor over it: slow
   phases with no steal are a neighbour on the same physical cores or
   memory, which the guest cannot tell.
2. `--calibrations` calibrations (bench/fidelity.py's base, 2 ranks) at each of
   `--repeats` rounds, in turn, each predicting the base and three held-out
   configurations (`simtrain run` on the calibration's files): the standard
   deviation of each configuration's prediction over the calibrations, by
   rounds. If the machine's phases were shorter than a calibration, more
   rounds would narrow it.

    PYTHONPATH=. .venv/bin/python bench/machine_drift.py
"""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml

from simtrain.real.calibrate import calibrate

PREDICTED = 4  # bench/fidelity.py's first configurations: the base, batch 32, batch 256, width 512


def cpu_and_steal_ticks() -> tuple[int, int]:
    """(all CPU ticks, stolen ticks) so far, from /proc/stat's first line (user ... steal)."""
    ticks = [int(field) for field in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    return sum(ticks), ticks[7]


def work_and_steal(seconds: float) -> list[tuple[float, float]]:
    """[(seconds the fixed work took, share of CPU time stolen meanwhile)], one every half second."""
    matrix = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    samples, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        total, stolen = cpu_and_steal_ticks()
        start = time.perf_counter()
        for _ in range(60):
            matrix @ matrix
        took = time.perf_counter() - start
        total_after, stolen_after = cpu_and_steal_ticks()
        samples.append((took, (stolen_after - stolen) / max(1, total_after - total)))
        time.sleep(0.5)
    return samples


def prediction_spread(calibrations: int, repeats: list[int]) -> dict[int, list[list[float]]]:
    """{rounds: [[predicted step of each configuration] per calibration]}, the round counts taking turns."""
    from fidelity import CONFIGURATIONS, predict, scenario_dict  # bench/fidelity.py's base and its prediction
    predicted = {rounds: [] for rounds in repeats}
    with tempfile.TemporaryDirectory() as folder:
        base = Path(folder) / "base.yaml"
        base.write_text(yaml.safe_dump(scenario_dict({})))
        for turn in range(calibrations):
            for rounds in repeats:
                out = Path(folder) / f"calibration_{rounds}_{turn}"
                start = time.perf_counter()
                calibration = calibrate(2, out, model_of=base, repeats=rounds)
                took = time.perf_counter() - start
                steps = [predict(out / f"{index}.yaml", overrides, out, calibration, True)["step_time_s"]
                         for index, (_, overrides) in enumerate(CONFIGURATIONS[:PREDICTED])]
                predicted[rounds].append(steps)
                print(f"{rounds} rounds ({took:.0f} s): " + ", ".join(f"{step * 1e3:.3f} ms" for step in steps),
                      flush=True)
    return predicted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--calibrations", type=int, default=5)
    parser.add_argument("--repeats", type=int, nargs="+", default=[20, 100], help="calibration's rounds, compared")
    args = parser.parse_args()
    from fidelity import CONFIGURATIONS
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average "
          f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    samples = work_and_steal(args.seconds)
    took = [seconds for seconds, _ in samples]
    print(f"fixed work, {len(samples)} times over {args.seconds:.0f} s: {min(took) * 1e3:.1f} to "
          f"{max(took) * 1e3:.1f} ms (median {statistics.median(took) * 1e3:.1f}); CPU time stolen: largest "
          f"{max(steal for _, steal in samples):.1%}, nonzero in {sum(steal > 0 for _, steal in samples)}")
    predicted = prediction_spread(args.calibrations, args.repeats)
    print("| rounds | " + " | ".join(label for label, _ in CONFIGURATIONS[:PREDICTED]) + " |")
    print("|---|" + "---|" * PREDICTED)
    for rounds, runs in predicted.items():
        spreads = [statistics.stdev(steps) / statistics.mean(steps) for steps in zip(*runs)]
        print(f"| {rounds} | " + " | ".join(f"{spread:.1%}" for spread in spreads) + " |")


if __name__ == "__main__":
    main()
