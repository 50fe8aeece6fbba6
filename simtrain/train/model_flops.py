"""Model FLOPs of a training step: the arithmetic the model needs, recomputation left out.

Model FLOPs are what MFU (model FLOPs utilization) divides by the devices' peak
(Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways",
appendix B): the FLOPs of one forward and one backward of the model, however
the run executes them. Recomputed forwards (train.checkpointing) are work the
devices do but the model does not need, so they are not model FLOPs; they are
in what the devices ran (report.json's `flops.device_tflops_per_device`).

- `gpt`: PaLM's closed form, per token 6N + 12·L·H·Q·T, with N the weights of
  the model's matrix multiplies (every Linear's, the language head's included:
  12·L·h² + V·h for train/gpt.py's model of width h and vocabulary V), L
  layers, H heads of Q features each (H·Q = h) and T the sequence length; a
  sample is T tokens; in a mixture-of-experts block (train/moe.py) N counts
  the router and the top_k + shared experts a token goes through (its
  activated weights, as MoE MFU is quoted). For this model it equals
  Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", eq. 3) without its recomputed forward:
  72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) for a batch of B sequences, where the
  paper's 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) counts the forward of every
  layer a second time.
- `llama`: the same closed form for train/llama.py's model, its matrix
  multiplies' weights N = L·(2·h² + 2·h·(h/H)·G + 3·h·F) + V·h (wq and wo,
  wk and wv of G key/value heads, the SwiGLU's three of F features, the
  output Linear; the token table is a lookup, not a multiply), and the
  attention term 12·L·h·T as gpt's: grouped-query attention shares keys and
  values, not the work, each of the H query heads attending over T positions;
  in a mixture-of-experts block (train/llama_moe.py) N counts the router and
  the top_k + shared SwiGLU experts of W = model.moe.expert_hidden features a
  token goes through, 3·h·W each, in place of the dense 3·h·F (the blocks
  model.moe makes MoE: past its first_dense, every n-th). With multi-head
  latent attention (model.latent_attention, train/latent_attention.py) the
  attention's weights in N are its five matrices (wq_a, wq_b, wkv_a, wkv_b,
  wo), and the attention term counts QKᵀ at the queries' and keys' head size
  d_qk = d_n + d_r and AV at the values' d_v: 6·L·H·T·(d_qk + d_v) per token,
  which is PaLM's 12·L·H·Q·T where both are Q.
- every other model (mlp, cnn, a user's): measured, the forward and backward
  FLOPs (cost.measure_step_cost, the operator recorder) of one batch of zeros
  through the model built without checkpointing, on the job's device kind
  (meta with numerics off, the host CPU with numerics on: a user's model need
  not run on meta).

    flops = model_flops_per_step(scenario, data, samples=scheme.samples_per_step())
    flops.per_step, flops.formula
"""
from typing import NamedTuple

import torch

from ..cost import measure_step_cost
from ..scenario import Scenario
from .architecture import latent_attention_parameters
from .data import DataSplits
from .models import build_model


PALM = "6N + 12LHQT per token (PaLM, Chowdhery et al. 2022, appendix B)"
MEASURED = "measured: forward and backward FLOPs of one batch, without recomputation"


class ModelFlops(NamedTuple):
    per_step: float
    formula: str  # PALM or MEASURED
    tokens_per_sample: int | None = None  # a language model's sequence length; None: its samples are not tokens


def model_flops_per_step(scenario: Scenario, data: DataSplits, samples: int) -> ModelFlops:
    """Model FLOPs of a step of `samples` samples (every replica's together)."""
    model = scenario.model
    # The data's own vocabulary and sequence length: the scenario's may be null (the data set's defaults).
    vocab, seq_len = data.info.num_classes, data.info.num_features
    if model.name == "gpt":
        return ModelFlops(samples * gpt_flops_per_sequence(model.layers, model.width, vocab, seq_len, model.moe),
                          PALM, seq_len)
    if model.name == "llama":
        return ModelFlops(samples * llama_flops_per_sequence(model.layers, model.width, model.heads,
                                                             model.key_value_heads, model.ffn_width, vocab,
                                                             seq_len, model.moe, model.latent_attention), PALM,
                          seq_len)
    batch = scenario.data.batch_size
    return ModelFlops(samples / batch * _measured_flops(scenario, data, batch), MEASURED)


def gpt_flops_per_sequence(layers: int, width: int, vocab: int, seq_len: int, moe=None) -> float:
    """PaLM's 6N + 12·L·H·Q·T per token, times T tokens, for train/gpt.py's model; with `moe` (a MoESpec), N
    counts the weights a token is computed with: an MoE block's router and top_k + shared experts."""
    mlp = 8 * width**2  # Linear(h, 4h), Linear(4h, h)
    weights = layers * (4 * width**2 + mlp) + vocab * width
    if moe is not None:
        weights += _activated_minus_dense(layers, width, moe, 2 * width * moe.expert_width(4 * width), mlp)
    return float(seq_len * (6 * weights + 12 * layers * width * seq_len))


def llama_flops_per_sequence(layers: int, width: int, heads: int, kv_heads: int, ffn_hidden: int, vocab: int,
                             seq_len: int, moe=None, latent=None) -> float:
    """PaLM's 6N + 12·L·H·Q·T per token, times T tokens, for train/llama.py's model; with `moe` (a MoESpec), N
    counts an MoE block's router and top_k + shared SwiGLU experts (train/llama_moe.py); with `latent` (a
    LatentAttentionSpec), the attention is multi-head latent attention (train/latent_attention.py): its matrices'
    weights in N, and 6·L·H·T·(d_qk + d_v) for the attention term."""
    mlp = 3 * width * ffn_hidden  # w1, w3, w2
    if latent is None:
        attention = 2 * width**2 + 2 * width * (width // heads) * kv_heads  # wq wo, wk wv
        head_dims = 2 * (width // heads)  # QKᵀ's and AV's head size
    else:  # its matrices: the parameters less the two latent norms
        attention = latent_attention_parameters(latent, width, heads) - latent.q_lora_rank - latent.kv_lora_rank
        head_dims = latent.qk_head_dim + latent.v_head_dim
    weights = layers * (attention + mlp) + vocab * width
    if moe is not None:
        weights += _activated_minus_dense(layers, width, moe, 3 * width * moe.expert_width(ffn_hidden), mlp)
    return float(seq_len * (6 * weights + 6 * layers * heads * head_dims * seq_len))


def _activated_minus_dense(layers: int, width: int, moe, expert: int, mlp: int) -> int:
    """What the MoE blocks add to N: in each, the router and the top_k + shared experts of `expert` weights each
    a token goes through, in place of the dense MLP's `mlp`."""
    return moe.moe_layers(layers) * (width * moe.experts + (moe.top_k + moe.shared_experts) * expert - mlp)


def _measured_flops(scenario: Scenario, data: DataSplits, batch: int) -> float:
    """Forward and backward FLOPs of one batch of `batch` samples through the model without checkpointing."""
    x, y = data.train[0]
    y = torch.as_tensor(y)
    device = "cpu" if scenario.numerics else "meta"
    with torch.device(device):
        model = build_model(scenario.model, data.info, scenario.seed)
    cost = measure_step_cost(model, torch.zeros((batch, *x.shape), dtype=x.dtype, device=device),
                             torch.zeros((batch, *y.shape), dtype=y.dtype, device=device))
    return cost.forward_flops + cost.backward_flops
