"""Tensor (intra-layer) model parallelism as Megatron-LM splits layers: Linear pairs column-then-row.

Shoeybi et al., "Megatron-LM" (2019), section 3: in a pair of Linear layers
with only element-wise functions between them, the first is split by its
output features and the second by its input features, so each of the `tp`
ranks computes its slice of the hidden activation alone and a partial sum of
the pair's output. Two collectives make that exact:

- `AllReduceForward(i)` (Megatron's "g"): the partial outputs are summed
  across the tp group in forward; in backward the gradient passes unchanged;
- `AllReduceBackward(i)` ("f"): the pair's input passes unchanged in forward;
  in backward each rank's partial gradient of it is summed across the group.

With sequence parallelism (Korthikanti et al. 2022, section 4.2.2) the
tensors between the pairs are cut along the sequence (dimension 1) across
the tp group, and the two become

- `ReduceScatter(i)` ("ḡ"): the partial outputs summed and scattered along the
  sequence in forward; the gradient's shards all-gathered in backward;
- `AllGather(i)` ("g"): the sequence shards gathered in forward; in backward
  the partial gradients summed and scattered back to the shards;

the same bytes on the links as the all-reduce (a ring all-reduce is a
reduce-scatter then an all-gather). Each boundary op names its collective in
forward and in backward (`forward`, `backward`: "all_reduce", "all_gather",
"reduce_scatter" or None).

The second Linear's bias is added once, after the sum. A layer's parallel
work is a list of `Apply(function)` steps on the tuple of tensors in flight,
with the collectives above between them (schemes/stage_execution.py runs
such lists with real collectives). The work of the chunk that ends the model
ends with its loss: `ApplyWithTarget(function)` steps are also given the
microbatch's target (a vocabulary-parallel head computes its loss with an
all-reduce of its own, train/vocab_parallel.py). A module is tensor-parallel when it has
`shard_(tp_rank, tp)`, which cuts its parameters in place to the rank's
slices and returns where each slice sits in the whole parameter, and
`parallel_ops()`; the gpt model's blocks (train/gpt.py) split attention by
heads this way. A Linear, element-wise, Linear run of an nn.Sequential (the
mlp) is split by `shard_column_row_` and `column_row_ops`.

    slices = shard_column_row_(column, row, tp_rank=1, tp=2)   # {"column.weight": Slice(0, 64, 128), ...}
    column_row_ops(column, [nn.ReLU()], row)   # [AllReduceBackward(0), Apply(..), AllReduceForward(0), Apply(..)]
"""
from typing import Callable, NamedTuple

import torch
from torch import nn

from .architecture import FEATURES, require_divides
from .fp8 import weight_only

ELEMENTWISE = (nn.ReLU, nn.GELU, nn.Tanh, nn.SiLU, nn.Sigmoid, nn.LeakyReLU)


class Apply(NamedTuple):
    function: Callable  # (*tensors) -> tuple of tensors


class ApplyWithTarget(NamedTuple):
    function: Callable  # (*tensors, target) -> tuple of tensors


class AllReduceForward(NamedTuple):
    index: int  # position in the tuple of tensors in flight
    forward = "all_reduce"  # the tp collective on the tensor in forward, and on its gradient in backward
    backward = None


class AllReduceBackward(NamedTuple):
    index: int
    forward = None
    backward = "all_reduce"


class AllGather(NamedTuple):
    """Sequence parallelism's "g": the tp ranks' sequence shards gathered (forward), the gradient
    reduce-scattered back to them (backward)."""

    index: int
    beside_gemm: bool = False  # a layer's, before its column-parallel Linears (parallel.tp_comm_overlap overlaps it)
    forward = "all_gather"
    backward = "reduce_scatter"


class ReduceScatter(NamedTuple):
    """Sequence parallelism's "ḡ": partial sums summed and cut into sequence shards (forward), the
    gradient's shards all-gathered (backward)."""

    index: int
    beside_gemm: bool = False  # a layer's, after its row-parallel Linears (parallel.tp_comm_overlap overlaps it)
    forward = "reduce_scatter"
    backward = "all_gather"


TP_BOUNDARIES = (AllReduceForward, AllReduceBackward, AllGather, ReduceScatter)  # the tp collectives between steps


class Slice(NamedTuple):
    """A rank's slice of a parameter: indices start:stop of the whole parameter along dim."""

    dim: int
    start: int
    stop: int


def shard_parameter_(module: nn.Module, name: str, dim: int, tp_rank: int, tp: int) -> Slice:
    """Keep only tp rank `tp_rank`'s slice of `module.name` along `dim` (equal, contiguous slices)."""
    parameter = getattr(module, name)
    require_divides(parameter.shape[dim], tp, FEATURES)
    size = parameter.shape[dim] // tp
    start = tp_rank * size
    setattr(module, name, nn.Parameter(parameter.detach().narrow(dim, start, size).clone()))
    return Slice(dim, start, start + size)


def shard_column_row_(column: nn.Linear, row: nn.Linear, tp_rank: int, tp: int) -> dict[str, Slice]:
    """Split `column` by output features and `row` by input features; `row`'s bias stays whole."""
    slices = {"column.weight": shard_parameter_(column, "weight", 0, tp_rank, tp),
              "row.weight": shard_parameter_(row, "weight", 1, tp_rank, tp)}
    if column.bias is not None:
        slices["column.bias"] = shard_parameter_(column, "bias", 0, tp_rank, tp)
    return slices


def column_row_ops(column: nn.Linear, middle: list[nn.Module], row: nn.Linear) -> list:
    """The parallel work of a split Linear, element-wise, Linear run on one tensor in flight."""
    def partial(x: torch.Tensor) -> tuple[torch.Tensor]:
        hidden = column(x)
        for function in middle:
            hidden = function(hidden)
        return (weight_only(row, hidden),)

    def add_bias(y: torch.Tensor) -> tuple[torch.Tensor]:
        return (y if row.bias is None else y + row.bias,)

    return [AllReduceBackward(0), Apply(partial), AllReduceForward(0), Apply(add_bias)]


def residual_block_ops(norm, attention_ops: list, after_attention, mlp, finish, sequence_parallel: bool) -> list:
    """A pre-norm transformer block (gpt's, llama's) on a one-tensor residual stream, with its four
    tensor-parallel collectives: "f" before each column-parallel half and "g" after each row-parallel half
    (all-reduces; under sequence parallelism the stream is this rank's part of the sequence, each "f" an
    all-gather and each "g" a reduce-scatter). `attention_ops` take (x, the attention's input) to (x, its
    output): one Apply, or ring attention's steps (train/ring_attention.py); `after_attention(x, a)` gives
    (x, the MLP's input); `finish(x, m)` adds the MLP's output to the stream."""
    f, g = _layer_collectives(sequence_parallel)
    return [*attention_half_ops(norm, attention_ops, after_attention, sequence_parallel),
            f, Apply(lambda x, h: (x, mlp(h))), g, Apply(finish)]


def attention_half_ops(norm, attention_ops: list, after_attention, sequence_parallel: bool) -> list:
    """The first half of residual_block_ops: x to (x, the MLP's input) through the attention and its "f" and
    "g" (a mixture of experts takes it on from there: train/moe.py)."""
    f, g = _layer_collectives(sequence_parallel)
    return [Apply(lambda x: (x, norm(x))), f, *attention_ops, g, Apply(after_attention)]


def _layer_collectives(sequence_parallel: bool) -> tuple:
    """A transformer layer's "f" and "g" on the second tensor in flight: under sequence parallelism an all-gather
    and a reduce-scatter beside the layer's GEMMs (which Transformer Engine overlaps with them:
    strategies/tp_overlap.py), else the all-reduce pair."""
    if sequence_parallel:
        return AllGather(1, beside_gemm=True), ReduceScatter(1, beside_gemm=True)
    return AllReduceBackward(1), AllReduceForward(1)
