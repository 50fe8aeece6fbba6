"""Full activation recomputation, one layer at a time, as Megatron-LM does it (train.checkpointing: full).

Under pipeline or tensor parallelism a chunk's forward runs unit by unit
(train/partition.py `RankModule.layers`: a gpt's embedding, each Block, its
head; an mlp's Linear, or tensor-parallel Linear pair, with the parameterless
layers after it), each with its tensor-parallel collectives
(schemes/stage_execution.py), and keeps nothing but each unit's input until
the backward. The backward walks the units in reverse: it runs a unit's
forward again from its kept input, with its all-reduces, then that unit's
backward, and lets go of the unit's activations and its input before the unit
before it. A chunk of L units therefore holds its L inputs from its forward to
its backward (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", section 4.1: 2sbh per layer in 16 bits) and, during
its backward, one unit's activations besides: at most

    sum(kept inputs) + max over units of (activations less the unit's input)

never a whole chunk's activations at once. A unit's activations are measured
without its input (`measure_chunk(..., inputs_kept=True, tp=tp)`): the kept input is
the very tensor the recomputed unit saves. The chunk's forward is one pass and
its backward another (a calibrated host's pass_overhead: hw/device.py): the
forwards run again are part of the backward, whose pass the last unit's starts.

    costs = measure_layers(share.layers[chunk], share.chunk_ops, (x,), target)
    held = sum(kept_bytes(costs, (x,)))
    kept, output, loss = yield from layers_forward(share.layers[chunk], costs, (x,), communicate, dtype,
                                                   target, loss_weight, numerics=True)
    input_grad = yield from layers_backward(share.layers[chunk], costs, kept, grads, communicate, dtype,
                                            target, loss_weight, numerics=True)
"""
import torch

from ..step_ops import Alloc, Free
from ..train.moe import recomputing
from ..train.partition import module_structure
from .chunk_measurement import measure_chunk
from .stage_execution import ChunkCost, chunk_backward, chunk_forward, held_whole, replay_backward, replay_forward


def measure_layers(layers: list, ops_of, inputs: tuple, target: torch.Tensor | None, tp: int = 1,
                   measured: dict | None = None, tp_overlap: bool = False) -> list[ChunkCost]:
    """Each unit's ChunkCost, its activations without its input, on the shapes the units before it hand on;
    the last unit ends with the loss against `target` (when given). A unit built as one measured before on
    inputs of the same shapes (a transformer's blocks; `measured` keeps them from call to call) is measured once."""
    measured = {} if measured is None else measured
    costs = []
    for number, (module, _) in enumerate(layers):
        ends = target if number == len(layers) - 1 else None
        key = ("unit", module_structure(module), tuple((t.shape, t.dtype, t.requires_grad) for t in inputs),
               None if ends is None else (ends.shape, ends.dtype), tp, tp_overlap)
        if key not in measured:
            measured[key] = measure_chunk(module, ops_of, inputs, ends, inputs_kept=True, tp=tp, tp_overlap=tp_overlap)
        costs.append(measured[key])
        output = costs[-1].output
        inputs = (torch.empty(output.shape, dtype=output.dtype, device="meta").requires_grad_(),)
    return costs


def kept_bytes(costs: list[ChunkCost], inputs: tuple) -> list[int]:
    """Bytes each unit keeps from its forward to its backward: its input (the batch itself is no activation)."""
    first = sum(t.nbytes for t in inputs if t.requires_grad)
    return [first, *(cost.output.nbytes for cost in costs[:-1])]


def layers_forward(layers: list, costs: list[ChunkCost], inputs: tuple, communicate, dtype: str,
                   target: torch.Tensor | None, loss_weight, numerics: bool):
    """Step program: the chunk's forward unit by unit (with numerics off, replayed from `costs`).
    Returns (each unit's input, the chunk's output, the loss or None)."""
    kept, loss = [], None
    for number, ((_, ops), cost) in enumerate(zip(layers, costs)):
        last = number == len(layers) - 1
        kept.append(inputs)
        if numerics:
            outputs, _, loss = yield from chunk_forward(ops, inputs, communicate, cost, dtype,
                                                        target if last else None, loss_weight, number == 0,
                                                        holds=False)
            inputs = tuple(o.detach().requires_grad_(o.requires_grad) for o in outputs)
        else:
            inputs = ((yield from replay_forward(cost, communicate, dtype, number == 0, holds=False)),)
    return kept, inputs[0].detach(), loss


def layers_backward(layers: list, costs: list[ChunkCost], kept: list[tuple], grads: tuple | None, communicate,
                    dtype: str, target: torch.Tensor | None, loss_weight, numerics: bool, held: list[int]):
    """Step program: each unit, last first, recomputed from its kept input and then its backward, its
    activations held only in between; `held` are the kept inputs' bytes, each let go after its unit.
    `grads` is None when the chunk ends with the loss. Returns the gradient of the chunk's first input."""
    for number in range(len(layers) - 1, -1, -1):
        ops, cost = layers[number][1], costs[number]
        first = number == len(layers) - 1  # the unit whose recomputed forward starts the backward's pass
        yield Alloc("activations", held_whole(cost))  # an MoE layer's experts hold theirs apart (stage_execution.py)
        if numerics:
            with recomputing(layers[number][0]):  # an MoE layer routes as its first forward did, recording nothing
                _, tape, _ = yield from chunk_forward(ops, kept[number], communicate, cost, dtype,
                                                      target if first else None, loss_weight, first)
            grads = yield from chunk_backward(tape, grads, communicate, cost, dtype, starts_pass=False)
        else:
            yield from replay_forward(cost, communicate, dtype, first)
            grads = ((yield from replay_backward(cost, communicate, dtype, starts_pass=False)),)
        yield Free("activations", held_whole(cost) + held[number])
    return grads[0]
