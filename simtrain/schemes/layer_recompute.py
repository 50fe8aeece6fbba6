"""Activation recomputation segment by segment, as Megatron-LM does it (train.checkpointing: full, sqrt, segments).

Under pipeline, tensor or context parallelism, or with MoE layers, a chunk's
forward runs segment by segment (train/partition.py `RankModule.layers`):
under full every unit is a segment (a gpt's embedding, each Block, its head;
an mlp's Linear, or tensor-parallel Linear pair, with the parameterless
layers after it), Megatron-LM's full recomputation; under sqrt or
{segments: k} the units are grouped k at a time as gradient checkpointing
groups a model's blocks (train/architecture.py recompute_segments; Megatron-LM's
--recompute-method uniform with --recompute-num-layers). Each segment runs
with its tensor-parallel collectives, ring attention steps and expert
exchanges (schemes/stage_execution.py), and keeps nothing but its input until
the backward. The backward walks the segments in reverse: it runs a segment's
forward again from its kept input, with its collectives, then that segment's
backward, and lets go of the segment's activations and its input before the
segment before it. Under sqrt and segments the last segment is not recomputed,
as torch's checkpoint_sequential (train/checkpointing.py) does not: it keeps
its activations from its forward, its backward starting at once. A chunk of L
segments therefore holds its L inputs from its forward to its backward
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4.1: 2sbh per layer in 16 bits), the last one's
activations under sqrt and segments, and, during its backward, one segment's
activations besides: at most

    sum(kept inputs) + max over segments of (activations less the segment's input)

never a whole chunk's activations at once. A segment's activations are
measured without its input (`measure_chunk(..., inputs_kept=True, tp=tp)`):
the kept input is the very tensor the recomputed segment saves. The chunk's
forward is one pass and its backward another (a calibrated host's
pass_overhead: hw/device.py): the forwards run again are part of the
backward, whose pass the last segment's starts.

    costs = measure_layers(share.layers[chunk], share.chunk_ops, (x,), target)
    held = kept_bytes(costs, (x,), share.recompute_last)
    kept, output, loss = yield from layers_forward(share.layers[chunk], costs, (x,), communicate, dtype,
                                                   target, loss_weight, True, share.recompute_last)
    input_grad = yield from layers_backward(share.layers[chunk], costs, kept, grads, communicate, dtype,
                                            target, loss_weight, True, held, share.recompute_last)
"""
import torch

from ..step_ops import Alloc, Free
from ..train.moe import recomputing
from ..train.partition import module_structure
from .chunk_measurement import measure_chunk
from .stage_execution import ChunkCost, chunk_backward, chunk_forward, held_whole, replay_backward, replay_forward
from .weight_grads import input_gradient_part, kept_for_weights, weight_gradient_compute


def measure_layers(layers: list, ops_of, inputs: tuple, target: torch.Tensor | None, tp: int = 1,
                   measured: dict | None = None, tp_overlap: bool = False, weight_split: bool = False) -> list[ChunkCost]:
    """Each unit's ChunkCost, its activations without its input, on the shapes the units before it hand on;
    the last unit ends with the loss against `target` (when given); with `weight_split` its weight-gradient
    operators told apart (weight_grads.py). A unit built as one measured before on inputs of the same shapes (a
    transformer's blocks; `measured` keeps them from call to call) is measured once."""
    measured = {} if measured is None else measured
    costs = []
    for number, (module, _) in enumerate(layers):
        ends = target if number == len(layers) - 1 else None
        key = ("unit", module_structure(module), tuple((t.shape, t.dtype, t.requires_grad) for t in inputs),
               None if ends is None else (ends.shape, ends.dtype), tp, tp_overlap, weight_split)
        if key not in measured:
            measured[key] = measure_chunk(module, ops_of, inputs, ends, inputs_kept=True, tp=tp, tp_overlap=tp_overlap,
                                          weight_split=weight_split)
        costs.append(measured[key])
        output = costs[-1].output
        inputs = (torch.empty(output.shape, dtype=output.dtype, device="meta").requires_grad_(),)
    return costs


def kept_bytes(costs: list[ChunkCost], inputs: tuple, recompute_last: bool = True) -> list[int]:
    """Bytes each segment keeps from its forward to its backward: its input (the batch itself is no activation),
    and the last one's activations too unless it is recomputed."""
    first = sum(t.nbytes for t in inputs if t.requires_grad)
    kept = [first, *(cost.output.nbytes for cost in costs[:-1])]
    if not recompute_last:
        kept[-1] += held_whole(costs[-1])
    return kept


def layers_forward(layers: list, costs: list[ChunkCost], inputs: tuple, communicate, dtype: str,
                   target: torch.Tensor | None, loss_weight, numerics: bool, recompute_last: bool = True):
    """Step program: the chunk's forward segment by segment (with numerics off, replayed from `costs`).
    Returns (each segment's input, or the last one's tape where it is not recomputed; the chunk's output; the
    loss or None)."""
    kept, loss = [], None
    for number, ((_, ops), cost) in enumerate(zip(layers, costs)):
        last = number == len(layers) - 1
        holds = last and not recompute_last  # its activations kept for its backward
        kept.append(inputs)
        if numerics:
            outputs, tape, loss = yield from chunk_forward(ops, inputs, communicate, cost, dtype,
                                                           target if last else None, loss_weight, number == 0,
                                                           holds=holds)
            if holds:
                kept[-1] = tape
            inputs = tuple(o.detach().requires_grad_(o.requires_grad) for o in outputs)
        else:
            inputs = ((yield from replay_forward(cost, communicate, dtype, number == 0, holds=holds)),)
    return kept, inputs[0].detach(), loss


def layers_backward(layers: list, costs: list[ChunkCost], kept: list, grads: tuple | None, communicate,
                    dtype: str, target: torch.Tensor | None, loss_weight, numerics: bool, held: list[int],
                    recompute_last: bool = True, input_only: bool = False):
    """Step program: each segment, last first, recomputed from its kept input and then its backward, its
    activations held only in between (the last one's, not recomputed unless `recompute_last`, from its forward);
    `held` are kept_bytes, each let go after its segment. `grads` is None when the chunk ends with the loss.
    With `input_only` (a split schedule's I pass) each segment's backward charges its input-gradient work alone
    and keeps what its weight-gradient operators read for the W pass (`weight_pass`). Returns the gradient of
    the chunk's first input."""
    for number in range(len(layers) - 1, -1, -1):
        ops, cost = layers[number][1], costs[number]
        charged, kept_for_w = (input_gradient_part(cost), cost.weight_held_bytes) if input_only else (cost, 0)
        first = number == len(layers) - 1  # the segment whose backward (or recomputed forward) starts the pass
        if first and not recompute_last:  # its tape kept from the forward
            if numerics:
                grads = yield from chunk_backward(kept[number], grads, communicate, charged, dtype)
            else:
                grads = ((yield from replay_backward(charged, communicate, dtype)),)
            yield from _keep_regathered(cost, input_only)
            yield Free("activations", held[number] - kept_for_w)
            continue
        yield Alloc("activations", held_whole(cost))  # an MoE layer's experts hold theirs apart (stage_execution.py)
        if numerics:
            with recomputing(layers[number][0]):  # an MoE layer routes as its first forward did, recording nothing
                _, tape, _ = yield from chunk_forward(ops, kept[number], communicate, cost, dtype,
                                                      target if first else None, loss_weight, first)
            grads = yield from chunk_backward(tape, grads, communicate, charged, dtype, starts_pass=False)
        else:
            yield from replay_forward(cost, communicate, dtype, first)
            grads = ((yield from replay_backward(charged, communicate, dtype, starts_pass=False)),)
        yield from _keep_regathered(cost, input_only)
        yield Free("activations", held_whole(cost) + held[number] - kept_for_w)
    return grads[0]


def _keep_regathered(cost: ChunkCost, input_only: bool):
    """Step program: an I pass's segment keeps the inputs it gathered again for its W (weight_grads.py)."""
    if input_only and cost.weight_regathered_bytes:
        yield Alloc("activations", cost.weight_regathered_bytes)


def weight_pass(costs: list[ChunkCost], dtype: str):
    """Step program: a split schedule's W pass of a recomputed chunk: every segment's weight-gradient operators,
    one compute span, then what its I kept for them let go."""
    yield weight_gradient_compute(costs, dtype)
    yield Free("activations", sum(kept_for_weights(cost) for cost in costs))
