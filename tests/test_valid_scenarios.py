"""Every job a user can write runs, or is refused in one line with the reason (issue 55, item 2).

Forty scenarios from the whole space (tests/scenario_space.py: layouts, ZeRO and HSDP, offload, precisions with
fp8, recomputation, schedules, overlap flags, experts, models, numerics off, representatives, a lost device with a
spare), stratified with a fixed seed: every option of every choice comes up, each about as often as the others
(`stratified`), and each run is small. A scenario must end in a report or in a SimtrainError of one line; a
traceback of any other kind fails. The longer form, hypothesis drawing from the same space, with the refusals
counted by reason: `python bench/valid_scenarios.py --examples 1000`.
"""
import json

import pytest

from scenario_space import outcome, stratified

SCENARIOS = stratified(40, seed=0)


@pytest.mark.slow  # forty runs together
@pytest.mark.parametrize("raw", SCENARIOS, ids=[f"scenario{index:02d}" for index in range(len(SCENARIOS))])
def test_a_scenario_from_the_space_runs_or_is_refused_in_one_line(raw):
    result = outcome(raw)  # raises on a traceback, or a refusal of more than one line
    assert result == "ran" or result.startswith("refused: "), json.dumps(raw)


def test_the_scenarios_take_every_option_of_every_choice():
    """The stratified set reaches each option of the choices every scenario makes, and of the ones most make."""
    def seen(path):
        values = []
        for raw in SCENARIOS:
            value = raw
            for key in path.split("."):
                value = value.get(key) if isinstance(value, dict) else None
            values.append(json.dumps(value))
        return set(values)

    assert seen("model.name") == {'"mlp"', '"gpt"', '"llama"'}
    assert {raw["model"].get("moe") is not None for raw in SCENARIOS} == {False, True}
    assert seen("parallel.pp") == seen("parallel.tp") == seen("parallel.cp") == {"1", "2"}
    assert seen("parallel.sharding.stage") == {"0", "1", "2", "3"}
    assert seen("cluster.compute_model") == {'"flops"', '"roofline"', '"kernels"'}
    assert seen("model.attention") == {'"eager"', '"fused"', "null"}
    assert seen("parallel.sharding.offload") == {'"none"', '"optimizer"', "null"}
    assert seen("train.precision") == {'"fp32"', '"bf16"', '"fp16"', '"fp8"'}
    assert seen("train.checkpointing") == {'"none"', '"selective"', '"full"', '"sqrt"'}
    assert seen("parallel.pipeline.schedule") == {'"gpipe"', '"1f1b"', '"interleaved"', '"zero_bubble"'}
    assert seen("parallel.all_reduce") == {'"ring"', '"tree"', '"nccl"'}
    assert seen("numerics") == {"false", "true"}
    assert seen("parallel.representatives") == {"false", "true"}
    assert seen("parallel.ep") == {"1", "2"}
    assert {bool(raw["cluster"].get("faults")) for raw in SCENARIOS} == {False, True}
    assert {raw["cluster"]["devices"] for raw in SCENARIOS} >= {1, 2, 4, 8, 16}
