"""Cutting a model into pipeline parts and tensor-parallel shards, and putting the whole model back together.

A model is split along its nn.Sequential (`model_entries`; a model of any other kind,
left uncut, is its own one entry, run whole). `model_units` groups the entries
into units the pipeline never cuts: each entry with parameters starts a unit
and takes the parameterless entries after it (ReLU, Flatten, pooling;
parameterless entries before the first one join the first unit); under
tensor parallelism a Linear, element-wise functions, Linear run is one unit,
since its two Linears are split as a pair (train/tensor_parallel.py).
`balanced_counts` deals units out to model parts so that the largest part's
FLOPs are as small as they can be (contiguous parts, each at least one unit).

`RankModule` is one rank's share: the model parts it runs (pipeline chunks,
each an nn.Sequential of copies of the model's entries; a model that is not
an nn.Sequential, uncut, is its one chunk, a copy of it whole), cut to its tensor
slices, with `ops[chunk]`, the chunk's work as a list of Apply and
all-reduce steps (the last model part's ending with the loss against the
target: a vocabulary-parallel head's own, else its `loss` on the outputs:
cross entropy, or its replica loader's, a prioritized sampler's
importance-weighted loss, train/sampling.py), `layers[chunk]`, the same work
cut into the segments it is recomputed in, one (module, ops) pair per segment: a unit under
train.checkpointing full, units grouped as gradient checkpointing groups blocks under sqrt or
{segments: k} where the chunk runs region by region (tp, cp or an MoE layer;
schemes/layer_recompute.py), and `sources`, where each of its parameters and buffers
comes from in the whole model. `assemble` writes ranks' pieces back into a
copy of the whole model: what final_model.pt holds and what is evaluated.

    units = model_units(model, tensor_parallel=False)
    counts = balanced_counts(unit_flops(model, units, x), parts=4)
    share = RankModule(model, units, counts, part_ids=[1], tp_rank=0, tp=1)
"""
import copy
from typing import NamedTuple

import torch
from torch import nn

from ..loss import cross_entropy
from ..op_cost import OperatorRecorder
from .architecture import group_units, pair_end, recompute_segments
from .checkpointing import apply_checkpointing, recompute_attention_cores_
from .moe import MoE, copy_holding_experts, whole_model_name
from .ring_attention import ContextShard
from .tensor_parallel import (ELEMENTWISE, TP_BOUNDARIES, Apply, ApplyWithTarget, Slice, column_row_ops,
                              shard_column_row_)

# The plain cross entropy that ends a model: what a chunk's cost is measured with (a sampler's weights are no
# part of it, and a measurement must not refresh its priorities)
LOSS = ApplyWithTarget(lambda outputs, target: (cross_entropy(outputs, target),))


def model_entries(model: nn.Module) -> list[nn.Module]:
    """What a model is cut along: an nn.Sequential's entries; any other model is its own one entry, run whole."""
    return list(model) if isinstance(model, nn.Sequential) else [model]


def model_units(model: nn.Module, tensor_parallel: bool, cut: bool = True) -> list[tuple[int, ...]]:
    """Entries of the nn.Sequential `model`, grouped into the units pipeline cuts fall between. A model of any
    other kind is one unit, its one entry, when it is left uncut (`cut` False: one part, its layers whole, its
    sequence whole), as data parallelism alone trains any module."""
    if not isinstance(model, nn.Sequential):
        if not cut:
            return [(0,)]
        raise ValueError(f"the model is a {type(model).__name__}; only an nn.Sequential can be cut into stages")
    entries = list(model)
    ends = [_pair_end(entries, index) if tensor_parallel else None for index in range(len(entries))]
    return group_units([next(entry.parameters(), None) is not None for entry in entries], ends)


def _pair_end(entries: list[nn.Module], start: int) -> int | None:
    """The index of the row Linear of a Linear, element-wise..., Linear run starting at `start`."""
    return pair_end([isinstance(entry, nn.Linear) for entry in entries],
                    [isinstance(entry, ELEMENTWISE) for entry in entries], start)


def unit_flops(model: nn.Module, units: list[tuple[int, ...]], x: torch.Tensor) -> list[float]:
    """Forward FLOPs of each unit on the batch shape of `x`."""
    return [flops for flops, _ in unit_passes(model, units, x)]


def unit_passes(model: nn.Module, units: list[tuple[int, ...]], x: torch.Tensor,
                dtype: torch.dtype | None = None) -> list[tuple[float, torch.Tensor]]:
    """Each unit's forward FLOPs and output (a meta tensor) on batches shaped like `x`, run in order on meta copies
    of its entries (in `dtype`, when given). A unit built as one run before, on an input of the same shape (a
    transformer's blocks), is run once, and only the entries run are copied."""
    entries = model_entries(model)
    passes, measured = [], {}
    h = torch.empty(x.shape, dtype=dtype if dtype is not None and x.is_floating_point() else x.dtype, device="meta")
    with torch.no_grad():
        for unit in units:
            key = (tuple(h.shape), h.dtype, *(module_structure(entries[index]) for index in unit))
            if key not in measured:
                with OperatorRecorder() as recorder:
                    for index in unit:
                        h = _meta_copy(entries[index], dtype)(h)
                measured[key] = float(recorder.flops), h
            passes.append(measured[key])
            h = passes[-1][1]
    return passes


def _meta_copy(module: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """A copy of `module` on the meta device (in `dtype`, when given): `module` is left as it is."""
    meta = copy.deepcopy(module).to("meta")
    return meta if dtype is None else meta.to(dtype)


def module_structure(module: nn.Module) -> tuple:
    """What a module computes, as far as its FLOPs go: each submodule's type, its parameters' and buffers'
    names, shapes and dtypes, and its public attributes (by value where hashable, else by identity) but those its
    class names as `RECORDS` (what its forwards did, not what it computes: an MoE layer's routing)."""
    def attribute(value):
        if isinstance(value, torch.Tensor):
            return tuple(value.shape), value.dtype
        try:
            hash(value)
        except TypeError:
            return id(value)
        return value

    return tuple((name, type(sub), tuple((key, tuple(tensor.shape), tensor.dtype) for key, tensor in
                                         [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]),
                  tuple((key, attribute(value)) for key, value in sorted(vars(sub).items())
                        if not key.startswith("_") and key not in getattr(type(sub), "RECORDS", ())))
                 for name, sub in module.named_modules())


def balanced_counts(weights: list[float], parts: int) -> list[int]:
    """Units per part: contiguous, at least one each, the heaviest part as light as possible.

    Bisection finds the smallest bound that greedy packing (a new part when the next unit
    would pass the bound) meets with at most `parts` parts; parts with the most units are
    then halved until there are `parts` (halving never passes the bound)."""
    if parts > len(weights):
        raise ValueError(f"{parts} parts need at least {parts} units, the model has {len(weights)}")

    def packed(bound: float) -> list[int]:
        counts, total = [0], 0.0
        for weight in weights:
            if counts[-1] and total + weight > bound:
                counts.append(0)
                total = 0.0
            counts[-1] += 1
            total += weight
        return counts

    low, high = max(weights), sum(weights)
    for _ in range(100):
        middle = (low + high) / 2
        if len(packed(middle)) > parts:
            low = middle
        else:
            high = middle
    counts = packed(high)
    while len(counts) < parts:
        largest = max(range(len(counts)), key=lambda i: (counts[i], -i))
        counts[largest:largest + 1] = [counts[largest] - counts[largest] // 2, counts[largest] // 2]
    return counts


class Source(NamedTuple):
    """Where a rank's parameter or buffer comes from: its name in the whole model and, when the rank
    holds a tensor-parallel slice of it, which slice."""

    name: str
    slice: Slice | None


class RankModule(nn.Module):
    """One rank's share of a model: its pipeline chunks, cut to its tensor-parallel slices, for its chunks of the
    sequence (`context`, under context parallelism: train/ring_attention.py).

    `counts` gives the units of each model part (balanced_counts); the rank runs parts
    `part_ids`, in order (its chunks). Every entry is a copy: the model is left as it is.
    Without tensor parallelism, context parallelism or MoE layers each chunk is checkpointed by `checkpointing`
    (train.checkpointing) as a whole model would be; under `full`, and under sqrt or segments with any of them
    (`segmented`), the stage recomputes each chunk segment by segment instead (`layers`,
    schemes/layer_recompute.py). A model that is not an nn.Sequential (one unit: model_units)
    is its one chunk, a copy of the model itself, checkpointed as the model would be under every
    `checkpointing`, with the model's own parameter names."""

    def __init__(self, model: nn.Module, units: list[tuple[int, ...]], counts: list[int], part_ids: list[int],
                 tp_rank: int = 0, tp: int = 1, checkpointing="none", sequence_parallel: bool = False,
                 context: ContextShard = ContextShard(), experts: tuple[int, int] = (0, 1)):
        super().__init__()
        first_unit = [sum(counts[:part]) for part in range(len(counts))]
        self.tp = tp
        self.sequence_parallel = sequence_parallel
        # (outputs, target) -> the batch's loss that ends the model: cross entropy, or the replica's loader's
        # (its `batch_loss`: a prioritized sampler weights it, train/sampling.py), which the scheme sets
        self.loss = cross_entropy
        self._ends_model = ApplyWithTarget(lambda outputs, target: (self.loss(outputs, target),))
        self.context = context
        self.chunks = nn.ModuleList()
        self.ops: list[list] = []
        self.layers: list[list[tuple[nn.Sequential, list]]] = []
        self._ends: list[bool] = []  # per chunk: whether it ends the model
        self._sizes: list[list[int] | None] = []  # per chunk: its segments' entries (None: run whole, one segment)
        self.sources: dict[str, Source] = {}
        whole = not isinstance(model, nn.Sequential)  # run whole, its one entry
        # each chunk recomputed segment by segment (schemes/layer_recompute.py): under full, and under sqrt or
        # segments where torch's checkpoint cannot cut a chunk (its tp, cp or ep steps run region by region)
        self.segmented = not whole and checkpointing not in ("none", "selective") and (
            checkpointing == "full" or tp > 1 or context.size > 1 or any(isinstance(m, MoE) for m in model.modules()))
        self.recompute_last = checkpointing == "full"  # sqrt and segments keep the last segment's activations
        for chunk_index, part in enumerate(part_ids):
            chunk_units = units[first_unit[part]:first_unit[part] + counts[part]]
            entries = [index for unit in chunk_units for index in unit]
            # ep rank experts[0] of experts[1]: its share of every MoE layer's experts, the only ones copied
            chunk = copy_holding_experts(model, *experts) if whole else nn.Sequential(
                *(copy_holding_experts(model[index], *experts) for index in entries))
            slices = self._shard(chunk, tp_rank, tp) if tp > 1 else {}
            for module in chunk.modules() if sequence_parallel else ():  # train/gpt.py's layers take it
                if hasattr(module, "sequence_parallel"):
                    module.sequence_parallel = True
            for module in chunk.modules() if context.size > 1 else ():  # gpt's and llama's layers take it
                if hasattr(module, "context"):
                    module.context = context
            if checkpointing == "selective":  # a chunk may hold no attention layer
                recompute_attention_cores_(chunk)
            elif tp == 1 and context.size == 1 and not self.segmented:  # as a model would
                chunk = apply_checkpointing(chunk, checkpointing)
            self.chunks.append(chunk)
            self._ends.append(part == len(counts) - 1)
            self._sizes.append(None if whole else self._segment_sizes(model, chunk_units, checkpointing))
            for local, _ in [*chunk.named_parameters(), *chunk.named_buffers()]:
                name = whole_model_name(chunk, local)
                position, _, rest = name.partition(".")
                whole_name = name if whole else f"{entries[int(position)]}.{rest}"
                self.sources[f"chunks.{chunk_index}.{local}"] = Source(whole_name, slices.get(local))
        self.build_ops()

    def build_ops(self) -> None:
        """Each chunk's work (`ops`) and its segments' (`layers`), from its modules as they are: built again once its
        MoE layers know their experts' hosts (strategies/expert_model_parallel.py), which may add an exchange."""
        self.ops = [self.chunk_ops(chunk, ends, self._ends_model) for chunk, ends in zip(self.chunks, self._ends)]
        self.layers = [[(chunk, ops)] if sizes is None else self._layers(chunk, sizes, ends)
                       for chunk, ops, sizes, ends in zip(self.chunks, self.ops, self._sizes, self._ends)]

    def _segment_sizes(self, model: nn.Sequential, chunk_units: list[tuple[int, ...]], checkpointing) -> list[int]:
        """The entries of each segment a chunk of `chunk_units` is recomputed in (train/architecture.py
        recompute_segments); one unit each where it is not recomputed segment by segment."""
        if not self.segmented:
            return [len(unit) for unit in chunk_units]
        matrix = [any(p.dim() >= 2 for index in unit for p in model[index].parameters()) for unit in chunk_units]
        return [sum(len(unit) for unit in chunk_units[first:end])
                for first, end in recompute_segments(checkpointing, matrix)]

    def _layers(self, chunk: nn.Sequential, sizes: list[int], ends_model: bool) -> list[tuple[nn.Sequential, list]]:
        """Each segment of `chunk` (`sizes` entries each: a unit, or under sqrt or segments a group of units) as a
        module of its own entries and its work, the last one's ending with the loss if the chunk ends the model."""
        entries, layers, start = list(chunk), [], 0
        for number, size in enumerate(sizes):
            layer = nn.Sequential(*entries[start:start + size])
            last = ends_model and number == len(sizes) - 1
            layers.append((layer, self.chunk_ops(layer, last, self._ends_model)))
            start += size
        return layers

    def tp_summed_parameters(self) -> list[nn.Parameter]:
        """The trainable parameters every tp rank holds whole whose gradient is each tp rank's share, summed
        across the tp group after the backward: under sequence parallelism all of them (each rank saw its part of
        the sequence), else those of the MoE layers (each tp rank routes its part: train/moe.py); none with one
        tp rank."""
        if self.tp == 1:
            return []
        experts = {id(p) for layer in self.modules() if isinstance(layer, MoE) for p in layer.parameters()}
        return [p for name, p in self.named_parameters() if p.requires_grad and self.sources[name].slice is None
                and (self.sequence_parallel or id(p) in experts)]

    def pieces(self) -> list[tuple[Source, torch.Tensor]]:
        """Each of its parameters and buffers with where it comes from in the whole model (for `assemble`)."""
        return [(self.sources[local], tensor.detach()) for local, tensor in [*self.named_parameters(),
                                                                               *self.named_buffers()]]

    def chunk_ops(self, chunk: nn.Sequential, ends_model: bool, loss: ApplyWithTarget = LOSS) -> list:
        """A chunk's work: the whole chunk in one step, or its tensor-parallel steps and all-reduces (and
        ring attention's steps under context parallelism); ending with `loss` if the chunk ends the model (the
        plain cross entropy, as a cost is measured; the rank's own ops end with its `loss`)."""
        if self.tp > 1 or self.context.size > 1 or any(isinstance(module, MoE) for module in chunk.modules()):
            return _parallel_ops(chunk, ends_model, self.tp, loss)  # a mixture of experts: its exchanges
        return [Apply(lambda x: (chunk(x),)), *([loss] if ends_model else [])]

    @staticmethod
    def _shard(chunk: nn.Sequential, tp_rank: int, tp: int) -> dict[str, Slice]:
        """Cut the chunk's pairs and tensor-parallel modules to tp rank `tp_rank`'s slices."""
        slices = {}
        entries = list(chunk)
        position = 0
        while position < len(entries):
            end = _pair_end(entries, position)
            if end is not None:
                pair = shard_column_row_(entries[position], entries[end], tp_rank, tp)
                positions = {"column": position, "row": end}
                for key, where in pair.items():
                    module, _, rest = key.partition(".")
                    slices[f"{positions[module]}.{rest}"] = where
                position = end + 1
                continue
            if hasattr(entries[position], "shard_"):
                shard = entries[position].shard_(tp_rank, tp)
                slices.update({f"{position}.{name}": where for name, where in shard.items()})
            position += 1
        return slices


def _parallel_ops(chunk: nn.Sequential, ends_model: bool, tp: int, loss: ApplyWithTarget) -> list:
    """The chunk's work under tensor parallelism: pairs and tensor-parallel modules with their
    all-reduces, every other entry applied whole; then `loss` if the chunk ends the model (a last
    entry with `parallel_loss_ops` computes its own). With one tp rank (context parallelism alone) the
    tp collectives, each over one rank, are left out."""
    ops = _tensor_parallel_ops(chunk, ends_model, loss)
    return ops if tp > 1 else [op for op in ops if type(op) not in TP_BOUNDARIES]


def _tensor_parallel_ops(chunk: nn.Sequential, ends_model: bool, loss: ApplyWithTarget) -> list:
    """The chunk's work with its tp collectives (see _parallel_ops)."""
    entries, ops, position = model_entries(chunk), [], 0
    while position < len(entries):
        if ends_model and position == len(entries) - 1 and hasattr(entries[position], "parallel_loss_ops"):
            return ops + entries[position].parallel_loss_ops()
        end = _pair_end(entries, position)
        if end is not None:
            ops += column_row_ops(entries[position], entries[position + 1:end], entries[end])
            position = end + 1
            continue
        entry = entries[position]
        ops += entry.parallel_ops() if hasattr(entry, "parallel_ops") else [Apply(lambda x, entry=entry: (entry(x),))]
        position += 1
    return ops + ([loss] if ends_model else [])


def assemble(template: nn.Module, pieces) -> nn.Module:
    """A copy of `template` holding `pieces`, (Source, tensor) pairs (RankModule.pieces of ranks' shares)
    that together hold every parameter once (slices of a tensor-parallel parameter from each of its tp ranks),
    each in its piece's dtype: mid-training under mixed precision, the compute-dtype model the ranks run."""
    whole = copy.deepcopy(template)
    targets = dict(whole.named_parameters()) | dict(whole.named_buffers())
    with torch.no_grad():
        for source, tensor in pieces:
            target = targets[source.name]
            if target.dtype != tensor.dtype:
                target.data = target.data.to(tensor.dtype)
            if source.slice is None:
                target.copy_(tensor)
            else:
                dim, start, stop = source.slice
                target.narrow(dim, start, stop - start).copy_(tensor)
    return whole
