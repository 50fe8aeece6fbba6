"""Fused (FlashAttention) causal attention: one kernel that never writes the s x s scores to memory.

`model.attention: fused` makes every gpt and llama block call `flash_attention(q, k, v)` in place of the
written-out core (QKᵀ, mask, softmax, AV as four kernels, the scores and probabilities through HBM;
train/gpt.py `attention_core`). What changes is what a device is charged and what autograd keeps:

- **one operator forward, one backward** (`simtrain::flash_attention`, `simtrain::flash_attention_backward`,
  torch custom operators), so the operator recorder (op_cost.py) sees each as one kernel;
- **FLOPs**: 4·b·h·s²·d forward for the two matrix multiplies, halved because the kernel skips the blocks
  the causal mask hides, and 2.5 times that for the backward (its five matrix multiplies, the scores
  recomputed from Q and K inside the kernel): the count FlashAttention-2 reports (Dao 2023,
  "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning", section 4.1:
  "with causal mask, we divide this number by 2 ... multiply the forward pass FLOPs by 2.5"). Where the
  values' head size d_v differs from the queries' and keys' d (multi-head latent attention:
  train/latent_attention.py) each multiply is counted at its own size: forward 2·b·h·s²·(d + d_v), backward
  2·b·h·s²·(3·d + 2·d_v) (QKᵀ, dQ and dK at d; dV and dP at d_v), the same counts when d_v = d. They are
  registered as the operators' FLOP formulas (torch.utils.flop_counter), so torch's own FlopCounterMode
  counts them too; they run at the matrix-multiply rate of the result's dtype;
- **bytes**: Q, K, V read and O and the log-sum-exp (fp32, one per query row and head) written forward (the log-sum-exp in fp32, or fp64 for fp64 inputs);
  dO, the log-sum-exp's gradient, Q, K, V, O and the log-sum-exp read and dQ, dK, dV written backward;
  nothing of size s² (the
  recorder counts each operator's tensors: these are all there are);
- **activations**: autograd saves Q, K, V, O and the log-sum-exp only, so the 5·a·s²·b bytes Korthikanti
  et al. (2022, section 4.1) count for the scores, softmax and its dropout are gone, as Megatron-Core's docs
  say of flash attention, and selective recomputation has nothing left to recompute.

Grouped-query attention runs natively: K and V carry their own (fewer) heads, each serving heads(q) /
heads(k) query heads in turn, as FlashAttention-2 reads them, so they are neither repeated in memory nor
charged repeated. The numerics are the exact softmax attention (the same math as the eager core, in the
inputs' dtype, with the log-sum-exp in fp32), and the backward its closed form; on meta tensors the
operators give shapes only.

    out = flash_attention(q, k, v)      # q (b, h, s, d); k (b, h_kv, s, d); v (b, h_kv, s, d_v); out (b, h, s, d_v)
    out, lse = flash_attention_with_lse(q, k, v, causal=False)   # a block of ring attention (its merge weights)
    use_fused_attention_(model)         # every gpt/llama block of `model` calls it
"""
import math

import torch
from torch.utils.flop_counter import register_flop_formula

def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax(QKᵀ/√d)·V of (batch, heads, length, head size d) queries, (batch, kv heads, length, d) keys
    and (batch, kv heads, length, d_v) values (kv heads dividing heads), as one fused operator forward and one
    backward."""
    return torch.ops.simtrain.flash_attention(q, k, v, True)[0]


def flash_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention's output and its log-sum-exp (b, h, s_q), causal (s_q = s_k) or over every key: what a
    blockwise (ring) attention merges its blocks by. Non-causal FLOPs are the whole 4·b·h·s_q·s_k·d."""
    return torch.ops.simtrain.flash_attention(q, k, v, causal)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None,
                     divisor: float, kept: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(QKᵀ/divisor)·V and its log-sum-exp, the scores where `hidden` (broadcast to (b, h, s_q, s_k)) is
    True left out, as one fused operator forward and one backward, charged `kept` of the FLOPs of every score
    (the share of score blocks a block-sparse kernel computes, FlexAttention's). `hidden` None: every score
    counts (numerics off, where no value is computed: the charge is still `kept`'s)."""
    return torch.ops.simtrain.masked_attention(q, k, v, hidden, divisor, kept)


def use_fused_attention_(model: torch.nn.Module) -> None:
    """Make every attention layer of `model` (a module with `fused_attention`: gpt's Block, llama's
    LlamaBlock) call flash_attention."""
    for module in model.modules():
        if hasattr(module, "fused_attention"):
            module.fused_attention = True


def forward_flops(q_shape, k_shape, v_shape, causal: bool) -> int:
    """FLOPs the fused forward is charged: 2·b·h·s_q·s_k·(d + d_v) (QKᵀ at the queries' head size d, PV at the
    values' d_v, 2 per multiply-add; 4·b·h·s_q·s_k·d where d_v = d), over 2 if causal."""
    batch, heads, length, width = q_shape
    return 2 * batch * heads * length * k_shape[-2] * (width + v_shape[-1]) // (2 if causal else 1)


def backward_flops(q_shape, k_shape, v_shape, causal: bool) -> int:
    """FLOPs the fused backward is charged: 2·b·h·s_q·s_k·(3·d + 2·d_v) (the scores recomputed, dQ and dK at d;
    dV and dP at d_v; 2.5 times the forward's where d_v = d), over 2 if causal."""
    batch, heads, length, width = q_shape
    return 2 * batch * heads * length * k_shape[-2] * (3 * width + 2 * v_shape[-1]) // (2 if causal else 1)


@torch.library.custom_op("simtrain::flash_attention", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _attention(q, k, v, _causal_mask(q) if causal else None, math.sqrt(q.shape[-1]))


@_forward.register_fake
def _(q, k, v, causal):
    return _forward_shapes(q, v)


@torch.library.custom_op("simtrain::flash_attention_backward", mutates_args=())
def _backward(grad: torch.Tensor, grad_lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor, lse: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # The probabilities recomputed from Q, K and the log-sum-exp; then the softmax's closed-form backward:
    # dV = Pᵀ dO, dP = dO Vᵀ, dS = P (dP - D), dQ = dS K / √d, dK = dSᵀ Q / √d, with D = rowsum(dO O) - dlse
    # (FlashAttention-2 computes D first; the log-sum-exp's own gradient, what a ring attention's merge of
    # blocks gives it, joins there, since d lse / dS = P).
    return _attention_backward(grad, grad_lse, q, k, v, out, lse, _causal_mask(q) if causal else None,
                               math.sqrt(q.shape[-1]))


@_backward.register_fake
def _(grad, grad_lse, q, k, v, out, lse, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3], *output)
    ctx.causal = inputs[3]


def _autograd_backward(ctx, grad_out, grad_lse):
    return (*torch.ops.simtrain.flash_attention_backward(grad_out, grad_lse, *ctx.saved_tensors, ctx.causal), None)


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.simtrain.flash_attention)
def _forward_flops(q_shape, k_shape, v_shape, causal, *args, **kwargs) -> int:
    return forward_flops(q_shape, k_shape, v_shape, causal)


@register_flop_formula(torch.ops.simtrain.flash_attention_backward)
def _backward_flops(grad_shape, grad_lse_shape, q_shape, k_shape, v_shape, kept_out_shape, lse_shape, causal, *args,
                    **kwargs) -> int:
    return backward_flops(q_shape, k_shape, v_shape, causal)


@torch.library.custom_op("simtrain::masked_attention", mutates_args=())
def _masked_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None, divisor: float,
                    kept: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _attention(q, k, v, hidden, divisor)


@_masked_forward.register_fake
def _(q, k, v, hidden, divisor, kept):
    return _forward_shapes(q, v)


@torch.library.custom_op("simtrain::masked_attention_backward", mutates_args=())
def _masked_backward(grad: torch.Tensor, grad_lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, hidden: torch.Tensor | None, divisor: float,
                     kept: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _attention_backward(grad, grad_lse, q, k, v, out, lse, hidden, divisor)


@_masked_backward.register_fake
def _(grad, grad_lse, q, k, v, out, lse, hidden, divisor, kept):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _masked_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3], *output, inputs[3])
    ctx.divisor, ctx.kept = inputs[4:]


def _masked_autograd_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, hidden = ctx.saved_tensors
    return (*torch.ops.simtrain.masked_attention_backward(grad_out, grad_lse, q, k, v, out, lse, hidden,
                                                          ctx.divisor, ctx.kept), None, None, None)


_masked_forward.register_autograd(_masked_autograd_backward, setup_context=_masked_setup_context)


@register_flop_formula(torch.ops.simtrain.masked_attention)
def _masked_forward_flops(q_shape, k_shape, v_shape, hidden_shape, divisor, kept, *args, **kwargs) -> int:
    return round(forward_flops(q_shape, k_shape, v_shape, False) * kept)


@register_flop_formula(torch.ops.simtrain.masked_attention_backward)
def _masked_backward_flops(grad_shape, grad_lse_shape, q_shape, k_shape, v_shape, kept_out_shape, lse_shape,
                           hidden_shape, divisor, kept, *args, **kwargs) -> int:
    return round(backward_flops(q_shape, k_shape, v_shape, False) * kept)


def _forward_shapes(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty tensors of the forward's two results: the output (sequence-major) and the log-sum-exp."""
    return _sequence_major(q.new_empty((*q.shape[:-1], v.shape[-1]))), q.new_empty(q.shape[:-1],
                                                                                   dtype=_accumulated(q))


def _sequence_major(out: torch.Tensor) -> torch.Tensor:
    """`out` (b, h, s, d) laid out as (b, s, h, d) in memory, as FlashAttention writes it: merging its heads
    for the output projection is then a view, not a copy."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _accumulated(q: torch.Tensor) -> torch.dtype:
    """What the softmax and the backward accumulate in: fp32, or the inputs' dtype if wider (fp64)."""
    return torch.promote_types(q.dtype, torch.float32)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None,
               divisor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(QKᵀ/divisor)·V, the scores `hidden` hides at -inf, and the log-sum-exp: both ops' forward."""
    scores = _scores(q, k, hidden, divisor).to(_accumulated(q))
    lse = scores.logsumexp(dim=-1)  # (b, h, s): the softmax's normalizer, kept for backward
    probs = (scores - lse.unsqueeze(-1)).exp().to(q.dtype)
    return _sequence_major(_grouped(probs, v, lambda p, vg: p @ vg)), lse


def _attention_backward(grad, grad_lse, q, k, v, out, lse, hidden: torch.Tensor | None,
                        divisor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of `_attention` in closed form: both ops' backward."""
    dtype = _accumulated(q)
    grad, q_, k_, v_, out = (t.to(dtype) for t in (grad, q, k, v, out))
    probs = (_scores(q_, k_, hidden, divisor) - lse.to(dtype).unsqueeze(-1)).exp()
    grad_probs = _grouped(grad, v_, lambda g, vg: g @ vg.transpose(-2, -1))
    rows = (grad * out).sum(-1, keepdim=True) - grad_lse.to(dtype).unsqueeze(-1)
    grad_scores = probs * (grad_probs - rows) / divisor
    grad_q = _grouped(grad_scores, k_, lambda s, kg: s @ kg)
    grad_k = _summed_over_group(grad_scores.transpose(-2, -1) @ q_, k.shape[1])
    grad_v = _summed_over_group(probs.transpose(-2, -1) @ grad, v.shape[1])
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


def _causal_mask(q: torch.Tensor) -> torch.Tensor:
    """The scores a causal mask hides: each query's future keys, (s, s)."""
    length = q.shape[-2]
    return torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)


def _scores(q: torch.Tensor, k: torch.Tensor, hidden: torch.Tensor | None, divisor: float) -> torch.Tensor:
    """QKᵀ/divisor of every query head against its key head, those `hidden` hides at -inf: (b, h, s_q, s_k)."""
    scores = _grouped(q, k, lambda qg, kg: qg @ kg.transpose(-2, -1)) / divisor
    return scores if hidden is None else scores.masked_fill(hidden, float("-inf"))


def _grouped(per_query_head: torch.Tensor, per_kv_head: torch.Tensor, product) -> torch.Tensor:
    """`product` of each query head's tensor with its key/value head's, (b, h, ...) out: query heads are
    dealt to key/value heads in consecutive groups (llama's repeat_interleave)."""
    batch, heads = per_query_head.shape[:2]
    kv_heads = per_kv_head.shape[1]
    grouped = per_query_head.reshape(batch, kv_heads, heads // kv_heads, *per_query_head.shape[2:])
    result = product(grouped, per_kv_head.unsqueeze(2))
    return result.reshape(batch, heads, *result.shape[3:])


def _summed_over_group(per_query_head: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A (b, h, ...) gradient summed over each key/value head's group of query heads: (b, kv_heads, ...)."""
    batch, heads = per_query_head.shape[:2]
    return per_query_head.reshape(batch, kv_heads, heads // kv_heads, *per_query_head.shape[2:]).sum(2)
