"""A model chunk's forward and backward for one microbatch, with its tensor-parallel all-reduces as collectives.

A chunk's work is a list of `Apply` steps and all-reduces
(train/tensor_parallel.py). The all-reduces cut it into regions. Forward runs
each region with autograd on and starts the next from detached copies of the
tensors in flight (after summing one of them across the tp group for an
`AllReduceForward`); the regions' inputs and outputs are kept on a `Tape`.
Backward runs the regions in reverse with `torch.autograd.backward`, handing
each region's input gradients to the region before it (after summing one of
them across the tp group for an `AllReduceBackward`). Parameter gradients
accumulate in the rank's gradient bucket over the microbatches, as autograd
accumulates them. Each region's measured FLOPs are charged as a compute span
right after it runs, so the trace shows the compute and the all-reduces of a
tensor-parallel layer in their real order.

`measure_chunk` measures a chunk's regions once per input shape on a meta
copy (FLOPs by torch's FLOP counter, each region's operators as (FLOPs,
bytes, count) groups by op_cost.py for a roofline device, activation bytes by
the saved-tensor hooks of cost.py): `ChunkCost`.

    outputs, tape, loss = yield from chunk_forward(ops, (x,), tp_all_reduce, cost, dtype)
    input_grads = yield from chunk_backward(tape, (grad,), tp_all_reduce, cost, dtype)

where `tp_all_reduce(buffer)` is the step-program operation (a Collective) that sums
`buffer` in place across the tp group.
"""
import copy
from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..cost import SavedTensorTracker
from ..loss import cross_entropy
from ..op_cost import OpCosts, OperatorCosts
from ..train.tensor_parallel import AllReduceForward, Apply
from .program import Compute


@dataclass(frozen=True)
class ChunkCost:
    forward_flops: tuple[float, ...]  # per region, in forward order
    backward_flops: tuple[float, ...]  # per region, in backward order
    activation_bytes: int  # peak bytes autograd holds for one microbatch's backward
    forward_ops: tuple[OpCosts, ...] = ()  # per region, in forward order: its operators (op_cost.py)
    backward_ops: tuple[OpCosts, ...] = ()  # per region, in backward order


@dataclass
class Tape:
    """What a microbatch's forward keeps for its backward."""

    regions: list = field(default_factory=list)  # (inputs, outputs) per region
    reduce_grad: list = field(default_factory=list)  # per region: index of an input whose gradient is summed


def chunk_forward(ops, inputs: tuple, all_reduce, cost: ChunkCost | None, dtype: str,
                  target: torch.Tensor | None = None, loss_fraction: float = 1.0):
    """Step program: run `ops` on `inputs` (a tuple of tensors; the ones that need a gradient require it),
    charging each region's FLOPs from `cost` (None: measuring, the charges are 0).

    With `target`, the chunk ends the model: the loss is cross entropy against it times
    `loss_fraction` (the microbatch's share of the batch). Returns (outputs, tape, loss)."""
    tape = Tape()
    region_inputs = state = inputs
    reduce_grad = None
    region = 0
    for op in ops:
        if type(op) is Apply:
            state = op.function(*state)
            continue
        tape.regions.append((region_inputs, state))
        tape.reduce_grad.append(reduce_grad)
        yield _region_compute(cost, region, "forward", dtype)
        region += 1
        values = tuple(t.detach() for t in state)
        reduce_grad = None
        if type(op) is AllReduceForward:
            values = tuple(v.clone() if i == op.index else v for i, v in enumerate(values))
            yield all_reduce(values[op.index])
        else:
            reduce_grad = op.index
        # the boundary's tensors start the next region; those that depend on a parameter need a gradient
        values = tuple(v.requires_grad_(t.requires_grad) for v, t in zip(values, state))
        region_inputs = state = values
    loss = None
    if target is not None:
        loss = cross_entropy(state[0], target)
        state = (loss * loss_fraction,)
    tape.regions.append((region_inputs, state))
    tape.reduce_grad.append(reduce_grad)
    yield _region_compute(cost, region, "forward", dtype)
    return state, tape, None if loss is None else loss.detach()


def chunk_backward(tape: Tape, output_grads: tuple | None, all_reduce, cost: ChunkCost | None, dtype: str):
    """Step program: backward through a microbatch's tape; `output_grads` None when its output is the loss.
    Returns the gradients of the chunk's inputs (None for inputs that need none)."""
    grads = output_grads
    for step, index in enumerate(range(len(tape.regions) - 1, -1, -1)):
        inputs, outputs = tape.regions[index]
        if grads is None:
            outputs[0].backward()
        else:
            pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(t.grad if t.requires_grad else None for t in inputs)
        yield _region_compute(cost, step, "backward", dtype)
        summed = tape.reduce_grad[index]
        if summed is not None and grads[summed] is not None:  # the data's own input needs no gradient
            yield all_reduce(grads[summed])
    return grads


def _region_compute(cost: ChunkCost | None, region: int, name: str, dtype: str) -> Compute:
    """The Compute of region `region` of the `name` pass (its index in that pass's order)."""
    if cost is None:
        return Compute(0.0, dtype, name)
    if name == "forward":
        return Compute(cost.forward_flops[region], dtype, name, ops=cost.forward_ops[region])
    return Compute(cost.backward_flops[region], dtype, name, ops=cost.backward_ops[region])


def measure_chunk(chunk: torch.nn.Module, ops_of, inputs: tuple, target: torch.Tensor | None) -> ChunkCost:
    """Per-region FLOPs and operator costs, and the activation peak, of one microbatch through `chunk`, on a
    meta copy.

    `ops_of(module)` gives a chunk module's ops; `inputs` and `target` give shapes and dtypes."""
    (forward_flops, forward_ops), (backward_flops, backward_ops) = _region_costs(chunk, ops_of, inputs, target)
    return ChunkCost(forward_flops, backward_flops, _activation_peak(chunk, ops_of, inputs, target),
                     forward_ops=forward_ops, backward_ops=backward_ops)


def _meta_run(chunk, ops_of, inputs, target):
    meta = copy.deepcopy(chunk).to("meta")
    meta_inputs = tuple(torch.empty(t.shape, dtype=t.dtype, device="meta").requires_grad_(t.requires_grad)
                        for t in inputs)
    meta_target = None if target is None else torch.empty(target.shape, dtype=target.dtype, device="meta")
    return meta, ops_of(meta), meta_inputs, meta_target


def _drive(program, counter=None, costs=None) -> tuple[object, tuple[tuple, tuple]]:
    """Run a step program without a clock (collectives skipped); with a FLOP counter and an OperatorCosts,
    the FLOPs and the operator costs of each region (each region ends with a Compute)."""
    flops, ops, before = [], [], 0.0
    try:
        op = next(program)
        while True:
            if counter is not None and type(op) is Compute:
                total = float(counter.get_total_flops())
                flops.append(total - before)
                ops.append(costs.take())
                before = total
            op = program.send(None)
    except StopIteration as stop:
        return stop.value, (tuple(flops), tuple(ops))


def _region_costs(chunk, ops_of, inputs, target) -> tuple[tuple, tuple]:
    """((forward FLOPs, forward OpCosts), (backward FLOPs, backward OpCosts)), each per region."""
    meta, ops, meta_inputs, meta_target = _meta_run(chunk, ops_of, inputs, target)
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        # outermost, OperatorCosts sees the operators the FLOP counter runs (after its decompositions)
        with OperatorCosts() as costs, FlopCounterMode(display=False) as counter:
            (outputs, tape, _), forward = _drive(chunk_forward(ops, meta_inputs, _no_collective, None, "",
                                                               meta_target), counter, costs)
        grads = None if target is not None else tuple(torch.ones_like(o) for o in outputs)
        with OperatorCosts() as costs, FlopCounterMode(display=False) as counter:
            _, backward = _drive(chunk_backward(tape, grads, _no_collective, None, ""), counter, costs)
    return forward, backward


def _activation_peak(chunk, ops_of, inputs, target) -> int:
    meta, ops, meta_inputs, meta_target = _meta_run(chunk, ops_of, inputs, target)
    data = [t for t in meta_inputs if not t.requires_grad]  # the batch itself is not an activation
    tracker = SavedTensorTracker([*meta.parameters(), *meta.buffers(), *data,
                                  *([meta_target] if meta_target is not None else [])])
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
            (outputs, tape, _), _ = _drive(chunk_forward(ops, meta_inputs, _no_collective, None, "", meta_target))
            grads = None if target is not None else tuple(torch.ones_like(o) for o in outputs)
            _drive(chunk_backward(tape, grads, _no_collective, None, ""))
            del tape, outputs
    return tracker.peak_bytes


def _no_collective(buffer):
    return None  # measuring: _drive skips whatever is yielded between regions
