"""Every collective at every size as NCCL chooses it, on the shipped DGX topologies, beside published figures.

For each DGX A100 and H100 topology file and each collective (all-reduce,
all-gather, reduce-scatter, broadcast, reduce: `benchmark_collective` with
`--algo auto`, NCCL's tuning model choosing algorithm and protocol per size;
all-to-all: `benchmark_all_to_all`, pairwise, as NCCL's is point-to-point),
busbw by nccl-tests' convention from 8 B to 8 GiB, numerics off. Prints two
markdown tables, the one of docs/validation/nccl-busbw.md's "Every collective
at every size" and the published points against the simulated ones, and
writes docs/busbw_every_size.png.

    PYTHONPATH=. .venv/bin/python bench/nccl_every_size.py      # a few minutes
"""
import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from simtrain.comm.bench import benchmark_all_to_all, benchmark_collective  # noqa: E402
from simtrain.hw.topology_builders import load_topology_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIZES = [1 << k for k in range(3, 34)]  # 8 B .. 8 GiB
SHOWN = [8, 1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 28, 1 << 30, 1 << 33]
TOPOLOGIES = ("dgx-a100-1node", "dgx-a100-2node", "dgx-a100-4node", "dgx-h100-1node", "dgx-h100-2node")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all")
# (topology, collective, algorithm forced or "auto", size, figure, unit, published range (low, high), source)
PUBLISHED = [
    ("dgx-h100-1node", "all_reduce", "auto", 1 << 33, "busbw", (480, 480),
     "~480 GB/s peak on 8 x H100 with NVLS (S. Jeaugey, NVIDIA/nccl-tests #212)"),
    ("dgx-h100-1node", "all_reduce", "auto", 1 << 33, "busbw", (476, 476),
     "476 GB/s, one H100 node, 'expected range' (NVIDIA/nccl-tests #290)"),
    ("dgx-h100-1node", "all_reduce", "auto", 1 << 32, "busbw", (475, 475),
     "475 GB/s at 4 GiB, 8 x H200 on NVLink4 (NVIDIA/nccl-tests #272)"),
    ("dgx-h100-1node", "all_gather", "auto", 1 << 33, "busbw", (370, 370),
     "~370 GB/s for non-all-reduce operations on 8 x H100 (NVIDIA/nccl-tests #212)"),
    ("dgx-h100-1node", "reduce_scatter", "auto", 1 << 33, "busbw", (370, 370), "as above (NVIDIA/nccl-tests #212)"),
    ("dgx-h100-1node", "broadcast", "auto", 1 << 33, "busbw", (370, 370), "as above (NVIDIA/nccl-tests #212)"),
    ("dgx-h100-1node", "all_reduce", "ring", 1 << 33, "busbw", (370, 370),
     "~370 GB/s with NCCL_ALGO=RING (NVIDIA/nccl-tests #212)"),
    ("dgx-h100-1node", "all_reduce", "auto", 8, "time_us", (12.49, 12.49),
     "12.49 us at 8 B, 8 x H20 on NVLink4 (deepseek-ai/DeepEP #303)"),
    ("dgx-h100-1node", "all_reduce", "auto", 1 << 10, "time_us", (16.38, 16.38), "16.38 us at 1 KiB, as above"),
    ("dgx-h100-1node", "all_reduce", "auto", 1 << 12, "time_us", (16.69, 16.69), "16.69 us at 4 KiB, as above"),
    ("dgx-a100-1node", "all_reduce", "auto", 1 << 33, "busbw", (230, 240),
     "230-240 GB/s on DGX A100 (NVIDIA/nccl-tests #149, #175)"),
    ("dgx-a100-2node", "all_reduce", "auto", 1 << 33, "busbw", (192, 192),
     "192 GB/s on DGX A100, 8 x HDR (NVIDIA/nccl #812)"),
    ("dgx-a100-4node", "all_reduce", "auto", 1 << 33, "busbw", (192, 192), "as above (NVIDIA/nccl #812)"),
    ("dgx-h100-2node", "all_reduce", "auto", 1 << 30, "busbw", (470, 470),
     "~470 GB/s expected on 2 x 8 H100, 8 x 400G (NVIDIA/nccl #2409, citing nccl-tests #309)"),
    ("dgx-h100-2node", "all_reduce", "nvls_tree", 8, "time_us", (47.60, 47.60),
     "47.60 us at 8 B, 2 x 8 H20, NDR, NCCL_ALGO=NVLSTree (NVIDIA/nccl #1244)"),
    ("dgx-h100-2node", "all_reduce", "nvls_tree", 512, "time_us", (46.58, 46.58), "46.58 us at 512 B, as above"),
]


def rows_of(topology, collective: str, algorithm: str, sizes: list[int]):
    if collective == "all_to_all":
        return list(benchmark_all_to_all(topology, "pairwise", sizes, numerics=False))
    return list(benchmark_collective(topology, collective, algorithm, sizes, numerics=False))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--png", default=str(ROOT / "docs" / "busbw_every_size.png"))
    args = parser.parse_args()
    topologies = {name: load_topology_file(ROOT / "topologies" / f"{name}.yaml") for name in TOPOLOGIES}
    curves = {}
    print("| topology | collective | " + " | ".join(_size(s) for s in SHOWN) + " |")
    print("|---|---|" + "---|" * len(SHOWN))
    for name, topology in topologies.items():
        for collective in COLLECTIVES:
            rows = rows_of(topology, collective, "auto", SIZES)
            curves[name, collective] = rows
            cells = " | ".join(_cell(row) for size, row in zip(SIZES, rows) if size in SHOWN)
            print(f"| {name} | {collective} | {cells} |")
    print()
    print("| topology | collective | algorithm | size | simulated | published | error | source |")
    print("|---|---|---|---|---|---|---|---|")
    for name, collective, algorithm, size, figure, (low, high), source in PUBLISHED:
        (row,) = rows_of(topologies[name], collective, algorithm, [size])
        value = row.busbw_GBps if figure == "busbw" else row.time_s * 1e6
        nearest = min(max(value, low), high)
        error = (value - nearest) / nearest
        unit = "GB/s" if figure == "busbw" else "us"
        shown = f"{low:g}" if low == high else f"{low:g}-{high:g}"
        print(f"| {name} | {collective} | {row.algorithm or 'pairwise'}/{row.protocol or '-'} | {_size(size)} "
              f"| {value:.1f} {unit} | {shown} {unit} | {error:+.1%} | {source} |")
    _plot(curves, args.png)


def _cell(row) -> str:
    chosen = f" {row.algorithm}/{row.protocol}" if row.algorithm else ""
    return f"{row.busbw_GBps:.3g}{chosen}"


def _size(nbytes: int) -> str:
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _plot(curves: dict, path: str) -> None:
    figure, axes = plt.subplots(2, 3, figsize=(13, 7.5), sharex=True)
    for axis, collective in zip(axes.flat, COLLECTIVES):
        for name in TOPOLOGIES:
            rows = curves[name, collective]
            axis.plot([row.nbytes for row in rows], [row.busbw_GBps for row in rows], marker="o", markersize=2,
                      label=f"simulated {name}")
        for name, coll, algorithm, size, figure_kind, (low, high), _ in PUBLISHED:
            if coll == collective and figure_kind == "busbw" and algorithm == "auto":
                axis.plot([size], [(low + high) / 2], marker="x", color="black", markersize=7)
        axis.set_xscale("log", base=2)
        axis.set_title(collective.replace("_", "-"))
        axis.set_ylabel("busbw (GB/s)")
        axis.grid(alpha=0.3)
    axes.flat[0].plot([], [], marker="x", color="black", linestyle="", label="published (table)")
    axes.flat[0].legend(fontsize=7, loc="upper left")
    for axis in axes[1]:
        axis.set_xticks([1 << k for k in range(3, 34, 6)], [_size(1 << k) for k in range(3, 34, 6)])
        axis.set_xlabel("size (nccl-tests' convention)")
    figure.suptitle("Every collective at every size, NCCL's algorithm and protocol choice (--algo auto)")
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
