"""Collective micro-benchmarks in the style of nccl-tests: all-reduce and all-to-all.

For each buffer size, every rank starts the collective at time zero on an idle
network; the time is when the last rank finishes (not when the clock stops: a
flow whose rate changed leaves its earlier finish time behind as a stale,
skipped clock event). algbw = size / time, and busbw is nccl-tests'
(doc/PERFORMANCE.md): the bandwidth each link would need for the optimal
algorithm, algbw * 2(N-1)/N for all-reduce and algbw * (N-1)/N for all-to-all.
As in nccl-tests' alltoall.cu, an all-to-all's size is each rank's whole send
buffer, cut into N equal blocks (one per rank, its own included).

With numerics on, every rank's result is checked against the one computed
directly (the sum; for all-to-all, block r of every rank's buffer in source
order); with numerics off the buffers are meta tensors and only time is
simulated. An all-reduce runs any algorithm of comm.ALGORITHMS over `channels`
(None: the topology's default); an all-to-all runs `pairwise` or
`hierarchical` (comm/all_to_all.py, on the hosts the topology's links show).
Errors name --algo and --channels, the benchmark's options in `simtrain
collective`.

    for row in benchmark_all_reduce(topology, "ring", [1 << 20, 1 << 30], numerics=False, channels=8):
        print(row.nbytes, row.time_s, row.busbw_GBps)
    rows = benchmark_all_to_all(topology, "pairwise", [1 << 20], numerics=True)
"""
from dataclasses import dataclass

import simpy
import torch

from ..errors import ScenarioError
from ..hw.cluster import run_to_end
from ..hw.network import Network
from ..hw.topology import Topology
from . import build_all_reduce
from .all_to_all import ALL_TO_ALL
from .channels import layout_of
from .nccl import PROGRAMS, NcclGroup
from .nccl_tuning import PROTOCOLS
from .simulated import SimCommunicator


@dataclass(frozen=True)
class CollectiveResult:
    nbytes: int
    time_s: float
    algbw_GBps: float
    busbw_GBps: float
    wrong: int | None  # ranks whose result differs from the reference; None without numerics
    algorithm: str | None = None  # benchmark_collective: NCCL's algorithm and protocol that ran
    protocol: str | None = None


def benchmark_all_reduce(topology: Topology, algorithm: str, sizes: list[int], numerics: bool,
                         seed: int = 0, dtype: torch.dtype = torch.float32, channels: int | None = None):
    """Yield one CollectiveResult per size (bytes), each on a fresh, idle network."""
    world = topology.num_devices
    program = build_all_reduce(algorithm, topology, topology.devices, channels, "--algo", "--channels")
    element_size = torch.empty((), dtype=dtype).element_size()
    for size in sizes:
        numel = max(1, size // element_size)
        buffers = _buffers(world, numel, numerics, seed, dtype)
        elapsed_s = _time(topology, [program(rank, world, buffers[rank]) for rank in range(world)],
                          f"{algorithm} all-reduce")
        wrong = None
        if numerics:
            expected = torch.stack(_buffers(world, numel, numerics, seed, dtype)).double().sum(dim=0)
            tolerance = 1e-5 * world
            wrong = sum(not torch.allclose(b.double(), expected, rtol=1e-5, atol=tolerance) for b in buffers)
        yield _result(numel * element_size, elapsed_s, 2 * (world - 1) / world, wrong)


def benchmark_all_to_all(topology: Topology, algorithm: str, sizes: list[int], numerics: bool,
                         seed: int = 0, dtype: torch.dtype = torch.float32):
    """Yield one CollectiveResult per size (bytes of each rank's send buffer), each on a fresh, idle network."""
    if algorithm not in ALL_TO_ALL:
        raise ScenarioError(f"--algo: unknown all-to-all algorithm {algorithm!r}; known: {', '.join(ALL_TO_ALL)}")
    world = topology.num_devices
    hosts = layout_of(topology, topology.devices).hosts
    if algorithm == "hierarchical" and len({len(ranks) for ranks in hosts}) > 1:
        raise ScenarioError("--algo: hierarchical needs the same number of ranks on every host, got "
                            + ", ".join(str(len(ranks)) for ranks in hosts))
    options = {"hosts": hosts} if algorithm == "hierarchical" else {}
    element_size = torch.empty((), dtype=dtype).element_size()
    for size in sizes:
        block = max(1, size // element_size // world)
        counts = [[block] * world for _ in range(world)]
        sends = _buffers(world, block * world, numerics, seed, dtype)
        recvs = [torch.empty_like(send) for send in sends]
        programs = [ALL_TO_ALL[algorithm](rank, world, sends[rank], recvs[rank], counts, **options)
                    for rank in range(world)]
        elapsed_s = _time(topology, programs, f"{algorithm} all-to-all")
        wrong = None
        if numerics:
            blocks = [send.split(block) for send in sends]
            wrong = sum(not torch.equal(recvs[rank], torch.cat([blocks[src][rank] for src in range(world)]))
                        for rank in range(world))
        yield _result(block * world * element_size, elapsed_s, (world - 1) / world, wrong)


def _buffers(world: int, numel: int, numerics: bool, seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every rank's input: seeded random numbers, or meta tensors without numerics."""
    if not numerics:
        return [torch.empty(numel, dtype=dtype, device="meta") for _ in range(world)]
    generators = [torch.Generator().manual_seed(seed * 1_000_003 + rank) for rank in range(world)]
    return [torch.randn(numel, generator=g, dtype=dtype) for g in generators]


def _time(topology: Topology, programs: list, name: str) -> float:
    """When the last of the ranks' programs ends, all started at time zero on an idle network."""
    env = simpy.Environment()
    comm = SimCommunicator(Network(env, topology, record=False), topology.devices, exclusive=True)
    finished_s = []
    for rank, program in enumerate(programs):
        comm.run(rank, program).callbacks.append(lambda _: finished_s.append(env.now))
    run_to_end(env)
    if comm.stuck():
        raise RuntimeError(f"{name} deadlocked: ranks {comm.stuck()}")
    return max(finished_s)


def _result(nbytes: int, elapsed_s: float, bus_factor: float, wrong: int | None, *choice) -> CollectiveResult:
    algbw = nbytes / elapsed_s / 1e9 if elapsed_s > 0 else float("inf")
    return CollectiveResult(nbytes, elapsed_s, algbw, algbw * bus_factor, wrong, *choice)


def benchmark_collective(topology: Topology, collective: str, algorithm: str, sizes: list[int], numerics: bool,
                         protocol: str = "auto", seed: int = 0, dtype: torch.dtype = torch.float32,
                         generation: str | None = None):
    """Yield one CollectiveResult per size for a collective as NCCL runs it (comm/nccl.py): `algorithm` and
    `protocol` NCCL's names, or "auto" for the pair (or the protocol) its tuning model chooses per size. The
    time is the flow model's for NCCL's call (nccl.NcclGroup.call: its launch latency, then the algorithm's
    program on the protocol's view of the links). A bad algorithm raises at the call, not the first row."""
    if collective not in PROGRAMS or algorithm not in ("auto", *PROGRAMS[collective]):
        raise ScenarioError(f"--algo: NCCL's {collective} runs {', '.join(PROGRAMS.get(collective, ()))} or auto, "
                            f"got {algorithm!r}")
    if protocol not in ("auto", *PROTOCOLS):
        raise ScenarioError(f"--protocol: one of auto, {', '.join(PROTOCOLS)}, got {protocol!r}")
    return _benchmark_collective(topology, collective, algorithm, sizes, numerics, protocol, seed, dtype, generation)


def _benchmark_collective(topology, collective, algorithm, sizes, numerics, protocol, seed, dtype, generation):
    world = topology.num_devices
    element_size = torch.empty((), dtype=dtype).element_size()
    if world == 1:  # nothing to move: NCCL returns at once, and so does its model (no tables for one rank)
        for size in sizes:
            yield _result(max(1, size // element_size) * element_size, 0.0, 1.0, 0 if numerics else None,
                          "local", "none")
        return
    group = NcclGroup(topology, topology.devices, generation)
    for size in sizes:
        numel = max(world, size // element_size // world * world) if collective in _SHARDED else \
            max(1, size // element_size)
        nbytes = numel * element_size
        algo, proto = group.choose(collective, nbytes, algorithm, protocol)
        buffers = _buffers(world, numel, numerics, seed, dtype)
        inputs = [buffer.clone() for buffer in buffers] if numerics else None
        programs = [group.call(collective, rank, buffers[rank], algo, proto) for rank in range(world)]
        elapsed_s = _time(topology, programs, f"{algo} {collective}")
        wrong = _wrong(collective, inputs, buffers) if numerics else None
        yield _result(nbytes, elapsed_s, BUS_FACTOR[collective](world), wrong, algo, proto)


_SHARDED = ("all_gather", "reduce_scatter")
# nccl-tests' doc/PERFORMANCE.md: busbw = algbw * factor(N).
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0}


def _wrong(collective: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> int:
    """Ranks whose result differs from the one computed directly with torch."""
    world = len(inputs)
    total = torch.stack(inputs).double().sum(dim=0)
    if collective == "all_reduce":
        expected = [total] * world
    elif collective == "reduce_scatter":
        expected = list(total.tensor_split(world))
        outputs = [output.tensor_split(world)[rank] for rank, output in enumerate(outputs)]
    elif collective == "all_gather":
        expected = [torch.cat([inputs[rank].tensor_split(world)[rank] for rank in range(world)])] * world
    elif collective == "broadcast":
        expected = [inputs[0]] * world
    else:  # reduce: root 0
        expected, outputs = [total], outputs[:1]
    tolerance = 1e-5 * world
    return sum(not torch.allclose(out.double(), ref.double(), rtol=1e-5, atol=tolerance)
               for out, ref in zip(outputs, expected))
