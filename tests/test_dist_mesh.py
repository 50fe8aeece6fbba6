"""torch's DeviceMesh and FSDP2 (`fully_shard`) in users' code, on simulated ranks (`simtrain.dist.spawn`).

References: the same functions under real gloo in 2 and 4 processes; closed-form sums over
each mesh dimension's ranks; one process training on the global batch.
"""
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import simtrain.dist
from gloo_processes import run_on_gloo
from simtrain.errors import SimtrainError

STEPS, BATCH = 3, 8


def seeded(rank, numel, salt=0):
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * salt + rank))


def meshes(rank, world):
    """A 1-D mesh over all ranks and, on 4 ranks, a 2-D ("dp", "tp") one: each dimension's group and a sum on it."""
    out = {}
    layouts = [((world,), None)] + ([((2, 2), ("dp", "tp"))] if world == 4 else [])
    for shape, names in layouts:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for dim in names or [0]:
            group = mesh.get_group(dim)
            tensor = seeded(rank, 5, len(shape))
            dist.all_reduce(tensor, group=group)
            key = f"{len(shape)}d.{dim}"
            out[f"{key}.ranks"] = dist.get_process_group_ranks(group)
            out[f"{key}.size"] = group.size()
            out[f"{key}.sum"] = tensor
            if names:  # the sub-mesh of one dimension has that dimension's group
                out[f"{key}.sub_mesh_ranks"] = dist.get_process_group_ranks(mesh[dim].get_group())
    return out


def coalesced(rank, world):
    """Two all-reduces, two all-gathers and two reduce-scatters, each pair coalesced into one work."""
    sums, scattered = [seeded(rank, 3, 20), seeded(rank, 5, 21)], [torch.empty(2), torch.empty(1)]
    gathered = [torch.empty(world * 2), torch.empty(world * 3)]
    with dist._coalescing_manager(async_ops=True) as manager:
        for tensor in sums:
            dist.all_reduce(tensor)
    manager.wait()
    with dist._coalescing_manager(async_ops=True) as manager:
        for out, salt in zip(gathered, (22, 23)):
            dist.all_gather_single(out, seeded(rank, out.numel() // world, salt))
    manager.wait()
    with dist._coalescing_manager(async_ops=True) as manager:
        for out, salt in zip(scattered, (24, 25)):
            dist.reduce_scatter_single(out, seeded(rank, out.numel() * world, salt))
    manager.wait()
    return {f"coalesced.{i}": tensor for i, tensor in enumerate(sums + gathered + scattered)}


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def batch(rank):
    generator = torch.Generator().manual_seed(rank)
    return [(torch.randn(BATCH, 16, generator=generator), torch.randint(0, 4, (BATCH,), generator=generator))
            for _ in range(STEPS)]


def fsdp_training(rank, world, shape=None, **options):
    """Rank's full parameters after an unmodified FSDP2 loop: `fully_shard` per Linear (with `options`) and on
    the root, on a mesh of `shape` (all ranks by default; 2-D: HSDP, replicated over dim 0, sharded over dim 1)."""
    shape = shape or (world,)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
    model = make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, **options)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batch(rank):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {name: value.full_tensor() for name, value in model.state_dict().items()}


def user_code(rank, world):
    out = {**meshes(rank, world), **coalesced(rank, world), **{f"fsdp.{k}": v for k, v in fsdp_training(rank, world).items()}}
    if world == 4:
        hsdp = fsdp_training(rank, world, (2, 2), reshard_after_forward=False)
        out.update({f"hsdp.{k}": v for k, v in hsdp.items()})
    else:  # bf16 compute and all-gathers, fp32 reduce-scatters (checked against gloo only)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        out.update({f"bf16.{k}": v for k, v in fsdp_training(rank, world, mp_policy=policy).items()})
    return out


def simtrain_rank(rank, world):
    dist.init_process_group("simtrain")
    return user_code(rank, world)


@pytest.fixture(scope="module", params=[2, 4])
def simulated(request):
    return request.param, simtrain.dist.spawn(simtrain_rank, world=request.param)


def test_each_mesh_dimension_has_its_ranks_and_its_sum(simulated):
    world, results = simulated
    for rank, out in enumerate(results):
        assert out["1d.0.ranks"] == list(range(world)) and out["1d.0.size"] == world
        torch.testing.assert_close(out["1d.0.sum"], sum(seeded(r, 5, 1) for r in range(world)), rtol=0, atol=1e-6)
        if world == 4:  # mesh [[0, 1], [2, 3]]: "dp" runs down a column, "tp" along a row
            for dim, ranks in (("dp", [rank % 2, rank % 2 + 2]), ("tp", [rank // 2 * 2, rank // 2 * 2 + 1])):
                assert out[f"2d.{dim}.ranks"] == ranks == out[f"2d.{dim}.sub_mesh_ranks"]
                assert out[f"2d.{dim}.size"] == 2
                torch.testing.assert_close(out[f"2d.{dim}.sum"], sum(seeded(r, 5, 2) for r in ranks),
                                           rtol=0, atol=1e-6)


def test_coalesced_collectives_meet_their_definitions(simulated):
    world, results = simulated
    for rank, out in enumerate(results):
        expected = [sum(seeded(r, 3, 20) for r in range(world)), sum(seeded(r, 5, 21) for r in range(world)),
                    torch.cat([seeded(r, 2, 22) for r in range(world)]),
                    torch.cat([seeded(r, 3, 23) for r in range(world)]),
                    sum(seeded(r, 2 * world, 24) for r in range(world))[2 * rank:2 * rank + 2],
                    sum(seeded(r, world, 25) for r in range(world))[rank:rank + 1]]
        for i, value in enumerate(expected):
            torch.testing.assert_close(out[f"coalesced.{i}"], value, rtol=0, atol=1e-6)


def test_fsdp2_and_hsdp_on_simulated_ranks_equal_one_process_on_the_global_batch(simulated):
    world, results = simulated
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [batch(rank) for rank in range(world)]
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = (torch.cat([b[step][i] for b in batches]) for i in (0, 1))
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    for out in results:
        for name, value in model.state_dict().items():
            for kind in ("fsdp", "hsdp") if world == 4 else ("fsdp",):
                torch.testing.assert_close(out[f"{kind}.{name}"], value, rtol=0, atol=1e-5)


@pytest.mark.gloo
def test_same_mesh_and_fsdp2_code_gives_what_gloo_gives(simulated):
    world, results = simulated
    gloo = run_on_gloo(user_code, world)
    for rank in range(world):
        assert results[rank].keys() == gloo[rank].keys()
        for name, value in gloo[rank].items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(results[rank][name], value, rtol=0, atol=1e-5)
            else:
                assert results[rank][name] == value, name


def test_two_runs_give_identical_results_and_simulated_time(simulated):
    world, first = simulated
    second = simtrain.dist.spawn(simtrain_rank, world=world)
    for a, b in zip(first, second):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)
    assert first.report.data == second.report.data and first.report.trace == second.report.trace
    assert first.report.data["sim_time_s"] > 0


def test_an_unsupported_collective_is_one_line_naming_it():
    def rank_code(rank, world):
        dist.init_process_group("simtrain")
        dist.all_gather_coalesced([[torch.empty(2) for _ in range(world)]], [torch.ones(2)])

    started = time.monotonic()
    with pytest.raises(SimtrainError, match="allgather_coalesced: not supported by the simtrain backend"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's: all_gather_coalesced is deprecated
        simtrain.dist.spawn(rank_code, world=2)
    assert time.monotonic() - started < 1.0


def _sharded_linears(layers: int):
    def train(rank, world):
        dist.init_process_group("simtrain")
        mesh = init_device_mesh("cpu", (world,))
        with torch.device("meta"):
            model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(layers)])
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        model(torch.randn(8, 2048)).sum().backward()
    return train


@pytest.mark.parametrize("numerics", [True, False])
def test_fsdp2_frees_each_layer_s_unsharded_parameters_on_the_ledger(numerics):
    """FSDP2 frees a layer's unsharded parameters after its forward by resizing their storage to 0, which no
    dispatched operator does. The ledger saw them allocated and never freed: every layer's stayed, 256 MiB for
    these 16 layers. Now 12 more layers add, in closed form, only their saved inputs (8 x 2048 fp32, 64 KiB each)
    to the activations' peak, and their sharded weight and gradient (a quarter of 2048 x 2048 fp32 each, 8 MiB
    together) to the other tensors'."""
    peaks = [simtrain.dist.spawn(_sharded_linears(layers), world=4, numerics=numerics)
             .report.data["devices"][0]["peak_memory_bytes_per_category"] for layers in (4, 16)]
    assert peaks[1]["activations"] - peaks[0]["activations"] == 12 * 8 * 2048 * 4
    assert peaks[1]["tensors"] - peaks[0]["tensors"] == 12 * 2 * 2048 * 2048 * 4 // 4
