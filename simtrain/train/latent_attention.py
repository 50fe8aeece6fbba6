"""Multi-head latent attention (MLA): DeepSeek-V2's and DeepSeek-V3's attention, in a llama block.

DeepSeek-AI 2024, "DeepSeek-V2" (arXiv 2405.04434), section 2.1, and "DeepSeek-V3" (arXiv 2412.19437),
section 2.1.1. With `model.latent_attention` (scenario/model.py `LatentAttentionSpec`: q_lora_rank r_q,
kv_lora_rank r_kv, qk_nope_head_dim d_n, qk_rope_head_dim d_r, v_head_dim d_v) a llama block's grouped-query
attention is, for the normalized stream h and H heads:

- queries through a latent: c_q = RMSNorm(wq_a h) (r_q features), then wq_b c_q, per head d_n features
  q_nope and d_r features q_rope, the latter rotated (train/llama.py `rotate`);
- keys and values through one compressed latent: wkv_a h = [c_kv (r_kv features), k_rope (d_r features)];
  k_rope is rotated once and shared by every head; wkv_b RMSNorm(c_kv) gives per head d_n features k_nope and
  d_v features v;
- each head attends causally with q = [q_nope, q_rope] against k = [k_nope, k_rope], softmax scale
  1 / sqrt(d_n + d_r), over its v; the heads' outputs (H · d_v) go through wo to the width h.

No bias anywhere; the latent norms have llama's epsilon. The attention core is llama's (train/gpt.py
`attention_kernel`: written out, recomputed under selective recomputation, or one FlashAttention kernel under
model.attention: fused, which counts the QKᵀ and dQ, dK multiplies at d_n + d_r and PV, dV, dP at d_v:
train/fused_attention.py). Keys and values are not repeated: every head has its own.

Parameters of the attention, its latent norms included: h·r_q + r_q + r_q·H·(d_n + d_r) + h·(r_kv + d_r) +
r_kv + r_kv·H·(d_n + d_v) + H·d_v·h (train/architecture.py `latent_attention_parameters`).

Tensor parallelism is Megatron-Core's MLA (`megatron/core/transformer/multi_latent_attention.py`): the down
projections (wq_a, wkv_a) and the latent norms are whole on every tp rank, the up projections (wq_b, wkv_b)
cut by heads (column-parallel) and wo by its input features (row-parallel). The block's "f" takes the latents
[c_q, c_kv, k_rope] (`_attention_input`), not the normalized stream: without sequence parallelism the forward
passes them on and the backward sums their gradient across the tp group, so the whole down projections get
the whole gradient on every rank; under sequence parallelism each rank projects its part of the sequence
down and the latents (r_q + r_kv + d_r features a token, fewer than the width) are all-gathered, their
gradient reduce-scattered back, the whole parameters' gradients then summed across the tp group as a
llama's norms' are (schemes/model_parallel.py). The rotations turn each token by its position in the whole
sequence, after the gather.

Context parallelism is ring attention as a llama's (train/ring_attention.py): each rank's keys (every head's,
k_rope repeated) and values travel the ring as one block (`block_of`), the values' width their own, as
Transformer Engine's context parallelism runs MLA (its `enable_mla` path).

    block = LatentAttentionBlock(LatentAttentionSpec(), 7168, 128, 18432, 1e4)   # DeepSeek-V3's dense layer
    model = build_llama(129280, 7168, 61, 128, 128, 18432, 1e4,
                        latent_attention_block(LatentAttentionSpec(), MoESpec(first_dense=3, ...)))
"""
import torch
from torch import nn

from ..scenario.model import LatentAttentionSpec, MoESpec
from .gpt import attention_kernel
from .llama import LlamaBlock, RMSNorm, rotate
from .llama_moe import LlamaMoEBlock
from .ring_attention import context_positions


class LatentAttention:
    """A llama block's attention as multi-head latent attention (a mixin: it comes before the block's class
    among the bases; the block's grouped-query projections are replaced)."""

    attention_split = ("wq_b", "wkv_b"), ("wo",)  # whole: wq_a, wkv_a and the latent norms

    def __init__(self, spec: LatentAttentionSpec, hidden: int, heads: int, ffn_hidden: int, rope_theta: float,
                 *moe: MoESpec):
        super().__init__(hidden, heads, heads, ffn_hidden, rope_theta, *moe)  # every head its own keys and values
        del self.wq, self.wk, self.wv, self.wo  # grouped-query attention's, replaced
        self.latent = spec
        self.wq_a = nn.Linear(hidden, spec.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(spec.q_lora_rank)
        self.wq_b = nn.Linear(spec.q_lora_rank, heads * spec.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(hidden, spec.kv_lora_rank + spec.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(spec.kv_lora_rank)
        self.wkv_b = nn.Linear(spec.kv_lora_rank, heads * (spec.qk_nope_head_dim + spec.v_head_dim), bias=False)
        self.wo = nn.Linear(heads * spec.v_head_dim, hidden, bias=False)

    def _attention_input(self, x: torch.Tensor) -> torch.Tensor:
        """The latents [RMSNorm(c_q), RMSNorm(c_kv), k_rope (not yet rotated)] of the normalized stream, one
        tensor (batch, length, r_q + r_kv + d_r): what the block's "f" takes."""
        h = self.attention_norm(x)
        c_kv, k_rope = self.wkv_a(h).split((self.latent.kv_lora_rank, self.latent.qk_rope_head_dim), dim=-1)
        return torch.cat((self.q_norm(self.wq_a(h)), self.kv_norm(c_kv), k_rope), dim=-1)

    def _attention(self, latents: torch.Tensor) -> torch.Tensor:
        """This rank's heads' attention, through its part of wo."""
        return self._output(attention_kernel(self)(*self._project(latents)))

    def _project(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's heads' queries and keys (batch, heads, length, d_n + d_r), rotated by each token's position
        in the whole sequence, and values (batch, heads, length, d_v)."""
        spec = self.latent
        batch, length, _ = latents.shape
        c_q, c_kv, k_rope = latents.split((spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim), dim=-1)
        positions = context_positions(length, self.context, latents.device) if self.context.size > 1 else None

        def per_head(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.heads, -1).transpose(1, 2)

        q_nope, q_rope = per_head(self.wq_b(c_q)).split((spec.qk_nope_head_dim, spec.qk_rope_head_dim), dim=-1)
        k_nope, v = per_head(self.wkv_b(c_kv)).split((spec.qk_nope_head_dim, spec.v_head_dim), dim=-1)
        k_rope = rotate(k_rope.unsqueeze(1), self.rope_theta, positions)  # (batch, 1, length, d_r): every head's
        q = torch.cat((q_nope, rotate(q_rope, self.rope_theta, positions)), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, self.heads, -1, -1)), dim=-1)
        return q, k, v


class LatentAttentionBlock(LatentAttention, LlamaBlock):
    """A llama block with multi-head latent attention and the dense SwiGLU MLP (DeepSeek-V3's first layers)."""


class LatentAttentionMoEBlock(LatentAttention, LlamaMoEBlock):
    """A llama block with multi-head latent attention and a mixture of SwiGLU experts (DeepSeek-V3's MoE layers)."""


def latent_attention_block(spec: LatentAttentionSpec, moe: MoESpec | None):
    """build_llama's `block` with multi-head latent attention `spec`: layer i (from 0) a LatentAttentionMoEBlock
    where `moe` puts experts (MoESpec.holds_experts), else a LatentAttentionBlock."""
    def block(layer: int, hidden: int, heads: int, kv_heads: int, ffn_hidden: int, rope_theta: float) -> nn.Module:
        shape = hidden, heads, ffn_hidden, rope_theta  # no key/value heads: every head has its own
        if moe is not None and moe.holds_experts(layer):
            return LatentAttentionMoEBlock(spec, *shape, moe)
        return LatentAttentionBlock(spec, *shape)
    return block

