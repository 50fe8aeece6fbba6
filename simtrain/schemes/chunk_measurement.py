"""What one microbatch through a model chunk costs, measured on a meta copy: per region, its FLOPs, operators,
kernels and collective, the parameters its backward adds to and when each gradient is complete, the activation
peak, and under sequence parallelism or tp_comm_overlap what is gathered again or overlapped.

The chunk's forward and backward step programs (stage_execution.py) run without a clock, their collectives
skipped, an operator recorder counting each region's work; a second meta pass measures the tensors autograd
saves (cost.py's saved-tensor hooks).

    cost = measure_chunk(chunk, ops_of, (x,), target, tp=2)     # a ChunkCost (stage_execution.py)
"""
import contextlib
import copy
from typing import NamedTuple

import torch

from ..cost import SavedTensorTracker
from ..op_cost import OperatorRecorder, merged
from ..step_ops import Compute
from ..train.tensor_parallel import Apply, ApplyWithTarget
from .stage_execution import ChunkCost, chunk_backward, chunk_forward
from ..strategies.saved_shards import RegionSplit
from ..strategies.tp_overlap import GemmWatch, TpOverlap, carve
from .weight_grads import WeightGradWatch


def measure_chunk(chunk: torch.nn.Module, ops_of, inputs: tuple, target: torch.Tensor | None,
                  inputs_kept: bool = False, tp: int = 1, tp_overlap: bool = False,
                  weight_split: bool = False) -> ChunkCost:
    """Per-region FLOPs and operator costs, and the activation peak, of one microbatch through `chunk`, on a
    meta copy.

    `ops_of(module, ends_model)` gives a chunk module's ops (ending with the loss when there is a
    `target`); `inputs` and `target` give shapes and dtypes; `tp` the tp group's size (what a sequence
    shard gathers to). The batch itself is never an activation; with `inputs_kept` no input is (the
    caller holds them: a recomputed unit's kept input). With `tp_overlap` (parallel.tp_comm_overlap) the GEMMs
    beside the layers' tp collectives are told apart (strategies/tp_overlap.py); with `weight_split` the
    backward's weight-gradient operators (schemes/weight_grads.py)."""
    forward, backward, output, input_grad, peak, splits, overlap, weights, kernels, ready, saved = _regions(
        chunk, ops_of, inputs, target, inputs_kept, tp, tp_overlap, weight_split)
    return ChunkCost(tuple(flops for flops, _, _, _ in forward), tuple(flops for flops, _, _, _ in backward), peak,
                     tuple(reduced for _, reduced, _, _ in forward), tuple(reduced for _, reduced, _, _ in backward),
                     _meta_like(output), _meta_like(input_grad),
                     tuple(ops for _, _, ops, _ in forward), tuple(ops for _, _, ops, _ in backward),
                     tuple(params for _, _, _, params in backward),
                     splits if any(split is not None for split in splits) else (), overlap,
                     *((tuple(weights.regions), min(weights.held_bytes, peak)) if weights is not None else ()),
                     weight_regathered_bytes=weights.regathered_bytes if weights is not None else 0,
                     forward_kernels=kernels[0], backward_kernels=kernels[1],
                     grad_ready_flops=() if tp_overlap else tuple(ready),
                     shared_saved_bytes=() if weight_split else _shared(chunk, ops_of, target, saved))


def _shared(chunk, ops_of, target, saved: tuple[int, ...]) -> tuple[int, ...]:
    """Of the bytes each forward region saved, those of the regions whose work may be a share of the measured
    (before a boundary with a `work_share`: an MoE layer's experts, train/moe_exchange.py), 0 for the others; ()
    where there are none."""
    boundaries = [op for op in ops_of(chunk, target is not None) if type(op) not in (Apply, ApplyWithTarget)]
    shared = [hasattr(type(op), "work_share") for op in boundaries] + [False]
    return tuple(nbytes if apart else 0 for nbytes, apart in zip(saved, shared)) if any(shared) else ()


def _meta_like(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def _meta_run(chunk, ops_of, inputs, target):
    meta = copy.deepcopy(chunk).to("meta")
    meta_inputs = tuple(torch.empty(t.shape, dtype=t.dtype, device="meta").requires_grad_(t.requires_grad)
                        for t in inputs)
    meta_target = None if target is None else torch.empty(target.shape, dtype=target.dtype, device="meta")
    return meta, ops_of(meta, target is not None), meta_inputs, meta_target


def _drive(program, recorder: OperatorRecorder | None = None, touched: list | None = None,
           watches: tuple = ()) -> tuple[object, list, tuple[int, ...]]:
    """Run a step program without a clock (collectives skipped); with an operator recorder, per region
    (each region ends with a Compute): its FLOPs, the meta copy of the buffer all-reduced after it, if any,
    its operators' costs and the parameters whose gradients it touched (what `touched` collected meanwhile),
    and in a tuple of their own the operators each region dispatched; each of `watches` is cut at each region's
    end."""
    regions, before = [], 0.0
    kernels, kernels_before = [], 0
    try:
        op = next(program)
        while True:
            if type(op) is Compute:
                total = float(recorder.flops) if recorder is not None else 0.0
                params = () if touched is None else tuple(sorted(set(touched)))
                regions.append((total - before, None, recorder.take() if recorder is not None else (), params))
                before = total
                dispatched = recorder.kernels if recorder is not None else 0
                kernels.append(dispatched - kernels_before)
                kernels_before = dispatched
                if touched is not None:
                    touched.clear()
                for watch in watches:
                    watch.cut()
            elif isinstance(op, _Reduced):
                flops, _, ops, params = regions[-1]
                regions[-1] = (flops, (op.kind, _meta_like(op.buffer)), ops, params)
            op = program.send(None)
    except StopIteration as stop:
        return stop.value, regions, tuple(kernels)


def _regions(chunk, ops_of, inputs, target, inputs_kept: bool, tp: int, tp_overlap: bool,
             weight_split: bool) -> tuple[list, list, torch.Tensor, torch.Tensor | None, int, tuple,
                                          TpOverlap | None, WeightGradWatch | None, tuple, list[float],
                                          tuple[int, ...]]:
    """(FLOPs, (collective, its input) or None, OpCosts, parameters touched) per region forward and backward,
    the chunk's first output, its first input's gradient, the activation peak and each backward region's
    RegionSplit or None, and with `tp_overlap` the TpOverlap (those less the GEMMs it runs beside collectives),
    the WeightGradWatch, the operators each region dispatched (forward, backward; a GEMM run beside a
    collective stays its region's), each trainable parameter's gradient-complete backward FLOPs and the bytes
    each forward region saved: one forward
    and backward on a meta copy, the operator recorder counting, a hook on each trainable parameter noting the
    backward regions that add to its gradient (another the backward's FLOPs when it is complete) and, with
    `tp_overlap`, a GemmWatch on each pass; with `weight_split`, a WeightGradWatch on the backward (and a second
    hook on each parameter, handing it the gradient). The activation peak is measured on a copy of its own, as
    cost.py measures a step: saved-tensor hooks change the operators autograd dispatches (its detaches)."""
    meta, ops, meta_inputs, meta_target = _meta_run(chunk, ops_of, inputs, target)
    touched, backward_recorder = [], OperatorRecorder()
    weights = WeightGradWatch(meta.parameters()) if weight_split else None
    trainable = [p for p in meta.parameters() if p.requires_grad]
    ready = [0.0] * len(trainable)
    for index, param in enumerate(trainable):
        param.register_hook(lambda grad, index=index: touched.append(index))
        # a gradient accumulated twice (a shared parameter) is complete the second time
        param.register_post_accumulate_grad_hook(
            lambda _, index=index: ready.__setitem__(index, float(backward_recorder.flops)))
        if weights is not None:
            param.register_hook(weights.gradient)
    gemms = [GemmWatch(meta.parameters()) for _ in range(2)] if tp_overlap else [None, None]
    measuring = [_measuring(tp) if watch is None else watch.communicating(_measuring(tp)) for watch in gemms]
    forward_watches = tuple(watch for watch in gemms[:1] if watch is not None)
    backward_watches = tuple(watch for watch in (gemms[1], weights) if watch is not None)
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        with OperatorRecorder() as recorder, contextlib.ExitStack() as watching:
            for watch in forward_watches:
                watching.enter_context(watch)
            (outputs, tape, _), forward, forward_kernels = _drive(
                chunk_forward(ops, meta_inputs, measuring[0], None, "", meta_target), recorder,
                watches=forward_watches)
        grads = None if target is not None else tuple(torch.ones_like(o) for o in outputs)
        shards = tape.shards[::-1]  # backward order
        with backward_recorder as recorder, contextlib.ExitStack() as watching:
            for watch in backward_watches:
                watching.enter_context(watch)
            marks = _mark_regathers(shards, recorder, weights)
            input_grads, backward, backward_kernels = _drive(
                chunk_backward(tape, grads, measuring[1], None, ""), recorder, touched, backward_watches)
        del tape
    splits, overlap = _splits(backward, shards, marks, weights), None
    if tp_overlap:
        boundaries = [op for op in ops if type(op) not in (Apply, ApplyWithTarget)]
        overlap, forward, backward, splits = carve(*gemms, boundaries, forward, backward, splits)
    peak, saved = _activation_peak(chunk, ops_of, inputs, target, inputs_kept, tp)
    return (forward, backward, outputs[0], input_grads[0], peak, splits, overlap, weights,
            (forward_kernels, backward_kernels), ready, saved)


def _activation_peak(chunk, ops_of, inputs, target, inputs_kept: bool, tp: int) -> tuple[int, tuple[int, ...]]:
    """The peak bytes autograd holds in one forward and backward of a meta copy of `chunk` (cost.py's saved-tensor
    hooks; the batch itself, and with `inputs_kept` every input, held elsewhere), and the bytes each forward region
    saved."""
    meta, ops, meta_inputs, meta_target = _meta_run(chunk, ops_of, inputs, target)
    held = [t for t in meta_inputs if inputs_kept or not t.requires_grad]
    tracker = SavedTensorTracker([*meta.parameters(), *meta.buffers(), *held,
                                  *([meta_target] if meta_target is not None else [])])
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
            (outputs, tape, _), saved = _saving(chunk_forward(ops, meta_inputs, _measuring(tp), None, "",
                                                              meta_target), tracker)
            grads = None if target is not None else tuple(torch.ones_like(o) for o in outputs)
            _regathered_on_meta(tape.shards)
            _drive(chunk_backward(tape, grads, _measuring(tp), None, ""))
            del tape
    return tracker.peak_bytes, saved


def _saving(program, tracker: SavedTensorTracker) -> tuple[object, tuple[int, ...]]:
    """Run a forward step program without a clock (collectives skipped); (its value, the bytes `tracker` saw saved
    in each region: each region ends with a Compute)."""
    saved, before = [], 0
    try:
        op = next(program)
        while True:
            if type(op) is Compute:
                saved.append(tracker.live_bytes - before)
                before = tracker.live_bytes
            op = program.send(None)
    except StopIteration as stop:
        return stop.value, tuple(saved)


def _regathered_on_meta(shards: list) -> list:
    """Measuring: each shard some saved tensor stands in for gets a meta tensor as its gathered-again whole (what
    the stand-ins unpack to); returns them, each with its position in `shards`."""
    packed = [(step, shard) for step, shard in enumerate(shards) if shard is not None and shard.packed]
    for _, shard in packed:
        shard.regathered = torch.empty(shard.gathered_shape, dtype=shard.shard.dtype, device="meta")
    return packed


def _mark_regathers(shards: list, recorder: OperatorRecorder, weights: WeightGradWatch | None) -> dict:
    """Measuring: for each backward region whose input was kept as its shard, (the backward's FLOPs, the
    operators since the last take) noted at the first use of the shard gathered again (which stands in for it,
    as a meta tensor like it); `weights`, when watching, marked there and told of each gathered input."""
    marks = {}

    def mark(step):
        if step not in marks and weights is not None:
            weights.mark()
        marks.setdefault(step, (float(recorder.flops), recorder.take()))
    for step, shard in _regathered_on_meta(shards):
        shard.at_unpack = lambda step=step: mark(step)
        if weights is not None:
            weights.gathered_again(shard.regathered)
    return marks


def _splits(backward: list, shards: list, marks: dict, weights: WeightGradWatch | None) -> tuple:
    """Each backward region's RegionSplit (its regions' operators: what `marks` took before the first use of the
    gathered shard, the rest after; with `weights`, the weight-gradient operators of the rest), or None; the
    regions' own entries get their whole operators back."""
    splits, start = [], 0.0
    for step, (flops, reduced, ops, params) in enumerate(backward):
        if step in marks:
            at, before = marks[step]
            splits.append(RegionSplit(_meta_like(shards[step].shard), at - start, before, flops - (at - start), ops,
                                      weights.after_mark(step) if weights is not None else (0.0, ())))
            backward[step] = (flops, reduced, merged(before, ops), params)
        else:
            splits.append(None)
        start += flops
    return tuple(splits)


class _Reduced(NamedTuple):
    """Measuring: a chunk's tp collective and its input, yielded in place of the collective."""

    kind: str
    buffer: torch.Tensor


def _measuring(tp: int):
    """A `communicate` for measuring on meta tensors: yields a _Reduced, its result shaped as the
    collective's would be (a sequence shard gathers to tp times its length, a whole scatters to 1/tp)."""
    def communicate(kind, tensor: torch.Tensor):
        if not isinstance(kind, str):  # an exchange that says what it receives (train/moe_exchange.py)
            return _Reduced(kind, tensor), kind.result_like(tensor)
        if kind == "all_reduce":
            return _Reduced(kind, tensor), tensor
        if kind in ("kv_ring", "kv_ring_back"):  # ring attention's step: a block like the one sent arrives
            return _Reduced(kind, tensor), torch.empty_like(tensor)
        shape = list(tensor.shape)
        shape[1] = shape[1] * tp if kind == "all_gather" else shape[1] // tp
        return _Reduced(kind, tensor), tensor.new_empty(shape)
    return communicate
