"""What each torch operator costs under a roofline: its FLOPs and the bytes it moves, measured as it dispatches.

The roofline model (Williams, Waterman and Patterson, "Roofline: an insightful
visual performance model for multicore architectures", CACM 52(4), 2009): a
kernel is bound either by its arithmetic or by its memory traffic, so it takes

    max(FLOPs / FLOP rate, bytes / memory bandwidth)

and a sequence of kernels takes the sum of theirs. `OperatorCosts` is a
TorchDispatchMode that records, for every aten operator dispatched inside it:

- its FLOPs: torch's own formulas (`torch.utils.flop_counter.flop_registry`:
  matrix multiplies, convolutions, attention; 2 FLOPs per multiply-add); every
  other operator (element-wise, reductions, softmax, normalization) counts 0;
- its bytes: every tensor input read once and every tensor output written once
  from HBM, each counted by the distinct elements it spans (a broadcast input,
  stride 0, is read once). An in-place operator reads and writes its
  argument. Views and other metadata-only operators (view, transpose, expand,
  t, detach, as_strided, slice, select, _unsafe_view) and allocations
  (empty, empty_like, empty_strided) move none.

Entered outside a FlopCounterMode, it sees the operators that counter runs
(after the counter's decompositions), so its FLOPs add up to the counter's.
Operators with equal (FLOPs, bytes) are grouped: a cost is `OpCosts`, a sorted
tuple of (FLOPs, bytes, count), a few dozen entries for a transformer region
however many layers it has. A device evaluates it for its own rates
(`roofline_seconds`; Device.compute_time).

    layer, x = nn.Linear(64, 64), torch.empty(64, 64)
    with OperatorCosts() as costs, FlopCounterMode(display=False):
        layer(x)
    ops = costs.take()                       # ((524288.0, 49408.0, 1),): one addmm
    roofline_seconds(ops, flops_rate=156e12, bytes_rate=0.8e12)     # 6.2e-08 s: memory-bound
"""
from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

OpCosts = tuple[tuple[float, float, int], ...]  # (FLOPs, bytes, count) per distinct operator cost, sorted

_aten = torch.ops.aten
# Operators that move no bytes though their schema does not mark them as views.
_NO_TRAFFIC = {_aten._unsafe_view, _aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty,
               _aten.new_empty_strided}


class OperatorCosts(TorchDispatchMode):
    """Records the (FLOPs, bytes) of every operator dispatched inside it, grouped by equal cost."""

    def __init__(self):
        super().__init__()
        self._counts: dict[tuple[float, float], int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func._overloadpacket in _NO_TRAFFIC:
            return out
        formula = flop_registry.get(func._overloadpacket)
        flops = float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0
        nbytes = float(sum(_distinct_bytes(t) for t in tree_leaves((args, kwargs, out))
                           if isinstance(t, torch.Tensor)))
        if flops or nbytes:
            key = (flops, nbytes)
            self._counts[key] = self._counts.get(key, 0) + 1
        return out

    def take(self) -> OpCosts:
        """The operators recorded since the last take, grouped by equal (FLOPs, bytes)."""
        counts, self._counts = self._counts, {}
        return tuple(sorted((flops, nbytes, count) for (flops, nbytes), count in counts.items()))


def _distinct_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the distinct elements `tensor` spans: dimensions of stride 0 (broadcast) count once."""
    return tensor.element_size() * math.prod(size for size, stride in zip(tensor.shape, tensor.stride()) if stride)


def roofline_seconds(ops: OpCosts, flops_rate: float, bytes_rate: float) -> float:
    """Seconds `ops` take, each operator bound by its arithmetic at `flops_rate` FLOP/s or its bytes at
    `bytes_rate` B/s, whichever is slower."""
    return sum(count * max(flops / flops_rate, nbytes / bytes_rate) for flops, nbytes, count in ops)


def scaled(ops: OpCosts, fraction: float) -> OpCosts:
    """`fraction` of the work of `ops` (every operator's FLOPs and bytes scaled): a share of a pass charged
    apart, whose roofline time is that fraction of the whole's."""
    return tuple((flops * fraction, nbytes * fraction, count) for flops, nbytes, count in ops)

