"""Megatron-Core's H100 weak-scaling table (scenarios/megatron-core-h100; docs/validation/megatron-core-h100.md).

Every row's scenario carries the one fitted H100 efficiency (fitted on GPT 1.7B by `python
bench/megatron_core_h100.py --calibrate gpt-1.7b`, which simulates the row: too long for the suite) and the
README's settings (heads, hidden, layers, tp, pp, GPUs, global batch, s = 4096, V = 131,072; under tp the
distributed optimizer's overlap and sequence parallelism), and validates.
"""
import sys
from pathlib import Path

import pytest

from simtrain.scenario import load_scenario

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import megatron_core_h100 as bench  # noqa: E402

# The README's table (images/model_table.png): heads, hidden, layers, tp, pp, GPUs, global batch
README_ROWS = {"gpt-1.7b": (16, 2048, 24, 1, 1, 48, 192), "gpt-7.1b": (32, 4096, 30, 2, 1, 96, 192),
               "gpt-16b": (48, 6144, 32, 4, 1, 192, 192), "gpt-32b": (56, 7168, 48, 8, 1, 384, 192),
               "gpt-70b": (64, 8192, 84, 8, 2, 768, 384), "gpt-119b": (80, 10240, 92, 8, 4, 1536, 768),
               "gpt-177b": (96, 12288, 96, 8, 6, 2304, 1152), "gpt-314b": (128, 16384, 96, 8, 8, 3072, 1536),
               "gpt-462b": (144, 18432, 112, 8, 16, 6144, 3072)}


@pytest.mark.parametrize("name", list(README_ROWS))
def test_each_row_is_the_readmes_settings_at_the_one_fitted_efficiency(name):
    scenario = load_scenario(bench.SCENARIOS / f"{name}.yaml")
    heads, hidden, layers, tp, pp, gpus, batch = README_ROWS[name]
    model, layout = scenario.model, scenario.parallel
    assert (model.heads, model.width, model.layers, layout.tp, layout.pp) == (heads, hidden, layers, tp, pp)
    assert scenario.cluster.devices == gpus and scenario.data.batch_size * gpus // (tp * pp) == batch
    assert (scenario.data.seq_len, scenario.data.vocab, model.attention) == (4096, 131072, "fused")
    fitted = load_scenario(bench.SCENARIOS / f"{bench.FITTED_ROW}.yaml").cluster.device.efficiency
    assert (scenario.cluster.device.base, scenario.cluster.device.efficiency) == ("h100-80gb", fitted)
    if tp > 1:  # the README's runs: --overlap-grad-reduce --overlap-param-gather, sequence parallelism, and
        # Megatron-LM's fp32 gradient reduction under bf16; two steps, the second the bench times
        sharding = layout.sharding
        assert (sharding.stage, sharding.overlap_grad_reduce, sharding.overlap_param_gather, sharding.reduce_dtype,
                layout.sequence_parallel, scenario.train.steps) == (1, True, True, "fp32", True, 2)

