"""All-reduce micro-benchmark in the style of nccl-tests.

For each buffer size, every rank starts the collective at time zero on an idle
network; the time is when the last rank finishes (not when the clock stops: a
flow whose rate changed leaves its earlier finish time behind as a stale,
skipped clock event). algbw = size / time and
busbw = algbw * 2(N-1)/N (nccl-tests' convention: the bandwidth each link would
need for an optimal all-reduce). With numerics on, every rank's result is
checked against the sum computed directly; with numerics off the buffers are
meta tensors and only time is simulated. Every algorithm of comm.ALGORITHMS
runs, over `channels` (None: the topology's default; errors name --algo and
--channels, the benchmark's options in `simtrain collective`).

    for row in benchmark_all_reduce(topology, "ring", [1 << 20, 1 << 30], numerics=False, channels=8):
        print(row.nbytes, row.time_s, row.busbw_GBps)
"""
from dataclasses import dataclass

import simpy
import torch

from ..hw.cluster import run_to_end
from ..hw.network import Network
from ..hw.topology import Topology
from . import build_all_reduce
from .simulated import SimCommunicator


@dataclass(frozen=True)
class CollectiveResult:
    nbytes: int
    time_s: float
    algbw_GBps: float
    busbw_GBps: float
    wrong: int | None  # ranks whose result differs from the reference sum; None without numerics


def benchmark_all_reduce(topology: Topology, algorithm: str, sizes: list[int], numerics: bool,
                         seed: int = 0, dtype: torch.dtype = torch.float32, channels: int | None = None):
    """Yield one CollectiveResult per size (bytes), each on a fresh, idle network."""
    world = topology.num_devices
    program = build_all_reduce(algorithm, topology, topology.devices, channels, "--algo", "--channels")
    element_size = torch.empty((), dtype=dtype).element_size()
    for size in sizes:
        numel = max(1, size // element_size)
        if numerics:
            generators = [torch.Generator().manual_seed(seed * 1_000_003 + rank) for rank in range(world)]
            buffers = [torch.randn(numel, generator=g, dtype=dtype) for g in generators]
            expected = torch.stack(buffers).double().sum(dim=0)
        else:
            buffers = [torch.empty(numel, dtype=dtype, device="meta") for _ in range(world)]
        env = simpy.Environment()
        comm = SimCommunicator(Network(env, topology, record=False), topology.devices, exclusive=True)
        finished_s = []
        for rank in range(world):
            comm.run(rank, program(rank, world, buffers[rank])).callbacks.append(lambda _: finished_s.append(env.now))
        run_to_end(env)
        if comm.stuck():
            raise RuntimeError(f"{algorithm} all-reduce deadlocked: ranks {comm.stuck()}")
        elapsed_s = max(finished_s)
        wrong = None
        if numerics:
            tolerance = 1e-5 * world
            wrong = sum(not torch.allclose(b.double(), expected, rtol=1e-5, atol=tolerance) for b in buffers)
        nbytes = numel * element_size
        algbw = nbytes / elapsed_s / 1e9 if elapsed_s > 0 else float("inf")
        yield CollectiveResult(nbytes, elapsed_s, algbw, algbw * 2 * (world - 1) / world, wrong)
