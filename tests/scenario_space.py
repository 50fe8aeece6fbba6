"""Scenarios drawn from the whole space a user can write, small enough to run in seconds (issue 55, item 2).

`scenario(choose)` builds one scenario dict that passes the schema's field types, across layouts (dp, pp, tp,
cp, ep, ZeRO stages and HSDP, offload), precisions, recomputation, pipeline schedules, the overlap flags,
experts, models (mlp, gpt, llama, MoE; eager or fused attention), compute models, numerics on and off,
representatives and a lost device with a spare;
`choose(name, options)` picks each of its choices. Two ways to pick:

- `scenarios()`, a hypothesis strategy (bench/valid_scenarios.py draws thousands);
- `stratified(count, seed)`, a fixed list: each choice takes, every time it is reached, one of the options
  used least so far for it (a seeded random one among them), so that a few dozen scenarios give every option
  of every choice, each about as often as the others.

Whether a scenario is a valid job is the simulator's to say: `outcome(raw)` runs it and returns "ran" or
"refused: <the one line>"; anything else (a traceback, a refusal of more than one line) raises.

    from hypothesis import given
    @given(scenarios())
    def test(raw): outcome(raw)
"""
from __future__ import annotations

import collections
import random
from typing import Callable

from hypothesis import strategies as st

from simtrain import run
from simtrain.errors import SimtrainError
from simtrain.scenario import validate_scenario


SAMPLES = 256  # the data set: each run evaluates its loss curve on the training part of it (tokens default 2048)


@st.composite
def scenarios(draw) -> dict:
    """A scenario dict from the whole space, drawn by hypothesis."""
    return scenario(lambda name, options: draw(st.sampled_from(options)))


def stratified(count: int, seed: int = 0) -> list[dict]:
    """`count` scenarios from the whole space, each choice's options used as evenly as the scenarios reaching
    it allow (option by position: a value listed twice comes up twice as often), ties broken by `seed`."""
    rng = random.Random(seed)
    used: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)

    def choose(name: str, options: list):
        counts = used[name, tuple(map(repr, options))]
        fewest = min(counts[index] for index in range(len(options)))
        index = rng.choice([index for index in range(len(options)) if counts[index] == fewest])
        counts[index] += 1
        return options[index]

    return [scenario(choose) for _ in range(count)]


def scenario(choose: Callable[[str, list], object]) -> dict:
    """A scenario dict from the whole space, each degree at most 2 (the job at most 16 devices), each run small:
    two steps, a data set of 256 samples."""
    model_name = choose("model", ["mlp", "gpt", "llama", "gpt-moe", "llama-moe"])
    sequence = model_name != "mlp"
    pp = choose("pp", [1, 2])
    tp = choose("tp", [1, 2]) if sequence else 1
    cp = choose("cp", [1, 2]) if sequence else 1
    dp = choose("dp", [1, 2, 4])
    experts = model_name.endswith("moe")
    ep = choose("ep", [1, 2]) if experts and dp > 1 else 1
    stage = choose("sharding.stage", [0, 0, 1, 2, 3])
    sharding: dict = {"stage": stage}
    if stage:
        sharding["degree"] = choose("sharding.degree", [None, 1] if dp > 1 else [None])
        sharding["offload"] = choose("sharding.offload", ["none", "none", "optimizer"])
        if pp * tp * cp > 1 and stage < 3 and choose("sharding.overlap", [False, True]):
            sharding["overlap_grad_reduce"] = True
            sharding["overlap_param_gather"] = choose("sharding.overlap_param_gather", [False, True])
    precision = choose("precision", ["fp32", "bf16", "fp16", "fp8"])
    sequence_parallel = tp > 1 and choose("sequence_parallel", [False, True])
    pipeline: dict = {"schedule": choose("pipeline.schedule", ["gpipe", "1f1b", "interleaved", "zero_bubble"]),
                      "microbatches": choose("pipeline.microbatches", [None, 1, 2, 4])}
    if pipeline["schedule"] == "interleaved" and pp > 1 and choose("pipeline.virtual_stages", [False, True]):
        pipeline["virtual_stages"] = 2
        pipeline["microbatches"] = 4
    lost = choose("lost", [False, True]) and choose("lost.again", [False, True])  # a quarter lose a device
    devices = dp * pp * tp * cp
    numerics = choose("numerics", [False, True])
    raw = {
        "name": "drawn", "seed": choose("seed", [0, 1, 2, 3]), "numerics": numerics,
        "cluster": {"topology": choose("topology", ["switch", "ring"]), "devices": devices + lost,
                    "device": "h100-80gb", "link": {"bandwidth": "100 GB/s", "latency": "2 us"}},
        "model": _model(model_name, choose),
        "data": ({"name": "tokens", "batch_size": 8, "seq_len": 16, "vocab": 32, "samples": SAMPLES} if sequence else
                 {"name": "synthetic", "samples": SAMPLES, "features": 8, "classes": 4, "batch_size": 8}),
        "train": {"steps": 2, "precision": precision,
                  "checkpointing": choose("checkpointing", ["none", "selective", "full", "sqrt"]),
                  "optimizer": {"name": choose("optimizer", ["sgd", "adam"]), "lr": 0.01}},
        "parallel": {"pp": pp, "tp": tp, "cp": cp, "ep": ep, "sharding": sharding, "pipeline": pipeline,
                     "sequence_parallel": sequence_parallel,
                     "tp_comm_overlap": sequence_parallel and choose("tp_comm_overlap", [False, True]),
                     "overlap": None if stage else choose("overlap", [None, True, False]),
                     "all_reduce": choose("all_reduce", ["ring", "tree", "nccl"]),
                     "representatives": not numerics and pp * tp > 1 and choose("representatives", [False, True])},
        "report": {"trace": False},
    }
    raw["cluster"]["compute_model"] = choose("compute_model", ["flops", "roofline", "kernels"])
    if sequence:
        raw["model"]["attention"] = choose("model.attention", ["eager", "fused"])
    if lost:
        raw["cluster"]["spares"] = 1
        raw["cluster"]["faults"] = [{"at": "1 us", "device": choose("faults.device", list(range(devices))),
                                     "fail": True}]
        raw["train"]["checkpoint"] = {"every": 1}
    return raw


def _model(name: str, choose) -> dict:
    if name == "mlp":
        return {"name": "mlp", "hidden": [16]}
    model = {"name": name.split("-")[0], "hidden": 32, "layers": choose("model.layers", [2, 4]), "heads": 4}
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
