"""The operator recorder: what each torch operator a pass dispatches costs, recorded once for every reader.

`OperatorRecorder` is a TorchDispatchMode that sees every aten operator
dispatched inside it and records, per operator:

- its **kernel**: every operator as dispatched counts one (views included):
  what a device's per-kernel overhead (`kernel_overhead`) is charged on;
- its **FLOPs**: torch's own formulas (`torch.utils.flop_counter.flop_registry`:
  matrix multiplies, convolutions, attention; 2 FLOPs per multiply-add); every
  other operator (element-wise, reductions, softmax, normalization) counts 0.
  An operator without a formula that torch can decompose (one with a
  composite kernel beside its own) is decomposed and its parts are recorded
  instead, as torch's FlopCounterMode does, so the totals are
  FlopCounterMode's, where its parts hold FLOPs (found once per operator, its
  decomposition run on meta tensors). One whose parts hold none (silu_backward,
  element-wise) runs as itself, as a GPU runs it: torch's own values (its
  decomposition rounds otherwise) and one kernel's bytes;
- its **bytes**: every tensor input read once and every tensor output written
  once from HBM, each counted by the distinct elements it spans (a broadcast
  input, stride 0, is read once). An in-place operator reads and writes its
  argument. Views and other metadata-only operators (view, transpose, expand,
  t, detach, as_strided, slice, select, _unsafe_view) and allocations
  (empty, empty_like, empty_strided) move none;
- its **rate dtype**: the dtype whose FLOP rate its arithmetic runs at, named as the device catalog names
  them (`RATE_DTYPES`): its first tensor operand's. A matrix multiply's operands set the tensor cores'
  rate: bf16 operands the bf16 rate, the float8 operands of a scaled GEMM (simtrain::scaled_mm,
  train/fp8.py; torch's _scaled_mm) the fp8 rate though it writes bf16. An operator without FLOPs, or
  of a dtype the catalog has no rate for, has none (""): it runs at the rate of the work it is part of;
- its **dtype**: the FLOPs are also summed by the dtype of the operator's result (`flops_by_dtype`);
- its **kernel**, what the kernel compute model (hw/kernel_model.py) times it as: a matrix multiply
  (`GEMMS`) as ("gemm", rows, columns, batch) of its result, the grid its tiles cover; a fused attention
  kernel (`ATTENTION`) as ("attention",); every other operator as ().

An operator on a wrapper tensor subclass (a DTensor) is handed back to the
subclass, and the operators it runs on its local tensors are the ones
recorded: a rank is charged for its shard's arithmetic, not the global
tensor's (torch's FlopCounterMode counts the global one).

Its readers: step costs (cost.py), the costs of model chunks under pipeline
and tensor parallelism (schemes/stage_execution.py), the roofline compute
model below, and the meter of a user's ranks under `simtrain.dist`
(torchdist/op_meter.py, which adds the memory of the tensors the ops make).

The roofline model (Williams, Waterman and Patterson, "Roofline: an insightful
visual performance model for multicore architectures", CACM 52(4), 2009): a
kernel is bound either by its arithmetic or by its memory traffic, so it takes

    max(FLOPs / FLOP rate of its rate dtype, bytes / memory bandwidth)

and a sequence of kernels takes the sum of theirs. Operators with equal
(FLOPs, bytes, rate dtype, kernel) are grouped: a cost is `OpCosts`, a sorted
tuple of (FLOPs, bytes, count, rate dtype, kernel), a few dozen entries for a
transformer region however many layers it has. A device evaluates it for its
own rates (hw/device.py's `roofline_seconds`, in Device.compute_time, on
its `by_cost(ops)`: the kernels left out, equal costs' counts added); the `flops`
compute model charges the FLOPs of operators of another rate dtype than the
work's at their own rate too (fp8 GEMMs beside bf16 attention).

    layer, x = nn.Linear(64, 64), torch.empty(64, 64)
    with OperatorRecorder() as recorder:
        layer(x)
    recorder.flops, recorder.kernels          # 524288, 2 (a t view and one addmm)
    ops = recorder.take()                     # ((524288.0, 49408.0, 1, "fp32", ("gemm", 64, 64, 1)),)
    hw.device.roofline_seconds(hw.device.by_cost(ops), {"fp32": 156e12}, bytes_rate=0.8e12)  # 6.2e-08 s
"""
from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import (TorchDispatchMode, _disable_current_modes,
                                         is_traceable_wrapper_subclass_type)
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.flop_counter import flop_registry

# (FLOPs, bytes, count, rate dtype, kernel) per distinct operator, sorted; rate dtype "": the work's own
OpCosts = tuple[tuple[float, float, int, str, tuple], ...]

_aten = torch.ops.aten
# Operators that move no bytes though their schema does not mark them as views.
_NO_TRAFFIC = {_aten._unsafe_view, _aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty,
               _aten.new_empty_strided}
# Arguments the GPU kernel does not read, by operator and position: the dense mask simtrain's masked attention
# (train/fused_attention.py) computes values with on a CPU, where FlexAttention evaluates its mask block by block.
_NOT_READ = {"simtrain::masked_attention": 3, "simtrain::masked_attention_backward": 7}
# The device catalog's name (hw/catalog.py, DeviceSpec.peak_flops) of the rate of arithmetic on operands of each
# torch dtype; float8 operands, e4m3 or e5m2, run at the fp8 tensor-core rate.
RATE_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8",
               torch.float8_e5m2: "fp8"}
# Operators that run as one matrix-multiply kernel (torch's, and the fp8 scaled GEMM of train/fp8_kernels.py), and
# those that run as one fused attention kernel (train/fused_attention.py's, and torch's own), by qualified name.
GEMMS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm",
                   "simtrain::scaled_mm"})
ATTENTION = frozenset({"simtrain::flash_attention", "simtrain::flash_attention_backward",
                       "simtrain::masked_attention", "simtrain::masked_attention_backward",
                       "aten::_scaled_dot_product_flash_attention",
                       "aten::_scaled_dot_product_flash_attention_backward",
                       "aten::_scaled_dot_product_flash_attention_for_cpu",
                       "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                       "aten::_scaled_dot_product_efficient_attention",
                       "aten::_scaled_dot_product_efficient_attention_backward",
                       "aten::_scaled_dot_product_cudnn_attention",
                       "aten::_scaled_dot_product_cudnn_attention_backward"})


_DEVICE = torch.ops.prim.device.default


class OperatorRecorder(TorchDispatchMode):
    """Records the kernels, FLOPs (in all, by result dtype and by rate dtype) and bytes of the operators dispatched
    inside it."""

    def __init__(self):
        super().__init__()
        self.flops = 0  # FLOPs since the recorder was entered (an int: exact however many operators)
        self.kernels = 0  # operators dispatched
        self.flops_by_dtype: dict[torch.dtype, float] = {}  # FLOPs by result dtype, in the order dtypes came
        self._counts: dict[tuple[float, float, str, tuple], int] = {}
        self._decomposing = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in dynamo.disable unless told not to (each subclass that defines
        # one: this class's too, which OpMeter's calls); the wrapper's first call imports torch._dynamo (1.4 s),
        # inside a spawn's first rank, where the import leaves the rank's frames in reference cycles, so its
        # tensors would count until the next collection; every call after it pays the wrapper.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:  # a fake tensor's device, asked in C++ (a real tensor answers there): no operator
            return func(*args, **(kwargs or {}))
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # the subclass runs it on its local tensors, which come back here
        kwargs = kwargs or {}
        if not self._decomposing:
            self.kernels += 1
        if _parts_hold_flops(func, args, kwargs):
            self._decomposing += 1
            try:
                with self:
                    decomposed = func.decompose(*args, **kwargs)
            finally:
                self._decomposing -= 1
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        self._record(func, args, kwargs, out)
        return out

    def _record(self, func, args, kwargs, out) -> None:
        if func.is_view or func._overloadpacket in _NO_TRAFFIC:
            return
        formula = flop_registry.get(func._overloadpacket)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        rate = ""
        if flops:
            self.flops += flops
            dtype = next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)).dtype  # the first result's
            self.flops_by_dtype[dtype] = self.flops_by_dtype.get(dtype, 0.0) + flops
            operand = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
            rate = RATE_DTYPES.get(operand.dtype, "")
        name = func._overloadpacket._qualified_op_name
        unread = _NOT_READ.get(name)
        if unread is not None:
            args = args[:unread] + args[unread + 1:]
        nbytes = float(sum(_distinct_bytes(t) for t in tree_leaves((args, kwargs, out))
                           if isinstance(t, torch.Tensor)))
        if flops or nbytes:
            key = (float(flops), nbytes, rate, _kernel(name, out))
            self._counts[key] = self._counts.get(key, 0) + 1

    def take(self) -> OpCosts:
        """The operators recorded since the last take, grouped by equal (FLOPs, bytes, rate dtype, kernel)."""
        counts, self._counts = self._counts, {}
        return _grouped(counts)


# By operator: whether its decomposition (its composite kernel) holds FLOPs (above), found on first sight.
_PARTS_HOLD_FLOPS: dict = {}


def _parts_hold_flops(func, args, kwargs) -> bool:
    """Whether operator `func` decomposes into parts that hold FLOPs: its decomposition run once, outside every
    mode, on meta tensors of its arguments' shapes under a recorder of its own."""
    known = _PARTS_HOLD_FLOPS.get(func)
    if known is None:
        with _disable_current_modes():
            meta_args, meta_kwargs = tree_map_only(
                torch.Tensor, lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"),
                (args, kwargs))
            try:
                with OperatorRecorder() as parts:
                    decomposed = func.decompose(*meta_args, **meta_kwargs)
                known = decomposed is not NotImplemented and parts.flops > 0
            except (RuntimeError, NotImplementedError):  # a decomposition that needs values: decomposed, as torch does
                known = True
        _PARTS_HOLD_FLOPS[func] = known
    return known


def _kernel(name: str, out) -> tuple:
    """The kernel operator `name` (qualified) runs as (op_cost's docstring): a GEMM's result grid, attention, or
    ()."""
    if name in GEMMS:
        rows, columns = out.shape[-2:]
        return ("gemm", rows, columns, math.prod(out.shape[:-2]))
    return ("attention",) if name in ATTENTION else ()


def merged(first: OpCosts, second: OpCosts) -> OpCosts:
    """Two OpCosts as one (equal operators' counts added)."""
    counts = {}
    for flops, nbytes, count, rate, kernel in (*first, *second):
        counts[flops, nbytes, rate, kernel] = counts.get((flops, nbytes, rate, kernel), 0) + count
    return _grouped(counts)


def without(ops: OpCosts, part: OpCosts) -> OpCosts:
    """`ops` less the operators of `part` (a part of them)."""
    counts = {(flops, nbytes, rate, kernel): count for flops, nbytes, count, rate, kernel in ops}
    for flops, nbytes, count, rate, kernel in part:
        key = (flops, nbytes, rate, kernel)
        counts[key] = counts.get(key, 0) - count
        if counts[key] < 0:
            raise ValueError("a part of a pass's operators is not among them")
    return _grouped({key: count for key, count in counts.items() if count})


def _grouped(counts: dict[tuple[float, float, str, tuple], int]) -> OpCosts:
    """OpCosts from counts of operators by (FLOPs, bytes, rate dtype, kernel), in sorted order."""
    return tuple(sorted((flops, nbytes, count, rate, kernel) for (flops, nbytes, rate, kernel), count
                        in counts.items()))


def _distinct_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the distinct elements `tensor` spans: dimensions of stride 0 (broadcast) count once."""
    return tensor.element_size() * math.prod(size for size, stride in zip(tensor.shape, tensor.stride()) if stride)


def scaled(ops: OpCosts, fraction: float) -> OpCosts:
    """`fraction` of the work of `ops` (every operator's FLOPs and bytes scaled): a share of a pass charged
    apart, whose roofline time is that fraction of the whole's."""
    return tuple((flops * fraction, nbytes * fraction, count, rate, kernel)
                 for flops, nbytes, count, rate, kernel in ops)

