"""Context parallelism's numerics: a sequence cut across a cp group, its causal attention computed as a ring.

Under context parallelism (parallel.cp = N) the ranks of a cp group share
each sequence. With causal load balancing, as Megatron-LM and torchtitan cut
it, the sequence is cut into 2N equal chunks and cp rank r holds chunks r and
2N - 1 - r (`shard_sequence`), so that every rank has as much causal attention
to compute as any other. Everything in a transformer but attention works token
by token, on the rank's own tokens at their global positions
(`context_positions`: a gpt's position embeddings, a llama's rotations).

Attention is ring attention (Liu et al. 2023): each rank computes its queries
against its own key/value block, then N - 1 times passes the block it holds to
cp rank r + 1 and receives rank r - 1's (comm/kv_ring.py, a `KeyValueRing`
boundary between two regions of the layer's work), each block's attention
merged into the running result by its log-sum-exp (the online softmax of
flash attention). With the load-balanced chunks, a block from a rank before r
is seen whole by both of r's chunks but only through its first chunk, and a
block from a rank after r only by r's second chunk: every block but the own
(causal) one is half a block of unmasked work (`attend`). Autograd gives the
backward; the gradient of each received block goes back around the ring
(the boundary's backward), travelling while the attention of the block
before it is differentiated (schemes/stage_execution.py): a ring step's
block passes through its region unchanged, so the gradient that arrives for
it is only added to what that region's backward gave it. A `Projected`
boundary (no collective) ends the projection before the own block's
attention, so the first block leaves once it exists and its gradient comes
home while the own block's attention is differentiated.

Selective activation recomputation (train.checkpointing: selective) cuts at
each ring step: every block's attention (`RecomputedBlock`) keeps only the
queries and the block, and recomputes its scores and softmax in its
backward, so no step's (s/N)²-sized scores outlive the step's backward, as
Korthikanti et al.'s attention core does on one device. Under
`model.attention: fused` each block is one FlashAttention kernel
(train/fused_attention.py: causal for the own block, whole for another's),
which keeps no scores to recompute; its log-sum-exp's gradient, which the
merge gives it, joins the kernel's backward.

    shard = ContextShard(rank=1, size=4)
    tokens = shard_sequence(tokens, shard)            # (b, s) -> (b, s/4): chunks 1 and 6 of 8
    ops = attention_ops(block)                        # a gpt or llama block's attention, in residual_block_ops
    out, lse, first_row = block_attention(q, block_of(k, v), rank=1, origin=0, recompute=True, fused=False)
"""
import math
from typing import NamedTuple

import torch

from .fused_attention import flash_attention_with_lse
from .tensor_parallel import Apply


class ContextShard(NamedTuple):
    """Which part of each sequence a rank holds: cp rank `rank` of a cp group of `size`."""

    rank: int = 0
    size: int = 1


class KeyValueRing(NamedTuple):
    """Ring attention's step: the key/value block in flight (at `index`) passed to the next cp rank, the
    previous rank's received (forward); the gradient of the received block passed back (backward)."""

    index: int
    forward = "kv_ring"
    backward = "kv_ring_back"


class Projected(NamedTuple):
    """The end of a block's projection to queries, keys and values, before its own block's attention: no
    collective, a region boundary (so the ring's first step starts once the keys and values exist)."""

    index: int = 0
    forward = None
    backward = None


def shard_sequence(tensor: torch.Tensor, shard: ContextShard, dim: int = 1) -> torch.Tensor:
    """Chunks r and 2N - 1 - r of `tensor`'s sequence (dimension `dim`) cut into 2N."""
    if shard.size == 1:
        return tensor
    chunks = tensor.chunk(2 * shard.size, dim)
    return torch.cat((chunks[shard.rank], chunks[2 * shard.size - 1 - shard.rank]), dim)


def context_positions(length: int, shard: ContextShard, device=None, start: int = 0,
                      count: int | None = None) -> torch.Tensor:
    """The positions in the whole sequence of tokens start..start + count (default: all) of the `length` tokens a
    rank holds (its two chunks)."""
    count = length - start if count is None else count
    if shard.size == 1:
        return torch.arange(start, start + count, device=device)
    chunk = length // 2
    first, second = shard.rank * chunk, (2 * shard.size - 1 - shard.rank) * chunk
    return torch.cat((torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)))[start:start + count]


def attend(q: torch.Tensor, kv: torch.Tensor, rank: int, origin: int,
           fused: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Attention of cp rank `rank`'s queries (batch, heads, length, width) to rank `origin`'s keys and values
    (kv: batch, kv heads, length, the keys' width (the queries') then the values' features, `block_of`):
    (out, its log-sum-exp, the first query row they cover). `fused`: as one FlashAttention kernel
    (train/fused_attention.py), else written out."""
    k, v = kv.split((q.shape[-1], kv.shape[-1] - q.shape[-1]), dim=-1)
    half = q.shape[-2] // 2
    first_row = 0
    if origin < rank:  # both of our chunks come after its first, before its second
        k, v = k[..., :half, :], v[..., :half, :]
    elif origin > rank:  # only our second chunk comes after its chunks
        q, first_row = q[..., half:, :], half
    if fused:  # our own chunks, in order of position, are causal; another rank's block is seen whole
        out, lse = flash_attention_with_lse(q, k, v, causal=origin == rank)
        return out, lse.unsqueeze(-1).to(out.dtype), first_row
    group = q.shape[1] // k.shape[1]  # query heads per key/value head (grouped-query attention)
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if origin == rank:  # our own chunks, in order of position: causal
        length = q.shape[-2]
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
    lse = scores.logsumexp(dim=-1, keepdim=True)
    return (scores - lse).exp() @ v, lse, first_row


class RecomputedBlock(torch.autograd.Function):
    """`attend` keeping only its queries and key/value block, its scores and softmax recomputed in backward
    (selective activation recomputation, one ring step at a time): (out, lse)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, kv: torch.Tensor, rank: int, origin: int):
        ctx.save_for_backward(q, kv)
        ctx.ranks = (rank, origin)
        out, lse, _ = attend(q, kv, rank, origin)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor):
        inputs = tuple(t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out, lse, _ = attend(*inputs, *ctx.ranks)
        return (*torch.autograd.grad((out, lse), inputs, (grad_out, grad_lse)), None, None)


def block_attention(q: torch.Tensor, kv: torch.Tensor, rank: int, origin: int, recompute: bool, fused: bool):
    """`attend`, fused (which keeps no scores: nothing to recompute), or with `recompute` (and autograd on) its
    selectively recomputed form."""
    if fused or not (recompute and torch.is_grad_enabled()):
        return attend(q, kv, rank, origin, fused)
    return *RecomputedBlock.apply(q, kv, rank, origin), q.shape[-2] // 2 if origin > rank else 0


def merge(out: torch.Tensor, lse: torch.Tensor, block: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The running attention (out, lse) with one more block's (attend's result) merged into its rows."""
    block_out, block_lse, first_row = block
    kept_out, kept_lse = out[..., :first_row, :], lse[..., :first_row, :]
    out, lse = out[..., first_row:, :], lse[..., first_row:, :]
    merged_lse = torch.logaddexp(lse, block_lse)
    merged = out * (lse - merged_lse).exp() + block_out * (block_lse - merged_lse).exp()
    return torch.cat((kept_out, merged), dim=-2), torch.cat((kept_lse, merged_lse), dim=-2)


def block_of(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The key/value block that travels the ring: keys and values (batch, kv heads, length, their widths) side by
    side along the features, one tensor even where the values' width differs from the keys' (multi-head latent
    attention, train/latent_attention.py)."""
    return torch.cat((k, v), dim=-1)


def attention_ops(block) -> list:
    """A transformer block's attention on a (x, h) stream: one step (`block._attention`), or under context
    parallelism (`block.context` of more than one rank) ring attention's steps over `block._project`'s queries,
    keys and values, finished by `block._output` (train/gpt.py, train/llama.py)."""
    if block.context.size == 1:
        return [Apply(lambda x, h: (x, block._attention(h)))]

    def project(x, h):
        q, k, v = block._project(h)
        return x, q, block_of(k, v)
    return ring_attention_ops(project, block._output, block.context, block.recompute_core, block.fused_attention)


def ring_attention_ops(project, finish, shard: ContextShard, recompute: bool = False, fused: bool = False) -> list:
    """The attention half of a block on a (x, h) stream as ring attention: `project(x, h)` gives x, the
    queries and the key/value block (`block_of`) of this rank's tokens, `finish(out)` the attention's output from
    the merged heads; the stream is (x, q, kv) after the projection, (x, q, kv, out, lse) between the ring's
    steps, (x, attention) after. With `recompute`, each step's attention is recomputed in backward; with `fused`,
    each step is one FlashAttention kernel."""
    def own_block(x, q, kv):
        out, lse, _ = block_attention(q, kv, shard.rank, shard.rank, recompute, fused)
        return x, q, kv, out, lse

    ops = [Apply(project), Projected(), Apply(own_block)]
    for step in range(1, shard.size):
        origin = (shard.rank - step) % shard.size
        ops += [KeyValueRing(2), Apply(lambda x, q, kv, out, lse, origin=origin:
                                       (x, q, kv, *merge(out, lse, block_attention(q, kv, shard.rank, origin,
                                                                                  recompute, fused))))]
    return ops + [Apply(lambda x, q, kv, out, lse: (x, finish(out)))]
