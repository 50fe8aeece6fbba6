"""Which backward operators compute weight gradients, measured: what a schedule's W pass runs apart from its I.

Zero-bubble schedules (simtrain/parallel/schedules: zero_bubble, dualpipev)
split a backward into I, the input gradient the previous stage waits for, and
W, the weight gradients nobody waits for. Which of a chunk's backward
operators belong to W is not assumed from layer types: `WeightGradWatch`
watches the backward of the chunk's measurement on its meta copy
(schemes/chunk_measurement.py `measure_chunk`), costs each operator with an
operator recorder of its own (op_cost.py), and follows each result through
copies (a cast, a clone, a sum of two gradients: `COPIES`, whose output has
as many elements as the tensor it reads; a view shares its storage). Each parameter's
gradient hook hands it the gradient autograd computed; the operators that
made that tensor, through its copies, are W's (a Linear's weight GEMM, a
bias's sum over the batch). Everything else is I's. Storages are told apart by
serial number (storage_identity.py), never by address.

What W needs of the forward (`held_bytes`): the storages W's operators read
that the backward did not make and that are no parameter, the activations a
microbatch keeps from its I to its W (a Linear's input, for its weight GEMM).

    watch = WeightGradWatch(parameters)
    with watch: ...backward, watch.cut() at each region's end, watch.gradient(grad) from each parameter hook...
    watch.regions[s]   # (FLOPs, OpCosts, kernels) of region s's weight-gradient operators
"""
from dataclasses import replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..op_cost import OpCosts, OperatorRecorder, merged, without
from ..step_ops import Compute
from ..storage_identity import StorageIds

COPIES = {"_to_copy", "clone", "copy_", "add", "add_", "_unsafe_view", "contiguous"}  # a gradient carried on


class _Operator:
    """An operator of the backward: its cost and whether a parameter's gradient came from it."""

    def __init__(self, flops: float, ops: OpCosts, reads: set):
        self.flops, self.ops, self.reads = flops, ops, reads
        self.weight = False


class WeightGradWatch(TorchDispatchMode):
    """Measuring a backward: per region (cut by `cut`), the FLOPs and operators that made parameters' gradients."""

    def __init__(self, parameters):
        super().__init__()
        self._ids = StorageIds()
        self._parameters = {self._ids.of(p) for p in parameters}
        self._probe = OperatorRecorder()
        self._made_by: dict[int, list[_Operator]] = {}  # storage -> the operators that made it, through copies
        self._sizes: dict[int, int] = {}  # storage -> its bytes, every storage seen
        self._made: set[int] = set()  # storages that first appeared as an operator's result: the backward's own
        self._operators: list[list[_Operator]] = [[]]  # per region

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        read = [(self._ids.of(t), t.numel()) for t in inputs]
        for tensor, (storage, _) in zip(inputs, read):
            self._sizes.setdefault(storage, tensor.untyped_storage().nbytes())
        before = self._probe.flops
        with self._probe:
            out = func(*args, **kwargs)
        operator = _Operator(self._probe.flops - before, self._probe.take(), {storage for storage, _ in read})
        self._operators[-1].append(operator)
        for tensor in (t for t in tree_leaves(out) if isinstance(t, torch.Tensor)):
            storage = self._ids.of(tensor)
            if storage not in self._sizes:
                self._made.add(storage)
                self._sizes[storage] = tensor.untyped_storage().nbytes()
            copied = [] if func._overloadpacket.__name__ not in COPIES else [
                source for source, numel in read if numel == tensor.numel() and source in self._made_by]
            shared = self._made_by.get(storage, [])  # a view, or an in-place operator: the same storage
            self._made_by[storage] = [operator, *shared, *(op for source in copied for op in self._made_by[source])]
        return out

    def gradient(self, grad: torch.Tensor) -> None:
        """A parameter's gradient, as its hook sees it: the operators that made it are weight-gradient work."""
        for operator in self._made_by.get(self._ids.of(grad), []):
            operator.weight = True

    def cut(self) -> None:
        """The current region has ended."""
        self._operators.append([])

    @property
    def regions(self) -> list[tuple[float, OpCosts, int]]:
        """Per region, in backward order: the FLOPs and OpCosts of its weight-gradient operators, and how many
        they are (the kernels a device's kernel_overhead is charged on)."""
        regions = []
        for operators in self._operators[:-1]:
            weight = [operator for operator in operators if operator.weight]
            ops = ()
            for operator in weight:
                ops = merged(ops, operator.ops)
            regions.append((float(sum(o.flops for o in weight)), ops, len(weight)))
        return regions

    @property
    def held_bytes(self) -> int:
        """Bytes of the forward's tensors W reads: neither a parameter nor made in the backward."""
        read = {storage for operators in self._operators for o in operators if o.weight for storage in o.reads}
        return sum(self._sizes[storage] for storage in sorted(read - self._made - self._parameters))


def input_gradient_part(cost):
    """A ChunkCost whose backward regions charge only their input-gradient work (an I pass): each region less
    its measured weight-gradient operators (`cost.weight_grads`) and their kernels."""
    return replace(cost, backward_flops=tuple(flops - weight for flops, (weight, _, _) in
                                              zip(cost.backward_flops, cost.weight_grads)),
                   backward_ops=tuple(without(ops, weight_ops) for ops, (_, weight_ops, _) in
                                      zip(cost.backward_ops, cost.weight_grads)),
                   backward_kernels=tuple(kernels - weight for kernels, (_, _, weight) in
                                          zip(cost.backward_kernels, cost.weight_grads)))


def weight_gradient_compute(cost, dtype: str) -> Compute:
    """A W pass: the weight-gradient operators of every backward region of `cost` (a ChunkCost, or a list of them:
    a recomputed chunk's segments), one compute span, a pass of its own (the host runs it apart from its I)."""
    regions = [region for each in (cost if isinstance(cost, list) else [cost]) for region in each.weight_grads]
    ops = ()
    for _, weight_ops, _ in regions:
        ops = merged(ops, weight_ops)
    return Compute(sum(flops for flops, _, _ in regions), dtype, "backward_weight",
                   kernels=sum(kernels for _, _, kernels in regions), ops=ops, passes=1)
