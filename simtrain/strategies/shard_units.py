"""A model's units under sharded data parallelism, and each unit's share of a step's measured compute.

A unit is what FSDP wraps: an entry of the model's nn.Sequential with
trainable parameters, with the parameterless entries after it
(train/partition.py's `model_units`; leading parameterless entries join the
first). A model that is not an nn.Sequential is one unit. `UnitCosts` cuts a
step's measured forward and backward (cost.py's StepCost) into per-unit
Compute operations:

- forward: each unit at the FLOPs measured for it on a meta copy of the
  model (train/partition.py's `unit_flops`, once per batch shape); the last
  unit takes what the others leave of the whole forward (the loss);
- backward, last unit first: each unit from the completion of the gradients
  of the unit after it to the completion of its own (`grad_ready_flops`, read
  by a post-accumulate-grad hook during the measured backward); the first
  unit's runs to the end of the backward;
- each piece with its share of the pass's kernels (rounded so that they add
  up) and of its operators' FLOPs and bytes (op_cost.scaled).

    costs = UnitCosts(job.model)
    layout = ShardLayout(numels, costs.param_units, shards=4)
    forward = costs.forward(x, cost, "bf16"); backward = costs.backward(cost, "bf16")
"""
import torch

from ..op_cost import scaled
from ..step_ops import Compute
from ..train.partition import model_units, unit_flops


class UnitCosts:
    """A model's units (as entries and as trainable parameter indices) and their shares of a step's compute."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.entries = _entry_units(model)  # None: not an nn.Sequential, one unit
        self.param_units = _param_units(model, self.entries)
        self._forward: dict[tuple, list[float]] = {}  # by batch shape and dtype: each unit's forward FLOPs

    def forward(self, x: torch.Tensor, cost, dtype: str) -> list[Compute]:
        """The forward on a batch like `x`, unit by unit."""
        key = (tuple(x.shape), x.dtype)
        if key not in self._forward:
            self._forward[key] = unit_flops(self.model, self.entries, x) if self.entries is not None else [0.0]
        flops = list(self._forward[key])
        flops[-1] = cost.forward_flops - sum(flops[:-1])
        return _pieces(flops, cost.forward_flops, cost.forward_kernels, cost.forward_ops, dtype, "forward")

    def backward(self, cost, dtype: str) -> list[Compute]:
        """The backward, unit by unit, last unit first."""
        flops, done = [], 0.0
        for unit in reversed(range(len(self.param_units))):
            ready = max(cost.grad_ready_flops[index] for index in self.param_units[unit]) if unit else \
                cost.backward_flops
            flops.append(max(ready - done, 0.0))
            done = max(ready, done)
        return _pieces(flops, cost.backward_flops, cost.backward_kernels, cost.backward_ops, dtype, "backward")


def _entry_units(model) -> list[tuple[int, ...]] | None:
    """The units as groups of the nn.Sequential's entries, a group without trainable parameters joined to the
    one before it; None for a model that is not an nn.Sequential."""
    if not isinstance(model, torch.nn.Sequential):
        return None
    units: list[tuple[int, ...]] = []
    for unit in model_units(model, tensor_parallel=False):
        if units and not any(p.requires_grad for entry in unit for p in model[entry].parameters()):
            units[-1] += unit
        else:
            units.append(unit)
    return units


def _param_units(model, entries) -> list[list[int]]:
    """Each unit's trainable parameters, as indices among the model's trainable parameters, in order."""
    if entries is None:
        return [list(range(sum(1 for p in model.parameters() if p.requires_grad)))]
    units, index = [], 0
    for unit in entries:
        count = sum(1 for entry in unit for p in model[entry].parameters() if p.requires_grad)
        units.append(list(range(index, index + count)))
        index += count
    return units


def _pieces(flops: list[float], total: float, kernels: int, ops, dtype: str, name: str) -> list[Compute]:
    """A pass cut into Compute operations of `flops` each (the first starts the pass)."""
    whole = Compute(total, dtype, name, kernels=kernels, ops=ops, passes=1)
    if not total:
        return [whole._replace(flops=piece, kernels=0, passes=int(not index)) for index, piece in enumerate(flops)]
    pieces, done = [], 0.0
    for piece in flops:
        pieces.append(compute_piece(whole, done, done + piece))
        done += piece
    return pieces


def compute_piece(compute: Compute, start: float, stop: float) -> Compute:
    """FLOPs [start, stop) of `compute`, with that share of its operators and kernels (the pieces add up to all),
    the first piece starting its passes."""
    share = (stop - start) / compute.flops
    kernels = round(compute.kernels * stop / compute.flops) - round(compute.kernels * start / compute.flops)
    return compute._replace(flops=stop - start, kernels=kernels, passes=compute.passes if start == 0 else 0,
                            ops=None if compute.ops is None else scaled(compute.ops, share))
