"""The combination matrix: every pair of the parallel dimensions and techniques that the support table lets run,
small, trains as one device does.

The features are test_support_table.py's examples (the keys that turn each on, the keys it needs), and a pipeline
under each schedule of its own (gpipe, 1f1b, interleaved, zero_bubble, dualpipev); `simtrain launch` is
tests/test_launch.py's (real gloo processes), and lost devices with a restart tests/test_recovery_layouts.py's.
A pair is one scenario of a gpt of width 16 (2 layers, 2 heads, 8 tokens a sequence, an MoE of 4 experts, top 2,
dropless, no balancing loss) trained 2 steps by SGD. Every pair the table does not refuse runs to its end, and:

- where both features keep fp32 arithmetic with numerics on, the trained parameters are those of the whole model
  in plain torch on one device, on the data-parallel ranks' batches together (test_expert_parallel.one_device),
  within 1e-5;
- in bf16, fp16 or fp8 the losses are finite; with numerics off (and representatives) every step takes time.
"""
import itertools
import math

import pytest

import simtrain
from simtrain.scenario import validate_scenario

from test_expert_parallel import assert_same_parameters, one_device
from test_support_table import EXAMPLES, Example, scenario_with, validation

SCHEDULES = {  # a pipeline under each schedule, beside test_support_table's "pp" (1f1b) and "split backward"
    "pp gpipe": Example({"parallel.pipeline.schedule": "gpipe"}, {"parallel.pp": 2}),
    "pp interleaved": Example({"parallel.pipeline.schedule": "interleaved", "parallel.pipeline.virtual_stages": 2},
                              {"parallel.pp": 2, "parallel.pipeline.microbatches": 4}),
    "pp dualpipev": Example({"parallel.pipeline.schedule": "dualpipev", "parallel.pipeline.virtual_stages": 2},
                            {"parallel.pp": 2, "parallel.pipeline.microbatches": 4}),
}
FEATURES = ["dp", "ZeRO 1", "ZeRO 2", "ZeRO 3", "HSDP", "offload", "tp", "sp", "cp", "pp", "split backward",
            *SCHEDULES, "ep", "bf16", "fp16", "fp8", "selective recomputation", "full recomputation",
            "gradient accumulation", "restart", "numerics off", "representatives"]
INEXACT = {"bf16", "fp16", "fp8", "numerics off", "representatives"}  # no fp32 numerics to compare
MOE = {"experts": 4, "top_k": 2, "capacity_factor": None, "aux_loss_coeff": 0.0}


def pair_scenario(pair, tmp_path) -> dict | None:
    """The scenario of the features `pair`, or None where their examples make no one scenario or the support
    table refuses them."""
    with pytest.MonkeyPatch.context() as patch:
        for name, example in SCHEDULES.items():  # the module's examples, with the schedules beside them
            patch.setitem(EXAMPLES, name, example)
        raw = scenario_with(pair)
    if raw is None or validation(raw, False, tmp_path)[0] is not None:
        return None
    raw["model"].update(hidden=16, heads=2, layers=2)
    if "moe" in raw["model"]:
        raw["model"]["moe"] = MOE
    raw["data"].update(seq_len=8, batch_size=4)
    raw["train"]["optimizer"] = {"name": "sgd", "lr": 0.1}
    return raw


@pytest.mark.parametrize("pair", list(itertools.combinations(FEATURES, 2)), ids=" x ".join)
def test_each_pair_runs_and_trains_as_one_device(pair, tmp_path):
    raw = pair_scenario(pair, tmp_path)
    if raw is None:
        pytest.skip("refused by the support table, or no one scenario")
    spec = validate_scenario(raw)
    report = simtrain.run(spec)
    assert report.data["status"] == "ok"
    if INEXACT & set(pair):
        losses = [loss for _, loss in report.data["loss_curve"]]
        assert all(loss is None or math.isfinite(loss) for loss in losses)
        assert report.data["step_time_s"] > 0
        return
    layout = report.data["parallel"]
    reference, _ = one_device(spec, layout["dp"] if layout["dp"] else spec.cluster.devices)
    assert_same_parameters(report.final_model, reference)
