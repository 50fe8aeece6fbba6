"""Representatives for users' code (`simtrain.dist.spawn(..., numerics=False, representatives=...)`): one rank per
class of ranks alike along a mesh dimension runs, the others post their parts of its collectives.

References: the same script with every rank run, numerics off (the whole report equal: simulated time, each
rank's end, compute and communication time, bytes and memory peaks, each link's bytes and busy time); the
classes' arithmetic spelled out by hand; a rank whose shapes or collectives depend on its data-parallel
coordinate, caught.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import simtrain.dist
from simtrain.dist import Representatives
from simtrain.errors import RankFailed, RepresentativesDiverge, RepresentativesUnsupported, ScenarioError
from simtrain.torchdist.representatives import Classes

TP = 4


def fsdp_tp_adam(rank, world):
    """One AdamW step of an MLP, tensor parallel over "tp", FSDP2 over "dp", a batch per "dp" rank."""
    dist.init_process_group("simtrain")
    mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp", "tp"))
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(mesh["dp"].get_local_rank()))
    model(x).square().mean().backward()
    optimizer.step()
    dist.all_reduce(torch.ones(8))  # the world group: it spans the alike dimension
    return rank


@pytest.mark.parametrize("world, topology, alike_dims, ran", [
    (8, "ring", (0,), [0, 1, 2, 3, TP]),  # the tp ranks of dp rank 0, and the witness (dp 1, tp 0)
    (8, "switch", (0, 1), [0, TP + 1]),  # tp alike too (distribute_tensor's source rank among them); the witness
    (16, "switch", (0, 1), [0, TP + 1]),  # is one further along both dimensions (dp 1, tp 1)
])
def test_representatives_give_the_report_of_every_rank_run(world, topology, alike_dims, ran):
    every = simtrain.dist.spawn(fsdp_tp_adam, world=world, topology=topology, numerics=False)
    alike = simtrain.dist.spawn(fsdp_tp_adam, world=world, topology=topology, numerics=False,
                                representatives=Representatives((world // TP, TP), alike_dims))
    assert alike.report.data == every.report.data
    assert every.report.data["sim_time_s"] > 0 and all(d["bytes_sent"] > 0 for d in every.report.data["devices"])
    # only the representatives and the witness ran; the others report their representative's value
    represented_by = (lambda rank: rank % TP) if alike_dims == (0,) else (lambda rank: 0)
    assert list(alike) == [rank if rank in ran else represented_by(rank) for rank in range(world)]


def stages(rank, world):
    """Stage 0 sends its activation to stage 1 over "pp", as a pipeline does; then an all-reduce over "dp"."""
    dist.init_process_group("simtrain")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    activation = torch.randn(256, 64) @ torch.randn(64, 64)
    if mesh["pp"].get_local_rank() == 0:
        dist.send(activation, group_dst=1, group=mesh["pp"].get_group())
    else:
        dist.recv(activation, group_src=0, group=mesh["pp"].get_group())
    dist.all_reduce(activation, group=mesh["dp"].get_group())


def test_represented_ranks_send_and_receive_in_the_mirrors_of_their_stage_groups():
    every = simtrain.dist.spawn(stages, world=4, numerics=False)
    alike = simtrain.dist.spawn(stages, world=4, numerics=False, representatives=Representatives((2, 2), (1,)))
    assert alike.report.data == every.report.data
    assert all(device["communication_s"] > 0 for device in every.report.data["devices"])


def shapes_by_dp_rank(rank, world):
    dist.init_process_group("simtrain")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    columns = 64 if mesh["dp"].get_local_rank() == 0 else 32
    dist.all_reduce(torch.randn(64, 64) @ torch.randn(64, columns), group=mesh["tp"].get_group())


def shapes_by_tp_rank(rank, world):
    dist.init_process_group("simtrain")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    columns = 64 if mesh["tp"].get_local_rank() == 0 else 32
    dist.all_reduce(torch.randn(64, 64) @ torch.randn(64, columns), group=mesh["dp"].get_group())


def extra_collective_on_dp_rank_1(rank, world):
    dist.init_process_group("simtrain")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dist.all_reduce(torch.ones(4), group=mesh["tp"].get_group())
    if mesh["dp"].get_local_rank() == 1:
        dist.all_reduce(torch.ones(4), group=mesh["tp"].get_group())


@pytest.mark.parametrize("script, alike_dims, witness, first_difference", [
    (shapes_by_dp_rank, (0,), 2, "operation #0: rank 0 computed 524288 FLOP of float32, rank 2 computed 262144 FLOP"),
    (extra_collective_on_dp_rank_1, (0,), 2, "operation #1: rank 0 had ended, rank 2 called all_reduce"),
    (shapes_by_tp_rank, (0, 1), 3, "operation #0: rank 0 computed 524288 FLOP of float32, rank 3 computed 262144 FLOP"),
], ids=["shapes", "control_flow", "shapes_by_tp_rank"])
def test_a_rank_that_diverges_along_the_alike_dimension_is_caught(script, alike_dims, witness, first_difference):
    with pytest.raises(RepresentativesDiverge, match=f"rank {witness}, which rank 0 represents, diverges .*"
                                                     f"{first_difference}"):
        simtrain.dist.spawn(script, world=4, numerics=False, representatives=Representatives((2, 2), alike_dims))


def test_what_cannot_be_represented_is_one_line():
    with pytest.raises(RankFailed, match="group \\[0, 1\\] spans part of an alike mesh dimension") as caught:
        simtrain.dist.spawn(shapes_by_dp_rank, world=4, numerics=False, representatives=Representatives((4,)))
    assert isinstance(caught.value.__cause__, RepresentativesUnsupported)
    for options, field in [(dict(numerics=True, representatives=Representatives((2, 2))), "needs numerics=False"),
                           (dict(numerics=False, representatives=Representatives((2, 4))), "mesh_shape: .* 8 ranks"),
                           (dict(numerics=False, representatives=Representatives((2, 2), (2,))), "alike_dims"),
                           (dict(numerics=False, representatives=(2, 2)), "representatives: expected")]:
        with pytest.raises(ScenarioError, match=field):
            simtrain.dist.spawn(shapes_by_dp_rank, world=4, **options)


def test_a_representative_stands_for_its_class_in_the_group_or_its_mirror():
    classes = Classes(Representatives((2, 3, 2), alike_dims=(1,)), world=12)  # ranks pp * 6 + dp * 2 + tp
    assert [rank for rank in range(12) if classes.runs(rank)] == [0, 1, 2, 6, 7]  # rank 2: the witness
    assert [classes.representative(rank) for rank in (4, 5, 10)] == [0, 1, 6]
    assert classes.stand_ins([6, 7], 1) == [(9, [8, 9], 1), (11, [10, 11], 1)]  # a tp group: its mirrors
    assert classes.stand_ins([1, 3, 5], 0) == [(3, [1, 3, 5], 1), (5, [1, 3, 5], 2)]  # a dp group: itself
    assert classes.stand_ins([1, 7], 0) == [(3, [3, 9], 0), (5, [5, 11], 0)]  # a pp group: its mirrors
    with pytest.raises(RepresentativesUnsupported, match="spans part"):
        classes.stand_ins([0, 2], 0)
    with pytest.raises(RepresentativesUnsupported, match="send across an alike mesh dimension"):
        classes.stand_ins([1, 3, 5], 0, "send of 4 float32")
    both = Classes(Representatives((2, 3, 2), alike_dims=(1, 2)), world=12)  # dp and tp alike: one rank per pp
    assert [rank for rank in range(12) if both.runs(rank)] == [0, 3, 6]  # rank 3 (dp 1, tp 1): the witness
    assert both.stand_ins([0, 1], 0)[:2] == [(1, [0, 1], 1), (2, [2, 3], 0)]  # tp group: itself, then dp 1's


def _all_reduce_then_barrier(rank, world):
    dist.init_process_group("simtrain")
    dist.all_reduce(torch.ones(1 << 10))
    dist.barrier()  # torchtitan's, before it sets its groups' timeouts
    return simtrain.dist.now_s()


def test_a_barrier_under_representatives_ends_when_every_rank_s_does():
    """A barrier's stand-ins carried a real tensor beside the representative's meta one (numerics off), and the
    transfer that landed one on the other ended the run in a traceback; each rank ends where it does in the full
    run."""
    full = simtrain.dist.spawn(_all_reduce_then_barrier, world=4, numerics=False)
    represented = simtrain.dist.spawn(_all_reduce_then_barrier, world=4, numerics=False,
                                      representatives=Representatives((4,), alike_dims=(0,)))
    assert represented[0] == full[0] > 0
    assert represented.report.data["devices"][3]["end_s"] == full.report.data["devices"][3]["end_s"]
