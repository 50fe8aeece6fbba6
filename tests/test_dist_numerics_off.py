"""Numerics off (`simtrain.dist.spawn(..., numerics=False)`), memory by category and the watchdog, for users'
torch.distributed code on simulated ranks.

References: the same script with numerics on (simulated time, bytes per rank and link, memory peaks: all equal);
closed forms for the memory of an MLP trained with Adam (4 bytes per fp32 weight and gradient, Adam's two states
per weight and a 4-byte step count per parameter, the two widest activations of the forward); the rank and line
that block, named within the watchdog's time.
"""
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import simtrain.dist
from dist_llama import pipeline_training, tp_fsdp_training
from simtrain.errors import NumericsOffUnsupported, RankBlocked, RankFailed, ScenarioError
from simtrain.op_cost import OperatorRecorder
from simtrain.torchdist.numerics_off import FakeFloats

BATCH, IN, HIDDEN, OUT = 16, 32, 64, 8


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def ddp_adam(rank, world):
    """Two Adam steps of DDP (small buckets: several all-reduces overlap backward)."""
    dist.init_process_group("simtrain")
    model = nn.parallel.DistributedDataParallel(mlp(), bucket_cap_mb=0.005)
    optimizer = torch.optim.Adam(model.parameters())
    generator = torch.Generator().manual_seed(rank)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(BATCH, IN, generator=generator)).square().mean().backward()
        optimizer.step()


def fsdp_tp(rank, world):
    dist.init_process_group("simtrain")
    tp_fsdp_training(world, tp=2, sequence_parallel=True, prefetch=True, layers=1)


def pipeline(rank, world):
    dist.init_process_group("simtrain")
    pipeline_training(world, pp=2, tp=1, schedule="1f1b")


@pytest.mark.parametrize("script, world", [(ddp_adam, 2), (fsdp_tp, 4), (pipeline, 2)],
                         ids=["ddp", "fsdp2_x_tp", "pipeline"])
def test_numerics_off_gives_the_time_bytes_and_memory_of_numerics_on(script, world):
    on, off = (simtrain.dist.spawn(script, world=world, numerics=numerics).report.data for numerics in (True, False))
    assert off["sim_time_s"] > 0 and all(device["bytes_sent"] > 0 for device in off["devices"])
    assert off == on


def test_numerics_off_tensors_are_fake_floats_and_real_integers():
    def rank_code(rank, world):
        dist.init_process_group("simtrain")
        weights, tokens = torch.randn(4, 4), torch.arange(4)
        dist.all_reduce(weights)
        return type(weights).__name__, weights.device.type, tokens.tolist()

    assert simtrain.dist.spawn(rank_code, world=2, numerics=False) == [("FakeTensor", "cpu", [0, 1, 2, 3])] * 2


def test_memory_by_category_meets_the_closed_forms_of_adam_on_an_mlp():
    def rank_code(rank, world):
        model = mlp()
        optimizer = torch.optim.Adam(model.parameters())
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.randn(BATCH, IN)).square().mean().backward()
            optimizer.step()

    weights = sum(p.numel() for p in mlp().parameters())
    tensors = len(list(mlp().parameters()))
    for numerics in (True, False):
        for device in simtrain.dist.spawn(rank_code, world=2, numerics=numerics).report.data["devices"]:
            peaks = device["peak_memory_bytes_per_category"]
            assert peaks["weights"] == 4 * weights
            assert peaks["gradients"] == 4 * weights
            assert peaks["optimizer_state"] == 2 * 4 * weights + 4 * tensors  # exp_avg, exp_avg_sq; a step count
            assert peaks["activations"] == 2 * 4 * BATCH * HIDDEN  # the first layer's output and the ReLU's


def test_the_operators_recorded_of_fake_tensors_are_those_of_real_ones():
    """A forward and backward of the MLP: the same operators (grouped by FLOPs, bytes, rate and kernel) recorded
    with fake tensors as with real ones. The autograd engine asks each fake tensor's device in C++, which a fake
    tensor answers through a dispatch (`prim.device`) down every mode: no operator, nothing to record."""
    def forward_backward():
        mlp()(torch.randn(BATCH, IN)).square().mean().backward()

    real, fake = OperatorRecorder(), OperatorRecorder()
    with real:
        forward_backward()
    with FakeFloats(), fake:
        forward_backward()
    assert fake.take() == real.take()


def test_an_op_that_needs_values_is_one_line_naming_it():
    def rank_code(rank, world):
        return torch.randn(3).sum().item()

    with pytest.raises(RankFailed, match=r"aten\._local_scalar_dense") as failed:
        simtrain.dist.spawn(rank_code, world=2, numerics=False)
    assert isinstance(failed.value.__cause__, NumericsOffUnsupported) and "\n" not in str(failed.value)


def test_a_rank_blocked_on_a_lock_is_reported_naming_it_within_the_timeout():
    lock = threading.Lock()
    lock.acquire()

    def rank_code(rank, world):
        dist.init_process_group("simtrain")
        dist.barrier()
        if rank == 1:
            lock.acquire()  # never released
        dist.barrier()

    start = time.monotonic()
    with pytest.raises(RankBlocked, match=r"rank 1 blocked .* at .*test_dist_numerics_off.py:\d+ in rank_code"):
        simtrain.dist.spawn(rank_code, world=2, timeout_s=0.2)
    assert time.monotonic() - start < 5


def test_bad_input_is_one_line_naming_the_field():
    with pytest.raises(ScenarioError, match="numerics"):
        simtrain.dist.spawn(lambda rank, world: None, world=2, numerics="off")
    with pytest.raises(ScenarioError, match="timeout_s"):
        simtrain.dist.spawn(lambda rank, world: None, world=2, timeout_s=0)


def _copied_model(rank, world):
    import copy
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    twin = copy.deepcopy(model)  # torchtitan's pipeline split copies the whole model before pruning each stage
    return [(type(p).__name__, tuple(p.shape)) for p in twin.parameters()]


def test_a_model_of_fake_tensors_deep_copies():
    """copy.deepcopy of a model whose parameters are fake copied the spawn's fake mode and its per-thread state,
    and ended in a traceback (cannot pickle '_thread._local'); the copy's tensors stay in the one mode."""
    copied = simtrain.dist.spawn(_copied_model, world=2, numerics=False)[0]
    assert copied == [("FakeTensor", (64, 64)), ("FakeTensor", (64,)), ("FakeTensor", (8, 64)), ("FakeTensor", (8,))]


def test_a_tensor_made_on_cpu_0_meets_one_made_on_cpu():
    """A CPU tensor made on device "cpu:0" (torchtitan's device, `cpu:<LOCAL_RANK>`, where its pipeline stages make
    their receive buffers) is on "cpu", as torch makes a real one; fake, it kept the index, and meeting a tensor made
    on "cpu" ended in FakeTensorDeviceMismatchError."""
    def rank_code(rank, world):
        total = torch.zeros(4, device=torch.device("cpu", 0)) + torch.ones(4)
        return str(total.device), tuple(total.shape)

    for numerics in (True, False):
        assert simtrain.dist.spawn(rank_code, world=1, numerics=numerics) == [("cpu", (4,))]


@torch.library.custom_op("simtrain_tests::gathered", mutates_args=())
def _gathered(shard: torch.Tensor, group_name: str) -> torch.Tensor:
    """A library's operator whose implementation is a collective (as torch's context parallelism wraps its
    all-gather of keys and values)."""
    from torch.distributed import _functional_collectives as funcol
    return funcol.all_gather_single(shard.contiguous(), 0, group_name).wait()


@_gathered.register_fake
def _(shard, group_name):
    return shard.new_empty((2 * shard.shape[0], *shard.shape[1:]))


def test_a_library_operator_s_collective_runs_with_numerics_off():
    """With numerics off a custom operator ran its fake kernel, which makes an output of the right shape and
    leaves its collective out (torch's context parallelism lost its gathers of keys and values): it runs its own
    implementation, so each rank sends what it sends with numerics on."""
    def rank_code(rank, world):
        dist.init_process_group("simtrain")
        return tuple(_gathered(torch.ones(8, 4), dist.group.WORLD.group_name).shape)

    on, off = (simtrain.dist.spawn(rank_code, world=2, numerics=numerics) for numerics in (True, False))
    assert list(on) == list(off) == [(16, 4)] * 2
    assert [device["bytes_sent"] for device in off.report.data["devices"]] == \
        [device["bytes_sent"] for device in on.report.data["devices"]] == [128, 128]
