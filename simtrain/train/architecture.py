"""The built-in models' architecture as plain data: their layers, widths and parameters, without torch.

train/models.py builds the mlp, the cnn, gpt and llama (with model.moe's
mixture-of-experts blocks, and a llama's model.latent_attention) as flat
nn.Sequentials. `architecture(spec, info)`
lists the same entries, in the same order, as `Entry` records: the module's
kind (its class name), its trainable parameters, whether it holds a weight
matrix or kernel (where a checkpointing block starts), whether it is an
attention layer, and its tensor-parallel cut: the counts that must divide by
tp, each with the line its `shard_` raises. So everything the pipeline split,
the tensor-parallel cut and gradient checkpointing refuse can be checked on a
scenario without building the model (simtrain/job_checks.py).

The rules are written once, here, over plain flags, and the torch side calls
them on the modules it builds: `group_units` (train/partition.py's
model_units), `pair_end` (a Linear, element-wise..., Linear run),
`checkpoint_blocks` (train/checkpointing.py's split_blocks), and
`require_divides` with the cut's lines (train/tensor_parallel.py,
train/gpt.py, train/llama.py, train/vocab_parallel.py).

    entries = architecture(ModelSpec(name="gpt", hidden=[64], layers=2, heads=4), tokens_info(32, 64))
    units = group_units([e.parameters > 0 for e in entries], [pair_end(...) ...])
    sum(e.parameters for e in entries)   # equals the built model's parameters
"""
from __future__ import annotations

import math
from typing import NamedTuple

from ..errors import ScenarioError
from .data_shape import DatasetInfo

FEATURES = "{count} features do not divide into {tp} equal slices"
GPT_HEADS = "{count} heads do not divide into {tp} equal groups"
HEADS = "model.heads {count} do not divide into {tp} equal groups"
KV_HEADS = "model.kv_heads {count} do not divide into {tp} equal groups"
FFN_HIDDEN = "model.ffn_hidden {count} does not divide into {tp} equal slices"
VOCAB = "data.vocab {count} does not divide into {tp} equal vocabulary slices"
ELEMENTWISE = ("ReLU", "GELU", "Tanh", "SiLU", "Sigmoid", "LeakyReLU")  # tensor_parallel.ELEMENTWISE's names


class Entry(NamedTuple):
    """One entry of a built-in model's nn.Sequential."""

    kind: str  # the module's class name
    parameters: int = 0  # trainable parameters
    matrix: bool = False  # holds a weight matrix or kernel (a parameter of two or more dimensions)
    cut: tuple[tuple[int, str], ...] = ()  # (count, line) its tensor-parallel shard_ needs divisible by tp
    attention: bool = False  # an attention layer (selective recomputation recomputes its core)
    out_features: int = 0  # a Linear's: what the column half of a tensor-parallel pair is cut by


def require_divides(count: int, tp: int, line: str) -> None:
    """ValueError(`line`) unless `count` divides into `tp` equal parts."""
    if count % tp:
        raise ValueError(line.format(count=count, tp=tp))


def check_model_fits_data(spec, info: DatasetInfo) -> None:
    """A one-line error if built-in model `spec` (a ModelSpec) cannot read data of shape `info`."""
    if spec.name == "cnn" and (info.image_shape is None or len(info.image_shape) != 3):
        raise ScenarioError("model.name: cnn needs image inputs (C, H, W), and this dataset has none")
    if spec.name in ("gpt", "llama") and not info.tokens:
        raise ScenarioError(f"model.name: {spec.name} needs token sequences (data.name: tokens)")


def architecture(spec, info: DatasetInfo) -> list[Entry]:
    """The entries train/models.py builds for built-in model `spec` (mlp, cnn, gpt, llama) on data `info`."""
    check_model_fits_data(spec, info)
    if spec.name == "mlp":
        return _mlp(info, list(spec.hidden), spec.batchnorm)
    if spec.name == "cnn":
        return _cnn(info, list(spec.channels), spec.batchnorm)
    if spec.name == "gpt":
        return _gpt(info.num_classes, info.input_shape[0], spec.width, spec.layers, spec.heads, spec.moe)
    if spec.name == "llama":
        return _llama(info.num_classes, spec.width, spec.layers, spec.heads, spec.key_value_heads, spec.ffn_width,
                      spec.moe, spec.latent_attention)
    raise ValueError(f"{spec.name!r} is not a built-in model")


def _linear(inputs: int, outputs: int, bias: bool = True) -> Entry:
    return Entry("Linear", inputs * outputs + (outputs if bias else 0), matrix=True, out_features=outputs)


def _mlp(info: DatasetInfo, hidden: list[int], batchnorm: bool) -> list[Entry]:
    entries, width = [Entry("Flatten")], info.num_features
    for next_width in hidden:
        entries += [_linear(width, next_width), *([Entry("BatchNorm1d", 2 * next_width)] if batchnorm else []),
                    Entry("ReLU")]
        width = next_width
    return entries + [_linear(width, info.num_classes)]


def _cnn(info: DatasetInfo, channels: list[int], batchnorm: bool) -> list[Entry]:
    in_channels, height, width = info.image_shape
    entries = [Entry("Unflatten")]
    for out_channels in channels:
        entries += [Entry("Conv2d", 9 * in_channels * out_channels + out_channels, matrix=True),
                    *([Entry("BatchNorm2d", 2 * out_channels)] if batchnorm else []), Entry("ReLU")]
        if height >= 2 and width >= 2:
            entries.append(Entry("MaxPool2d"))
            height, width = height // 2, width // 2
        in_channels = out_channels
    return entries + [Entry("Flatten"), _linear(in_channels * height * width, info.num_classes)]


def _gpt(vocab: int, seq_len: int, hidden: int, layers: int, heads: int, moe) -> list[Entry]:
    attention = 4 * hidden * hidden + 4 * hidden + 4 * hidden  # query, key, value, projection; two LayerNorms
    block = Entry("Block", attention + _gpt_mlp(hidden, 4 * hidden), matrix=True, cut=((heads, GPT_HEADS),),
                  attention=True)
    moe_block = None if moe is None else block._replace(  # train/moe.py MoEBlock: the experts are not cut
        kind="MoEBlock", parameters=attention + _moe(hidden, moe, _gpt_mlp(hidden, moe.expert_width(4 * hidden))))
    return [Entry("TokenEmbedding", (vocab + seq_len) * hidden, matrix=True, cut=((vocab, VOCAB),)),
            *_blocks(layers, block, moe_block, moe),
            Entry("LanguageHead", 2 * hidden + hidden * vocab + vocab, matrix=True, cut=((vocab, VOCAB),))]


def _llama(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn_hidden: int, moe,
           latent) -> list[Entry]:
    if latent is None:
        head_width = hidden // heads
        attention = 2 * hidden * heads * head_width + 2 * hidden * kv_heads * head_width  # wq wo, wk wv
        kind = "Llama"
    else:  # train/latent_attention.py: every head its own keys and values
        attention, kind = latent_attention_parameters(latent, hidden, heads), "LatentAttention"
    attention += 2 * hidden  # the block's two norms
    heads_cut = ((heads, HEADS), (kv_heads, KV_HEADS))
    block = Entry(f"{kind}Block", attention + 3 * hidden * ffn_hidden, matrix=True, attention=True,
                  cut=(*heads_cut, (ffn_hidden, FFN_HIDDEN)))
    moe_block = None if moe is None else block._replace(  # train/llama_moe.py LlamaMoEBlock: the experts are not cut
        kind=f"{kind}MoEBlock", parameters=attention + _moe(hidden, moe, 3 * hidden * moe.expert_width(ffn_hidden)),
        cut=heads_cut)
    return [Entry("LlamaEmbedding", vocab * hidden, matrix=True, cut=((vocab, VOCAB),)),
            *_blocks(layers, block, moe_block, moe),
            Entry("LlamaHead", hidden + hidden * vocab, matrix=True, cut=((vocab, VOCAB),))]


def latent_attention_parameters(latent, hidden: int, heads: int) -> int:
    """Parameters of multi-head latent attention `latent` (a LatentAttentionSpec; train/latent_attention.py) of
    width `hidden` and `heads` heads, its latent norms included: wq_a, q_norm, wq_b, wkv_a, kv_norm, wkv_b, wo."""
    rope, nope = latent.qk_rope_head_dim, latent.qk_nope_head_dim
    return (hidden * latent.q_lora_rank + latent.q_lora_rank + latent.q_lora_rank * heads * (nope + rope)
            + hidden * (latent.kv_lora_rank + rope) + latent.kv_lora_rank
            + latent.kv_lora_rank * heads * (nope + latent.v_head_dim) + heads * latent.v_head_dim * hidden)


def _gpt_mlp(hidden: int, width: int) -> int:
    """Parameters of a gpt MLP or expert: Linear(hidden, width), Linear(width, hidden), with biases."""
    return 2 * hidden * width + width + hidden


def _moe(hidden: int, moe, expert: int) -> int:
    """Parameters of an MoE layer (train/moe.py MoE) whose experts have `expert` each: router, routed and shared."""
    return hidden * moe.experts + (moe.experts + moe.shared_experts) * expert


def _blocks(layers: int, block: Entry, moe_block: Entry | None, moe) -> list[Entry]:
    """`layers` blocks, MoE blocks where model.moe puts them (train/moe.py moe_block, train/llama_moe.py)."""
    return [moe_block if moe is not None and moe.holds_experts(layer) else block for layer in range(layers)]


def pair_end(linear: list[bool], elementwise: list[bool], start: int) -> int | None:
    """The index of the row Linear of a Linear, element-wise..., Linear run starting at `start` (entries given by
    whether each is a Linear and whether it is element-wise), or None."""
    if not linear[start]:
        return None
    index = start + 1
    while index < len(linear) and elementwise[index]:
        index += 1
    return index if index < len(linear) and linear[index] else None


def group_units(parameters: list[bool], pair_ends: list[int | None]) -> list[tuple[int, ...]]:
    """Entries grouped into the units pipeline cuts fall between (train/partition.py model_units): each entry with
    parameters starts a unit and takes the parameterless entries after it (those before the first one join
    it); a tensor-parallel pair (pair_ends[i]: where the run starting at i ends, or None) is one unit."""
    units: list[list[int]] = []
    index = 0
    while index < len(parameters):
        end = pair_ends[index]
        if end is not None or parameters[index] or not units:
            if units and not any(parameters[i] for i in units[-1]):  # leading parameterless entries
                units[-1].extend(range(index, (end or index) + 1))
            else:
                units.append(list(range(index, (end or index) + 1)))
        else:
            units[-1].append(index)
        index = (end or index) + 1
    return [tuple(unit) for unit in units]


def checkpoint_blocks(matrix: list[bool]) -> list[list[int]]:
    """Entry indices grouped into gradient checkpointing's blocks, each starting at an entry with a weight
    matrix or kernel (`matrix`); entries before the first such one join it."""
    blocks: list[list[int]] = []
    for index, starts_block in enumerate(matrix):
        if blocks and not starts_block:
            blocks[-1].append(index)
        elif blocks and not any(matrix[i] for i in blocks[-1]):
            blocks[-1].append(index)  # the entries so far had no weight matrix: this one joins them
        else:
            blocks.append([index])
    return blocks


def checkpoint_segments(spec, blocks: int) -> int:
    """The segments train.checkpointing `spec` (sqrt, full or CheckpointSegments) cuts `blocks` blocks into; a
    one-line error if it asks for more segments than there are blocks."""
    if spec == "sqrt":
        return max(1, round(math.sqrt(blocks)))
    if spec == "full":
        return blocks
    if spec.segments > blocks:
        raise ScenarioError(f"train.checkpointing.segments: {spec.segments} is more than the model's {blocks} blocks")
    return spec.segments


def deal_blocks(blocks: list[list[int]], segments: int) -> list[tuple[int, int]]:
    """(first index, end index) per segment, `blocks` (lists of consecutive indices) dealt out as evenly as
    possible, earlier segments taking the extra block."""
    base, extra = divmod(len(blocks), segments)
    bounds, start = [], 0
    for segment in range(segments):
        count = base + (segment < extra)
        indices = [i for block in blocks[start:start + count] for i in block]
        bounds.append((indices[0], indices[-1] + 1))
        start += count
    return bounds


def recompute_segments(spec, matrix: list[bool]) -> list[tuple[int, int]]:
    """(first unit, end unit) of each segment train.checkpointing `spec` (full, sqrt or CheckpointSegments)
    recomputes a chunk's units in (schemes/layer_recompute.py; `matrix`: whether each unit has a weight matrix or
    kernel). Under full every unit is a segment; under sqrt or {segments: k} the units' checkpoint_blocks are dealt
    out as gradient checkpointing deals a model's entries (train/checkpointing.py), the same segments for a chunk
    of the same entries."""
    if spec == "full":
        return [(unit, unit + 1) for unit in range(len(matrix))]
    blocks = checkpoint_blocks(matrix)
    return deal_blocks(blocks, checkpoint_segments(spec, len(blocks)))


def units_of(entries: list[Entry], tensor_parallel: bool) -> list[tuple[int, ...]]:
    """The pipeline's units of a built-in model (group_units on its entries)."""
    return group_units([entry.parameters > 0 for entry in entries], _pair_ends(entries, tensor_parallel))


def _pair_ends(entries: list[Entry], tensor_parallel: bool) -> list[int | None]:
    linear = [entry.kind == "Linear" for entry in entries]
    elementwise = [entry.kind in ELEMENTWISE for entry in entries]
    return [pair_end(linear, elementwise, i) if tensor_parallel else None for i in range(len(entries))]


def check_tensor_cut(entries: list[Entry], tp: int) -> bool:
    """ValueError with the line RankModule's cut raises for the first entry (model order) that does not split `tp`
    ways; whether the model has anything to split (a pair, or an entry with a cut)."""
    ends = _pair_ends(entries, tensor_parallel=True)
    index, splits = 0, False
    while index < len(entries):
        if ends[index] is not None:
            require_divides(entries[index].out_features, tp, FEATURES)
            index, splits = ends[index] + 1, True
            continue
        for count, line in entries[index].cut:
            require_divides(count, tp, line)
        splits = splits or bool(entries[index].cut)
        index += 1
    return splits
