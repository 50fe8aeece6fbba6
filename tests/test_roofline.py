"""The roofline compute model (`cluster.compute_model: roofline`): every operator takes the slower of its
arithmetic and its memory traffic.

References: closed forms of the roofline (Williams, Waterman and Patterson 2009) for a GEMM, a LayerNorm
and a GELU, with FLOPs and bytes counted by hand; the `flops` model's own runs (the default, unchanged);
the numerics-on run of the same scenario; and the per-operator sum of max(0, memory time - arithmetic time)
for a whole GPT step.
"""
import json

import pytest
import simpy
import torch
import torch.nn.functional as F
from torch import nn

import simtrain
from simtrain.cost import measure_step_cost
from simtrain.errors import ScenarioError
from simtrain.hw.catalog import CATALOG
from simtrain.hw.device import Device
from simtrain.hw.eventlog import EventLog
from simtrain.op_cost import OperatorRecorder
from simtrain.scenario import validate_scenario

A100 = CATALOG["a100-40gb"]
FLOPS_FP16 = A100.peak_flops["fp16"] * A100.efficiency
FLOPS_FP32 = A100.peak_flops["fp32"] * A100.efficiency
BYTES_RATE = A100.memory_bandwidth * A100.efficiency


def device(compute_model: str = "roofline") -> Device:
    return Device(simpy.Environment(), 0, "gpu0", A100, EventLog(), compute_model=compute_model)


def measured(function, *inputs):
    """The FLOPs and the OpCosts the operator recorder records for `function(*inputs)`."""
    with OperatorRecorder() as recorder:
        function(*inputs)
    return float(recorder.flops), recorder.take()


@pytest.mark.parametrize("m,k,n,bound", [(64, 64, 64, "memory"), (4096, 4096, 4096, "compute")])
def test_a_linear_layer_takes_the_slower_of_its_flops_and_its_bytes(m, k, n, bound):
    layer = nn.Linear(k, n, dtype=torch.float16, device="meta")
    x = torch.empty(m, k, dtype=torch.float16, device="meta")
    flops, ops = measured(layer, x)
    # one addmm (the transposed weight is a view): reads x, W and the bias, writes y; 2 bytes an element
    arithmetic = 2 * m * k * n / FLOPS_FP16
    memory = (m * k + k * n + n + m * n) * 2 / BYTES_RATE
    # at fp16's FLOP rate, as a GEMM of an m x n result
    assert ops == ((2.0 * m * k * n, (m * k + k * n + n + m * n) * 2.0, 1, "fp16", ("gemm", m, n, 1)),)
    assert device().compute_time(flops, "fp16", ops) == pytest.approx(max(arithmetic, memory), rel=1e-12)
    assert (memory > arithmetic) == (bound == "memory")
    assert device("flops").compute_time(flops, "fp16", ops) == pytest.approx(arithmetic, rel=1e-12)
    # on the SMs a communication kernel holding 16 of the A100's 108 leaves (strategies/tp_overlap.py), either model
    for model, seconds in (("roofline", max(arithmetic, memory)), ("flops", arithmetic)):
        assert device(model).compute_time(flops, "fp16", ops, sm_margin=16) == pytest.approx(seconds * 108 / 92,
                                                                                             rel=1e-12)


def test_layer_norm_and_gelu_take_their_bytes_over_the_bandwidth():
    rows, width = 512, 1024
    x = torch.empty(rows, width, device="meta")
    norm = nn.LayerNorm(width, device="meta")
    # native_layer_norm reads x, the weight and the bias, writes y and each row's mean and 1/std (fp32)
    flops, ops = measured(norm, x)
    nbytes = (rows * width + 2 * width + rows * width + 2 * rows) * 4
    assert flops == 0 and ops == ((0.0, float(nbytes), 1, "", ()),)  # no FLOPs: no rate of its own, no GEMM
    assert device().compute_time(flops, "fp32", ops) == pytest.approx(nbytes / BYTES_RATE, rel=1e-12)
    # gelu reads x and writes y
    flops, ops = measured(F.gelu, x)
    assert ops == ((0.0, 2.0 * rows * width * 4, 1, "", ()),)
    assert device().compute_time(flops, "fp32", ops) == pytest.approx(2 * rows * width * 4 / BYTES_RATE, rel=1e-12)


def test_views_move_no_bytes_and_a_broadcast_input_is_read_once():
    x = torch.empty(8, 16, device="meta")
    bias = torch.empty(16, device="meta")
    _, ops = measured(lambda t: t.reshape(16, 8).t().unsqueeze(0).expand(4, 8, 16).detach()[1:, 2], x)
    assert ops == ()
    _, ops = measured(lambda t, b: t + b.expand(8, 16), x, bias)
    assert ops == ((0.0, (8 * 16 + 16 + 8 * 16) * 4.0, 1, "", ()),)


def run(raw: dict, compute_model: str | None = None, numerics: bool = True) -> dict:
    cluster = dict(raw["cluster"], **({"compute_model": compute_model} if compute_model else {}))
    return simtrain.run(validate_scenario({**raw, "cluster": cluster, "numerics": numerics})).data


QUICKSTART = {"name": "quickstart", "seed": 0, "cluster": {"topology": "ring", "devices": 4},
              "model": {"name": "mlp", "hidden": [128, 128]}, "data": {"name": "digits", "batch_size": 32},
              "train": {"steps": 5, "optimizer": {"name": "sgd", "lr": 0.1}}}


def gpt(devices: int = 8, steps: int = 2, **parallel) -> dict:
    """A small gpt; 256 samples, of which the loss curve evaluates the training part after the last step."""
    return {"name": "gpt", "seed": 0, "cluster": {"topology": "ring", "devices": devices},
            "model": {"name": "gpt", "hidden": 64, "layers": 2, "heads": 4},
            "data": {"name": "tokens", "batch_size": 8, "seq_len": 32, "vocab": 64, "samples": 256},
            "train": {"steps": steps, "optimizer": {"name": "sgd", "lr": 0.1}},
            "parallel": {"pipeline": {"microbatches": 2}, **parallel}}


def figures(data: dict) -> str:
    return json.dumps({key: value for key, value in data.items() if key != "wall_time_s"}, sort_keys=True)


@pytest.mark.parametrize("raw", [QUICKSTART, gpt(pp=2, tp=2)], ids=["quickstart", "gpt pp=2 tp=2"])
def test_the_flops_model_is_the_default_and_moves_no_figure(raw):
    default, flops = run(raw, numerics=False), run(raw, "flops", numerics=False)
    assert figures(flops) == figures(default)
    assert run(raw, "roofline", numerics=False)["step_time_s"] > default["step_time_s"]


@pytest.mark.parametrize("raw", [gpt(devices=2), gpt(pp=2, tp=2)], ids=["gpt dp=2", "gpt pp=2 tp=2"])
def test_roofline_times_are_the_same_with_numerics_on_and_off(raw):
    on, off = run(raw, "roofline"), run(raw, "roofline", numerics=False)
    for key in ("step_time_s", "sim_time_s", "breakdown_s", "per_device"):
        assert json.dumps(off.get(key), sort_keys=True) == json.dumps(on.get(key), sort_keys=True), key


@pytest.mark.parametrize("devices", [1, 2])
def test_a_roofline_step_is_slower_by_its_memory_bound_operators_excess(devices):
    """Two devices: the backward is charged in pieces between DDP's bucket all-reduces, each its share. The batch
    of 8 runs as its 2 micro-batches of 4 (gradient accumulation), each charged its own operators."""
    raw = gpt(devices=devices, steps=3)
    roofline, flops = run(raw, "roofline"), run(raw, "flops")
    model = simtrain.run(validate_scenario(raw)).final_models[0]
    microbatches = raw["parallel"]["pipeline"]["microbatches"]
    tokens = torch.zeros(8 // microbatches, 32, dtype=torch.long)
    cost = measure_step_cost(model, tokens, tokens)
    ops = cost.forward_ops + cost.backward_ops
    assert sum(f * count for f, _, count, *_ in ops) == cost.forward_flops + cost.backward_flops
    excess = microbatches * sum(count * max(0.0, nbytes / BYTES_RATE - f / FLOPS_FP32)
                                for f, nbytes, count, *_ in ops)
    assert excess > 0
    compute = roofline["breakdown_s"]["compute"] - flops["breakdown_s"]["compute"]
    assert compute == pytest.approx(excess, rel=1e-9)
    if devices == 1:
        assert roofline["step_time_s"] - flops["step_time_s"] == pytest.approx(excess, rel=1e-9)


def test_an_unknown_compute_model_is_a_one_line_error():
    with pytest.raises(ScenarioError, match="cluster.compute_model: Input should be 'flops', 'roofline' or 'kernels'"):
        validate_scenario({"name": "t", "cluster": {"devices": 2, "compute_model": "rofline"}})
