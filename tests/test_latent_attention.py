"""Multi-head latent attention (train/latent_attention.py) and dense first layers (model.moe.first_dense).

References:
- the MLA block against DeepSeek-V2's formulas written out here head by head, position by position, in float64
  (its own RMSNorm, rotations as complex multiplications), eager and fused, within 1e-6;
- DeepSeek-V3's published size (DeepSeek-V3 technical report, arXiv 2412.19437, section 4.2: 671B parameters in
  all, 37B activated for each token, the 14B of the multi-token-prediction module left out) from its config
  (hidden 7168, 61 layers, 128 heads, vocabulary 129280, dense ffn 18432, 3 dense first layers, 256 routed experts
  of 2048 and 1 shared, top 8, MLA of ranks 1536 and 512, head sizes 128 + 64 and 128) by the architecture's own
  count, which equals what the model builds on meta;
- PaLM's 6N + 6·L·H·T·(d_qk + d_v) per token against the operator recorder's count of a step, and the fused
  kernel's FLOPs against the written-out multiplies;
- single-process torch (test_expert_parallel.one_device: the whole model, SGD) for the losses and parameters of
  tp 2 (with and without sp, eager and fused, selective recomputation), cp 2, pp 2 and an MoE under tp x ep;
- the block kinds and parameters of a model with dense first layers by closed form;
- one-line errors for bad input.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import simtrain
from simtrain.cost import measure_step_cost
from simtrain.errors import ScenarioError
from simtrain.scenario import validate_scenario
from simtrain.scenario.model import LatentAttentionSpec, ModelSpec, MoESpec
from simtrain.train.architecture import architecture, latent_attention_parameters
from simtrain.train.data_shape import tokens_info
from simtrain.train.fused_attention import flash_attention
from simtrain.train.gpt import Block, attention_core, build_gpt
from simtrain.train.latent_attention import LatentAttentionBlock, LatentAttentionMoEBlock, latent_attention_block
from simtrain.train.llama import LlamaBlock, build_llama
from simtrain.train.llama_moe import LlamaMoEBlock, llama_moe_block
from simtrain.train.model_flops import llama_flops_per_sequence
from simtrain.train.models import build_model
from simtrain.train.moe import MoEBlock, moe_block

from test_expert_parallel import assert_same_parameters, one_device

SMALL = LatentAttentionSpec(q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
HIDDEN, HEADS, FFN, THETA = 16, 4, 24, 1e4


def reference_attention(block: LatentAttentionBlock, x: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2's MLA (section 2.1, eqs. 9-19) on x (batch, length, hidden), in float64, one head and one
    position at a time."""
    spec, weights = block.latent, {name: p.detach().double() for name, p in block.named_parameters()}
    nope, rope, v_dim, r_kv = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim, spec.kv_lora_rank

    def rms(t, weight):
        return t / torch.sqrt((t ** 2).mean(-1, keepdim=True) + 1e-5) * weight

    def rotated(t, position):  # features (2i, 2i+1) as a complex number turned by position · θ^(-2i/rope)
        pairs = torch.view_as_complex(t.reshape(*t.shape[:-1], rope // 2, 2).contiguous())
        angles = position * THETA ** (-torch.arange(0, rope, 2, dtype=torch.float64) / rope)
        return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(-2)

    h = rms(x.double(), weights["attention_norm.weight"])
    queries = rms(h @ weights["wq_a.weight"].T, weights["q_norm.weight"]) @ weights["wq_b.weight"].T
    compressed = h @ weights["wkv_a.weight"].T
    keys_values = rms(compressed[..., :r_kv], weights["kv_norm.weight"]) @ weights["wkv_b.weight"].T
    shared_rope = compressed[..., r_kv:]  # one rotary key per position, every head's
    batch, length, _ = x.shape
    heads_out = torch.zeros(batch, length, HEADS * v_dim, dtype=torch.float64)
    for head in range(HEADS):
        q = queries[..., head * (nope + rope):(head + 1) * (nope + rope)]
        kv = keys_values[..., head * (nope + v_dim):(head + 1) * (nope + v_dim)]
        for t in range(length):
            scores = torch.stack([
                (q[:, t, :nope] * kv[:, u, :nope]).sum(-1)
                + (rotated(q[:, t, nope:], t) * rotated(shared_rope[:, u], u)).sum(-1) for u in range(t + 1)], -1)
            weights_u = (scores / math.sqrt(nope + rope)).softmax(-1)  # (batch, t + 1)
            heads_out[:, t, head * v_dim:(head + 1) * v_dim] = (weights_u.unsqueeze(-1) * kv[:, :t + 1, nope:]).sum(1)
    return heads_out @ weights["wo.weight"].T


# ---------------------------------------------------------------- the module against its formulas

@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
def test_the_block_is_deepseeks_latent_attention_then_llamas_mlp(fused):
    torch.manual_seed(0)
    block = LatentAttentionBlock(SMALL, HIDDEN, HEADS, FFN, THETA)
    block.fused_attention = fused
    with torch.no_grad():
        for norm in (block.attention_norm, block.q_norm, block.kv_norm, block.ffn_norm):
            norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 7, HIDDEN)
    attention = reference_attention(block, x)
    torch.testing.assert_close(block._attention(block._attention_input(x)).double(), attention, rtol=0, atol=1e-6)
    mid = x.double() + attention
    weights = {name: p.detach().double() for name, p in block.named_parameters()}
    h = mid / torch.sqrt((mid ** 2).mean(-1, keepdim=True) + 1e-5) * weights["ffn_norm.weight"]
    mlp = (F.silu(h @ weights["w1.weight"].T) * (h @ weights["w3.weight"].T)) @ weights["w2.weight"].T
    torch.testing.assert_close(block(x).double(), mid + mlp, rtol=0, atol=1e-6)


def test_its_parameters_are_the_closed_form():
    block = LatentAttentionBlock(SMALL, HIDDEN, HEADS, FFN, THETA)
    attention = sum(p.numel() for name, p in block.named_parameters()
                    if not name.startswith(("attention_norm", "ffn_norm", "w1", "w2", "w3")))
    assert attention == latent_attention_parameters(SMALL, HIDDEN, HEADS) == (
        16 * 12 + 12 + 12 * 4 * 10 + 16 * 12 + 8 + 8 * 4 * 11 + 4 * 5 * 16)


def test_the_fused_kernel_with_values_of_their_own_width_is_the_written_out_attention():
    """q, k of head size 10 and v of 6: the same output and gradients as the eager core; FLOPs each multiply at its
    own size: forward 2·b·h·s²·(d + d_v), backward the same plus QKᵀ recomputed (non-causal, counted whole)."""
    torch.manual_seed(0)
    q, k = (torch.randn(2, 3, 8, 10, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, 8, 6, requires_grad=True)
    grad = torch.randn(2, 3, 8, 6)
    eager = attention_core(q, k, v)
    fused = flash_attention(q, k, v)
    torch.testing.assert_close(fused, eager)
    for fused_grad, eager_grad in zip(torch.autograd.grad(fused, (q, k, v), grad),
                                      torch.autograd.grad(eager, (q, k, v), grad)):
        torch.testing.assert_close(fused_grad, eager_grad)
    with FlopCounterMode(display=False) as counted:
        out, lse = torch.ops.simtrain.flash_attention(q, k, v, False)
        torch.autograd.grad(out, (q, k, v), grad)
    forward, backward = 2 * 2 * 3 * 8 * 8 * (10 + 6), 2 * 2 * 3 * 8 * 8 * (3 * 10 + 2 * 6)
    assert counted.get_total_flops() == forward + backward
    assert backward == 2 * forward + 2 * 2 * 3 * 8 * 8 * 10  # the eager multiplies' backward, plus QKᵀ again


@pytest.mark.parametrize("moe", [None, MoESpec(experts=4, top_k=2, shared_experts=1, expert_hidden=8, first_dense=1)],
                         ids=["dense", "moe"])
def test_meta_flops_are_palms_closed_form_with_the_attentions_head_sizes(moe):
    """Numerics off: forward + backward FLOPs are 6N + 6·L·H·T·(d_qk + d_v) per token, N the five attention
    matrices, the MLPs (an MoE block's router and top_k + shared experts) and the head."""
    layers, vocab, seq_len, batch = 3, 64, 16, 2
    with torch.device("meta"):
        model = build_llama(vocab, HIDDEN, layers, HEADS, HEADS, FFN, THETA, latent_attention_block(SMALL, moe))
    tokens = torch.empty((batch, seq_len), dtype=torch.long, device="meta")
    cost = measure_step_cost(model, tokens, tokens)
    per_sequence = llama_flops_per_sequence(layers, HIDDEN, HEADS, HEADS, FFN, vocab, seq_len, moe, SMALL)
    assert cost.forward_flops + cost.backward_flops == batch * per_sequence
    if moe is None:
        matrices = 16 * 12 + 12 * 40 + 16 * 12 + 8 * 44 + 20 * 16 + 3 * 16 * 24
        attention = 6 * layers * HEADS * (10 + 5) * seq_len  # QKᵀ at d_n + d_r = 10, AV at d_v = 5
        assert per_sequence == seq_len * (6 * (layers * matrices + vocab * 16) + attention)


# ---------------------------------------------------------------- DeepSeek-V3's size

DEEPSEEK_V3 = ModelSpec(name="llama", hidden=7168, layers=61, heads=128, ffn_hidden=18432,
                        latent_attention=LatentAttentionSpec(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                                             qk_rope_head_dim=64, v_head_dim=128),
                        moe=MoESpec(experts=256, top_k=8, expert_hidden=2048, shared_experts=1, first_dense=3))
VOCAB = 129280


def test_deepseek_v3_has_its_published_671b_parameters_and_37b_activated():
    """Total: every parameter, the token table and the output head included: 671.03B. Activated for a token:
    every parameter but the 248 routed experts it is not sent to in each of the 58 MoE blocks and the token table's
    other rows (a token reads its own row): 36.63B. Both round to the published figures (the activated would be
    37.55B with the whole token table counted)."""
    entries = architecture(DEEPSEEK_V3, tokens_info(4096, VOCAB))
    assert [entry.kind for entry in entries[1:-1]] == ["LatentAttentionBlock"] * 3 + ["LatentAttentionMoEBlock"] * 58
    total = sum(entry.parameters for entry in entries)
    expert = 3 * 7168 * 2048
    activated = total - 58 * (256 - 8) * expert - (VOCAB - 1) * 7168
    assert (total, activated) == (671_026_404_352, 36_625_610_752)
    assert round(total / 1e9) == 671 and round(activated / 1e9) == 37


def test_deepseek_v3s_first_blocks_build_on_meta_to_the_architectures_count():
    """The first four blocks (the three dense, one MoE) of DeepSeek-V3's shapes, built on meta: the parameters
    the architecture counts."""
    spec = DEEPSEEK_V3.model_copy(update={"layers": 4})
    info = tokens_info(4096, VOCAB)
    with torch.device("meta"):
        model = build_model(spec, info, seed=0)
    assert [type(block) for block in list(model)[1:-1]] == [LatentAttentionBlock] * 3 + [LatentAttentionMoEBlock]
    assert sum(p.numel() for p in model.parameters()) == sum(entry.parameters for entry in architecture(spec, info))


# ---------------------------------------------------------------- parallelism against one device

LATENT = SMALL.model_dump()
MOE = {"experts": 4, "top_k": 2, "aux_loss_coeff": 0.0, "first_dense": 1, "shared_experts": 1, "expert_hidden": 8}


def scenario(devices, moe=None, attention="eager", checkpointing="none", **parallel):
    return validate_scenario({
        "name": "t", "seed": 3, "cluster": {"topology": "switch", "devices": devices, "device": "h100-80gb"},
        "model": {"name": "llama", "hidden": HIDDEN, "layers": 3, "heads": HEADS, "ffn_hidden": FFN,
                  "latent_attention": LATENT, "attention": attention, **({"moe": moe} if moe else {})},
        "data": {"name": "tokens", "batch_size": 4, "seq_len": 8, "vocab": 32},
        "train": {"steps": 2, "optimizer": {"name": "sgd", "lr": 0.1}, "precision": "fp32",
                  "checkpointing": checkpointing},
        "parallel": parallel, "report": {"trace": False}})


@pytest.mark.parametrize("spec", [
    pytest.param(lambda: scenario(2, tp=2), id="tp2"),
    pytest.param(lambda: scenario(2, tp=2, sequence_parallel=True), id="tp2-sp"),
    pytest.param(lambda: scenario(2, attention="fused", tp=2, sequence_parallel=True), id="tp2-sp-fused"),
    pytest.param(lambda: scenario(2, checkpointing="selective", tp=2), id="tp2-selective"),
    pytest.param(lambda: scenario(2, cp=2), id="cp2"),
    pytest.param(lambda: scenario(2, attention="fused", cp=2), id="cp2-fused"),
    pytest.param(lambda: scenario(2, pp=2, pipeline={"microbatches": 2}), id="pp2"),
    pytest.param(lambda: scenario(4, moe=MOE, tp=2, sequence_parallel=True, ep=2), id="moe-tp2-sp-ep2"),
])
def test_parallel_mla_trains_what_one_device_trains(spec):
    """The down projections and latent norms whole on each tp rank, the up projections cut by heads, wo by its
    input features; the "f" on the latents (all-gathered under sp); ring attention's blocks of keys (d_n + d_r)
    and values (d_v) side by side: the losses and parameters of the whole model in plain torch, within 1e-5."""
    spec = spec()
    report = simtrain.run(spec)
    losses = []
    reference, _ = one_device(spec, report.data["parallel"]["dp"] or 1, losses)
    assert [loss for _, loss in report.data["loss_curve"]] == pytest.approx(losses, abs=1e-5)
    assert_same_parameters(report.final_model, reference)


def test_numerics_off_runs_mla_with_experts_under_dualpipev_ep_and_zero1_in_fp8():
    """DeepSeek-V3's layout in small: pp 2 (dualpipev), ep 4, ZeRO-1, fp8, numerics off, dense first block."""
    raw = scenario(8, moe={**MOE, "experts": 8}, pp=2, ep=4, sharding={"stage": 1},
                   pipeline={"schedule": "dualpipev", "virtual_stages": 2, "microbatches": 4}).model_dump()
    raw["numerics"], raw["train"]["precision"] = False, "fp8"
    report = simtrain.run(validate_scenario(raw))
    assert report.data["status"] == "ok" and report.data["step_time_s"] > 0


# ---------------------------------------------------------------- dense first layers

def test_dense_first_layers_then_every_nth_block_by_closed_form():
    """first_dense 3, every 2, 8 blocks: blocks 4, 6, 8 (from 1) are MoE; the parameters are the dense and MoE
    blocks' closed forms (llama: norms, wq wo wk wv, SwiGLU or router and experts; gpt: its Block's)."""
    moe = MoESpec(experts=4, top_k=2, shared_experts=1, every=2, first_dense=3, expert_hidden=8)
    assert [layer for layer in range(8) if moe.holds_experts(layer)] == [3, 5, 7] and moe.moe_layers(8) == 3
    vocab, heads, kv_heads = 32, 4, 2
    llama = build_llama(vocab, HIDDEN, 8, heads, kv_heads, FFN, THETA, llama_moe_block(moe))
    kinds = [LlamaMoEBlock if layer in (3, 5, 7) else LlamaBlock for layer in range(8)]
    assert [type(block) for block in list(llama)[1:-1]] == kinds
    attention = 2 * HIDDEN + 2 * HIDDEN * HIDDEN + 2 * HIDDEN * (HIDDEN // heads) * kv_heads
    dense, experts = attention + 3 * HIDDEN * FFN, attention + HIDDEN * 4 + 5 * 3 * HIDDEN * 8
    assert sum(p.numel() for p in llama.parameters()) == 2 * vocab * HIDDEN + HIDDEN + 5 * dense + 3 * experts
    gpt = build_gpt(vocab, 8, HIDDEN, 8, heads, moe_block(moe))
    assert [type(block) for block in list(gpt)[1:-1]] == [MoEBlock if layer in (3, 5, 7) else Block
                                                          for layer in range(8)]
    gpt_attention = 4 * HIDDEN * HIDDEN + 8 * HIDDEN
    gpt_dense = gpt_attention + 8 * HIDDEN * HIDDEN + 5 * HIDDEN
    gpt_experts = gpt_attention + HIDDEN * 4 + 5 * (2 * HIDDEN * 8 + 8 + HIDDEN)
    embedding, head = (vocab + 8) * HIDDEN, 2 * HIDDEN + HIDDEN * vocab + vocab
    assert sum(p.numel() for p in gpt.parameters()) == embedding + head + 5 * gpt_dense + 3 * gpt_experts


def test_the_architecture_lists_the_dense_first_layers_as_built():
    spec = ModelSpec(name="llama", hidden=HIDDEN, layers=5, heads=HEADS, ffn_hidden=FFN, latent_attention=LATENT,
                     moe=MoESpec(experts=4, first_dense=2))
    info = tokens_info(8, 32)
    entries = architecture(spec, info)
    model = build_model(spec, info, seed=0)
    assert [entry.kind for entry in entries] == [type(module).__name__ for module in model]
    assert [entry.parameters for entry in entries] == [sum(p.numel() for p in module.parameters())
                                                       for module in model]


# ---------------------------------------------------------------- bad input

LLAMA = {"name": "llama", "hidden": HIDDEN, "layers": 3, "heads": HEADS, "ffn_hidden": FFN}


@pytest.mark.parametrize("model,parallel,expected", [
    ({**LLAMA, "moe": {"first_dense": 3}}, {},
     "model.moe.first_dense: 3 leaves none of the llama's 3 model.layers an MoE block"),
    ({**LLAMA, "moe": {"first_dense": 2, "every": 2}}, {}, "model.moe.first_dense: 2 leaves none"),
    ({**LLAMA, "name": "gpt", "ffn_hidden": None, "latent_attention": {}}, {},
     "model.latent_attention: an option of model.name llama, not of gpt"),
    ({**LLAMA, "kv_heads": 2, "latent_attention": {}}, {}, "model.kv_heads: multi-head latent attention"),
    ({**LLAMA, "latent_attention": {**LATENT, "qk_rope_head_dim": 5}}, {},
     "model.latent_attention.qk_rope_head_dim: 5 must be even"),
    ({**LLAMA, "latent_attention": {**LATENT, "v_head_dim": 0}}, {}, "model.latent_attention.v_head_dim"),
    ({**LLAMA, "latent_attention": LATENT}, {"tp": 8},
     "parallel.tp: the model cannot be split 8 ways: model.heads 4 do not divide into 8 equal groups"),
])
def test_bad_input_is_one_line_naming_the_key(model, parallel, expected):
    with pytest.raises(ScenarioError, match=expected) as error:
        raw = {"model": model, "data": {"name": "tokens"}, "cluster": {"devices": parallel.get("tp", 1)},
               "parallel": parallel}
        simtrain.run(validate_scenario(raw)) if parallel else validate_scenario(raw)
    assert "\n" not in str(error.value)
