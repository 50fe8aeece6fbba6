"""The llama model (train/llama.py) against direct references, and its tensor and pipeline parallelism.

- Layers: RMSNorm against its formula in float64; rotary embeddings against the complex
  multiplication of Meta's reference; grouped-query attention against torch's own
  scaled_dot_product_attention (causal, enable_gqa) on the same projections; a block against
  those pieces put together by hand.
- Parameters: the formula of the docs against sum(p.numel()), and Llama 3's published sizes
  (8.03B, 70.6B, 405B) from their published shapes, built on meta.
- Model FLOPs: PaLM's closed form against the operator recorder's count of a step.
- Parallelism: tp 2 and pp 2 x tp 2 train the same parameters as one device within 1e-5 (fp32)
  (selective recomputation and sequence parallelism: tests/test_llama_long.py).
- Bad input: one line naming the key, exit 2.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from simtrain import run
from simtrain.cost import measure_step_cost
from simtrain.scenario import ModelSpec, validate_scenario
from simtrain.train.llama import LlamaBlock, RMSNorm, build_llama, parameter_count, rotate
from simtrain.train.model_flops import llama_flops_per_sequence

from refusals import refusal
from simulated_steps import flat_parameters

LLAMA = {"name": "llama", "seed": 2, "cluster": {"devices": 1},
         "model": {"name": "llama", "hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2, "ffn_hidden": 48},
         "data": {"name": "tokens", "batch_size": 8, "samples": 256, "seq_len": 8, "vocab": 16},
         "train": {"steps": 20, "optimizer": {"lr": 0.1, "momentum": 0.9}}, "report": {"trace": False, "every": 20}}


def scenario(devices: int = 1, **parallel):
    pipeline = {key: parallel.pop(key) for key in ("microbatches",) if key in parallel}
    return validate_scenario({**LLAMA, "cluster": {"devices": devices},
                              "parallel": {**parallel, **({"pipeline": pipeline} if pipeline else {})}})



# ---------------------------------------------------------------- layers against their formulas

def test_rmsnorm_is_its_formula():
    torch.manual_seed(0)
    norm = RMSNorm(16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 16) * 4
    x64 = x.double()
    expected = x64 / torch.sqrt((x64 ** 2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    torch.testing.assert_close(norm(x).double(), expected, rtol=1e-6, atol=1e-6)


def test_rotary_embedding_is_the_complex_multiplication():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 8)  # batch, heads, positions, head width
    theta = 500000.0
    pairs = torch.view_as_complex(x.double().reshape(2, 3, 7, 4, 2))
    frequencies = theta ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    turns = torch.polar(torch.ones(7, 4, dtype=torch.float64), torch.outer(torch.arange(7.0, dtype=torch.float64),
                                                                          frequencies))
    expected = torch.view_as_real(pairs * turns).reshape(2, 3, 7, 8)
    torch.testing.assert_close(rotate(x, theta).double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(rotate(x, theta)[..., 0, :], x[..., 0, :])  # position 0 is not turned


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_grouped_query_attention_is_torchs(heads, kv_heads):
    torch.manual_seed(0)
    block = LlamaBlock(hidden=32, heads=heads, kv_heads=kv_heads, ffn_hidden=48, rope_theta=10000.0)
    h = torch.randn(2, 6, 32)
    width = 32 // heads

    def heads_of(t, n):
        return t.view(2, 6, n, width).transpose(1, 2)

    q = rotate(heads_of(block.wq(h), heads), 10000.0)
    k = rotate(heads_of(block.wk(h), kv_heads), 10000.0)
    v = heads_of(block.wv(h), kv_heads)
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected = block.wo(attended.transpose(1, 2).reshape(2, 6, 32))
    torch.testing.assert_close(block._attention(h), expected, rtol=1e-5, atol=1e-6)


def test_block_is_attention_then_swiglu_on_the_residual_stream():
    torch.manual_seed(0)
    block = LlamaBlock(hidden=32, heads=4, kv_heads=2, ffn_hidden=48, rope_theta=10000.0)
    x = torch.randn(2, 6, 32)
    after_attention = x + block._attention(block.attention_norm(x))
    h = block.ffn_norm(after_attention)
    expected = after_attention + block.w2(F.silu(block.w1(h)) * block.w3(h))
    torch.testing.assert_close(block(x), expected)
    assert all(module.bias is None for module in block.modules() if isinstance(module, torch.nn.Linear))


# ---------------------------------------------------------------- parameters and FLOPs

@pytest.mark.parametrize("vocab,hidden,layers,heads,kv_heads,ffn", [
    (16, 32, 2, 4, 2, 48), (64, 64, 3, 8, 8, 96), (10, 48, 1, 6, 1, 128)])
def test_parameter_count_formula(vocab, hidden, layers, heads, kv_heads, ffn):
    model = build_llama(vocab, hidden, layers, heads, kv_heads, ffn, 10000.0)
    assert sum(p.numel() for p in model.parameters()) == parameter_count(vocab, hidden, layers, heads, kv_heads, ffn)


# Llama 3's shapes (Grattafiori et al. 2024, table 3; vocabulary 128,256) and Meta's published sizes.
LLAMA3 = {"8B": ((128256, 4096, 32, 32, 8, 14336), 8.03e9),
          "70B": ((128256, 8192, 80, 64, 8, 28672), 70.6e9),
          "405B": ((128256, 16384, 126, 128, 8, 53248), 405e9)}


@pytest.mark.parametrize("size", sorted(LLAMA3))
def test_llama3_sizes_match_the_published_ones(size):
    shape, published = LLAMA3[size]
    with torch.device("meta"):
        model = build_llama(*shape, 500000.0)
    count = sum(p.numel() for p in model.parameters())
    assert count == parameter_count(*shape)
    assert count == pytest.approx(published, rel=0.005)


def test_default_ffn_width_is_llamas_rule():
    # Llama 2 7B: width 4096, ffn 11008 (= 256 x ceil(int(2/3 x 4 x 4096) / 256)).
    assert ModelSpec(name="llama", hidden=4096, heads=32).ffn_width == 11008
    assert ModelSpec(name="llama", hidden=64, heads=4).ffn_width == 256
    assert ModelSpec(name="llama", hidden=64, heads=4, ffn_hidden=100).ffn_width == 100


def test_model_flops_are_palms_closed_form_and_the_recorders_count():
    torch.manual_seed(0)
    model = build_llama(16, 32, 2, 4, 2, 48, 10000.0)
    tokens = torch.randint(0, 16, (3, 8))
    cost = measure_step_cost(model, tokens, tokens)
    per_sequence = llama_flops_per_sequence(2, 32, 4, 2, 48, 16, 8)
    assert cost.forward_flops + cost.backward_flops == 3 * per_sequence
    weights = 2 * (2 * 32 * 32 + 2 * 32 * 8 * 2 + 3 * 32 * 48) + 16 * 32
    assert per_sequence == 8 * (6 * weights + 12 * 2 * 32 * 8)
    result = run(validate_scenario({**LLAMA, "train": {**LLAMA["train"], "steps": 1}}))
    assert result.data["flops"]["model_flops_formula"].startswith("6N + 12LHQT")


# ---------------------------------------------------------------- parallelism

@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2, "tp": 2, "microbatches": 2}, {"dp": 2, "tp": 2}],
                         ids=lambda layout: "-".join(f"{k}{v}" for k, v in layout.items()))
def test_tensor_and_pipeline_parallel_train_what_one_device_trains(layout):
    layout = dict(layout)
    devices = layout.get("dp", 1) * layout.get("pp", 1) * layout.get("tp", 1)
    split = run(scenario(devices, **layout))
    global_batch = LLAMA["data"]["batch_size"] * layout.get("dp", 1)
    alone = run(validate_scenario({**LLAMA, "data": {**LLAMA["data"], "batch_size": global_batch}}))
    assert split.data["status"] == "ok"
    assert alone.data["final_loss"] < math.log(16)  # it learned something
    torch.testing.assert_close(flat_parameters(split.final_models[0]), flat_parameters(alone.final_models[0]),
                               rtol=0, atol=1e-5)
    assert split.data["final_loss"] == pytest.approx(alone.data["final_loss"], abs=1e-5)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("model,devices,parallel,expected", [
    ({"kv_heads": 3}, 1, {}, "model.kv_heads: 3 key/value heads do not divide model.heads 4"),
    ({"kv_heads": 2}, 4, {"tp": 4}, "parallel.tp: the model cannot be split 4 ways: model.kv_heads 2 do not divide "
                                    "into 4 equal groups"),
    ({"ffn_hidden": 50, "kv_heads": 4}, 4, {"tp": 4},
     "parallel.tp: the model cannot be split 4 ways: model.ffn_hidden 50 does not divide into 4 equal slices"),
    ({"heads": 8, "hidden": 24}, 1, {}, "model.heads: a llama's head width"),
    ({"name": "gpt", "kv_heads": 2}, 1, {}, "model.kv_heads: an option of model.name llama, not of gpt"),
])
def test_bad_llama_input_is_one_line_and_exit_2(tmp_path, capsys, model, devices, parallel, expected):
    raw = {**LLAMA, "model": {**LLAMA["model"], **model}, "cluster": {"devices": devices}, "parallel": parallel}
    assert expected in refusal(tmp_path, capsys, raw)

