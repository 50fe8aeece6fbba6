"""Every program NCCL's tuner can choose, over real gloo processes, computes what torch computes.

The tuner chooses an (algorithm, protocol) pair; the protocol (LL, LL128,
Simple) changes how a program's bytes move on the simulated links (comm/nccl.py
`Wire`), not which bytes move nor what is added: one program per (collective,
algorithm), the same under every protocol. So each program NcclGroup runs
(comm/nccl.py PROGRAMS: ring, NCCL's tree, NVLS, NVLS-tree; PAT's are run over
gloo in test_gloo_collectives.py) runs here once, as the simulator runs it, in
6 gloo processes: 4 GPU ranks (one node of 4 for NVLS, two nodes of 2
otherwise), and each node's reducing NVSwitch as a rank of its own after them
(ranks 4 and 5), as the simulator runs a switch's program as a rank after the
communicator's. Reference: each rank's seeded input, reduced or gathered with
torch in this process, in nccl-tests' buffer layout (comm/bench.py).
"""
import pytest
import torch

from gloo_processes import run_on_gloo
from simtrain.comm.gloo import run_program
from simtrain.comm.nccl import PROGRAMS, NcclGroup
from simtrain.hw.topology import Topology
from simtrain.hw.topology_builders import LinkClass, build_topology

pytestmark = pytest.mark.gloo  # real torch.distributed processes

GPUS, PROCESSES = 4, 6
NUMEL = 37 * 24 + 8  # shards and channels that do not divide it evenly
LINK = LinkClass(bandwidth=360e9, latency=0.25e-6)


def one_node() -> Topology:
    built = build_topology("switch", GPUS, LINK)
    return Topology(built.graph, built.devices, built.name, reducing=frozenset({"switch"}))


def two_nodes() -> Topology:
    built = build_topology("hierarchical", GPUS, LINK, inter_link=LinkClass(bandwidth=50e9, latency=1.5e-6),
                           gpus_per_node=GPUS // 2)
    return Topology(built.graph, built.devices, built.name, reducing=frozenset({"node0-switch", "node1-switch"}))


CASES = [(collective, algorithm) for collective, algorithms in PROGRAMS.items() for algorithm in algorithms
         if algorithm != "pat"]


def seeded_input(rank: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(2029 + rank))


def every_program(rank: int, world: int) -> dict:
    """Each case's result on GPU rank `rank` (a switch rank runs its node's program and returns nothing)."""
    results = {}
    for collective, algorithm in CASES:
        topology = one_node() if algorithm == "nvls" else two_nodes()
        group = NcclGroup(topology, topology.devices)
        protocol = "Simple" if algorithm.startswith("nvls") else "LL"
        buf = seeded_input(rank)
        if rank < GPUS:
            results[collective, algorithm] = run_program(group.call(collective, rank, buf, algorithm, protocol))
        elif algorithm.startswith("nvls"):
            _, switches = group.switches(collective, algorithm, buf)
            if rank - GPUS < len(switches):
                run_program(switches[rank - GPUS])
    return results


@pytest.fixture(scope="module")
def gloo_results():
    return run_on_gloo(every_program, PROCESSES)


@pytest.mark.parametrize("collective, algorithm", CASES)
def test_nccl_program_over_gloo_computes_what_torch_computes(gloo_results, collective, algorithm):
    inputs = [seeded_input(rank) for rank in range(GPUS)]
    total = torch.stack(inputs).sum(dim=0)
    outputs = [gloo_results[rank][collective, algorithm] for rank in range(GPUS)]
    if collective == "all_reduce":
        expected = [total] * GPUS
    elif collective == "reduce_scatter":  # rank r's shard r: the sum of every rank's shard r
        outputs = [out.tensor_split(GPUS)[rank] for rank, out in enumerate(outputs)]
        expected = list(total.tensor_split(GPUS))
    elif collective == "all_gather":  # every rank: rank j's shard j, for each j
        expected = [torch.cat([inputs[j].tensor_split(GPUS)[j] for j in range(GPUS)])] * GPUS
    elif collective == "broadcast":  # root 0's buffer everywhere
        expected = [inputs[0]] * GPUS
    else:  # reduce: the sum at root 0
        expected, outputs = [total], outputs[:1]
    for out, reference in zip(outputs, expected):
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
