"""A small decoder-only transformer (GPT-2's shape), written from torch.nn, ready for pipeline and tensor parallelism.

`build_gpt(vocab, seq_len, hidden, layers, heads)` is an nn.Sequential of
`TokenEmbedding`, `layers` pre-LayerNorm `Block`s (causal self-attention and
a GELU MLP of 4 x hidden, each added to the residual stream, as in GPT-2:
Radford et al. 2019) and `LanguageHead` (final LayerNorm, Linear to the
vocabulary). It maps tokens (batch, seq_len) to logits (batch, seq_len,
vocab); loss.cross_entropy takes every position as a prediction.

Pipeline stages cut the Sequential between its entries. A Block is
tensor-parallel as Megatron-LM splits it (Shoeybi et al. 2019, figure 3):
q, k and v by heads and the attention's output projection by its input
features; the MLP's first Linear by its output features and the second by its
input features. Each half is then one "f" and one "g" all-reduce
(train/tensor_parallel.py), and the biases of the two row-split Linears are
added after the sum. The vocabulary is split as Megatron splits it
(train/vocab_parallel.py): the token table by rows, its partial lookups
summed by a "g" all-reduce, then the whole position embeddings added; the
head's final LayerNorm stays whole and its Linear is split by output features
(an "f" all-reduce before it), and its loss is the vocabulary-parallel cross
entropy, so the head's work ends with the loss (`parallel_loss_ops`).
Parameters that stay whole (position embeddings, LayerNorms, the row-split
Linears' biases) get the same gradient on every tp rank.

Sequence parallelism (Korthikanti et al. 2022; `sequence_parallel`, set by
parallel.sequence_parallel): between the tensor-parallel pairs the residual
stream is cut along the sequence across the tp group, so the LayerNorms, the
residual adds and the biases work on a tp-th of it; each "f" becomes an
all-gather and each "g" a reduce-scatter (train/tensor_parallel.py). The
embedding's partial lookups are reduce-scattered, each rank adding the
position embeddings of its part; the head's final LayerNorm works on the
part, then gathers it for the vocabulary-parallel Linear. The whole
parameters then get each rank's share of their gradient, summed across the
tp group after the backward (schemes/model_parallel.py).

Context parallelism (parallel.cp; `context`, a ContextShard set per rank):
each rank holds two chunks of every sequence, its position embeddings those of
their global positions, and the attention is ring attention over the cp group
(train/ring_attention.py) between the block's "f" and "g".

Attention is written out (matmul, causal mask, softmax, matmul) so torch's
FLOP counter sees it on every device, meta included. Under selective
activation recomputation (train.checkpointing: selective, `recompute_core`)
that core, and only it, runs again in backward (`RecomputedAttention`).
Under model.attention: fused (`fused_attention`) the core is one
FlashAttention kernel instead (train/fused_attention.py).

    model = build_gpt(vocab=64, seq_len=32, hidden=64, layers=2, heads=4)
    logits = model(tokens)                      # (batch, 32, 64)
    model[-1].shard_(tp_rank=1, tp=2)           # vocabulary 32..63 of the head
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from .fp8 import weight_only
from .fused_attention import flash_attention
from .ring_attention import ContextShard, attention_ops, context_positions
from .tensor_parallel import (AllGather, AllReduceBackward, AllReduceForward, Apply, ReduceScatter,
                              Slice, residual_block_ops, shard_parameter_)
from .architecture import GPT_HEADS, VOCAB, require_divides
from .vocab_parallel import head_loss_ops, local_lookup


class TokenEmbedding(nn.Module):
    """Token plus learned position embeddings; tensor-parallel by vocabulary rows of the token table."""

    def __init__(self, vocab: int, seq_len: int, hidden: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seq_len, hidden)
        self.vocab_start, self.tp_rank, self.tp = 0, 0, 1  # the first token of this rank's rows; its tp rank, of tp
        self.sequence_parallel = False  # parallel.sequence_parallel: hands on this tp rank's part of the sequence
        self.context = ContextShard()  # parallel.cp: which chunks of the sequence this rank holds

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._add_positions(self.tokens(tokens))

    def _add_positions(self, embedded: torch.Tensor, part: int = 0, parts: int = 1) -> torch.Tensor:
        """`embedded` (part `part` of `parts` of the rank's tokens) plus their position embeddings."""
        length = embedded.shape[1]
        return embedded + self.positions(context_positions(length * parts, self.context, embedded.device,
                                                           part * length, length))

    def shard_(self, tp_rank: int, tp: int) -> dict[str, Slice]:
        """Keep tp rank `tp_rank`'s vocabulary rows of the token table."""
        require_divides(self.tokens.num_embeddings, tp, VOCAB)
        where = shard_parameter_(self.tokens, "weight", 0, tp_rank, tp)
        self.vocab_start, self.tp_rank, self.tp = where.start, tp_rank, tp
        return {"tokens.weight": where}

    def parallel_ops(self) -> list:
        """Partial lookups summed across the tp group (and scattered along the sequence under sequence
        parallelism), then the (whole) position embeddings of the positions this rank holds."""
        lookup = Apply(lambda tokens: (local_lookup(self.tokens, tokens, self.vocab_start),))
        if self.sequence_parallel:
            return [lookup, ReduceScatter(0),
                    Apply(lambda part: (self._add_positions(part, self.tp_rank, self.tp),))]
        return [lookup, AllReduceForward(0), Apply(lambda embedded: (self._add_positions(embedded),))]


class Block(nn.Module):
    """x + attention(ln1(x)), then x + mlp(ln2(x)); tensor-parallel by heads and MLP features."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads  # on this rank: all of them, or its share under tensor parallelism
        self.recompute_core = False  # train.checkpointing: selective (the attention core recomputed in backward)
        self.fused_attention = False  # model.attention: fused (one FlashAttention kernel: train/fused_attention.py)
        self.sequence_parallel = False  # parallel.sequence_parallel: the residual stream cut along the sequence
        self.context = ContextShard()  # parallel.cp: which chunks of the sequence this rank holds
        self.ln1 = nn.LayerNorm(hidden)
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.projection = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.expand = nn.Linear(hidden, 4 * hidden)
        self.contract = nn.Linear(4 * hidden, hidden)

    def extra_repr(self) -> str:  # printed: cost.py's cache tells them apart
        return ", ".join(f"{flag}=True" for flag in ("recompute_core", "fused_attention") if getattr(self, flag))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(self.ln1(x)) + self.projection.bias
        return x + self._mlp(self.ln2(x)) + self.contract.bias

    def _attention(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's heads' attention, through its part of the output projection (no bias)."""
        q, k, v = self._project(h)
        return self._output(attention_kernel(self)(q, k, v))

    def _project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's heads' queries, keys and values, each (batch, heads, length, head size)."""
        batch, length, _ = h.shape
        return tuple(linear(h).view(batch, length, self.heads, -1).transpose(1, 2)
                     for linear in (self.query, self.key, self.value))

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """The heads' attention (batch, heads, length, head size) through this rank's part of the projection."""
        return weight_only(self.projection, out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1))

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return weight_only(self.contract, F.gelu(self.expand(h)))

    column_split, row_split = ("query", "key", "value", "expand"), ("projection", "contract")  # Linears split by tp

    def shard_(self, tp_rank: int, tp: int) -> dict[str, Slice]:
        """Keep tp rank `tp_rank`'s heads and MLP features; where each slice sits in the whole parameter."""
        require_divides(self.heads, tp, GPT_HEADS)
        slices = {}
        for name in self.column_split:
            for part in ("weight", "bias"):
                slices[f"{name}.{part}"] = shard_parameter_(getattr(self, name), part, 0, tp_rank, tp)
        for name in self.row_split:
            slices[f"{name}.weight"] = shard_parameter_(getattr(self, name), "weight", 1, tp_rank, tp)
        self.heads //= tp
        return slices

    def parallel_ops(self) -> list:
        """The block with its four tensor-parallel collectives (tensor_parallel.residual_block_ops)."""
        return residual_block_ops(self.ln1, attention_ops(self), self._after_attention, self._mlp,
                                  lambda x, m: (x + m + self.contract.bias,), self.sequence_parallel)

    def _after_attention(self, x: torch.Tensor, attention: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + attention + self.projection.bias
        return x, self.ln2(x)


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of (batch, heads, length, head size) queries, keys and values: softmax(QKᵀ/√d) V."""
    length = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(causal, float("-inf")).softmax(dim=-1) @ v


def attention_kernel(block: nn.Module):
    """What computes `block`'s causal attention core from its q, k and v: one FlashAttention kernel under
    model.attention: fused (it keeps no scores, so selective recomputation has nothing to add), else the
    written-out core, recomputed in backward under selective recomputation."""
    if block.fused_attention:
        return flash_attention
    return RecomputedAttention.apply if block.recompute_core and torch.is_grad_enabled() else attention_core


class RecomputedAttention(torch.autograd.Function):
    """The attention core with selective activation recomputation (Korthikanti et al. 2022, section 5):
    forward keeps only q, k and v, backward runs the core again from them and differentiates it. The
    scores, the softmax and its mask (5as²b bytes per layer in 16 bits) never outlive the layer's
    backward. (A Function rather than torch.utils.checkpoint: checkpoint holds its inputs out of sight of
    the saved-tensor hooks that measure activation memory, cost.py; here q, k and v are saved through them.)"""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(q, k, v)
        return attention_core(q, k, v)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs = tuple(t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = attention_core(*inputs)
        return torch.autograd.grad(out, inputs, grad)


class LanguageHead(nn.Module):
    """Final LayerNorm and the Linear to one logit per vocabulary entry; tensor-parallel by vocabulary."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.logits = nn.Linear(hidden, vocab)
        self.vocab_start, self.tp_rank, self.tp = 0, 0, 1
        self.sequence_parallel = False  # parallel.sequence_parallel: takes this tp rank's part of the sequence

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(self.norm(x))

    def shard_(self, tp_rank: int, tp: int) -> dict[str, Slice]:
        """Keep tp rank `tp_rank`'s vocabulary range of the logits Linear (split by output features)."""
        require_divides(self.logits.out_features, tp, VOCAB)
        slices = {f"logits.{part}": shard_parameter_(self.logits, part, 0, tp_rank, tp) for part in ("weight", "bias")}
        self.vocab_start, self.tp_rank, self.tp = slices["logits.weight"].start, tp_rank, tp
        return slices

    def parallel_loss_ops(self) -> list:
        """The head and the vocabulary-parallel cross entropy: the loss, with its logits never gathered (the
        normalized sequence is, under sequence parallelism)."""
        return head_loss_ops(self.norm, self.logits, self.vocab_start, self.tp_rank, self.tp,
                             AllGather if self.sequence_parallel else AllReduceBackward)


def build_gpt(vocab: int, seq_len: int, hidden: int, layers: int, heads: int, block=None) -> nn.Sequential:
    """Embedding, `layers` blocks, head (the caller seeds torch first); `block(layer, hidden, heads)` builds
    layer `layer`'s block (default a Block; train/moe.py's moe_block puts mixtures of experts in)."""
    block = block or (lambda layer, hidden, heads: Block(hidden, heads))
    return nn.Sequential(TokenEmbedding(vocab, seq_len, hidden), *(block(i, hidden, heads) for i in range(layers)),
                         LanguageHead(hidden, vocab))
