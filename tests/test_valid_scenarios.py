"""Every job a user can write runs, or is refused in one line with the reason (issue 55, item 2).

Scenarios are drawn from the whole space (tests/scenario_space.py: layouts, ZeRO and HSDP, offload,
precisions with fp8, recomputation, schedules, overlap flags, experts, models, numerics off, representatives, a
lost device with a spare), with a fixed seed, each run small. A draw must end in a report or in a
SimtrainError of one line; a traceback of any other kind fails. The longer form, with the refusals counted by
reason: `python bench/valid_scenarios.py --examples 1000`.
"""
import pytest
from hypothesis import HealthCheck, given, settings

from scenario_space import outcome, scenarios


@pytest.mark.slow
@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(raw=scenarios())
def test_a_drawn_scenario_runs_or_is_refused_in_one_line(raw):
    result = outcome(raw)  # raises on a traceback, or a refusal of more than one line
    assert result == "ran" or result.startswith("refused: ")
