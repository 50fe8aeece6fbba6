"""A model chunk's forward and backward for one microbatch, with its tensor-parallel collectives.

A chunk's work is a list of `Apply` steps and tp collectives
(train/tensor_parallel.py: all-reduces, and under sequence parallelism
all-gathers and reduce-scatters); the chunk that ends the model ends with its
loss, its `ApplyWithTarget` steps given the microbatch's target. The
collectives cut the work into regions. Forward runs each region with autograd
on and starts the next from detached copies of the tensors in flight (after
the boundary's forward collective on one of them: summed across the tp group
for an `AllReduceForward`, gathered or scattered along the sequence); the
regions' inputs and outputs are kept on a `Tape`.
Backward runs the regions in reverse with `torch.autograd.backward`, handing
each region's input gradients to the region before it (after the boundary's
backward collective on one of them: summed for an `AllReduceBackward`). Parameter gradients
accumulate in the rank's gradient bucket over the microbatches, as autograd
accumulates them. Each region's measured FLOPs are charged as a compute span
right after it runs, so the trace shows the compute and the all-reduces of a
tensor-parallel layer in their real order.

`measure_chunk` (chunk_measurement.py) measures a chunk's regions once per input shape on a meta
copy (FLOPs, and each region's operators as (FLOPs, bytes, count, rate dtype)
groups for a roofline device, and how many it dispatched, by the operator
recorder of op_cost.py; the shapes of what is all-reduced and sent on) and,
as cost.py measures a step, its activation bytes on a second copy by cost.py's
saved-tensor hooks (which change the operators autograd dispatches): `ChunkCost`.
With numerics off, `replay_forward` and `replay_backward` yield the same
compute spans and all-reduces from a ChunkCost alone, on meta buffers, without
running an operator: a microbatch then costs a few step operations however
large the model.

A calibrated host's fixed costs (hw/device.py `fixed_time`): each region's
compute carries the torch operators it dispatched as its kernels (views
included, as cost.py counts a whole step's; a GEMM run beside a collective
stays its region's), and a pass's first region starts the pass (`starts_pass`:
a chunk's forward and its backward each; a unit's forward run again in the
backward is part of the backward's). A loss weight of 1 multiplies nothing, as
Replica.backward weights a loss, so a replicated step counts cost.py's kernels.

Ring attention's key/value step (train/ring_attention.py `KeyValueRing`,
forward "kv_ring") is posted before the compute of the region that ends at
it and awaited after it: the next block moves while this one's attention is
computed, as ring attention overlaps them. Its backward ("kv_ring_back", the
gradient of the received block going back) is posted once the region after
it has computed that gradient, and awaited after the backward of the region
before it: that region passes the block through unchanged, so it runs
without the arriving gradient, which is then added to its input's (the sum
autograd would have made).

Under sequence parallelism the region after an all-gather keeps the rank's
part of the sequence in place of the gathered input and its backward gathers
it again, beside the first half of its Linears' backward
(strategies/saved_shards.py; `ChunkCost.backward_regather`).

With parallel.tp_comm_overlap (strategies/tp_overlap.py, Transformer Engine's
userbuffers) a layer's all-gather runs as ring steps beside slices of the
GEMMs at the start of the region after it, its reduce-scatter in splits
beside slices of the GEMM that ends the region before it; in the backward the
output gradient's all-gather runs beside the input-gradient GEMM of the
region after it and the input gradient's reduce-scatter beside the weight
gradient (`ChunkCost.tp_overlap`: those GEMMs, measured apart).

A boundary may say what share of its measured work the region before it did
(`work_share`: an MoE layer's combine, whose experts' region was measured on
balanced routing and received more or fewer tokens this time,
train/moe_exchange.py): that region's compute is charged that share of its
FLOPs and operators forward and backward. Its saved activations
(`ChunkCost.shared_saved_bytes`, measured apart) are held apart from the
rest of the chunk's (`held_whole`, from the chunk's forward to the end of its
backward): that share of them, from the region's forward to its backward
(replayed, all of them; not measured apart under split backwards).

Full activation recomputation (train.checkpointing: full, as Megatron-LM's)
runs these one unit of a chunk at a time (schemes/layer_recompute.py).

    outputs, tape, loss = yield from chunk_forward(ops, (x,), tp_collective, cost, dtype)
    input_grads = yield from chunk_backward(tape, (grad,), tp_collective, cost, dtype)

where `tp_collective(kind, tensor)` gives (the step-program operation, a Collective, of
collective `kind` on `tensor` across the tp group, the tensor that holds its result once it
has run): "all_reduce" sums `tensor` in place; "all_gather" and "reduce_scatter" gather or
scatter it along the sequence (comm/sequence_shards.py).
"""
import contextlib
from dataclasses import dataclass, field

import torch

from ..op_cost import OpCosts, scaled
from ..train.tensor_parallel import Apply, ApplyWithTarget
from ..step_ops import Alloc, Await, Collective, Compute, Free, Post
from ..strategies.saved_shards import RegionSplit, SavedShard
from ..strategies.tp_overlap import COMM_SMS, TpOverlap, forward_beside, ring_exchange

OVERLAPPED = ("kv_ring",)  # collectives that run beside the compute of the region before them
OVERLAPPED_BACK = ("kv_ring_back",)  # backward collectives that run beside the compute of the region after them


@dataclass(frozen=True)
class ChunkCost:
    forward_flops: tuple[float, ...]  # per region, in forward order
    backward_flops: tuple[float, ...]  # per region, in backward order
    activation_bytes: int  # peak bytes autograd holds for one microbatch's backward
    # The tp collective after each region ((kind, a meta tensor of its input's shape and dtype), or None),
    # forward and backward order; what the chunk hands on: its first output, and its first input's gradient
    forward_reduced: tuple = ()
    backward_reduced: tuple = ()
    output: torch.Tensor | None = None
    input_grad: torch.Tensor | None = None
    forward_ops: tuple[OpCosts, ...] = ()  # per region, in forward order: its operators (op_cost.py)
    backward_ops: tuple[OpCosts, ...] = ()  # per region, in backward order
    # per region, in backward order: the chunk's trainable parameters (indices, chunk.parameters() order) whose
    # gradient it adds to, the ones the forward region it reverses uses (bucket_overlap.py)
    backward_params: tuple[tuple[int, ...], ...] = ()
    # per region, in backward order: a RegionSplit where the region's gathered input was kept as its sequence
    # shard and is gathered again (strategies/saved_shards.py), else None
    backward_regather: tuple[RegionSplit | None, ...] = ()
    # parallel.tp_comm_overlap: the GEMMs run beside the layers' tp collectives (strategies/tp_overlap.py), which the
    # regions' FLOPs, operators and RegionSplits above then leave out; None: no overlap
    tp_overlap: TpOverlap | None = None
    # split backwards (zero_bubble, dualpipev): per region, in backward order, the (FLOPs, OpCosts, kernels) of its
    # weight-gradient operators, which a W pass runs apart (schemes/weight_grads.py); () when not measured
    weight_grads: tuple = ()
    weight_held_bytes: int = 0  # of activation_bytes, what the W pass reads: kept from a microbatch's I to its W
    # what the W pass reads of the inputs gathered again in the backward (sequence parallelism: saved_shards.py),
    # which its I gathers and keeps to its W, besides activation_bytes
    weight_regathered_bytes: int = 0
    # per region, forward and backward order: the torch operators it dispatches (a device's kernel_overhead)
    forward_kernels: tuple[int, ...] = ()
    backward_kernels: tuple[int, ...] = ()
    # per trainable parameter (chunk.parameters() order): the backward FLOPs done when its gradient is complete,
    # where a bucket's all-reduce may start inside a region (bucket_overlap.py); () under tp_comm_overlap, whose
    # regions leave GEMMs out
    grad_ready_flops: tuple[float, ...] = ()
    # per region, forward order: the bytes autograd saved in the forward of a region whose work may be a share of
    # what was measured (an MoE layer's experts), held apart from the rest; 0 for the others; () when none is
    shared_saved_bytes: tuple[int, ...] = ()


def held_whole(cost: ChunkCost) -> int:
    """The activation bytes a chunk holds from its forward to the end of its backward: its peak less what its
    regions of a share of their measured work hold apart (chunk_forward, replay_forward)."""
    return cost.activation_bytes - sum(cost.shared_saved_bytes)


@dataclass
class Tape:
    """What a microbatch's forward keeps for its backward."""

    regions: list = field(default_factory=list)  # (inputs, outputs) per region
    # per region: (index of an input, the collective on its gradient), or None
    reduce_grad: list = field(default_factory=list)
    shards: list = field(default_factory=list)  # per region: the SavedShard of its gathered input, or None
    shares: list = field(default_factory=list)  # per region: the share of its measured work it did, or None (all)
    held: list = field(default_factory=list)  # per region: the activation bytes it holds apart until its backward


def chunk_forward(ops, inputs: tuple, communicate, cost: ChunkCost | None, dtype: str,
                  target: torch.Tensor | None = None, loss_weight=1.0, starts_pass: bool = True, holds: bool = True):
    """Step program: run `ops` on `inputs` (a tuple of tensors; the ones that need a gradient require it),
    charging each region's FLOPs and kernels from `cost` (None: measuring, the charges are 0), the first
    region starting a pass if `starts_pass`.

    With `target`, the chunk ends the model and its ops end with the loss against it; backward
    starts from the loss times `loss_weight` (the microbatch's share of the batch, times the fp16
    loss scale: a float or a 0-dim tensor). `holds`: its activations are held until its backward (not a forward
    whose activations are let go, to be run again before the backward: layer_recompute.py). Returns (outputs,
    tape, loss)."""
    tape = Tape()
    region_inputs = state = inputs
    reduce_grad = shard = None
    region = 0
    for op in ops:
        if type(op) in (Apply, ApplyWithTarget):
            with shard.hooks() if shard is not None else contextlib.nullcontext():
                state = op.function(*state) if type(op) is Apply else op.function(*state, target)
            continue
        tape.regions.append((region_inputs, state))
        tape.reduce_grad.append(reduce_grad)
        tape.shards.append(shard)
        shard = None
        share = getattr(op, "work_share", None)  # an MoE layer's experts: the tokens they received this time
        tape.shares.append(share)
        compute = _shared(_region_compute(cost, region, "forward", dtype, starts_pass), share)
        held = _held_apart(cost, region, share) if holds else 0  # its share of the activations it saved
        tape.held.append(held)
        if held:
            yield Alloc("activations", held)
        region += 1
        values = tuple(t.detach() for t in state)
        if op.forward in OVERLAPPED:
            collective, result = communicate(op.forward, values[op.index])
            yield from _beside(compute, collective)
            values = tuple(result if i == op.index else v for i, v in enumerate(values))
        else:
            beside = forward_beside(cost.tp_overlap if cost is not None else None, region - 1, op.forward)
            if beside is None:
                yield compute
            if op.forward is not None:  # an all-reduce sums in place a copy of what autograd may hold
                tensor = values[op.index].clone() if op.forward == "all_reduce" else values[op.index]
                if beside is None:
                    collective, result = communicate(op.forward, tensor)
                    yield collective
                else:
                    result = yield from beside(compute, communicate, tensor)
                if op.forward == "all_gather":  # the next region keeps the shard, not what it gathers to
                    result = result.contiguous()
                    shard = SavedShard(tensor, result)
                values = tuple(result if i == op.index else v for i, v in enumerate(values))
        reduce_grad = None if op.backward is None else (op.index, op.backward)
        # the boundary's tensors start the next region; those that depend on a parameter need a gradient
        values = tuple(v.requires_grad_(t.requires_grad) for v, t in zip(values, state))
        region_inputs = state = values
    loss = None
    if target is not None:
        loss = state[0]
        state = (loss if loss_weight == 1.0 else loss * loss_weight,)  # as Replica.backward weights it
    tape.regions.append((region_inputs, state))
    tape.reduce_grad.append(reduce_grad)
    tape.shards.append(shard)
    tape.shares.append(None)
    tape.held.append(0)
    yield _region_compute(cost, region, "forward", dtype, starts_pass)
    return state, tape, None if loss is None else loss.detach()


def chunk_backward(tape: Tape, output_grads: tuple | None, communicate, cost: ChunkCost | None, dtype: str,
                   starts_pass: bool = True):
    """Step program: backward through a microbatch's tape; `output_grads` None when its output is the loss;
    its first region starts a pass if `starts_pass`. Returns the gradients of the chunk's inputs (None for inputs
    that need none)."""
    grads, arriving, gathering = output_grads, None, None
    overlap = cost.tp_overlap if cost is not None else None
    for step, index in enumerate(range(len(tape.regions) - 1, -1, -1)):
        if gathering is not None:  # tp_comm_overlap: the output gradient gathered beside the input-gradient GEMM
            at, tensor = gathering
            gathered = yield from ring_exchange(communicate, tensor, overlap.grad_gather_beside[step], dtype,
                                                "backward")
            grads, gathering = tuple(gathered if i == at else g for i, g in enumerate(grads)), None
        boundary = tape.reduce_grad[index]
        scatter = None
        if overlap is not None and overlap.grad_scatter_beside[step]:
            scatter = lambda grads, at=boundary[0], kind=boundary[1]: (None if grads[at] is None  # noqa: E731
                                                                       else communicate(kind, grads[at]))
        grads, scattered = yield from _backward_compute(cost, step, dtype, communicate, starts_pass,
                                                        tape.shards[index],
                                                        lambda region=tape.regions[index], grads=grads:
                                                        _autograd(*region, grads), scatter, tape.shares[index])
        if tape.held[index]:  # what it held apart, let go after its backward
            yield Free("activations", tape.held[index])
        if arriving is not None:  # the gradient of the block this region passed through unchanged
            handle, at, arrived = arriving
            if handle is not None:
                yield Await(handle)
            grads = tuple(g + arrived if i == at else g for i, g in enumerate(grads))
            arriving = None
        if scattered is not None:  # reduce-scattered beside the weight gradient
            grads = tuple(scattered if i == boundary[0] else g for i, g in enumerate(grads))
        elif boundary is not None and grads[boundary[0]] is not None:  # the data's own input needs no gradient
            at, kind = boundary
            if overlap is not None and step + 1 < len(tape.regions) and \
                    overlap.grad_gather_beside[step + 1] is not None:
                gathering = (at, grads[at])
                continue
            collective, result = communicate(kind, grads[at])
            if kind in OVERLAPPED_BACK:
                handle = (yield Post(*collective)) if type(collective) is Collective else (yield collective)
                arriving = (handle, at, result)
                grads = tuple(None if i == at else g for i, g in enumerate(grads))
                continue
            yield collective
            grads = tuple(result if i == at else g for i, g in enumerate(grads))
    return grads


def _autograd(inputs: tuple, outputs: tuple, grads: tuple | None) -> tuple:
    """Backward through one region from its outputs' gradients (None: its output is the loss); returns its
    inputs' gradients."""
    if grads is None:
        outputs[0].backward()
    else:
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return tuple(t.grad if t.requires_grad else None for t in inputs)


def _backward_compute(cost: ChunkCost | None, step: int, dtype: str, communicate, starts_pass: bool,
                      shard: SavedShard | None = None, run=lambda: None, scatter=None, share: float | None = None):
    """Step program: backward region `step`'s numerics (`run()`) and its compute (its kernels, and the pass it
    may start, charged on its first piece); where the region's gathered input was kept as its shard, the shard
    gathered again beside the first half of its column-parallel Linears' backward (their input gradient) and
    awaited before the second (their weight gradient; in a split schedule's I pass, none):
    strategies/saved_shards.py. With `scatter` (tp_comm_overlap), `scatter(run())` gives the collective of the input
    gradient and its result, posted beside the weight gradient (or None: no collective); the halves beside a
    collective then run on the SMs its userbuffers kernel leaves (tp_overlap.py COMM_SMS). `share`: the share of
    its measured work the region did (an MoE layer's experts, by the tokens they received), or None. Returns
    (run()'s value, that result or None)."""
    split = cost.backward_regather[step] if cost is not None and cost.backward_regather else None
    compute = _shared(_region_compute(cost, step, "backward", dtype, starts_pass), share)
    if split is None:
        value = run()
        yield compute
        return value, None
    yield Compute(split.before_flops, dtype, "backward_part", kernels=compute.kernels, ops=split.before_ops,
                  passes=compute.passes)
    collective, regathered = communicate("all_gather", split.shard if shard is None else shard.shard)
    handle = yield Post(*collective._replace(label="tp_regather"))
    beside = 1 - split.behind
    yield Compute(split.after_flops * beside, dtype, "backward_part", ops=scaled(split.after_ops, beside),
                  sm_margin=COMM_SMS if scatter is not None else 0)  # tp_comm_overlap's bulk overlaps take SMs
    yield Await(handle)
    if shard is not None:
        shard.regathered = regathered.contiguous()
    value = run()
    behind = Compute(split.after_flops * split.behind, dtype, "backward", ops=scaled(split.after_ops, split.behind))
    posted = scatter(value) if scatter is not None else None
    if posted is None:
        yield behind
        return value, None
    collective, scattered = posted
    handle = yield Post(*collective)
    yield behind._replace(sm_margin=COMM_SMS)
    yield Await(handle)
    return value, scattered


def _region_compute(cost: ChunkCost | None, region: int, name: str, dtype: str, starts_pass: bool) -> Compute:
    """The Compute of region `region` of the `name` pass (its index in that pass's order), its first region
    starting the pass if `starts_pass`."""
    if cost is None:
        return Compute(0.0, dtype, name)
    passes = int(starts_pass and region == 0)
    if name == "forward":
        return Compute(cost.forward_flops[region], dtype, name, kernels=cost.forward_kernels[region],
                       ops=cost.forward_ops[region], passes=passes)
    return Compute(cost.backward_flops[region], dtype, name, kernels=cost.backward_kernels[region],
                   ops=cost.backward_ops[region], passes=passes)


def _held_apart(cost: ChunkCost | None, region: int, share: float | None) -> int:
    """Bytes forward region `region` holds apart from the chunk's whole, doing `share` of its measured work (None:
    all of it)."""
    if cost is None or not cost.shared_saved_bytes:
        return 0
    return round(cost.shared_saved_bytes[region] * (1 if share is None else share))


def _shared(compute: Compute, share: float | None) -> Compute:
    """`compute` with `share` of its FLOPs and operators' work (None or 1: all of it); its kernels as many (an
    expert's GEMMs run however many tokens it received)."""
    if share is None or share == 1:
        return compute
    return compute._replace(flops=compute.flops * share, ops=scaled(compute.ops, share) if compute.ops else compute.ops)


def _beside(compute: Compute, collective):
    """Step program: an OVERLAPPED collective posted, a region's compute, the collective awaited (measuring,
    where the collective is a _Reduced: the compute, then it)."""
    if type(collective) is Collective:
        handle = yield Post(*collective)
        yield compute
        yield Await(handle)
    else:
        yield compute
        yield collective


def replay_forward(cost: ChunkCost, communicate, dtype: str, starts_pass: bool = True, holds: bool = True):
    """Step program: chunk_forward's compute spans and collectives from `cost` alone (numerics off), its
    activations held apart too where it `holds` them; returns the meta tensor the chunk hands on."""
    for region, reduced in enumerate(cost.forward_reduced):
        held = _held_apart(cost, region, None) if holds else 0
        if held:
            yield Alloc("activations", held)
        compute = _region_compute(cost, region, "forward", dtype, starts_pass)
        if reduced is not None and reduced[0] in OVERLAPPED:
            yield from _beside(compute, communicate(*reduced)[0])
        else:
            beside = None if reduced is None else forward_beside(cost.tp_overlap, region, reduced[0])
            if beside is not None:
                yield from beside(compute, communicate, reduced[1])
            else:
                yield compute
                if reduced is not None:
                    yield communicate(*reduced)[0]
    return cost.output


def replay_backward(cost: ChunkCost, communicate, dtype: str, starts_pass: bool = True):
    """Step program: chunk_backward's compute spans and collectives from `cost` alone (numerics off);
    returns the meta gradient of the chunk's first input (None if it needs none)."""
    arriving = gathering = None
    overlap = cost.tp_overlap
    regions = len(cost.backward_reduced)
    for step, reduced in enumerate(cost.backward_reduced):
        if gathering is not None:  # tp_comm_overlap: the output gradient gathered beside the input-gradient GEMM
            yield from ring_exchange(communicate, gathering, overlap.grad_gather_beside[step], dtype, "backward")
            gathering = None
        scatter = None
        if overlap is not None and overlap.grad_scatter_beside[step] and reduced is not None:
            scatter = lambda _, reduced=reduced: communicate(*reduced)  # noqa: E731
        _, scattered = yield from _backward_compute(cost, step, dtype, communicate, starts_pass, scatter=scatter)
        held = _held_apart(cost, regions - 1 - step, None)
        if held:  # what its forward region held apart
            yield Free("activations", held)
        if arriving is not None:
            yield Await(arriving)
            arriving = None
        if reduced is None or scattered is not None:
            continue
        if overlap is not None and step + 1 < len(cost.backward_reduced) and \
                overlap.grad_gather_beside[step + 1] is not None:
            gathering = reduced[1]
        elif reduced[0] in OVERLAPPED_BACK:
            arriving = yield Post(*communicate(*reduced)[0])
        else:
            yield communicate(*reduced)[0]
    return cost.input_grad
