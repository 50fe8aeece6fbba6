"""Simulator speed at scale: ring all-reduce of 100 MB, numerics off.

On 64, 256, 1,024 and 4,096 devices of a ring topology, one all-reduce runs on
meta tensors; we time the simulation (wall clock, best of a few) and divide by
the number of transfers, 2(N-1) per rank. Target: <= 2 s at 1,024 devices and
wall time growing no faster than the number of transfers.

    .venv/bin/python bench/scale.py [--max-devices 4096]
"""
import argparse
import time

from simtrain.comm.bench import benchmark_all_reduce
from simtrain.hw.topology_builders import LinkClass, build_topology

SIZE = 100 * 10**6
LINK = LinkClass(bandwidth=100e9, latency=5e-6)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-devices", type=int, default=4096)
    args = parser.parse_args()
    print(f"{'devices':>8} {'transfers':>11} {'wall (s)':>9} {'us/transfer':>12} {'sim time (ms)':>14} {'closed form (ms)':>17}")
    for devices in (64, 256, 1024, 4096):
        if devices > args.max_devices:
            break
        topology = build_topology("ring", devices, LINK)
        topology.path(topology.devices[0], topology.devices[1])  # warm networkx import paths
        repeats = 3 if devices <= 1024 else 1
        best, sim_time = float("inf"), None
        for _ in range(repeats):
            start = time.perf_counter()
            (row,) = benchmark_all_reduce(topology, "ring", [SIZE], numerics=False)
            best = min(best, time.perf_counter() - start)
            sim_time = row.time_s
        transfers = 2 * (devices - 1) * devices
        closed = 2 * (devices - 1) * (LINK.latency + SIZE / devices / LINK.bandwidth)
        print(f"{devices:>8} {transfers:>11,} {best:>9.2f} {best / transfers * 1e6:>12.2f} "
              f"{sim_time * 1e3:>14.3f} {closed * 1e3:>17.3f}")


if __name__ == "__main__":
    main()
