"""FLOPs and activation memory of one training step, measured from torch itself.

`measure_step_cost(model, x, y)` runs one forward (mean cross-entropy loss,
computed in fp32 from upcast logits, as a mixed-precision replica does) and
one backward on a deep copy of `model` and returns a `StepCost`. Operators
and activation bytes are measured in two separate passes, each on its own
copy. Every figure but the activation bytes is the operator recorder's
(op_cost.py), one recorder around the forward (model and loss) and one around
`loss.backward()`:

- `forward_flops`, `backward_flops`: torch's FLOP formulas (flop_counter's
  definitions: matrix multiplies, convolutions and attention, 2 FLOPs per
  multiply-add; element-wise ops, reductions and softmax count 0).
- `grad_ready_flops`: for each trainable parameter, in `model.parameters()`
  order, the backward FLOPs counted when its gradient was complete (a
  post-accumulate-grad hook reads the backward recorder): when, in the
  backward, an overlapping all-reduce may start on it.
- `forward_kernels`, `backward_kernels`: the torch operators (aten ops, views
  included) the forward and the backward dispatch: what a per-kernel
  overhead (a device's `kernel_overhead`) is charged on.
- `forward_ops`, `backward_ops`: each pass's operators as (FLOPs, bytes,
  count, rate dtype, kernel) groups: what a device under `compute_model: roofline`
  or `kernels` charges.
- `activation_bytes`: the peak, over forward and backward, of the bytes of
  tensors autograd holds for backward. Every tensor autograd saves goes
  through `torch.autograd.graph.saved_tensors_hooks`; its storage is counted
  once however many saved tensors view it (whole storage: a saved slice keeps
  its whole storage alive), from the first save until autograd drops the last
  saved reference to it (each graph node drops its saved tensors after its
  backward runs). Under gradient checkpointing (`simtrain.train.checkpointing`)
  a checkpointed segment's forward saves nothing but its input, and the
  tensors its recomputation keeps for backward are counted from the
  recomputation until backward uses them; the recomputation's FLOPs are part
  of `backward_flops`. Storages of the model's parameters and buffers and of the
  input batch (x and y) are not activations and are not counted; under
  autocast, the low-precision copies of weights and inputs that autograd saves
  are new storages and are counted. Gradients,
  the optimizer state and temporaries that autograd never saves are not counted
  either: the device's memory ledger accounts for those.

The caller's model, its parameters' `.grad`, its inputs and the global RNG
are untouched. Results are cached by (model class, printed structure,
parameter names/shapes/dtypes, training flags, x and y shapes and dtypes,
autocast state; the printed structure names the checkpointed segments), so calling it every step costs a dictionary lookup after the
first. It works on `meta` tensors too: shapes and bytes without arithmetic.

    cost = measure_step_cost(model, x, y)
    cost.forward_flops, cost.backward_flops, cost.activation_bytes
"""
from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .loss import cross_entropy
from .op_cost import OpCosts, OperatorRecorder
from .storage_identity import StorageIds


@dataclass(frozen=True)
class StepCost:
    """What one forward + backward of a model on one batch costs."""

    forward_flops: float
    backward_flops: float
    activation_bytes: int  # peak bytes of tensors autograd saves for backward
    grad_ready_flops: tuple[float, ...] = ()  # backward FLOPs done when each trainable parameter's gradient is complete
    forward_kernels: int = 0  # torch operators the forward dispatches
    backward_kernels: int = 0
    forward_ops: OpCosts = ()  # the forward's operators as (FLOPs, bytes, count, rate dtype) groups (op_cost.py)
    backward_ops: OpCosts = ()


_cache: dict[tuple, StepCost] = {}


def measure_step_cost(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> StepCost:
    """FLOPs of forward and backward, and peak saved-activation bytes, of one step (cached)."""
    key = _cache_key(model, x, y)
    cost = _cache.get(key)
    if cost is None:
        cost = _cache[key] = _measure(model, x, y)
    return cost


def _cache_key(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple:
    parameters = tuple(
        (name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in model.named_parameters()
    )
    training = tuple(module.training for module in model.modules())
    autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    inputs = (tuple(x.shape), x.dtype, x.requires_grad, tuple(y.shape), y.dtype)
    return (type(model), repr(model), parameters, training, inputs, autocast)


def _measure(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> StepCost:
    # Two passes, each on its own copy: the operators, and the tensors autograd saves.
    forward_flops, backward_flops, grad_ready_flops, kernels, ops = _count_flops(model, x, y)
    return StepCost(forward_flops=forward_flops, backward_flops=backward_flops,
                    activation_bytes=_peak_saved_bytes(model, x, y), grad_ready_flops=grad_ready_flops,
                    forward_kernels=kernels[0], backward_kernels=kernels[1], forward_ops=ops[0], backward_ops=ops[1])


def _fresh(model: nn.Module, x: torch.Tensor) -> tuple[nn.Module, torch.Tensor]:
    replica = copy.deepcopy(model)
    for parameter in replica.parameters():
        parameter.grad = None
    return replica, x.detach().requires_grad_(x.requires_grad)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return cross_entropy(model(x), y)


def _count_flops(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple:
    """(forward FLOPs, backward FLOPs, grad_ready_flops, (forward operators, backward operators),
    (forward OpCosts, backward OpCosts))."""
    replica, x = _fresh(model, x)
    trainable = [p for p in replica.parameters() if p.requires_grad]
    ready = [0.0] * len(trainable)
    backward = OperatorRecorder()

    def hook(index):
        def record(_):  # a gradient accumulated twice (a shared parameter) is ready the second time
            ready[index] = float(backward.flops)
        return record

    handles = [p.register_post_accumulate_grad_hook(hook(index)) for index, p in enumerate(trainable)]
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        with OperatorRecorder() as forward:
            loss = _loss(replica, x, y)
        with backward:
            loss.backward()
    for handle in handles:
        handle.remove()
    return (float(forward.flops), float(backward.flops), tuple(ready),
            (forward.kernels, backward.kernels), (forward.take(), backward.take()))


def _peak_saved_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    replica, x = _fresh(model, x)
    tracker = SavedTensorTracker([*replica.parameters(), *replica.buffers(), x, y])
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
            _loss(replica, x, y).backward()
    return tracker.peak_bytes


class _Saved:
    """What autograd holds for one saved tensor; its death means autograd let go."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedTensorTracker:
    """Live and peak bytes of the storages autograd holds for backward."""

    def __init__(self, excluded: list[torch.Tensor]):
        self._ids = StorageIds()
        self._excluded = {self._ids.of(t) for t in excluded}
        self._holders: dict[int, int] = {}  # storage number -> saved references alive
        self._nbytes: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def pack(self, tensor: torch.Tensor):
        storage_id = self._ids.of(tensor)
        if storage_id in self._excluded:
            return tensor
        if storage_id in self._holders:
            self._holders[storage_id] += 1
        else:
            self._holders[storage_id] = 1
            self._nbytes[storage_id] = tensor.untyped_storage().nbytes()
            self.live_bytes += self._nbytes[storage_id]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        saved = _Saved(tensor)
        weakref.finalize(saved, self._release, storage_id)
        return saved

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, storage_id: int) -> None:
        self._holders[storage_id] -= 1
        if self._holders[storage_id] == 0:
            del self._holders[storage_id]
            self.live_bytes -= self._nbytes.pop(storage_id)

