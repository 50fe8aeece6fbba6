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

Under sequence parallelism a column-parallel Linear's input was kept as its
sequence shard and is gathered again in the backward (strategies/saved_shards.py).
The I pass gathers it, beside the Linears' input gradient, and keeps the
gathered input for W, as the zero-bubble schedules' implementation on
Megatron-LM keeps it (Qi et al. 2024, "Zero Bubble Pipeline Parallelism": its
WeightGradStore holds each deferred weight GEMM's total_input): the bytes W
reads of those gathered inputs (`regathered_bytes`, each storage noted by
`gathered_again`) are held from I to W besides. Such a region's backward is
cut where the gathered input is first used (`mark`): the weight-gradient
operators from there on (`after_mark`) are the Linears' weight GEMMs, which an
I pass leaves to W (`input_gradient_part`).

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
from ..strategies.saved_shards import RegionSplit

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
        self._marks: dict[int, int] = {}  # region -> its operators before the first use of its gathered input
        self._regathered: set[int] = set()  # storages of the inputs gathered again in the backward

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

    def mark(self) -> None:
        """The current region's gathered input is used from here on (a RegionSplit's `after` piece)."""
        self._marks[len(self._operators) - 1] = len(self._operators[-1])

    def gathered_again(self, tensor: torch.Tensor) -> None:
        """`tensor` is an input gathered again in the backward, which W may read."""
        self._regathered.add(self._ids.of(tensor))

    def after_mark(self, region: int) -> tuple[float, OpCosts]:
        """The FLOPs and OpCosts of region `region`'s weight-gradient operators from its mark on."""
        weight = [operator for operator in self._operators[region][self._marks[region]:] if operator.weight]
        ops = ()
        for operator in weight:
            ops = merged(ops, operator.ops)
        return float(sum(o.flops for o in weight)), ops

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
        return sum(self._sizes[storage] for storage in sorted(self._read() - self._made - self._parameters))

    @property
    def regathered_bytes(self) -> int:
        """Bytes of the inputs gathered again in the backward that W reads."""
        return sum(self._sizes[storage] for storage in sorted(self._read() & self._regathered))

    def _read(self) -> set[int]:
        return {storage for operators in self._operators for o in operators if o.weight for storage in o.reads}


def input_gradient_part(cost):
    """A ChunkCost whose backward regions charge only their input-gradient work (an I pass): each region less
    its measured weight-gradient operators (`cost.weight_grads`) and their kernels; a region whose gathered
    input is gathered again (saved_shards.py) with its input-gradient work from the first use of that input on
    beside the gather, and nothing after it."""
    return replace(cost, backward_flops=tuple(flops - weight for flops, (weight, _, _) in
                                              zip(cost.backward_flops, cost.weight_grads)),
                   backward_ops=tuple(without(ops, weight_ops) for ops, (_, weight_ops, _) in
                                      zip(cost.backward_ops, cost.weight_grads)),
                   backward_kernels=tuple(kernels - weight for kernels, (_, _, weight) in
                                          zip(cost.backward_kernels, cost.weight_grads)),
                   backward_regather=tuple(None if split is None else _input_split(split, weight)
                                           for split, weight in zip(cost.backward_regather, cost.weight_grads)))


def _input_split(split: RegionSplit, weight: tuple) -> RegionSplit:
    """`split` (a RegionSplit of a backward region whose weight-gradient operators are `weight`) less those
    operators, its `after` piece all beside the gather."""
    flops, ops, _ = weight
    after_flops, after_ops = split.after_weight
    return split._replace(before_flops=split.before_flops - (flops - after_flops),
                          before_ops=without(split.before_ops, without(ops, after_ops)),
                          after_flops=split.after_flops - after_flops, after_ops=without(split.after_ops, after_ops),
                          after_weight=(0.0, ()), behind=0.0)


def kept_for_weights(cost) -> int:
    """Bytes a microbatch's I keeps to its W (a ChunkCost's): what W reads of the activations, and of the inputs
    the I gathered again."""
    return cost.weight_held_bytes + cost.weight_regathered_bytes


def weight_gradient_compute(cost, dtype: str) -> Compute:
    """A W pass: the weight-gradient operators of every backward region of `cost` (a ChunkCost, or a list of them:
    a recomputed chunk's segments), one compute span, a pass of its own (the host runs it apart from its I)."""
    regions = [region for each in (cost if isinstance(cost, list) else [cost]) for region in each.weight_grads]
    ops = ()
    for _, weight_ops, _ in regions:
        ops = merged(ops, weight_ops)
    return Compute(sum(flops for flops, _, _ in regions), dtype, "backward_weight",
                   kernels=sum(kernels for _, _, kernels in regions), ops=ops, passes=1)
