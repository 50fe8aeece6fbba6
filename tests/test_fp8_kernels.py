"""What an fp8 Linear costs a device: the kernels a GPU runs (train/fp8_kernels.py), against closed forms.

- Kernels and bytes: one Float8Linear forward and backward of x (m, k) by a weight (n, k), bf16, is seen
  by the operator recorder as the kernels torchao's tensorwise recipe runs on a GPU, and nothing else:
  forward, a cast of x and one of w to e4m3 and one scaled GEMM; backward, a cast of the output's
  gradient to e5m2, casts of x and w again, and two scaled GEMMs. A cast of t elements reads 2t bytes
  (bf16) and writes t (float8) and its 4-byte scale; a GEMM of (a, b) by (b, c) reads a·b + b·c float8
  bytes and the two scales and writes 2·a·c (bf16), for 2·a·b·c FLOPs at the fp8 rate. The same with
  numerics off (meta tensors).
- Time: on an H100, that Linear takes, under the roofline, the sum over those kernels of
  max(FLOPs / fp8 rate, bytes / bandwidth); under the flops model, its FLOPs over the fp8 rate. Beside a
  bf16 batched matmul (attention's, which torchao leaves in bf16) in the same work, the batched matmul's
  FLOPs run at the bf16 rate under either model.
- A model: every Linear of a gpt runs in fp8, those whose bias the block adds itself (the output projection
  and the second MLP Linear) too: a step's FLOPs at the fp8 rate are PaLM's 6N per token (N the Linears'
  weights, 12·L·h² and the head's h·V), those at the bf16 rate attention's 12·L·h·T per token.
- A step: a gpt large enough for its GEMMs to be bound by arithmetic trains faster in fp8 than in bf16
  under the roofline, by less than the 2x of the fp8 peak over bf16's.
"""
import pytest
import simpy
import torch
from torch import nn

from simtrain import run
from simtrain.cost import measure_step_cost
from simtrain.hw.catalog import CATALOG
from simtrain.hw.device import Device
from simtrain.hw.eventlog import EventLog
from simtrain.op_cost import OperatorRecorder, merged
from simtrain.scenario import validate_scenario
from simtrain.train.fp8 import convert_to_float8_
from simtrain.train.gpt import Block, LanguageHead, TokenEmbedding

H100 = CATALOG["h100-80gb"]
FP8_RATE, BF16_RATE = (H100.peak_flops[dtype] * H100.efficiency for dtype in ("fp8", "bf16"))
BYTES_RATE = H100.memory_bandwidth * H100.efficiency
SCALE_BYTES = 4  # a float32 scale per cast tensor


def cast(elements: int) -> tuple:
    """A cast kernel of `elements` bf16 elements to float8: reads 2 bytes each, writes 1 and the scale."""
    return (0.0, float(2 * elements + elements + SCALE_BYTES), 1, "", ())


def gemm(a: int, b: int, c: int) -> tuple:
    """A scaled GEMM of float8 (a, b) by (b, c) into bf16 (a, c): its FLOPs at the fp8 rate."""
    return (2.0 * a * b * c, float(a * b + b * c + 2 * SCALE_BYTES + 2 * a * c), 1, "fp8", ("gemm", a, c, 1))


def linear_ops(m: int, k: int, n: int, device: str) -> tuple:
    """The recorder's (forward, backward) OpCosts and FLOPs of a Float8Linear (n, k) on x (m, k), bf16."""
    layer = nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device=device)
    convert_to_float8_(layer)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device).requires_grad_()
    with OperatorRecorder() as forward:
        out = layer(x)
    grad = torch.ones_like(out)
    with OperatorRecorder() as backward:
        out.backward(grad)
    return forward.take(), backward.take(), float(forward.flops + backward.flops)


@pytest.mark.parametrize("device", ["cpu", "meta"], ids=["numerics on", "numerics off"])
def test_the_recorder_sees_a_gpus_kernels_for_one_fp8_linear(device):
    m, k, n = 64, 32, 48
    forward, backward, flops = linear_ops(m, k, n, device)
    assert forward == tuple(sorted([cast(m * k), cast(n * k), gemm(m, k, n)]))
    # grad_input = g (m, n) @ w (n, k); grad_weight = gᵀ (n, m) @ x (m, k)
    assert backward == tuple(sorted([cast(m * n), cast(m * k), cast(n * k), gemm(m, n, k), gemm(n, m, k)]))
    assert flops == 3 * 2 * m * k * n


def device(compute_model: str) -> Device:
    return Device(simpy.Environment(), 0, "gpu0", H100, EventLog(), compute_model=compute_model)


@pytest.mark.parametrize("m,k,n", [(64, 32, 48), (8192, 4096, 4096)], ids=["memory-bound", "compute-bound"])
def test_an_fp8_linear_takes_its_kernels_roofline_on_an_h100(m, k, n):
    forward, backward, flops = linear_ops(m, k, n, "meta")
    kernels = [cast(m * k), cast(n * k), gemm(m, k, n), cast(m * n), cast(m * k), cast(n * k), gemm(m, n, k),
               gemm(n, m, k)]
    roofline = sum(max(f / FP8_RATE, nbytes / BYTES_RATE) for f, nbytes, *_ in kernels)
    ops = merged(forward, backward)
    assert device("roofline").compute_time(flops, "fp8", ops) == pytest.approx(roofline, rel=1e-12)
    assert device("flops").compute_time(flops, "fp8", ops) == pytest.approx(3 * 2 * m * k * n / FP8_RATE, rel=1e-12)


def test_attentions_batched_matmul_runs_at_the_bf16_rate_beside_fp8_gemms():
    m, k, n, heads, length, width = 4096, 2048, 2048, 16, 1024, 128
    forward, _, _ = linear_ops(m, k, n, "meta")
    q, keys = (torch.empty(heads, length, width, dtype=torch.bfloat16, device="meta") for _ in range(2))
    with OperatorRecorder() as recorder:
        torch.bmm(q, keys.transpose(1, 2))
    scores = recorder.take()
    scores_flops = 2.0 * heads * length * width * length
    scores_bytes = 2.0 * (2 * heads * length * width + heads * length * length)
    assert scores == ((scores_flops, scores_bytes, 1, "bf16", ("gemm", length, length, heads)),)
    ops, flops = merged(forward, scores), 2.0 * m * k * n + scores_flops
    expected = {"flops": 2 * m * k * n / FP8_RATE + scores_flops / BF16_RATE,
                "roofline": (sum(max(f / FP8_RATE, nbytes / BYTES_RATE) for f, nbytes, *_ in forward)
                             + max(scores_flops / BF16_RATE, scores_bytes / BYTES_RATE))}
    for model, seconds in expected.items():
        assert device(model).compute_time(flops, "fp8", ops) == pytest.approx(seconds, rel=1e-12), model


def test_every_linear_of_a_gpt_runs_its_flops_at_the_fp8_rate():
    layers, hidden, heads, vocab, batch, length = 2, 64, 4, 32, 3, 16
    with torch.device("meta"):
        model = nn.Sequential(TokenEmbedding(vocab, length, hidden), *(Block(hidden, heads) for _ in range(layers)),
                              LanguageHead(hidden, vocab)).to(torch.bfloat16)
    convert_to_float8_(model)
    tokens = torch.zeros(batch, length, dtype=torch.long, device="meta")
    cost = measure_step_cost(model, tokens, tokens)
    flops_by_rate = {}
    for flops, _, count, rate, _ in cost.forward_ops + cost.backward_ops:
        if flops:
            flops_by_rate[rate] = flops_by_rate.get(rate, 0.0) + flops * count
    linear_weights = 12 * layers * hidden**2 + hidden * vocab
    assert flops_by_rate == {"fp8": 6 * batch * length * linear_weights,
                             "bf16": 12 * layers * hidden * length * batch * length}


def gpt_step_s(precision: str) -> float:
    return run(validate_scenario({
        "name": "fp8-step", "seed": 0, "numerics": False,
        "cluster": {"devices": 1, "device": "h100-80gb", "compute_model": "roofline"},
        "model": {"name": "gpt", "hidden": 2048, "layers": 2, "heads": 16, "attention": "fused"},
        "data": {"name": "tokens", "batch_size": 8, "seq_len": 2048, "vocab": 8192},
        "train": {"steps": 1, "precision": precision, "optimizer": {"name": "adam", "lr": 1e-4}},
        "report": {"trace": False}})).data["step_time_s"]


def test_a_gpt_step_is_faster_in_fp8_than_in_bf16_under_the_roofline():
    fp8, bf16 = gpt_step_s("fp8"), gpt_step_s("bf16")
    assert bf16 / 2 < fp8 < bf16
