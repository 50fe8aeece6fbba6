"""Scenarios drawn from the whole space a user can write, small enough to run in seconds (issue 55, item 2).

`scenarios()` is a hypothesis strategy of scenario dicts that pass the schema's field types, across layouts
(dp, pp, tp, cp, ep, ZeRO stages and HSDP, offload), precisions, recomputation, pipeline schedules, the
overlap flags, experts, models (mlp, gpt, llama, MoE), numerics on and off, representatives and a lost device
with a spare. Whether a draw is a valid job is the simulator's to say: `outcome(raw)` runs it and returns
"ran" or "refused: <the one line>"; anything else (a traceback, a refusal of more than one line) raises.

    from hypothesis import given
    @given(scenarios())
    def test(raw): outcome(raw)
"""
from __future__ import annotations

from hypothesis import strategies as st

from simtrain import run
from simtrain.errors import SimtrainError
from simtrain.scenario import validate_scenario


@st.composite
def scenarios(draw) -> dict:
    """A scenario dict from the whole space, each degree at most 2 (the job at most 16 devices)."""
    model_name = draw(st.sampled_from(["mlp", "gpt", "llama", "gpt-moe", "llama-moe"]))
    sequence = model_name != "mlp"
    pp = draw(st.sampled_from([1, 2]))
    tp = draw(st.sampled_from([1, 2])) if sequence else 1
    cp = draw(st.sampled_from([1, 2])) if sequence else 1
    dp = draw(st.sampled_from([1, 2, 4]))
    experts = model_name.endswith("moe")
    ep = draw(st.sampled_from([1, 2])) if experts and dp > 1 else 1
    stage = draw(st.sampled_from([0, 0, 1, 2, 3]))
    sharding: dict = {"stage": stage}
    if stage:
        sharding["degree"] = draw(st.sampled_from([None, 1] if dp > 1 else [None]))
        sharding["offload"] = draw(st.sampled_from(["none", "none", "optimizer"]))
        if pp * tp * cp > 1 and stage < 3 and draw(st.booleans()):
            sharding["overlap_grad_reduce"] = True
            sharding["overlap_param_gather"] = draw(st.booleans())
    precision = draw(st.sampled_from(["fp32", "bf16", "fp16", "fp8"]))
    sequence_parallel = tp > 1 and draw(st.booleans())
    pipeline: dict = {"schedule": draw(st.sampled_from(["gpipe", "1f1b", "interleaved"])),
                      "microbatches": draw(st.sampled_from([None, 1, 2, 4]))}
    if pipeline["schedule"] == "interleaved" and pp > 1 and draw(st.booleans()):
        pipeline["virtual_stages"] = 2
        pipeline["microbatches"] = 4
    lost = draw(st.booleans()) and draw(st.booleans())  # a quarter of the draws lose a device
    devices = dp * pp * tp * cp
    numerics = draw(st.booleans())
    raw = {
        "name": "drawn", "seed": draw(st.integers(0, 3)), "numerics": numerics,
        "cluster": {"topology": draw(st.sampled_from(["switch", "ring"])), "devices": devices + lost,
                    "device": "h100-80gb", "link": {"bandwidth": "100 GB/s", "latency": "2 us"}},
        "model": _model(model_name, draw),
        "data": ({"name": "tokens", "batch_size": 8, "seq_len": 16, "vocab": 32} if sequence else
                 {"name": "synthetic", "samples": 256, "features": 8, "classes": 4, "batch_size": 8}),
        "train": {"steps": 2, "precision": precision,
                  "checkpointing": draw(st.sampled_from(["none", "selective", "full", "sqrt"])),
                  "optimizer": {"name": draw(st.sampled_from(["sgd", "adam"])), "lr": 0.01}},
        "parallel": {"pp": pp, "tp": tp, "cp": cp, "ep": ep, "sharding": sharding, "pipeline": pipeline,
                     "sequence_parallel": sequence_parallel,
                     "tp_comm_overlap": sequence_parallel and draw(st.booleans()),
                     "overlap": None if stage else draw(st.sampled_from([None, True, False])),
                     "all_reduce": draw(st.sampled_from(["ring", "tree", "nccl"])),
                     "representatives": not numerics and pp * tp > 1 and draw(st.booleans())},
        "report": {"trace": False},
    }
    if lost:
        raw["cluster"]["spares"] = 1
        raw["cluster"]["faults"] = [{"at": "1 us", "device": draw(st.integers(0, devices - 1)), "fail": True}]
        raw["train"]["checkpoint"] = {"every": 1}
    return raw


def _model(name: str, draw) -> dict:
    if name == "mlp":
        return {"name": "mlp", "hidden": [16]}
    model = {"name": name.split("-")[0], "hidden": 32, "layers": draw(st.sampled_from([2, 4])), "heads": 4}
    if model["name"] == "llama":
        model["kv_heads"] = 2
    if name.endswith("moe"):
        model["moe"] = {"experts": 4, "top_k": 2}
    return model


def outcome(raw: dict) -> str:
    """"ran", or "refused: <the one line>" for a job the simulator refuses; any other ending raises."""
    try:
        run(validate_scenario(raw))
    except SimtrainError as error:
        message = str(error)
        assert message and "\n" not in message, f"a refusal of more than one line: {message!r}"
        return f"refused: {message}"
    return "ran"
