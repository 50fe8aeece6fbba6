"""A llama block whose SwiGLU MLP is a mixture of SwiGLU experts: Mixtral's and DeepSeek-V3's layer.

`LlamaMoEBlock` is train/llama.py's LlamaBlock (RMSNorm, rotary embeddings,
grouped-query attention) with its MLP replaced by train/moe.py's `MoE`: the
same router (softmax in fp32, top-k renormalized, capacity, the balancing
loss), shared experts (DeepSeekMoE) and expert parallelism, with every expert,
routed or shared, a `SwiGLUExpert`, w2(silu(w1 h) · w3 h), as the dense MLP is.
Its width is `model.moe.expert_hidden`: by default `model.ffn_hidden`, each
expert a copy of the dense MLP's shape as in Mixtral 8x7B (Jiang et al. 2024:
8 experts of 14336 beside width 4096, top-2); DeepSeek-V3 (DeepSeek-AI 2024)
gives its experts a width of their own, 2048 beside its dense layers' 18432,
256 routed experts and one shared, top-8, its first 3 blocks dense
(`model.moe.first_dense`). Its multi-head latent attention is
train/latent_attention.py's (`LatentAttentionMoEBlock`, this block with that
attention); its router is train/moe.py's.

Parameters of an MoE block of width h, H heads, G key/value heads, E routed
and S shared experts of W features each:

    2·h (norms) + 2·h² + 2·h·(h/H)·G (wq, wo, wk, wv) + h·E (router) + (E + S)·3·h·W

and a token's forward through the experts is top_k + S SwiGLUs, 6·h·W FLOPs
each (three matrix multiplies of h·W multiply-adds).

Tensor parallelism cuts the attention as LlamaBlock's (by heads, with its "f"
and "g"); the experts stay whole on every tp rank (Megatron-Core's
expert_tensor_parallel_size 1), and each tp rank routes its part of the
sequence, with sequence parallelism or without: `parallel_ops` is the
attention half of the block, then the MoE layer with its ep group's exchanges
(train/moe.py ExpertsBlock.experts_ops), as gpt's MoEBlock.

    model = build_llama(64, 64, 2, 4, 2, 192, 1e4, llama_moe_block(MoESpec(experts=8, top_k=2)))
    model[1].moe.experts[0]                  # SwiGLUExpert(w1, w3: 64 -> 192, w2: 192 -> 64)
"""
import torch
import torch.nn.functional as F
from torch import nn

from ..scenario.model import MoESpec
from .architecture import HEADS, KV_HEADS
from .llama import LlamaBlock
from .moe import ExpertsBlock, MoE
from .ring_attention import attention_ops
from .tensor_parallel import attention_half_ops


class SwiGLUExpert(nn.Module):
    """One llama expert: w2(silu(w1 h) · w3 h), w1 and w3 from hidden to width features, w2 back; no bias."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, width, bias=False)
        self.w3 = nn.Linear(hidden, width, bias=False)
        self.w2 = nn.Linear(width, hidden, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(h)) * self.w3(h))


class LlamaMoEBlock(ExpertsBlock, LlamaBlock):
    """A LlamaBlock whose MLP is a mixture of SwiGLU experts: x + attention(norm(x)), then x + moe(norm(x))."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn_hidden: int, rope_theta: float, spec: MoESpec):
        super().__init__(hidden, heads, kv_heads, ffn_hidden, rope_theta)
        del self.w1, self.w3, self.w2  # the dense MLP, replaced
        width = spec.expert_width(ffn_hidden)
        self.moe = MoE(hidden, spec, lambda: SwiGLUExpert(hidden, width))

    def before_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._after_attention(x, self._attention(self._attention_input(x)))

    mlp_split = (), ()  # the experts stay whole on every tp rank

    def tensor_parallel_counts(self) -> tuple[tuple[int, str], ...]:
        return (self.heads, HEADS), (self.kv_heads, KV_HEADS)  # no MLP features: the experts are not cut

    def parallel_ops(self) -> list:
        """The attention with its tensor-parallel collectives, then the mixture of experts on this tp rank's
        tokens (ExpertsBlock.experts_ops)."""
        return attention_half_ops(self._attention_input, attention_ops(self), self._after_attention,
                                  self.sequence_parallel) + self.experts_ops()


def llama_moe_block(spec: MoESpec):
    """build_llama's `block`: layer i (from 0) is a LlamaMoEBlock where `spec` puts experts (MoESpec.holds_experts:
    past the first_dense, when i + 1 is a multiple of `spec.every`)."""
    def block(layer: int, *shape) -> nn.Module:
        return LlamaMoEBlock(*shape, spec) if spec.holds_experts(layer) else LlamaBlock(*shape)
    return block
