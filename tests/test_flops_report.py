"""report.json's `flops`: model TFLOP/s per device and MFU.

References: closed forms (an MLP's matrix multiplies; PaLM's 6N + 12LHQT; Narayanan et al. 2021's step
FLOPs), and bench/megatron_lm_table1.py's TFLOP/s per GPU on the paper's own scenarios.
"""
import sys
from pathlib import Path

import pytest
import torch

import simtrain
from simtrain.cost import measure_step_cost
from simtrain.scenario import load_scenario, validate_scenario
from simtrain.train.gpt import build_gpt
from simtrain.train.model_flops import gpt_flops_per_sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import megatron_lm_table1 as bench  # noqa: E402

DEVICES, BATCH, HIDDEN = 4, 16, 32


def mlp_scenario(hidden=(HIDDEN,), **train):
    return validate_scenario({
        "name": "t", "seed": 0,
        "cluster": {"topology": "ring", "devices": DEVICES},
        "model": {"name": "mlp", "hidden": list(hidden)},
        "data": {"name": "digits", "batch_size": BATCH},
        "train": {"steps": 3, "optimizer": {"name": "sgd", "lr": 0.1}, **train},
        "report": {"trace": False},
    })


def test_an_mlps_model_flops_are_its_matrix_multiplies():
    """digits: 64 features, 10 classes. Forward 2·B·(64·32 + 32·10); backward twice that, less the first
    layer's input gradient (the batch needs none)."""
    flops = simtrain.run(mlp_scenario()).data["flops"]
    per_sample = 2 * (64 * HIDDEN + HIDDEN * 10) + 4 * HIDDEN * 10 + 2 * 64 * HIDDEN
    assert flops["model_flops_per_step"] == DEVICES * BATCH * per_sample
    assert flops["mfu"] == pytest.approx(flops["tflops_per_device"] / flops["peak_tflops_per_device"], rel=1e-12)
    assert flops["peak_tflops_per_device"] == 19.5  # the default device's fp32 peak
    # no recomputation: the devices ran exactly the model's FLOPs
    assert flops["device_tflops_per_device"] == pytest.approx(flops["tflops_per_device"], rel=1e-12)


def test_recomputation_is_not_model_flops():
    """Checkpointed, the devices run more FLOPs (recomputed forwards); the model FLOPs do not change."""
    plain = simtrain.run(mlp_scenario(hidden=[HIDDEN] * 4)).data["flops"]
    checkpointed = simtrain.run(mlp_scenario(hidden=[HIDDEN] * 4, checkpointing="full")).data["flops"]
    assert checkpointed["model_flops_per_step"] == plain["model_flops_per_step"]
    assert checkpointed["device_flops_utilization"] > checkpointed["mfu"]


LLAMA = Path(__file__).resolve().parent.parent / "scenarios" / "llama_small.yaml"


@pytest.mark.parametrize("overrides,said", [
    (["model.attention=fused"], "their kernels' FLOPs"),  # fewer than the formula's: the masked half skipped
    (["train.checkpointing=full"], "full recomputation included"),
    (["train.checkpointing=selective"], "selective recomputation included"),
])
def test_the_summary_says_recomputation_only_where_the_run_recomputed(overrides, said, capsys):
    """The MFU line's hardware share names what the devices recomputed (report.json's flops.recomputation,
    train.checkpointing), never recomputation on a run without it."""
    from simtrain.views import print_summary

    scenario = load_scenario(LLAMA, ["numerics=false", "train.steps=1", *overrides])
    data = simtrain.run(scenario).data
    assert data["flops"]["recomputation"] == scenario.train.checkpointing
    assert data["flops"]["device_flops_utilization"] != data["flops"]["mfu"]
    print_summary(data)
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "│ MFU" in line]
    assert f"(devices ran {data['flops']['device_flops_utilization']:.1%} of peak, {said})" in line
    assert ("recomputation" in line) == (scenario.train.checkpointing != "none")


def test_palm_closed_form_is_what_torch_counts_for_the_gpt():
    """6N + 12LHQT per token equals the FLOP counter's forward + backward of the model (no checkpointing)."""
    layers, width, heads, vocab, seq_len, batch = 3, 48, 4, 96, 16, 2
    with torch.device("meta"):
        model = build_gpt(vocab, seq_len, width, layers, heads)
    tokens = torch.empty((batch, seq_len), dtype=torch.long, device="meta")
    cost = measure_step_cost(model, tokens, tokens)
    assert cost.forward_flops + cost.backward_flops == batch * gpt_flops_per_sequence(layers, width, vocab, seq_len)


@pytest.mark.parametrize("row", ["gpt-3.6b", "gpt-7.5b"])
def test_tflops_per_gpu_agrees_with_bench_megatron_lm_table1(row):
    """bench/megatron_lm_table1.py divides Narayanan et al.'s step FLOPs, 96·B·s·l·h²·(1 + s/6h + V/16lh), which
    count every layer's forward a second time (full recomputation), by the step time. The report's model
    FLOPs leave that recomputed forward out: 72·B·s·l·h²·(1 + s/6h + V/12lh). The FLOPs its devices ran
    are the paper's plus the language head's recomputed forward, 2·B·s·h·V (simtrain recomputes whole
    chunks, the head's included)."""
    scenario = load_scenario(bench.SCENARIOS / f"{row}.yaml")
    bench_tflops, _ = bench.TABLE.simulate(row)
    data = simtrain.run(scenario).data
    flops = data["flops"]
    layout = scenario.parallel
    batch = scenario.data.batch_size * scenario.cluster.devices // (layout.pp * layout.tp)
    s, l, h, vocab = scenario.data.seq_len, scenario.model.layers, scenario.model.width, scenario.data.vocab
    paper = bench.model_flops(scenario)
    model = 72 * batch * s * l * h**2 * (1 + s / (6 * h) + vocab / (12 * l * h))
    assert flops["model_flops_per_step"] == pytest.approx(model, rel=1e-12)
    assert flops["tflops_per_device"] == pytest.approx(bench_tflops * model / paper, rel=1e-12)
    head_recomputed = 2 * batch * s * h * vocab
    assert flops["device_tflops_per_device"] == pytest.approx(bench_tflops * (paper + head_recomputed) / paper,
                                                              rel=1e-12)
    assert flops["mfu"] == pytest.approx(flops["tflops_per_device"] / 312, rel=1e-12)  # A100 fp16 peak
