"""The simulated collectives are real algorithms: the same programs over real gloo equal the simulation
and dist.all_reduce, for every algorithm and with several channels, with 2 and 4 processes (2 hosts of
1 and of 2 GPUs); NCCL's PAT all-gather and reduce-scatter equal torch's, computed directly."""
import pytest
import simpy
import torch
import torch.distributed as dist

from gloo_processes import run_on_gloo
from simtrain.comm import ALGORITHMS, build_all_reduce
from simtrain.comm.gloo import run_program
from simtrain.comm.pat import pat_all_gather, pat_reduce_scatter
from simtrain.comm.simulated import SimCommunicator
from simtrain.hw.network import Network
from simtrain.hw.topology_builders import LinkClass, build_topology

pytestmark = pytest.mark.gloo  # real torch.distributed processes

NUMEL = 1001  # chunks that do not divide evenly
# (algorithm, channels): channels None is the default, one per rail across the two hosts
CASES = [*((algorithm, None) for algorithm in ALGORITHMS), ("ring", 3), ("hierarchical", 2), ("dbtree", 3)]


def topology(world):
    return build_topology("hierarchical", world, LinkClass(100e9, 1e-6), inter_link=LinkClass(10e9, 2e-6),
                          gpus_per_node=world // 2)


def seeded_input(rank):
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(4321 + rank))


def programs_and_all_reduce(rank, world):
    """Every case's program over gloo, and dist.all_reduce, on this rank's seeded input."""
    topo = topology(world)
    results = {}
    for algorithm, channels in CASES:
        buf = seeded_input(rank)
        all_reduce = build_all_reduce(algorithm, topo, topo.devices, channels)
        results[algorithm, channels] = run_program(all_reduce(rank, world, buf, average=True)).clone()
    for collective, program in (("all_gather", pat_all_gather), ("reduce_scatter", pat_reduce_scatter)):
        results["pat", collective] = run_program(program(rank, world, seeded_input(rank))).clone()
    reference = seeded_input(rank)
    dist.all_reduce(reference)
    results["torch.distributed"] = reference / world
    return results


@pytest.fixture(scope="module", params=[2, 4])
def gloo_results(request):
    world = request.param
    return world, run_on_gloo(programs_and_all_reduce, world)


def simulated(world, algorithm, channels):
    topo = topology(world)
    env = simpy.Environment()
    comm = SimCommunicator(Network(env, topo), topo.devices)
    all_reduce = build_all_reduce(algorithm, topo, topo.devices, channels)
    buffers = [seeded_input(r) for r in range(world)]
    for rank in range(world):
        comm.run(rank, all_reduce(rank, world, buffers[rank], average=True))
    env.run()
    return buffers


@pytest.mark.parametrize("algorithm,channels", CASES)
def test_program_over_gloo_equals_simulation_and_torch_all_reduce(gloo_results, algorithm, channels):
    world, results = gloo_results
    sim = simulated(world, algorithm, channels)
    for rank in range(world):
        torch.testing.assert_close(results[rank][algorithm, channels], sim[rank], rtol=0, atol=1e-6)
        torch.testing.assert_close(results[rank][algorithm, channels], results[rank]["torch.distributed"],
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_pat_over_gloo_computes_what_torch_computes(gloo_results, collective):
    world, results = gloo_results
    blocks = [seeded_input(rank).tensor_split(world) for rank in range(world)]  # rank r's own: block r
    gathered = torch.cat([blocks[owner][owner] for owner in range(world)])
    for rank in range(world):
        out = results[rank]["pat", collective]
        if collective == "all_gather":
            assert torch.equal(out, gathered)
        else:
            expected = torch.stack([blocks[source][rank] for source in range(world)]).double().sum(dim=0)
            torch.testing.assert_close(out.tensor_split(world)[rank].double(), expected, rtol=0, atol=1e-5)
