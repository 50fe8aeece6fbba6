"""Fused attention (model.attention: fused; train/fused_attention.py) against its references.

- Numerics: outputs and gradients of q, k and v equal single-process torch's
  F.scaled_dot_product_attention, causal and not (grouped-query heads included), within 1e-12 in fp64.
- Charge: one operator forward and one backward; FLOPs 4·b·h·s²·d / 2 (causal) forward and 2.5 times
  that backward, FlashAttention-2's count (Dao 2023, section 4.1); bytes Q, K, V, O and the fp32
  log-sum-exp forward, and dO, the log-sum-exp's gradient, Q, K, V, O, log-sum-exp, dQ, dK, dV backward: the
  closed forms, exactly.
- Activation bytes per layer: Korthikanti et al. 2022's Table 2 as simtrain's layer keeps it
  (tests/test_sequence_parallel.py `simtrain_layer`) without the attention core's 5as²b term (and the
  causal mask's s²), plus the log-sum-exp (4·a·s·b/t), exactly.
- A gpt trains the same parameters with fused and eager attention (within 1e-6, fp32).
- Bad input: fused attention on a model without attention: one line naming model.attention, exit 2.
"""
import pytest
import torch
import torch.nn.functional as F

from simtrain import run
from simtrain.cli import main
from simtrain.hw.resolved_cluster import resolve_cluster
from simtrain.memory_plan import replay_step
from simtrain.op_cost import OperatorRecorder
from simtrain.scenario import validate_scenario
from simtrain.train.fused_attention import flash_attention, flash_attention_with_lse

B, HEADS, KV_HEADS, S, D = 2, 4, 2, 16, 8


@pytest.mark.parametrize("causal", [True, False])
def test_numerics_are_torchs_attention_with_grouped_heads(causal):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, heads, S, D, dtype=torch.float64, generator=generator, requires_grad=True)
               for heads in (HEADS, KV_HEADS, KV_HEADS))
    grad = torch.randn(B, HEADS, S, D, dtype=torch.float64, generator=generator)
    ours = flash_attention_with_lse(q, k, v, causal)[0]
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-12)
    for mine, theirs in zip(torch.autograd.grad(ours, (q, k, v), grad), torch.autograd.grad(reference, (q, k, v), grad)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12)


def test_the_log_sum_exps_gradient_is_the_written_out_softmaxs():
    """A ring attention merges blocks by their log-sum-exp, so its gradient must reach q and k: against the
    log-sum-exp of the written-out scores, differentiated by autograd, in fp64."""
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, heads, S, D, dtype=torch.float64, generator=generator, requires_grad=True)
               for heads in (HEADS, KV_HEADS, KV_HEADS))
    grad_out, grad_lse = torch.randn(B, HEADS, S, D, dtype=torch.float64, generator=generator), \
        torch.randn(B, HEADS, S, dtype=torch.float64, generator=generator)
    out, lse = flash_attention_with_lse(q, k, v, causal=False)
    scores = q @ k.repeat_interleave(HEADS // KV_HEADS, 1).transpose(-2, -1) / D ** 0.5
    reference_lse = scores.logsumexp(-1)
    reference_out = scores.softmax(-1) @ v.repeat_interleave(HEADS // KV_HEADS, 1)
    torch.testing.assert_close(lse, reference_lse, rtol=0, atol=1e-12)
    ours = torch.autograd.grad((out, lse), (q, k, v), (grad_out, grad_lse))
    theirs = torch.autograd.grad((reference_out, reference_lse), (q, k, v), (grad_out, grad_lse))
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(mine, reference, rtol=0, atol=1e-12)


def test_flops_and_bytes_are_flashattention_2s_closed_forms():
    q, k, v = (torch.empty(B, heads, S, D, dtype=torch.bfloat16, device="meta", requires_grad=True)
               for heads in (HEADS, KV_HEADS, KV_HEADS))
    forward_flops = 4 * B * HEADS * S * S * D // 2
    q_bytes, kv_bytes, lse_bytes = 2 * B * HEADS * S * D, 2 * B * KV_HEADS * S * D, 4 * B * HEADS * S
    with OperatorRecorder() as forward:
        out = flash_attention(q, k, v)
    assert forward.take() == ((forward_flops, q_bytes + 2 * kv_bytes + q_bytes + lse_bytes, 1, "bf16",
                               ("attention",)),)
    grad = torch.empty_like(out)
    with OperatorRecorder() as backward:
        torch.autograd.grad(out, (q, k, v), grad)
    charged = [entry for entry in backward.take() if entry[0]]
    # reads dO, the log-sum-exp's gradient, Q, K, V, O, the log-sum-exp; writes dQ, dK, dV
    assert charged == [(2.5 * forward_flops, 3 * q_bytes + 2 * kv_bytes + 2 * lse_bytes + q_bytes + 2 * kv_bytes, 1,
                        "bf16", ("attention",))]


SEQ, BATCH, HIDDEN, A = 64, 2, 64, 4  # as tests/test_sequence_parallel.py's Table 2 check


def layer_bytes(tp: int, attention: str) -> int:
    """Activation bytes one more gpt layer holds (fp16, numerics off): the peak with 3 layers minus 2."""
    def peak(layers: int) -> int:
        spec = validate_scenario({
            "name": "fused", "numerics": False, "cluster": {"devices": tp, "device": {"base": "a100-80gb"}},
            "model": {"name": "gpt", "hidden": HIDDEN, "layers": layers, "heads": A, "attention": attention},
            "data": {"name": "tokens", "batch_size": BATCH, "seq_len": SEQ, "vocab": 64, "samples": 64},
            "train": {"steps": 1, "precision": "fp16"}, "parallel": {"tp": tp}, "report": {"trace": False}})
        return replay_step(spec, resolve_cluster(spec.cluster), BATCH).devices[0].memory.peak["activations"]
    return peak(3) - peak(2)


@pytest.mark.parametrize("tp", [1, 2])
def test_activations_are_table_2_without_the_attention_core(tp):
    sbh = SEQ * BATCH * HIDDEN
    layer_norm_stats = 16 * BATCH * SEQ
    eager_core = 2 * A * SEQ * SEQ * BATCH / tp + SEQ * SEQ  # softmax output (no dropout) and the causal mask
    eager = sbh * (8 + 24 / tp) + layer_norm_stats + eager_core
    assert layer_bytes(tp, "eager") == eager
    assert layer_bytes(tp, "fused") == eager - eager_core + 4 * A * SEQ * BATCH / tp


def test_a_gpt_trains_the_same_parameters_fused_and_eager():
    def parameters(attention: str) -> torch.Tensor:
        report = run(validate_scenario({
            "name": "fused", "seed": 1, "cluster": {"devices": 1},
            "model": {"name": "gpt", "hidden": 32, "layers": 2, "heads": 4,
                      "attention": attention},
            "data": {"name": "tokens", "batch_size": 8, "samples": 64, "seq_len": 8, "vocab": 16},
            "train": {"steps": 4, "optimizer": {"lr": 0.1}}, "report": {"trace": False, "every": 4}}))
        return torch.cat([p.detach().flatten() for p in report.final_models[0].parameters()])
    torch.testing.assert_close(parameters("fused"), parameters("eager"), rtol=0, atol=1e-6)


def test_fused_attention_on_a_model_without_attention_prints_one_line_and_exits_2(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text("train: {steps: 1}\nmodel: {name: mlp, attention: fused}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "model.attention" in err and "\n" not in err


def _document_causal(documents):
    """FlexAttention's mask_mod of causal attention within each document (torchtitan's block_causal)."""
    def mask_mod(batch, head, q_index, kv_index):
        return (documents[batch, q_index] == documents[batch, kv_index]) & (q_index >= kv_index)
    return mask_mod


def test_flexattention_stand_in_computes_torchs_flex_attention_and_charges_the_blocks_it_keeps():
    """simtrain's stand-in for FlexAttention (frameworks/torchtitan.py, simtrain::masked_attention) against torch's
    own flex_attention forward (eager on a CPU) under a document-causal block mask, its gradients against the
    written-out masked softmax, and its FLOPs: the share of 128 x 128 score blocks the block mask computes, in
    closed form."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention as torch_flex

    from simtrain.frameworks.torchtitan import flex_attention
    torch.manual_seed(0)
    batch, heads, kv_heads, length, width = 2, 4, 2, 512, 16
    documents = torch.tensor([[0] * 300 + [1] * 212, [0] * 512])  # the first sequence packs two documents
    mask = create_block_mask(_document_causal(documents), batch, None, length, length, device="cpu")
    q = torch.randn(batch, heads, length, width, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, length, width, requires_grad=True) for _ in range(2))
    with OperatorRecorder() as recorder:
        out, _ = flex_attention(q, k, v, score_mod=None, block_mask=mask, scale=None, enable_gqa=True,
                                return_aux=None, kernel_options={})
        forward_flops = recorder.flops
        out.square().sum().backward()
    torch.testing.assert_close(out.detach(), torch_flex(q.detach(), k.detach(), v.detach(), block_mask=mask,
                                                        enable_gqa=True), rtol=1e-5, atol=1e-5)
    hidden = ~((documents[:, None, :, None] == documents[:, None, None, :])
               & torch.ones(length, length, dtype=torch.bool).tril())
    grouped_k, grouped_v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    reference = torch.softmax((q @ grouped_k.transpose(-2, -1) / width ** 0.5).masked_fill(hidden, float("-inf")),
                              -1) @ grouped_v
    expected = torch.autograd.grad(reference.square().sum(), (q, k, v))
    recomputed = [t.grad for t in (q, k, v)]
    for got, want in zip(recomputed, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # 4 x 4 blocks of 128: the one-document sequence keeps the 10 on or below the diagonal; in the two-document one
    # rows 384-511 are all document 1's (it starts at 300), so their blocks against keys 0-255 go: 8 kept
    kept = (10 + 8) / (2 * 16)
    assert forward_flops == round(kept * 4 * batch * heads * length * length * width)
    assert recorder.flops - forward_flops == round(kept * 10 * batch * heads * length * length * width)
