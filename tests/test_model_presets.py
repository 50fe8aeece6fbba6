"""model.preset (scenario/model_presets.py) against the published models it names.

- Shapes: each preset fills the shapes the shipped scenarios wrote by hand before they named it (those
  scenarios cite the papers' tables: Llama 3 table 3, DeepSeek-V3 section 4.2), so a scenario that names a
  preset runs the model it ran before.
- Sizes: each preset's model, built on meta by the model code (numerics off), counts its published parameters:
  totals within 0.5% (GPT-3 ties its head to the token table and simtrain's gpt does not: +0.35%), activated
  parameters of the MoE models (every parameter but the routed experts a token is not sent to) within 2% (the
  published figures have two or three digits; DeepSeek-V3's 37B leaves the token table's unread rows out:
  tests/test_latent_attention.py).
- Rule: a field the scenario gives wins over the preset's, in moe and latent_attention field by field; the
  resolved scenario (what `simtrain validate` checks and scenario.resolved.yaml holds) reads back the same.
- Bad input: an unknown preset is one line naming the known ones, exit 2.
"""
from pathlib import Path

import pytest
import torch
import yaml

from simtrain.cli import main
from simtrain.scenario import load_scenario, validate_scenario
from simtrain.scenario.model_presets import MODEL_PRESETS
from simtrain.train.data_shape import tokens_info
from simtrain.train.models import build_model
from simtrain.train.moe import MoE

from refusals import refusal

ROOT = Path(__file__).resolve().parent.parent

# What the shipped scenarios wrote by hand before they named the preset (git show c6c471d:scenarios/...).
LLAMA3_405B = {"name": "llama", "hidden": 16384, "layers": 126, "heads": 128, "kv_heads": 8, "ffn_hidden": 53248,
               "rope_theta": 500000, "attention": "fused"}
HAND_WRITTEN = {
    "llama3-405b-16k": (LLAMA3_405B, {"name": "tokens", "batch_size": 16, "seq_len": 8192, "vocab": 128256}),
    "llama3-405b-8k": (LLAMA3_405B, {"name": "tokens", "batch_size": 32, "seq_len": 8192, "vocab": 128256}),
    "llama3-405b-100k": (LLAMA3_405B, {"name": "tokens", "batch_size": 16, "seq_len": 8192, "vocab": 128256}),
    "llama3-405b-gb200-100k": (LLAMA3_405B, {"name": "tokens", "batch_size": 16, "seq_len": 8192, "vocab": 128256}),
    "llama3-70b-long-context": (
        {"name": "llama", "hidden": 8192, "layers": 80, "heads": 64, "kv_heads": 8, "ffn_hidden": 28672,
         "rope_theta": 500000, "attention": "fused"},  # fused since 2026-12-07 (the long-context guide)
        {"name": "tokens", "batch_size": 8, "seq_len": 8192, "vocab": 128256}),
    "deepseek-v3": (
        {"name": "llama", "hidden": 7168, "layers": 61, "heads": 128, "ffn_hidden": 18432, "latent_attention": {},
         "attention": "fused", "moe": {"experts": 256, "expert_hidden": 2048, "top_k": 8, "shared_experts": 1,
                                       "first_dense": 3, "score": "sigmoid", "groups": 8, "group_limit": 4}},
        {"name": "tokens", "batch_size": 120, "seq_len": 4096, "vocab": 129280}),
}


@pytest.mark.parametrize("name", sorted(HAND_WRITTEN))
def test_a_shipped_scenario_naming_a_preset_runs_the_model_it_wrote_by_hand(name):
    shipped = load_scenario(ROOT / "scenarios" / f"{name}.yaml")
    assert shipped.model.preset is not None
    model, data = HAND_WRITTEN[name]
    by_hand = validate_scenario({"model": model, "data": data})
    assert shipped.model.model_dump(exclude={"preset"}) == by_hand.model.model_dump(exclude={"preset"})
    assert shipped.data == by_hand.data


# Published sizes (billions): total, activated a token (MoE). Sources: scenario/model_presets.py.
PUBLISHED = {"llama3-8b": (8.03, None), "llama3-70b": (70.6, None), "llama3-405b": (405.9, None),
             "gpt3-175b": (175.0, None), "mixtral-8x7b": (46.7, 12.9), "mixtral-8x22b": (141.0, 39.0),
             "deepseek-v3": (671.0, 37.0)}


def test_every_preset_has_a_published_size():
    assert sorted(PUBLISHED) == sorted(MODEL_PRESETS)


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_a_presets_model_counts_its_published_parameters(preset):
    scenario = validate_scenario({"numerics": False, "model": {"preset": preset}})
    with torch.device("meta"):
        model = build_model(scenario.model, tokens_info(scenario.data.seq_len, scenario.data.vocab), seed=0)
    total = sum(p.numel() for p in model.parameters())
    published_total, published_activated = PUBLISHED[preset]
    assert total / 1e9 == pytest.approx(published_total, rel=0.005)
    moe = scenario.model.moe
    if moe is not None:
        experts = [module for module in model.modules() if isinstance(module, MoE)]
        assert len(experts) == moe.moe_layers(scenario.model.layers)
        expert = sum(p.numel() for p in experts[0].experts[0].parameters())
        activated = total - len(experts) * (moe.experts - moe.top_k) * expert
        assert activated / 1e9 == pytest.approx(published_activated, rel=0.02)


def test_a_given_field_wins_over_the_presets_and_the_resolved_scenario_reads_back():
    scenario = validate_scenario({"model": {"preset": "deepseek-v3", "layers": 4, "moe": {"capacity_factor": 1.25},
                                            "latent_attention": {"kv_lora_rank": 256}},
                                  "data": {"seq_len": 128, "batch_size": 2}})
    model = scenario.model
    assert (model.layers, model.width, model.heads) == (4, 7168, 128)
    assert (model.moe.capacity_factor, model.moe.experts, model.moe.top_k, model.moe.first_dense) == (1.25, 256, 8, 3)
    assert (model.latent_attention.kv_lora_rank, model.latent_attention.q_lora_rank) == (256, 1536)
    assert (scenario.data.name, scenario.data.seq_len, scenario.data.vocab) == ("tokens", 128, 129280)
    assert validate_scenario(yaml.safe_load(scenario.to_yaml())) == scenario


def test_given_data_fields_win_and_a_data_set_of_another_kind_is_left_alone():
    scenario = validate_scenario({"model": {"preset": "llama3-8b", "layers": 1},
                                  "data": {"name": "tokens", "vocab": 64, "seq_len": 16}})
    assert (scenario.data.vocab, scenario.data.seq_len) == (64, 16)
    scenario = validate_scenario({"model": {"preset": "llama3-8b"}, "data": {"name": "synthetic"}})
    assert (scenario.data.name, scenario.data.vocab, scenario.data.seq_len) == ("synthetic", None, None)


def test_an_unknown_preset_is_one_line_naming_the_known_ones(tmp_path, capsys):
    line = refusal(tmp_path, capsys, {"model": {"preset": "llama4-8b"}})
    assert "model.preset" in line and "llama4-8b" in line
    assert all(name in line for name in MODEL_PRESETS)


def test_validate_shows_what_the_preset_filled_in(tmp_path, capsys):
    path = tmp_path / "preset.yaml"
    path.write_text(yaml.safe_dump({"numerics": False, "cluster": {"devices": 1},
                                    "model": {"preset": "mixtral-8x7b", "layers": 2, "moe": {"top_k": 1}},
                                    "data": {"batch_size": 1, "seq_len": 64}}))
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(path)])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "model.preset mixtral-8x7b: name llama, hidden 4096, layers 2, heads 32, kv_heads 8, ffn_hidden 14336, "
        "rope_theta 1e+06, moe {experts: 8, top_k: 1}, data.vocab 32000, data.seq_len 64")
