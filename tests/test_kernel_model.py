"""The kernel compute model (`cluster.compute_model: kernels`): a GEMM at the share of its tiles' waves its
result fills, fused attention at its generation's published fraction of peak, every other kernel as the roofline.

The calibration rule (issue 52): one fitted figure per GPU generation, which its row reproduces and every shipped
scenario of that generation takes.

References: tile and wave quantization counted by hand (NVIDIA's Matrix Multiplication Background User's Guide,
sections 3.1 and 3.2: a tile the result does not fill and a wave the tiles do not fill cost a whole one), the
roofline's closed forms for the same operators, FlashAttention's FLOPs over its published rate, and a GPT step
charged per operator by hand from the operators torch dispatched.
"""
import math
from pathlib import Path

import pytest
import simpy
import torch
import yaml
from torch import nn

import simtrain
import simtrain.dist
from simtrain.cost import measure_step_cost
from simtrain.hw.catalog import CALIBRATED, CATALOG, resolve_device
from simtrain.hw.device import Device
from simtrain.hw.eventlog import EventLog
from simtrain.hw.kernel_model import TILE, filled
from simtrain.op_cost import OperatorRecorder
from simtrain.scenario import load_scenario, validate_scenario
from simtrain.train.fused_attention import flash_attention, forward_flops

from refusals import refusal

H100 = CATALOG["h100-80gb"]
SMS = H100.streaming_multiprocessors  # 132
BF16_RATE = H100.peak_flops["bf16"] * H100.efficiency
BYTES_RATE = H100.memory_bandwidth * H100.efficiency


def device(compute_model: str = "kernels", spec=H100) -> Device:
    return Device(simpy.Environment(), 0, "gpu0", spec, EventLog(), compute_model=compute_model)


def test_a_result_of_exactly_one_wave_of_whole_tiles_fills_it():
    rows, columns = TILE
    assert filled(rows * 12, columns * 11, 1, SMS) == 1.0  # 132 tiles of 256 x 128 on 132 SMs
    assert filled(columns * 11, rows * 12, 1, SMS) == 1.0  # the same, the tile turned
    assert filled(rows, columns, SMS, SMS) == 1.0  # a batch of 132 one-tile results


def test_one_tile_more_than_the_sms_takes_a_second_wave():
    rows, columns = TILE
    # 133 tiles: two waves of 132 tile-slots, 133 of them used
    assert filled(rows * 133, columns, 1, SMS) == pytest.approx(133 / 264, rel=1e-15)


def test_a_side_one_element_past_a_tile_computes_a_whole_edge_tile():
    # 257 x 128: 2 tiles of 256 rows (the second holding 1 row) or 3 x 1 of 128 x 256 (the tile turned), one wave
    assert filled(257, 128, 1, SMS) == pytest.approx(257 * 128 / (SMS * 256 * 128), rel=1e-15)
    # 4096 x 4096: 16 x 32 = 512 tiles, 4 waves of 132 = 528 slots
    assert filled(4096, 4096, 1, SMS) == pytest.approx(512 / 528, rel=1e-15)
    assert filled(4096, 4096, 1, None) == 1.0  # no SM count: no quantization


def test_a_linear_layer_takes_its_gemm_at_the_share_its_waves_fill():
    m, k, n = 4096, 4096, 4224  # 16 x 33 = 528 tiles of 256 x 128: 4 full waves on 132 SMs
    layer = nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device="meta")
    x = torch.empty(m, k, dtype=torch.bfloat16, device="meta")
    with OperatorRecorder() as recorder:
        layer(x)
    ops, flops = recorder.take(), recorder.flops
    assert ops[0][4] == ("gemm", m, n, 1)
    assert device().compute_time(flops, "bf16", ops) == pytest.approx(2 * m * k * n / BF16_RATE, rel=1e-12)
    # one row more: a 17th row of tiles, 544 tiles (561 = 132 x 4 + 16: five waves)
    layer_x = torch.empty(m + 1, k, dtype=torch.bfloat16, device="meta")
    with OperatorRecorder() as recorder:
        layer(layer_x)
    waves = math.ceil(17 * 33 / SMS)
    assert waves == 5
    share = (m + 1) * n / (waves * SMS * 256 * 128)
    assert device().compute_time(recorder.flops, "bf16", recorder.take()) == pytest.approx(
        2 * (m + 1) * k * n / (BF16_RATE * share), rel=1e-12)
    # the roofline charges the same GEMM its FLOPs at peak x efficiency, however its waves fall
    assert device("roofline").compute_time(flops, "bf16", ops) == pytest.approx(2 * m * k * n / BF16_RATE,
                                                                                rel=1e-12)


def test_a_memory_bound_kernel_is_charged_as_the_roofline_charges_it():
    x = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
    with OperatorRecorder() as recorder:
        torch.nn.functional.gelu(x)
    ops = recorder.take()
    assert ops == ((0.0, 2.0 * 2 * 4096 * 4096, 1, "", ()),)
    assert device().compute_time(0, "bf16", ops) == device("roofline").compute_time(0, "bf16", ops)
    assert device().compute_time(0, "bf16", ops) == pytest.approx(4 * 4096 * 4096 / BYTES_RATE, rel=1e-12)


def test_fused_attention_runs_at_its_generations_published_fraction_of_peak():
    batch, heads, length, width = 2, 16, 8192, 128
    q, k, v = (torch.empty(batch, heads, length, width, dtype=torch.bfloat16, device="meta") for _ in range(3))
    with OperatorRecorder() as recorder:
        flash_attention(q, k, v)
    ops = recorder.take()
    flops = forward_flops(q.shape, k.shape, v.shape, True)
    assert ops[0][4] == ("attention",)
    rates = {"h100-80gb": 989.5e12 * 0.75, "a100-80gb": 312e12 * 0.73,  # FlashAttention-3's 75%, -2's 73%
             "b200-180gb": 2250e12 * CATALOG["b200-180gb"].efficiency}  # none published: the efficiency
    for name, rate in rates.items():
        assert device(spec=CATALOG[name]).compute_time(flops, "bf16", ops) == pytest.approx(flops / rate,
                                                                                           rel=1e-12), name


def gpt(compute_model: str) -> dict:
    """A small fp32 gpt on one H100, the batch in one pass: its attention scores a batched GEMM (heads x batch)."""
    return {"name": "gpt", "seed": 0,
            "cluster": {"topology": "ring", "devices": 1, "device": "h100-80gb", "compute_model": compute_model},
            "model": {"name": "gpt", "hidden": 64, "layers": 2, "heads": 4},
            "data": {"name": "tokens", "batch_size": 8, "seq_len": 32, "vocab": 64, "samples": 256},
            "train": {"steps": 2, "optimizer": {"name": "sgd", "lr": 0.1}}}


def test_a_gpt_steps_compute_is_its_operators_charged_one_by_one():
    kernels, roofline = (simtrain.run(validate_scenario(gpt(model))) for model in ("kernels", "roofline"))
    tokens = torch.zeros(8, 32, dtype=torch.long)
    cost = measure_step_cost(kernels.final_models[0], tokens, tokens)
    fp32_rate = H100.peak_flops["fp32"] * H100.efficiency
    excess, shapes = 0.0, set()
    for flops, nbytes, count, rate, kernel in cost.forward_ops + cost.backward_ops:
        share = 1.0
        if kernel:
            assert kernel[0] == "gemm" and rate == "fp32"
            shapes.add(kernel)
            share = filled(*kernel[1:], SMS)
        excess += count * (max(flops / (fp32_rate * share), nbytes / BYTES_RATE)
                           - max(flops / fp32_rate, nbytes / BYTES_RATE))
    assert ("gemm", 32, 32, 8 * 4) in shapes  # the scores: a (32 x 32) result per sequence and head
    compute = kernels.data["breakdown_s"]["compute"] - roofline.data["breakdown_s"]["compute"]  # a step's
    assert excess > 0 and compute == pytest.approx(excess, rel=1e-9)


# --- one calibration per GPU generation ---

ROOT = Path(__file__).resolve().parent.parent


def shipped_devices():
    """(file, its cluster.device) of every shipped scenario."""
    for path in sorted((ROOT / "scenarios").rglob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        if isinstance(raw, dict) and isinstance(raw.get("cluster"), dict):
            yield path.relative_to(ROOT), raw["cluster"].get("device")


def test_no_shipped_scenario_fits_a_figure_of_its_own_for_a_calibrated_generation():
    """The calibration rule: a generation with a fitted figure takes it (`calibrated`) in every shipped scenario;
    none gives an efficiency of its own for a part of that generation."""
    seen = 0
    for path, device in shipped_devices():
        if isinstance(device, dict) and CATALOG[device["base"]].generation in CALIBRATED:
            assert device.get("efficiency", "calibrated") == "calibrated", path
            seen += device.get("efficiency") == "calibrated"
    assert seen >= 22  # the Megatron-LM A100 and Megatron-Core H100 tables, the Llama 3 405B steps


def test_the_hopper_figure_is_the_fit_of_its_row():
    """The one fitted Hopper figure gives its row, Megatron-Core's 1.7B on 48 H100s, its published 408.8 TFLOP/s
    per GPU (Megatron-LM's README): 72 B s l h² (1 + s/(6h) + V/(12 l h)) FLOPs a step, over the step's time."""
    scenario = load_scenario(ROOT / "scenarios" / "megatron-core-h100" / "gpt-1.7b.yaml")
    assert resolve_device(scenario.cluster.device).efficiency == CALIBRATED["hopper"].efficiency
    assert scenario.cluster.compute_model == CALIBRATED["hopper"].compute_model == "kernels"
    step_s = simtrain.run(scenario).data["loss_curve"][-1][0]
    batch, s, layers, h, vocab = 4 * 48, 4096, 24, 2048, 131072
    flops = 72 * batch * s * layers * h**2 * (1 + s / (6 * h) + vocab / (12 * layers * h))
    assert flops / step_s / 48 / 1e12 == pytest.approx(408.8, rel=5e-4)


@pytest.mark.parametrize("cluster,expected", [
    ({"device": {"base": "b200-180gb", "efficiency": "calibrated"}, "compute_model": "kernels"},
     "cluster.device.efficiency: calibrated: no published row of b200-180gb's generation (blackwell) has been "
     "fitted; give a number (fitted: ampere, hopper)"),
    ({"device": {"base": "h100-80gb", "efficiency": "calibrated"}, "compute_model": "roofline"},
     "cluster.device.efficiency: calibrated: the hopper figure was fitted under compute_model: kernels, not "
     "roofline; set that or give a number"),
    ({"device": {"base": "a100-80gb", "efficiency": "calibrated"}, "compute_model": "kernels"},
     "cluster.device.efficiency: calibrated: the ampere figure was fitted under compute_model: roofline, not "
     "kernels"),
    ({"device": {"base": "h100-80gb", "efficiency": "Calibrated"}, "compute_model": "kernels"},
     "cluster.device.efficiency: expected a number or calibrated, got 'Calibrated'"),
    ({"device": {"name": "mine", "memory": "8 GiB", "memory_bandwidth": "1 TB/s", "efficiency": "calibrated",
                 "peak_flops": {"fp32": 1e12, "tf32": 1e12, "fp16": 1e12, "bf16": 1e12}}},
     "cluster.device.efficiency: calibrated needs a base part (whose GPU generation was fitted)"),
])
def test_a_calibrated_efficiency_without_a_fit_is_one_line(tmp_path, capsys, cluster, expected):
    raw = {"name": "t", "numerics": False, "cluster": {"devices": 2, **cluster},
           "model": {"name": "gpt", "hidden": 64, "layers": 2, "heads": 4},
           "data": {"name": "tokens", "batch_size": 4, "seq_len": 32, "vocab": 64}}
    assert expected in refusal(tmp_path, capsys, raw)


def test_calibrated_resolves_to_the_generations_figure_for_every_part_of_it():
    for name, spec in CATALOG.items():
        if spec.generation in CALIBRATED:
            tweaked = resolve_device({"base": name, "efficiency": "calibrated"})
            assert tweaked.efficiency == CALIBRATED[spec.generation].efficiency
            assert tweaked.peak_flops == spec.peak_flops


def test_a_step_on_a_calibrated_device_carries_its_calibrations_error_bar():
    """step_time_error: the step time times the root mean square of the Hopper calibration's errors on the
    published rows it was not fitted on; a device of its own efficiency has none."""
    raw = gpt("kernels")
    raw["cluster"]["device"] = {"base": "h100-80gb", "efficiency": "calibrated"}
    data = simtrain.run(validate_scenario(raw)).data
    residuals = CALIBRATED["hopper"].residuals
    relative = math.sqrt(sum(error**2 for error in residuals) / len(residuals))
    assert data["step_time_error"] == {"seconds": pytest.approx(data["step_time_s"] * relative, rel=1e-12),
                                       "relative": pytest.approx(relative, rel=1e-12), "generation": "hopper",
                                       "rows": 8}
    assert 0.03 < relative < 0.04
    assert "step_time_error" not in simtrain.run(validate_scenario(gpt("kernels"))).data


@pytest.mark.parametrize("compute_model", ["flops", "roofline", "kernels"])
def test_users_code_is_charged_under_the_clusters_compute_model(tmp_path, compute_model):
    """simtrain.dist charges a rank's operators as a scenario's are: one GEMM of a 4,097 x 4,224 result (17 x 33 =
    561 tiles of 256 x 128, five waves on 132 SMs) costs its FLOPs at the rate, the roofline's max with its
    bytes, or the kernel model's share of its waves."""
    m, k, n = 4097, 4096, 4224
    path = tmp_path / "gemm.yaml"
    path.write_text(yaml.safe_dump({
        "name": "gemm", "cluster": {"topology": "ring", "devices": 1, "compute_model": compute_model,
                                    "device": {"base": "h100-80gb", "efficiency": 0.5}}}))

    def one_gemm(rank, world):
        torch.empty(m, k, dtype=torch.bfloat16) @ torch.empty(k, n, dtype=torch.bfloat16)

    compute_s = simtrain.dist.spawn(one_gemm, scenario=path, numerics=False).report.data["devices"][0]["compute_s"]
    rate, bytes_rate = 989.5e12 * 0.5, 3.35e12 * 0.5
    arithmetic, memory = 2 * m * k * n / rate, 2 * (m * k + k * n + m * n) / bytes_rate
    expected = {"flops": arithmetic, "roofline": max(arithmetic, memory),
                "kernels": max(arithmetic / (m * n / (5 * SMS * 256 * 128)), memory)}
    assert compute_s == pytest.approx(expected[compute_model], rel=1e-12)
    assert (expected["kernels"] > expected["roofline"]) and arithmetic > memory
