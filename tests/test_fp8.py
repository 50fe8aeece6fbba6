"""fp8 training (train/fp8.py) and the H100 generation's catalog entries.

- Rounding: the float8 casts against a reference that rounds to the nearest value of the format's
  grid (every one of its 256 bit patterns, decoded), ties to an even mantissa, past the largest
  value saturated; the Float8Linear's forward and both backward GEMMs against that rounding and
  the scales written out, computed in float64.
- Training: a small llama in fp8 and in bf16 on the same run: loss curves close, not identical.
- Time: on every catalog part, a step's Linear GEMMs cost their FLOPs (PaLM's 6N per token) over
  the part's rate for the run's precision, fp8 included, and attention's batched matmuls theirs
  (PaLM's 12·L·h·T per token) over its bf16 rate, in fp8 too (torchao leaves them in bf16).
- Bad input: fp8 on a device without an fp8 rate, one line naming train.precision, exit 2.
"""
import pytest
import torch

from simtrain import run
from simtrain.hw.catalog import CATALOG, resolve_device
from simtrain.hw.cluster import build_cluster, run_to_end
from simtrain.job import Job
from simtrain.scenario import validate_scenario
from simtrain.train.fp8 import Float8Linear, convert_to_float8_, restore_linears_, to_float8
from simtrain.train.model_flops import llama_flops_per_sequence

from refusals import refusal

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def grid(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite value of the float8 `dtype` (float64) and whether its mantissa's last bit is 0."""
    bits = torch.arange(256, dtype=torch.uint8)
    values = bits.view(dtype).double()
    finite = torch.isfinite(values)
    return values[finite], (bits[finite] & 1) == 0


def round_to_grid(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (float64) rounded to the nearest value of `dtype`, ties to the even mantissa, saturated."""
    values, even = grid(dtype)
    largest = values.max()
    x = x.clamp(-largest, largest).flatten()
    distance = (x[:, None] - values[None, :]).abs()
    nearest = distance.min(dim=1, keepdim=True).values
    candidates = distance == nearest
    prefer_even = candidates & even[None, :]
    chosen = torch.where(prefer_even.any(dim=1, keepdim=True), prefer_even, candidates).double().argmax(dim=1)
    return values[chosen].reshape(x.shape)


def reference_cast(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """(t · scale rounded to `dtype`'s grid, scale) with scale = max / amax, all in float64."""
    t = t.double()
    scale = float(torch.tensor(torch.finfo(dtype).max / t.abs().max().item(), dtype=torch.float32))
    return round_to_grid(t * scale, dtype).reshape(t.shape), scale


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_casts_round_to_the_nearest_value_ties_to_even(dtype):
    torch.manual_seed(0)
    x = torch.randn(4096) * 3
    x[0] = x.abs().max() * 2  # the amax: scaled exactly to the largest value
    cast, scale = to_float8(x, dtype)
    expected, expected_scale = reference_cast(x, dtype)
    assert float(scale) == expected_scale
    assert torch.equal(cast.double(), expected)
    assert cast.double().abs().max() == torch.finfo(dtype).max


def test_ties_go_to_the_even_mantissa_and_overflow_saturates():
    # e4m3 near 1: spacing 1/8. 1 + 1/16 lies between 1 (mantissa 000) and 1.125 (001): to 1.
    values = torch.tensor([1 + 1 / 16, 1.125 + 1 / 16, 1000.0, -1000.0], dtype=torch.float64)
    assert torch.equal(round_to_grid(values, E4M3), torch.tensor([1.0, 1.25, 448.0, -448.0], dtype=torch.float64))
    assert torch.equal(values[:2].float().to(E4M3).double(), torch.tensor([1.0, 1.25], dtype=torch.float64))


def layer_and_input(bias: bool):
    torch.manual_seed(1)
    layer = torch.nn.Linear(24, 40, bias=bias).to(torch.bfloat16)
    convert_to_float8_(layer)
    x = (torch.randn(3, 5, 24) * 2).to(torch.bfloat16).requires_grad_()
    return layer, x


@pytest.mark.parametrize("bias", [False, True])
def test_forward_is_the_float8_gemm_of_the_rounded_operands(bias):
    layer, x = layer_and_input(bias)
    assert type(layer) is Float8Linear
    x8, sx = reference_cast(x.detach().reshape(15, 24), E4M3)
    w8, sw = reference_cast(layer.weight.detach(), E4M3)
    expected = ((x8 @ w8.t()) / (sx * sw)).to(torch.bfloat16).reshape(3, 5, 40)
    if bias:
        expected = expected + layer.bias.detach()
    out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=0)  # one bf16 rounding apart
    plain = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert not torch.equal(out, plain)  # the float8 rounding is there


def test_backward_casts_the_output_gradient_to_e5m2():
    layer, x = layer_and_input(False)
    torch.manual_seed(2)
    grad_output = (torch.randn(3, 5, 40) * 1e-3).to(torch.bfloat16)
    layer(x).backward(grad_output)
    g8, sg = reference_cast(grad_output.reshape(15, 40), E5M2)
    x8, sx = reference_cast(x.detach().reshape(15, 24), E4M3)
    w8, sw = reference_cast(layer.weight.detach(), E4M3)
    grad_input = ((g8 @ w8) / (sg * sw)).to(torch.bfloat16).reshape(3, 5, 24)
    grad_weight = ((g8.t() @ x8) / (sg * sx)).to(torch.bfloat16)
    torch.testing.assert_close(x.grad.float(), grad_input.float(), rtol=2**-7, atol=0)
    torch.testing.assert_close(layer.weight.grad.float(), grad_weight.float(), rtol=2**-7, atol=0)


def test_conversion_keeps_the_parameters_and_goes_back():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    before = [id(p) for p in model.parameters()]
    convert_to_float8_(model)
    assert [type(m) for m in model] == [Float8Linear, torch.nn.ReLU, Float8Linear]
    assert [id(p) for p in model.parameters()] == before
    restore_linears_(model)
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]


# ---------------------------------------------------------------- training and time

LLAMA = {"name": "fp8", "seed": 4, "cluster": {"devices": 1, "device": "h100-80gb"},
         "model": {"name": "llama", "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2},
         "data": {"name": "tokens", "batch_size": 16, "samples": 512, "seq_len": 16, "vocab": 32},
         "train": {"steps": 60, "optimizer": {"name": "adam", "lr": 3e-3}}, "report": {"trace": False, "every": 20}}


def with_precision(precision: str, **changes) -> dict:
    return {**LLAMA, **changes, "train": {**LLAMA["train"], "precision": precision}}


def test_fp8_trains_as_bf16_does_within_a_small_gap():
    fp8 = run(validate_scenario(with_precision("fp8")))
    bf16 = run(validate_scenario(with_precision("bf16")))
    fp8_losses = [loss for _, loss in fp8.data["loss_curve"]]
    bf16_losses = [loss for _, loss in bf16.data["loss_curve"]]
    assert fp8.data["amp"]["precision"] == "fp8"
    assert fp8_losses != bf16_losses  # the float8 rounding changes the run
    assert bf16_losses[-1] < 0.8 * bf16_losses[0]  # it learns
    gap = max(abs(a - b) for a, b in zip(fp8_losses, bf16_losses))
    assert gap < 0.05 * bf16_losses[0]
    assert abs(fp8.data["final_loss"] - bf16.data["final_loss"]) < 0.02 * bf16.data["final_loss"]


def one_step(raw: dict) -> Job:
    scenario = validate_scenario(raw)
    cluster = build_cluster(scenario.cluster, record=True, seed=scenario.seed)
    job = Job(scenario, cluster, range(cluster.size))
    job.start()
    run_to_end(cluster.env)
    return job


@pytest.mark.parametrize("device", ["h100-80gb", "h200-141gb", "b200-180gb"])
@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_gemms_cost_their_flops_at_the_parts_rate(device, precision):
    raw = with_precision(precision, cluster={"devices": 1, "device": device}, numerics=False)
    raw["train"] = {**raw["train"], "steps": 1}
    job = one_step(raw)
    spans = {span.name: span.end - span.start for span in job.cluster.log.spans if span.kind == "compute"}
    per_sequence = llama_flops_per_sequence(2, 64, 4, 2, 256, 32, 16)  # ffn: Llama's rule for width 64
    attention = 12 * 2 * 64 * 16 * 16  # 12·L·h·T per token, T tokens
    spec = CATALOG[device]
    linear_rate, attention_rate = (spec.peak_flops[dtype] * spec.efficiency for dtype in (precision, "bf16"))
    sequence_s = (per_sequence - attention) / linear_rate + attention / attention_rate
    assert spans["forward"] == pytest.approx(16 * sequence_s / 3, rel=1e-12)
    assert spans["backward"] == pytest.approx(16 * sequence_s * 2 / 3, rel=1e-12)


def test_catalog_entries_load_with_their_fp8_rates():
    for name in ("h100-80gb", "h200-141gb", "b200-180gb"):
        spec = resolve_device(name)
        assert spec.peak_flops["fp8"] == 2 * spec.peak_flops["bf16"]  # fp8 tensor cores: twice bf16's rate
        assert spec.nvlink_bandwidth is not None
    assert "fp8" not in CATALOG["a100-40gb"].peak_flops
    assert resolve_device({"base": "a100-40gb", "peak_flops": {"fp8": "600 TFLOP/s"}}).peak_flops["fp8"] == 600e12


@pytest.mark.parametrize("cluster,expected", [
    ({"devices": 1, "device": "a100-40gb"}, "train.precision: fp8 needs devices with an fp8 rate; a100-40gb has "
                                            "none"),
    ({"devices": 2, "device": "h100-80gb", "overrides": {1: {"device": "v100-16gb"}}}, "v100-16gb has none"),
])
def test_fp8_without_an_fp8_rate_is_one_line_and_exit_2(tmp_path, capsys, cluster, expected):
    assert expected in refusal(tmp_path, capsys, with_precision("fp8", cluster=cluster))
