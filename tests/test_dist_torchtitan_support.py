"""What torchtitan's own parallelize function needed of simtrain.dist (bench/torchtitan_llama3.py runs it).

- `ReduceOp.PREMUL_SUM(factor)`: FSDP2 reduce-scatters its gradients with it when the gradient divide factor is
  not the group's size (torchtitan sets it to 1). Gloo has no PREMUL_SUM; the reference is NCCL's definition:
  each rank's input times the factor, summed.
- Selective activation checkpointing of a DTensor's reduce-scatter (torchtitan's policy saves the output of
  `_c10d_functional.reduce_scatter_tensor` and checks, when backward recomputes, that nothing has written it since):
  the collective's writes run below autograd, as a C++ backend's do. Reference: the same loss in one process.
  (The version counter of an all_reduce's tensor equals gloo's: tests/test_dist_backend.py.)
- `simtrain.dist.now_s()`: the simulated clock after the rank's counted ops, the closed form of a matmul's time.
- torch's fused attention on CPU (`F.scaled_dot_product_attention`, torchtitan's `ScaledDotProductAttention`) has no
  FLOP formula of torch's: charged FlashAttention-2's count (Dao 2023, section 4.1), as `model.attention: fused` is.
"""
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import simtrain.dist
from simtrain.hw.catalog import CATALOG
from simtrain.op_cost import OperatorRecorder


def seeded(rank, *shape, salt=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 * salt + rank))


def premul_sums(rank, world):
    dist.init_process_group("simtrain")
    summed = seeded(rank, 7)  # 7 elements: uneven chunks over 3 ranks
    dist.all_reduce(summed, op=dist.ReduceOp.PREMUL_SUM(0.25))
    scattered = torch.empty(2)
    dist.reduce_scatter_single(scattered, seeded(rank, 2 * world, salt=1), op=dist.ReduceOp.PREMUL_SUM(0.5))
    reduced = seeded(rank, 5, salt=2)
    dist.reduce(reduced, dst=1, op=dist.ReduceOp.PREMUL_SUM(2.0))
    return summed, scattered, reduced


def test_premul_sum_multiplies_each_rank_s_input_by_its_factor_before_the_sum():
    world = 3
    results = simtrain.dist.spawn(premul_sums, world=world)
    for rank, (summed, scattered, reduced) in enumerate(results):
        torch.testing.assert_close(summed, 0.25 * sum(seeded(r, 7) for r in range(world)))
        torch.testing.assert_close(scattered, 0.5 * sum(seeded(r, 2 * world, salt=1) for r in range(world))[
            2 * rank:2 * rank + 2])
        if rank == 1:
            torch.testing.assert_close(reduced, 2.0 * sum(seeded(r, 5, salt=2) for r in range(world)))


def save_reduce_scatters(ctx, op, *args, **kwargs):
    """torchtitan's selective checkpointing policy, for what this test has: collectives' outputs kept."""
    if op == torch.ops._c10d_functional.reduce_scatter_tensor.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed_rowwise(rank, world):
    """A row-parallel Linear whose output is reduce-scattered over its rows (sequence parallel), checkpointed."""
    dist.init_process_group("simtrain")
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    linear = parallelize_module(torch.nn.Linear(8, 6, bias=False), mesh, RowwiseParallel(output_layouts=Shard(0)))
    columns = slice(8 // world * rank, 8 // world * (rank + 1))
    context = partial(create_selective_checkpoint_contexts, save_reduce_scatters)
    out = checkpoint(lambda x: torch.tanh(linear(x)), seeded(0, 4, 8)[:, columns], use_reentrant=False,
                     context_fn=context)
    out.square().sum().backward()  # this rank's rows (the Linear returns its local shard)
    return linear.weight.grad.full_tensor()


@pytest.mark.parametrize("numerics", [True, False])
def test_selective_checkpointing_of_a_reduce_scatter_gives_one_process_s_gradient(numerics):
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 6, bias=False)
    torch.tanh(linear(seeded(0, 4, 8))).square().sum().backward()
    results = simtrain.dist.spawn(checkpointed_rowwise, world=2, numerics=numerics)
    for grad in results:
        if numerics:
            torch.testing.assert_close(grad, linear.weight.grad, rtol=0, atol=1e-6)
        else:
            assert grad.shape == linear.weight.grad.shape


def matmul_time(rank, world):
    start = simtrain.dist.now_s()
    torch.randn(64, 128) @ torch.randn(128, 32)
    return start, simtrain.dist.now_s()


def test_now_s_reads_the_clock_after_the_rank_s_counted_ops():
    device = CATALOG["a100-40gb"]
    (start, end), = simtrain.dist.spawn(matmul_time, world=1, device="a100-40gb")
    assert start == 0
    assert end == pytest.approx(2 * 64 * 128 * 32 / (device.peak_flops["fp32"] * device.efficiency), rel=1e-12)


def test_cpu_fused_attention_is_charged_flash_attention_2_s_flops():
    q = torch.randn(2, 8, 64, 16, requires_grad=True)  # grouped-query: 8 query heads, 2 key/value heads
    k, v = torch.randn(2, 2, 64, 16, requires_grad=True), torch.randn(2, 2, 64, 16, requires_grad=True)
    with OperatorRecorder() as recorder:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        forward = recorder.flops
        out.sum().backward()
    assert forward == 4 * 2 * 8 * 64 * 64 * 16 // 2  # QKᵀ and PV, 2 FLOPs per multiply-add, half under the mask
    assert recorder.flops == forward * 3.5  # backward 2.5 times forward (Dao 2023, 4.1)
