"""A Llama-style decoder-only transformer, written from torch.nn, ready for pipeline and tensor parallelism.

`build_llama(vocab, hidden, layers, heads, kv_heads, ffn_hidden, rope_theta)`
is an nn.Sequential of `LlamaEmbedding`, `layers` pre-norm `LlamaBlock`s and
`LlamaHead`, the architecture of Llama 2 and 3 (Touvron et al. 2023; Grattafiori
et al. 2024, "The Llama 3 Herd of Models", table 3):

- RMSNorm (Zhang and Sennrich 2019) before attention, before the MLP and
  before the head: x / sqrt(mean(x²) + 1e-5) · weight, computed in fp32 and
  rounded back to the stream's dtype, as Meta's reference does;
- rotary position embeddings (Su et al. 2021, "RoFormer"), no learned
  positions: in every head, features (2i, 2i+1) of the query and the key at
  position m are turned by the angle m · θ^(-2i/d) (d the head width, θ
  `rope_theta`), the complex multiplication (x_2i + j·x_2i+1) · e^(j·angle) of
  Meta's reference, in fp32;
- grouped-query attention (Ainslie et al. 2023): `heads` query heads share
  `kv_heads` key/value heads, query head i reading key/value head
  i // (heads / kv_heads);
- a SwiGLU MLP (Shazeer 2020): w2(silu(w1 h) · w3 h), of `ffn_hidden` features;
- untied token embedding and output Linear; no bias anywhere.

With `model.moe` the SwiGLU MLP of every n-th block (past its first_dense) is
a mixture of SwiGLU experts, Mixtral's and DeepSeek-V3's layer (`block`,
train/llama_moe.py); with `model.latent_attention` every block's attention is
DeepSeek-V2's and V3's multi-head latent attention (train/latent_attention.py).

It maps tokens (batch, seq_len) to logits (batch, seq_len, vocab). With width
h, L layers, H heads, G key/value heads, F ffn features and vocabulary V its
parameters number

    N = 2·V·h + L·(2·h² + 2·h·(h/H)·G + 3·h·F + 2·h) + h

(embedding and head; per block wq and wo, wk and wv, w1 w2 w3, two norms; the
final norm): `parameter_count`.

Tensor parallelism splits a block as Megatron-LM and torchtitan do: wq by
query heads and wk, wv by key/value heads (rank r keeps query heads
[r·H/tp, (r+1)·H/tp) and the key/value heads they read, [r·G/tp, (r+1)·G/tp)),
wo by its input features; w1 and w3 by output features and w2 by input
features. Each half is one "f" and one "g" all-reduce (train/tensor_parallel.py);
the norms stay whole and, without sequence parallelism, get the same gradient
on every tp rank. The vocabulary is split as gpt's (train/vocab_parallel.py):
the token table by rows, its partial lookups summed; the head's output Linear
by vocabulary, its loss the vocabulary-parallel cross entropy.

Sequence parallelism (Korthikanti et al. 2022; `sequence_parallel`, set by
parallel.sequence_parallel) is gpt's (train/gpt.py): between the
tensor-parallel pairs the residual stream is cut along the sequence across
the tp group, each "f" an all-gather and each "g" a reduce-scatter; the
embedding's partial lookups are reduce-scattered and the head gathers its
normalized part. The attention gathers the whole sequence before wq, wk and
wv, so the rotations turn every query and key by its global position, as
without the split. The RMSNorm weights, the only whole parameters, get each
rank's share of their gradient, summed across the tp group after the
backward (schemes/model_parallel.py).

Context parallelism (parallel.cp; `context`, set per rank) is gpt's: ring
attention over the cp group (train/ring_attention.py), the rotations turning
each of the rank's queries and keys by its global position; the key/value
heads travel the ring before they are repeated for their query heads.

Attention is gpt's core (matmul, causal mask, softmax, matmul; train/gpt.py
`attention_core`) on the rotated queries and the keys and values repeated
for their query heads, written out so torch's FLOP counter sees it on every
device, meta included. Under selective activation recomputation
(train.checkpointing: selective, `recompute_core`) that core, and only it,
runs again in backward (gpt's `RecomputedAttention`). Under model.attention:
fused (`fused_attention`) it is one FlashAttention kernel, reading the key/value
heads unrepeated (train/fused_attention.py).

    model = build_llama(vocab=64, hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=192, rope_theta=1e4)
    logits = model(tokens)                      # (batch, seq_len, 64)
"""
import torch
import torch.nn.functional as F
from torch import nn

from .gpt import attention_kernel
from .ring_attention import ContextShard, attention_ops, context_positions
from .tensor_parallel import (AllGather, AllReduceBackward, AllReduceForward, Apply, ReduceScatter, Slice,
                              residual_block_ops, shard_parameter_)
from .architecture import FFN_HIDDEN, HEADS, KV_HEADS, VOCAB, require_divides
from .vocab_parallel import head_loss_ops, local_lookup

NORM_EPS = 1e-5  # Llama 2 and 3's RMSNorm epsilon


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight over the last dimension, in fp32, returned in x's dtype."""

    def __init__(self, hidden: int, eps: float = NORM_EPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotate(x: torch.Tensor, theta: float, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary embedding of x (batch, heads, length, head width): features (2i, 2i+1) at position m turned by
    m · theta^(-2i/width), in fp32; returned in x's dtype."""
    length, width = x.shape[-2], x.shape[-1]
    inverse_frequencies = theta ** -(torch.arange(0, width, 2, device=x.device, dtype=torch.float32) / width)
    positions = (torch.arange(length, device=x.device, dtype=torch.float32) if positions is None
                 else positions.to(torch.float32))
    angles = torch.outer(positions, inverse_frequencies)
    cos, sin = angles.cos(), angles.sin()
    pairs = x.float().unflatten(-1, (width // 2, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    turned = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return turned.flatten(-2).type_as(x)


class LlamaEmbedding(nn.Module):
    """The token table (no positions: they enter as rotations); tensor-parallel by vocabulary rows."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.vocab_start = 0  # the first token of this rank's rows
        self.sequence_parallel = False  # parallel.sequence_parallel: hands on this tp rank's part of the sequence

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tokens(tokens)

    def shard_(self, tp_rank: int, tp: int) -> dict[str, Slice]:
        """Keep tp rank `tp_rank`'s vocabulary rows of the token table."""
        require_divides(self.tokens.num_embeddings, tp, VOCAB)
        where = shard_parameter_(self.tokens, "weight", 0, tp_rank, tp)
        self.vocab_start = where.start
        return {"tokens.weight": where}

    def parallel_ops(self) -> list:
        """Partial lookups summed across the tp group (and scattered along the sequence under sequence
        parallelism)."""
        summed = ReduceScatter if self.sequence_parallel else AllReduceForward
        return [Apply(lambda tokens: (local_lookup(self.tokens, tokens, self.vocab_start),)), summed(0)]


class LlamaBlock(nn.Module):
    """x + attention(norm(x)), then x + swiglu(norm(x)); tensor-parallel by heads and MLP features."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn_hidden: int, rope_theta: float):
        super().__init__()
        head_width = hidden // heads
        self.heads, self.kv_heads = heads, kv_heads  # on this rank: all of them, or its share under tp
        self.rope_theta = rope_theta
        self.recompute_core = False  # train.checkpointing: selective (the attention core recomputed in backward)
        self.fused_attention = False  # model.attention: fused (one FlashAttention kernel: train/fused_attention.py)
        self.sequence_parallel = False  # parallel.sequence_parallel: the residual stream cut along the sequence
        self.context = ContextShard()  # parallel.cp: which chunks of the sequence this rank holds
        self.attention_norm = RMSNorm(hidden)
        self.wq = nn.Linear(hidden, heads * head_width, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * head_width, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * head_width, bias=False)
        self.wo = nn.Linear(heads * head_width, hidden, bias=False)
        self.ffn_norm = RMSNorm(hidden)
        self.w1 = nn.Linear(hidden, ffn_hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn_hidden, bias=False)
        self.w2 = nn.Linear(ffn_hidden, hidden, bias=False)

    def extra_repr(self) -> str:  # printed: cost.py's cache tells them apart
        return ", ".join(f"{flag}=True" for flag in ("recompute_core", "fused_attention") if getattr(self, flag))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(self._attention_input(x))
        return x + self._mlp(self.ffn_norm(x))

    def _attention_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the attention's projections read, and tensor parallelism's "f" takes: the normalized stream
        (multi-head latent attention's latents: train/latent_attention.py)."""
        return self.attention_norm(x)

    def _attention(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's heads' attention, through its part of the output projection."""
        q, k, v = self._project(h)
        if not self.fused_attention:  # the fused kernel reads each key/value head for its group of query heads
            group = self.heads // self.kv_heads  # query heads per key/value head
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return self._output(attention_kernel(self)(q, k, v))

    def _project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's rotated queries (batch, heads, length, width), rotated keys and values (its key/value
        heads), each token turned by its position in the whole sequence."""
        batch, length, _ = h.shape

        def split_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
            return t.view(batch, length, heads, -1).transpose(1, 2)

        positions = context_positions(length, self.context, h.device) if self.context.size > 1 else None
        q = rotate(split_heads(self.wq(h), self.heads), self.rope_theta, positions)
        k = rotate(split_heads(self.wk(h), self.kv_heads), self.rope_theta, positions)
        return q, k, split_heads(self.wv(h), self.kv_heads)

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """The heads' attention (batch, heads, length, width) through this rank's part of wo."""
        return self.wo(out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1))

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(h)) * self.w3(h))

    # the Linears tp splits by output features (column) and by input features (row): the attention's, the MLP's
    attention_split = ("wq", "wk", "wv"), ("wo",)
    mlp_split = ("w1", "w3"), ("w2",)

    def tensor_parallel_counts(self) -> tuple[tuple[int, str], ...]:
        """(count, line) of what tensor parallelism cuts: each count must divide by tp, else `line`."""
        return (self.heads, HEADS), (self.kv_heads, KV_HEADS), (self.w1.out_features, FFN_HIDDEN)

    def shard_(self, tp_rank: int, tp: int) -> dict[str, Slice]:
        """Keep tp rank `tp_rank`'s query heads, the key/value heads they read and its MLP features; where each
        slice sits in the whole parameter."""
        for count, line in self.tensor_parallel_counts():
            require_divides(count, tp, line)
        (attention_column, attention_row), (mlp_column, mlp_row) = self.attention_split, self.mlp_split
        slices = {f"{name}.weight": shard_parameter_(getattr(self, name), "weight", 0, tp_rank, tp)
                  for name in attention_column + mlp_column}
        for name in attention_row + mlp_row:
            slices[f"{name}.weight"] = shard_parameter_(getattr(self, name), "weight", 1, tp_rank, tp)
        self.heads //= tp
        self.kv_heads //= tp
        return slices

    def parallel_ops(self) -> list:
        """The block with its four tensor-parallel collectives (tensor_parallel.residual_block_ops)."""
        return residual_block_ops(self._attention_input, attention_ops(self), self._after_attention, self._mlp,
                                  lambda x, m: (x + m,), self.sequence_parallel)

    def _after_attention(self, x: torch.Tensor, attention: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + attention
        return x, self.ffn_norm(x)


class LlamaHead(nn.Module):
    """Final RMSNorm and the Linear to one logit per vocabulary entry; tensor-parallel by vocabulary."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.norm = RMSNorm(hidden)
        self.output = nn.Linear(hidden, vocab, bias=False)
        self.vocab_start, self.tp_rank, self.tp = 0, 0, 1
        self.sequence_parallel = False  # parallel.sequence_parallel: takes this tp rank's part of the sequence

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))

    def shard_(self, tp_rank: int, tp: int) -> dict[str, Slice]:
        """Keep tp rank `tp_rank`'s vocabulary range of the output Linear (split by output features)."""
        require_divides(self.output.out_features, tp, VOCAB)
        where = shard_parameter_(self.output, "weight", 0, tp_rank, tp)
        self.vocab_start, self.tp_rank, self.tp = where.start, tp_rank, tp
        return {"output.weight": where}

    def parallel_loss_ops(self) -> list:
        """The head and the vocabulary-parallel cross entropy: the loss, with its logits never gathered (the
        normalized sequence is, under sequence parallelism)."""
        return head_loss_ops(self.norm, self.output, self.vocab_start, self.tp_rank, self.tp,
                             AllGather if self.sequence_parallel else AllReduceBackward)


def build_llama(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn_hidden: int,
                rope_theta: float, block=None) -> nn.Sequential:
    """Embedding, `layers` blocks, head (the caller seeds torch first); `block(layer, hidden, heads, kv_heads,
    ffn_hidden, rope_theta)` builds layer `layer`'s block (default a LlamaBlock; train/llama_moe.py's
    llama_moe_block puts mixtures of experts in, train/latent_attention.py's latent_attention_block latent
    attention)."""
    block = block or (lambda layer, *shape: LlamaBlock(*shape))
    return nn.Sequential(LlamaEmbedding(vocab, hidden),
                         *(block(i, hidden, heads, kv_heads, ffn_hidden, rope_theta) for i in range(layers)),
                         LlamaHead(hidden, vocab))


def parameter_count(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn_hidden: int) -> int:
    """N = 2·V·h + L·(2·h² + 2·h·(h/H)·G + 3·h·F + 2·h) + h: the parameters build_llama makes."""
    per_block = 2 * hidden**2 + 2 * hidden * (hidden // heads) * kv_heads + 3 * hidden * ffn_hidden + 2 * hidden
    return 2 * vocab * hidden + layers * per_block + hidden
