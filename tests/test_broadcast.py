"""Binomial-tree broadcast: every rank gets the root's data; uncontended time against closed forms."""
import math

import pytest
import simpy
import torch

from simtrain.comm.broadcast import broadcast
from simtrain.comm.simulated import SimCommunicator
from simtrain.hw.network import Network
from simtrain.hw.topology_builders import LinkClass, build_topology

ALPHA, B = 5e-6, 100e9
LINK = LinkClass(bandwidth=B, latency=ALPHA)


def run_broadcast(world, roots, numel, topology="fully_connected", meta=False):
    """Each rank passes {root: buffer}; roots hold seeded data, the others empty buffers."""
    env = simpy.Environment()
    comm = SimCommunicator(Network(env, build_topology(topology, world, LINK)), [f"gpu{r}" for r in range(world)])
    device = "meta" if meta else "cpu"
    sources = {root: torch.randn(numel, generator=torch.Generator().manual_seed(root)).to(device) for root in roots}
    buffers = [{root: sources[root].clone() if rank == root else torch.full((numel,), float("nan"), device=device)
                for root in roots} for rank in range(world)]
    for rank in range(world):
        comm.run(rank, broadcast(rank, world, buffers[rank]), label="broadcast")
    env.run()
    assert comm.stuck() == []
    return sources, buffers, env.now


@pytest.mark.parametrize("world,roots", [(1, [0]), (2, [1]), (5, [3]), (8, [0]), (7, [0, 2, 6]), (6, range(6))])
def test_every_rank_ends_with_each_roots_data(world, roots):
    sources, buffers, _ = run_broadcast(world, list(roots), numel=37)
    for rank_buffers in buffers:
        for root, source in sources.items():
            assert torch.equal(rank_buffers[root], source)


@pytest.mark.parametrize("world", [2, 3, 4, 7, 16])
def test_one_broadcast_takes_ceil_log2_rounds_on_fully_connected(world):
    nbytes = 16 * 2**20
    _, _, elapsed = run_broadcast(world, [world - 1], nbytes // 4, meta=True)
    expected = math.ceil(math.log2(world)) * (ALPHA + nbytes / B)
    assert elapsed == pytest.approx(expected, rel=1e-6)


def test_concurrent_trees_share_the_round_link():
    # 4 ranks, every rank a root: round 0 each rank sends one buffer to r+1; round 1 two buffers to r+2.
    nbytes = 4 * 2**20
    _, _, elapsed = run_broadcast(4, [0, 1, 2, 3], nbytes // 4, meta=True)
    assert elapsed == pytest.approx((ALPHA + nbytes / B) + (ALPHA + 2 * nbytes / B), rel=1e-6)
