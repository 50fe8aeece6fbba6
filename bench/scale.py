"""Simulator speed and host memory at scale: ring all-reduce of 100 MB, numerics off.

On 64 to 8,192 devices (up to 131,072 with --max-devices) of a ring topology, one all-reduce runs on meta tensors
(`benchmark_all_reduce`: an idle network, every rank posting at time zero), each
device count in a fresh process so that its peak resident memory is its own.
The network times the ring as a group (Network.time_ring, hw/ring_timing.py); with
`--flow-by-flow` it moves every transfer through the network as a flow (the
path any other traffic takes), up to `--flow-max-devices`. Targets: <= 2 s at
1,024 devices and <= 60 s at 8,192, host memory linear in the device count;
<= 60 s for 100 MiB at 131,072 (`--bytes 104857600 --max-devices 131072`: a
buffer that splits evenly over a power-of-two ring, whose positions then run
in lockstep, hw/ring_timing.py).

    .venv/bin/python bench/scale.py [--max-devices 8192] [--bytes 100000000] [--flow-by-flow]
"""
import argparse
import json
import resource
import subprocess
import sys
import time

BANDWIDTH, LATENCY = 100e9, 5e-6
DEVICE_COUNTS = (64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def one(devices: int, size: int, exclusive: bool) -> dict:
    """Time one all-reduce in this process: wall seconds, simulated seconds, peak RSS."""
    import simpy
    import torch

    from simtrain.comm import build_all_reduce
    from simtrain.comm.simulated import SimCommunicator
    from simtrain.hw.cluster import run_to_end
    from simtrain.hw.network import Network
    from simtrain.hw.topology_builders import LinkClass, build_topology

    start = time.perf_counter()
    topology = build_topology("ring", devices, LinkClass(bandwidth=BANDWIDTH, latency=LATENCY))
    program = build_all_reduce("ring", topology, topology.devices, 1)
    env = simpy.Environment()
    comm = SimCommunicator(Network(env, topology, record=False), topology.devices, exclusive=exclusive)
    ends = []
    for rank in range(devices):
        buffer = torch.empty(size // 4, device="meta")
        comm.run(rank, program(rank, devices, buffer)).callbacks.append(lambda _: ends.append(env.now))
    run_to_end(env)
    return {"wall_s": time.perf_counter() - start, "sim_s": max(ends),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-devices", type=int, default=8192)
    parser.add_argument("--bytes", type=int, default=100 * 10**6, help="The buffer each rank all-reduces.")
    parser.add_argument("--flow-by-flow", action="store_true", help="Also time every transfer as a flow.")
    parser.add_argument("--flow-max-devices", type=int, default=1024)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--flows", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.bytes, exclusive=not args.flows)))
        return
    baseline = json.loads(subprocess.run([sys.executable, "-c", "import json, resource, torch, simtrain.comm; "
                                          "print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss"
                                          " * 1024))"], capture_output=True, text=True, check=True).stdout)
    print(f"imports alone: {baseline / 2**20:.0f} MiB resident")
    print(f"{'devices':>8} {'path':>13} {'transfers':>11} {'wall (s)':>9} {'peak RSS (MiB)':>15} "
          f"{'above imports':>14} {'sim time (ms)':>14} {'closed form (ms)':>17}")
    for devices in DEVICE_COUNTS:
        if devices > args.max_devices:
            break
        paths = ["group"] + (["flow-by-flow"] if args.flow_by_flow and devices <= args.flow_max_devices else [])
        for path in paths:
            command = [sys.executable, __file__, "--one", str(devices), "--bytes", str(args.bytes)] + (
                ["--flows"] if path != "group" else [])
            row = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
            transfers = 2 * (devices - 1) * devices
            closed = 2 * (devices - 1) * (LATENCY + args.bytes / devices / BANDWIDTH)
            print(f"{devices:>8} {path:>13} {transfers:>11,} {row['wall_s']:>9.2f} "
                  f"{row['peak_rss_bytes'] / 2**20:>15.0f} {(row['peak_rss_bytes'] - baseline) / 2**20:>14.0f} "
                  f"{row['sim_s'] * 1e3:>14.3f} {closed * 1e3:>17.3f}", flush=True)


if __name__ == "__main__":
    main()
