"""A 1,000-point sweep of a 1,024-GPU scenario with numerics off, on this machine's cores.

The scenario is Megatron-LM's GPT 76.1B row (scenarios/megatron/gpt-76.1b.yaml: tp 8 x pp 4 x dp 32 on 1,024
A100s, representatives); the grid asks a network and device what-if, 10 x 10 x 10 points: the inter-node link's
bandwidth, the NVLink bandwidth and the device's efficiency. It runs through `simtrain sweep`'s own code
(studies/sweep.py: spawned worker processes, each running its share of the points), writing sweep.csv, sweep.json
and sweep.png. Target (issue 30): the 1,000 points in at most one hour on 2 cores.

    .venv/bin/python bench/sweep_1000.py [--per-axis 10] [--workers 2]

`--per-axis 2` is an 8-point check of the same path, seconds per point printed either way.
"""
import argparse
import tempfile
import time
from pathlib import Path

from simtrain.studies.sweep import parse_grid, run_sweep

SCENARIO = "scenarios/megatron/gpt-76.1b.yaml"


def axis(path: str, low: float, high: float, count: int, unit: str = "") -> str:
    values = [low + (high - low) * i / max(count - 1, 1) for i in range(count)]
    return f"{path}=" + ",".join(f"{value:.4g}{unit}" for value in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-axis", type=int, default=10, help="values on each of the three axes")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    args = parser.parse_args()
    grids = [parse_grid(axis("cluster.inter_node_link.bandwidth", 12.5, 50, args.per_axis, " GB/s")),
             parse_grid(axis("cluster.link.bandwidth", 150, 450, args.per_axis, " GB/s")),
             parse_grid(axis("cluster.device.efficiency", 0.55, 0.8, args.per_axis))]
    points = args.per_axis ** 3
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        rows = run_sweep(SCENARIO, grids, [], Path(out), workers=args.workers)
        wall = time.perf_counter() - start
    failed = [row for row in rows if row.get("error")]
    print(f"{points} points of {SCENARIO} on {args.workers} workers: {wall:.0f} s "
          f"({wall / points:.2f} s a point, {wall / 3600:.2f} h); failed: {len(failed)}")
    print(f"target: 1,000 points in at most 1 h -> {'met' if wall * 1000 / points <= 3600 else 'NOT met'} "
          f"(extrapolated from {points} points)" if points != 1000 else
          f"target: at most 1 h -> {'met' if wall <= 3600 else 'NOT met'}")


if __name__ == "__main__":
    main()
