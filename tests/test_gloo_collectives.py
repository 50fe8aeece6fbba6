"""The simulated collectives are real algorithms: the same programs over real gloo give the same numbers."""
import os
import tempfile

import pytest
import simpy
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from simtrain.comm import ALL_REDUCE
from simtrain.comm.gloo import run_program
from simtrain.comm.simulated import SimCommunicator
from simtrain.hw.network import Network
from simtrain.hw.topology_builders import LinkClass, build_topology

WORLD, NUMEL = 4, 1001  # chunks that do not divide evenly


def seeded_input(rank):
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1234 + rank))


def _worker(rank, workdir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(workdir, 'rendezvous')}",
                            rank=rank, world_size=WORLD)
    try:
        results = {}
        for name, program in sorted(ALL_REDUCE.items()):
            buf = seeded_input(rank)
            results[name] = run_program(program(rank, WORLD, buf, average=True)).clone()
        reference = seeded_input(rank)
        dist.all_reduce(reference)
        results["torch.distributed"] = reference / WORLD
        torch.save(results, os.path.join(workdir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears gloo down while a peer still talks to it
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_results():
    with tempfile.TemporaryDirectory(prefix="gloo_coll_") as workdir:
        mp.start_processes(_worker, args=(workdir,), nprocs=WORLD, join=True, start_method="spawn")
        return [torch.load(os.path.join(workdir, f"rank{r}.pt")) for r in range(WORLD)]


def simulated(name):
    env = simpy.Environment()
    topology = build_topology("ring", WORLD, LinkClass(bandwidth=10e9, latency=1e-6))
    comm = SimCommunicator(Network(env, topology), topology.devices)
    buffers = [seeded_input(r) for r in range(WORLD)]
    for rank in range(WORLD):
        comm.run(rank, ALL_REDUCE[name](rank, WORLD, buffers[rank], average=True))
    env.run()
    return buffers


@pytest.mark.parametrize("name", sorted(ALL_REDUCE))
def test_program_over_gloo_equals_simulation_and_torch_all_reduce(gloo_results, name):
    sim = simulated(name)
    for rank in range(WORLD):
        torch.testing.assert_close(gloo_results[rank][name], sim[rank], rtol=0, atol=1e-6)
        torch.testing.assert_close(gloo_results[rank][name], gloo_results[rank]["torch.distributed"],
                                   rtol=0, atol=1e-5)
