"""Simulated all-reduce bus bandwidth on DGX topologies, beside published nccl-tests figures.

For each topology file and algorithm, `benchmark_all_reduce` (numerics off,
the default channels) gives busbw for sizes 1 MiB .. 8 GiB, doubling. Prints a
markdown table of chosen sizes (the one in README.md, "Collectives as NCCL runs
them") and writes docs/busbw_dgx_a100_2node.png: busbw against size for every
algorithm on two DGX A100 nodes, with the bounds the InfiniBand adapters set.

    PYTHONPATH=. .venv/bin/python bench/nccl_busbw.py            # table + PNG, about a minute
"""
import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from simtrain.comm import channel_count  # noqa: E402
from simtrain.comm.bench import benchmark_all_reduce  # noqa: E402
from simtrain.hw.topology_builders import build_topology  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIZES = [1 << k for k in range(20, 34)]  # 1 MiB .. 8 GiB
SHOWN = [1 << 20, 1 << 24, 1 << 28, 1 << 30, 1 << 33]
# (topology file, algorithms, published figure)
RUNS = [
    ("dgx-a100-1node", ("ring", "dbtree"), "230-240 GB/s (nccl-tests #149, #175)"),
    ("dgx-h100-1node", ("ring", "dbtree"), "~370 GB/s, NCCL_ALGO=RING (nccl-tests #212)"),
    ("dgx-a100-2node", ("ring", "hierarchical", "dbtree"), "192 GB/s at scale (nccl #812)"),
    ("dgx-a100-4node", ("ring", "hierarchical", "dbtree"), "192 GB/s at scale (nccl #812)"),
]
NIC_RATE_Bps = 25e9 * 0.96  # HDR line rate x the file's ib-hdr efficiency


def adapters_bound_GBps(hosts: int, gpus_per_host: int) -> float:
    """busbw if each host's g NICs carried only the 2(n-1)/n * S that must leave it."""
    world = hosts * gpus_per_host
    return gpus_per_host * NIC_RATE_Bps * (world - 1) / world * hosts / (hosts - 1) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--png", default=str(ROOT / "docs" / "busbw_dgx_a100_2node.png"))
    args = parser.parse_args()
    header = " | ".join(_size(s) for s in SHOWN)
    print(f"| topology | algorithm | channels | busbw (GB/s) at {header} | published |")
    print("|---|---|---|" + "---|" * len(SHOWN) + "---|")
    curves = {}
    for name, algorithms, published in RUNS:
        topology = build_topology(ROOT / "topologies" / f"{name}.yaml", None, None)
        for algorithm in algorithms:
            rows = list(benchmark_all_reduce(topology, algorithm, SIZES, numerics=False))
            busbw = {row.nbytes: row.busbw_GBps for row in rows}
            channels = channel_count(algorithm, topology, topology.devices)
            cells = " | ".join(f"{busbw[s]:.1f}" for s in SHOWN)
            print(f"| {name} | {algorithm} | {channels} | {cells} | {published} |")
            if name == "dgx-a100-2node":
                curves[algorithm] = [busbw[s] for s in SIZES]
        if name.endswith("node") and not name.endswith("1node"):
            hosts = int(name.split("-")[-1][0])
            print(f"| {name} | adapters' bound | | {adapters_bound_GBps(hosts, 8):.1f} at any size | |")
    _plot(curves, args.png)


def _size(nbytes: int) -> str:
    return f"{nbytes >> 30} GiB" if nbytes >= 1 << 30 else f"{nbytes >> 20} MiB"


def _plot(curves: dict, path: str) -> None:
    figure, axes = plt.subplots(figsize=(7, 4.2))
    for algorithm, busbw in curves.items():
        axes.plot(SIZES, busbw, marker="o", markersize=3, label=f"simulated {algorithm}")
    axes.axhline(adapters_bound_GBps(2, 8), color="grey", linestyle="--",
                 label="adapters' bound, 2(n-1)/n S through 8 x 24 GB/s per host")
    axes.axhline(8 * NIC_RATE_Bps / 1e9, color="grey", linestyle=":", label="ring bound, 8 x 24 GB/s")
    axes.axhline(192, color="black", linewidth=0.8, label="NVIDIA, DGX A100 ring at scale: 192 GB/s (nccl #812)")
    axes.set_xscale("log", base=2)
    axes.set_xticks(SIZES[::2], [_size(s) for s in SIZES[::2]])
    axes.set_xlabel("all-reduce size")
    axes.set_ylabel("busbw (GB/s)")
    axes.set_title("Simulated all-reduce, two DGX A100 nodes (8 x HDR each)")
    axes.set_ylim(0, 400)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
