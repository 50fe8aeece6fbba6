"""torch's tensor-parallel styles, DTensor redistribution and functional collectives in users' code, on simulated
ranks (`simtrain.dist.spawn`), and a llama-style model trained with FSDP2 x tensor parallelism on a 2-D mesh.

References: each collective's and each redistribution's definition computed directly; the ring's closed-form
bytes; the time of the same collective and compute run apart (overlap: end = max, not sum); one process
training the whole model on the global batch; the same training code on 2, 4 and 8 real gloo processes.
"""
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import simtrain.dist
from dist_llama import single_process, tp_fsdp_training
from gloo_processes import run_on_gloo
from simtrain.errors import SimtrainError

WORLDS = {2: 2, 4: 2, 8: 4}  # world -> tensor-parallel degree; the rest of the ranks is FSDP2's "dp"
LAYERS = 2  # two blocks: each is sharded, and with prefetching the first starts the second's all-gather


def seeded(rank, *shape, salt=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 * salt + rank))


def functional_and_dtensor(rank, world):
    """Functional collectives (awaited by use or by wait_tensor) and DTensor redistributions on a 1-D mesh, and
    one across both dimensions of a (2, world / 2) mesh."""
    mesh = init_device_mesh("cpu", (world,))
    out = {"all_reduce": funcol.wait_tensor(funcol.all_reduce(seeded(rank, 4, 3), "sum", mesh)),
           "all_reduce_max": funcol.all_reduce(seeded(rank, 5), "max", mesh) * 1,
           "all_gather": funcol.all_gather_single(seeded(rank, 2, 3, salt=1), 0, mesh) * 1,
           "reduce_scatter": funcol.reduce_scatter_single(seeded(rank, 2 * world, salt=2), "sum", 0, mesh) * 1,
           "reduce_scatter_avg": funcol.reduce_scatter_single(seeded(rank, 2 * world, salt=2), "avg", 0, mesh) * 1,
           "all_to_all": funcol.all_to_all_single(seeded(rank, 3 * world, salt=3), None, None, mesh) * 1,
           "broadcast": funcol.broadcast(seeded(rank, 4, salt=4), 1, mesh) * 1}
    coalesced = funcol.all_reduce_coalesced([seeded(rank, 3, salt=5), seeded(rank, 2, salt=6)], "sum", mesh)
    coalesced += funcol.all_gather_single_coalesced([seeded(rank, 2, salt=12), seeded(rank, 1, salt=13)], mesh)
    out.update({f"coalesced.{i}": tensor * 1 for i, tensor in enumerate(coalesced)})
    partial = DTensor.from_local(seeded(rank, 2 * world, 3, salt=7), mesh, [Partial()])
    sharded = DTensor.from_local(seeded(rank, 2, 2 * world, salt=8), mesh, [Shard(0)])
    replicated = DTensor.from_local(seeded(0, 4, 2 * world, salt=9), mesh, [Replicate()])
    biggest = DTensor.from_local(seeded(rank, 5, salt=10), mesh, [Partial("max")])
    for name, tensor, placement in (("partial_to_replicate", partial, Replicate()),
                                    ("partial_to_shard", partial, Shard(0)),
                                    ("shard_to_replicate", sharded, Replicate()),
                                    ("shard0_to_shard1", sharded, Shard(1)),
                                    ("replicate_to_shard", replicated, Shard(1)),
                                    ("partial_max_to_replicate", biggest, Replicate())):
        out[name] = tensor.redistribute(mesh, [placement]).to_local() * 1
    grid = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    both = DTensor.from_local(seeded(rank, 2, 3, salt=11), grid, [Shard(0), Partial()])
    out["grid_to_replicate"] = both.redistribute(grid, [Replicate(), Replicate()]).to_local() * 1
    return out


def simtrain_functional_and_dtensor(rank, world):
    dist.init_process_group("simtrain")
    return functional_and_dtensor(rank, world)


@pytest.fixture(scope="module")
def functional():
    return simtrain.dist.spawn(simtrain_functional_and_dtensor, world=4)


def test_functional_collectives_and_redistributions_meet_their_definitions(functional):
    world, results = 4, functional
    ranks = range(world)
    partial_sum = sum(seeded(r, 2 * world, 3, salt=7) for r in ranks)
    sharded_full = torch.cat([seeded(r, 2, 2 * world, salt=8) for r in ranks])
    for rank, out in enumerate(results):
        expected = {
            "all_reduce": sum(seeded(r, 4, 3) for r in ranks),
            "all_reduce_max": torch.stack([seeded(r, 5) for r in ranks]).amax(0),
            "all_gather": torch.cat([seeded(r, 2, 3, salt=1) for r in ranks]),
            "reduce_scatter": sum(seeded(r, 2 * world, salt=2) for r in ranks)[2 * rank:2 * rank + 2],
            "reduce_scatter_avg": sum(seeded(r, 2 * world, salt=2) for r in ranks)[2 * rank:2 * rank + 2] / world,
            "all_to_all": torch.cat([seeded(r, 3 * world, salt=3)[3 * rank:3 * rank + 3] for r in ranks]),
            "broadcast": seeded(1, 4, salt=4),
            "coalesced.0": sum(seeded(r, 3, salt=5) for r in ranks),
            "coalesced.1": sum(seeded(r, 2, salt=6) for r in ranks),
            "coalesced.2": torch.cat([seeded(r, 2, salt=12) for r in ranks]),
            "coalesced.3": torch.cat([seeded(r, 1, salt=13) for r in ranks]),
            "partial_to_replicate": partial_sum,
            "partial_to_shard": partial_sum[2 * rank:2 * rank + 2],
            "shard_to_replicate": sharded_full,
            "shard0_to_shard1": sharded_full[:, 2 * rank:2 * rank + 2],
            "replicate_to_shard": seeded(0, 4, 2 * world, salt=9)[:, 2 * rank:2 * rank + 2],
            "partial_max_to_replicate": torch.stack([seeded(r, 5, salt=10) for r in ranks]).amax(0),
            # rows of the (dp, tp) mesh are the "tp" groups (summed), its columns "dp" (concatenated)
            "grid_to_replicate": torch.cat([sum(seeded(r, 2, 3, salt=11) for r in (2 * row, 2 * row + 1))
                                            for row in (0, 1)]),
        }
        assert out.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(out[name], value, rtol=0, atol=1e-6, msg=name)


def test_two_runs_give_identical_results_and_reports(functional):
    again = simtrain.dist.spawn(simtrain_functional_and_dtensor, world=4)
    for a, b in zip(functional, again):
        assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    assert functional.report.data == again.report.data and functional.report.trace == again.report.trace
    assert functional.report.data["sim_time_s"] > 0


def test_a_functional_collective_overlaps_the_compute_before_its_wait():
    nbytes, flops, a100_fp32 = 1 << 20, 1e9, 19.5e12 * 0.5  # catalog peak x default efficiency

    def rank_code(rank, world, collective, compute):
        dist.init_process_group("simtrain")
        pending = funcol.all_reduce(torch.ones(nbytes // 4), "sum", dist.group.WORLD) if collective else None
        if compute:
            simtrain.dist.compute(flops)  # runs while the all-reduce moves
        if collective:
            assert torch.equal(funcol.wait_tensor(pending), torch.full((nbytes // 4,), 2.0))

    def end_s(collective, compute):
        result = simtrain.dist.spawn(lambda rank, world: rank_code(rank, world, collective, compute), world=2,
                                     bandwidth="50 GB/s", latency="5 us")
        return max(device["end_s"] for device in result.report.data["devices"])

    all_reduce_s = 2 * (5e-6 + nbytes / (2 * 50e9))  # the ring on 2 ranks
    assert end_s(True, False) == pytest.approx(all_reduce_s, rel=1e-12)
    assert end_s(False, True) == pytest.approx(flops / a100_fp32, rel=1e-12)
    assert end_s(True, True) == pytest.approx(max(all_reduce_s, flops / a100_fp32), rel=1e-12)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_styles_send_the_ring_s_bytes_and_compute_the_single_process_result(sequence_parallel):
    """Column- then row-wise Linears on 4 ranks: one all-reduce of the output (or, sequence parallel, an
    all-gather of the input and a reduce-scatter of the output): each rank sends 2 (n - 1) / n of it."""
    rows, width = 8, 16

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(width, 32), torch.nn.ReLU(), torch.nn.Linear(32, width))

    x = seeded(0, rows, width)
    with torch.no_grad():
        expected = mlp()(x)

    @simtrain.dist.distributed(world=4, bandwidth="50 GB/s", latency="5 us")
    def forward(rank, world, run):
        dist.init_process_group("simtrain")
        model, mesh, layout = mlp(), init_device_mesh("cpu", (world,)), Shard(0) if sequence_parallel else Replicate()
        parallelize_module(model, mesh, {"0": ColwiseParallel(input_layouts=layout),
                                         "2": RowwiseParallel(output_layouts=layout)})  # scatters the weights
        before = run.bytes_sent(rank)
        with torch.no_grad():
            out = model(x.chunk(world)[rank] if sequence_parallel else x)
        torch.testing.assert_close(out, expected.chunk(world)[rank] if sequence_parallel else expected,
                                   rtol=0, atol=1e-6)
        assert run.bytes_sent(rank) - before == 2 * (world - 1) / world * rows * width * 4

    forward()


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_tensor_parallel_rank_is_charged_its_shard_s_flops(sequence_parallel):
    """Column- then row-wise Linears on 2 ranks, forward and backward: each rank computes with its half of the
    weights, so its compute is half the whole model's FLOPs (torch's FlopCounterMode on one process) at the
    device's rate (DTensor's operators are charged as the local ones it runs, not at the global shapes)."""
    rows, width, a100_fp32 = 8, 16, 19.5e12 * 0.5  # catalog peak x default efficiency

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.ReLU(), torch.nn.Linear(64, width))

    x = seeded(0, rows, width)
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        mlp()(x).sum().backward()

    def rank_code(rank, world):
        dist.init_process_group("simtrain")
        model, mesh, layout = mlp(), init_device_mesh("cpu", (world,)), Shard(0) if sequence_parallel else Replicate()
        parallelize_module(model, mesh, {"0": ColwiseParallel(input_layouts=layout),
                                         "2": RowwiseParallel(output_layouts=layout)})
        model(x.chunk(world)[rank] if sequence_parallel else x).sum().backward()

    devices = simtrain.dist.spawn(rank_code, world=2, bandwidth="50 GB/s", latency="5 us").report.data["devices"]
    assert [device["compute_s"] for device in devices] == pytest.approx([counter.get_total_flops() / 2 / a100_fp32] * 2,
                                                                        rel=1e-12)


def llama_code(rank, world):
    """The llama-style model trained with FSDP2 x tensor parallelism on a ("dp", "tp") mesh, without and with
    sequence parallel styles (on 4 ranks also with FSDP2's explicit prefetching). Runs under gloo too."""
    tp = WORLDS[world]
    variants = {"tp": {"sequence_parallel": False}, "sp": {"sequence_parallel": True}}
    if world == 4:
        variants["prefetch"] = {"sequence_parallel": True, "prefetch": True}
    return {f"{variant}.{name}": value for variant, options in variants.items()
            for name, value in tp_fsdp_training(world, tp, layers=LAYERS, **options).items()}


def simtrain_llama(rank, world):
    dist.init_process_group("simtrain")
    return llama_code(rank, world)


@pytest.fixture(scope="module", params=sorted(WORLDS))
def llama(request):
    return request.param, simtrain.dist.spawn(simtrain_llama, world=request.param)


@pytest.mark.slow
def test_fsdp2_times_tensor_parallel_llama_equals_one_process_on_the_global_batch(llama):
    world, results = llama
    expected = single_process(world // WORLDS[world], LAYERS)
    variants = ("tp", "sp", "prefetch") if world == 4 else ("tp", "sp")
    for out in results:
        assert len(out) == len(variants) * len(expected)
        for name, value in expected.items():
            for variant in variants:
                torch.testing.assert_close(out[f"{variant}.{name}"], value, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.gloo
def test_fsdp2_times_tensor_parallel_llama_gives_what_gloo_gives(llama):
    world, results = llama
    gloo = run_on_gloo(llama_code, world)
    for rank in range(world):
        assert results[rank].keys() == gloo[rank].keys()
        for name, value in gloo[rank].items():
            torch.testing.assert_close(results[rank][name], value, rtol=0, atol=1e-5)


def _error(rank_code, world=4):
    """The run's one-line error, within a second of wall time, with every rank's thread ended."""
    threads, started = threading.active_count(), time.monotonic()
    with pytest.raises(SimtrainError) as error:
        simtrain.dist.spawn(rank_code, world=world)
    assert time.monotonic() - started < 1.0 and threading.active_count() == threads
    return str(error.value)


def test_a_collective_one_rank_skips_on_one_mesh_dimension_is_a_deadlock_naming_its_group():
    def rank_code(rank, world):
        dist.init_process_group("simtrain")
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        if rank != 3:
            dist.all_reduce(torch.ones(4), group=mesh.get_group("tp"))

    message = _error(rank_code)
    assert message.startswith("deadlock at ") and "rank 2 waits on all_reduce(sum) of 4 float32 (collective #0 " \
           "of group [2, 3]), which ranks [3] have not called" in message


def test_different_sizes_on_one_mesh_dimension_are_a_mismatch_naming_both_ranks():
    def rank_code(rank, world):
        dist.init_process_group("simtrain")
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dist.all_reduce(torch.ones(5 if rank == 3 else 4), group=mesh.get_group("dp"))

    message = _error(rank_code)
    assert message.endswith("CollectiveMismatch: collective #0 of group [1, 3]: rank 1 called all_reduce(sum) of 4 "
                            "float32, rank 3 called all_reduce(sum) of 5 float32")


def test_an_unsupported_reduce_op_of_a_functional_collective_is_one_line_naming_it():
    def rank_code(rank, world):
        dist.init_process_group("simtrain")
        funcol.all_reduce(torch.ones(3, dtype=torch.int32), "band", dist.group.WORLD) * 1

    assert _error(rank_code, world=2) == ("rank 0 raised SimtrainError: all_reduce: reduce op BAND is not supported "
                                          "by the simtrain backend (it supports sum, avg, product, max, min, "
                                          "premul_sum)")
