"""The support table (simtrain/parallel/support.py) and the validators, which must not drift apart.

Every feature has an example: the keys that turn it on, the keys it needs (set unless another feature's
example sets them) and the model it runs on. A row's scenario is its features' examples together (for a
group of alternatives, each alternative in turn); every pair of features is another. Each scenario is
validated as `simtrain validate` does (validate_scenario, then preflight: the job's checks on its numbers;
nothing runs), or, with simtrain launch, as launch checks it (real/launch.py). The reference is the table
itself: the same scenario, validated with the table emptied, must pass (what the validators refuse besides
the table is a feature's own need, never a combination), and the table's first row for it, read with the
layout and the pipeline schedule the job would have, is the line validation refuses with, or None where it
validates. Every row is the first one for at least one of its scenarios: no row is shadowed by another.
"""
import ast
import importlib.util
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import pytest
import yaml

from simtrain.errors import ScenarioError
from simtrain.parallel import Layout, support
from simtrain.parallel.schedules import pipeline_schedule
from simtrain.parallel.support import FEATURE, FEATURES, REFUSED, Case, Refusal
from simtrain.preflight import preflight
from simtrain.real.launch import scenario_for
from simtrain.scenario import validate_scenario

ROOT = Path(__file__).resolve().parent.parent
MODELS = {  # a model and the data it trains on
    "gpt": ({"name": "gpt", "hidden": 32, "layers": 4, "heads": 4},
            {"name": "tokens", "batch_size": 8, "seq_len": 16, "vocab": 32}),
    "mlp": ({"name": "mlp", "hidden": [16], "batchnorm": True},
            {"name": "synthetic", "samples": 256, "features": 8, "classes": 4, "batch_size": 8}),
}
MOE = {"experts": 4, "top_k": 2}


@dataclass(frozen=True)
class Example:
    """A feature in a scenario: the keys that turn it on, the keys it needs, the model it needs (None: any)."""

    sets: dict = field(default_factory=dict)
    needs: dict = field(default_factory=dict)
    model: str | None = None


EXAMPLES = {
    "dp": Example({"parallel.dp": 2}),
    "ZeRO 1": Example({"parallel.sharding.stage": 1}, {"parallel.dp": 2}),
    "ZeRO 2": Example({"parallel.sharding.stage": 2}, {"parallel.dp": 2}),
    "ZeRO 3": Example({"parallel.sharding.stage": 3}, {"parallel.dp": 2}),
    "HSDP": Example({"parallel.dp": 4, "parallel.sharding.degree": 2}, {"parallel.sharding.stage": 2}),
    "offload": Example({"parallel.sharding.offload": "optimizer", "cluster.shared_memory": {}},
                       {"parallel.sharding.stage": 2, "parallel.dp": 2}),
    "tp": Example({"parallel.tp": 2}, model="gpt"),  # the mlp's BatchNorm leaves no Linear pair to split
    "sp": Example({"parallel.sequence_parallel": True}, {"parallel.tp": 2}, "gpt"),
    "cp": Example({"parallel.cp": 2}, model="gpt"),
    "pp": Example({"parallel.pp": 2}),
    "split backward": Example({"parallel.pipeline.schedule": "zero_bubble"}, {"parallel.pp": 2}),
    "gradient accumulation": Example({"parallel.pipeline.microbatches": 2}),
    "dp alone": Example(),  # none of pp, tp, cp: what the other features' examples leave out
    "DDP overlap": Example({"parallel.overlap": True}, {"parallel.dp": 2}),
    "ZeRO overlap": Example({"parallel.sharding.overlap_grad_reduce": True},
                            {"parallel.sharding.stage": 1, "parallel.dp": 2, "parallel.pp": 2}),
    "MoE": Example({"model.moe": MOE}, model="gpt"),
    "drawn routing": Example({"model.moe": {**MOE, "routing": {"model": "zipf"}}}, model="gpt"),
    "capacity": Example({"model.moe": {**MOE, "capacity_factor": 1.25}}, model="gpt"),
    "capacity below 1": Example({"model.moe": {**MOE, "capacity_factor": 0.5}}, model="gpt"),
    "ep": Example({"parallel.ep": 2}, {"model.moe": MOE, "parallel.dp": 2}, "gpt"),
    "deepep dispatch": Example({"parallel.moe_dispatch": "deepep"}, {"parallel.ep": 2, "model.moe": MOE,
                                                                     "parallel.dp": 2}, "gpt"),
    "bf16": Example({"train.precision": "bf16"}),
    "fp16": Example({"train.precision": "fp16"}),
    "fp8": Example({"train.precision": "fp8"}),
    "selective recomputation": Example({"train.checkpointing": "selective"}, model="gpt"),
    "full recomputation": Example({"train.checkpointing": "full"}),
    "recomputation in segments": Example({"train.checkpointing": "sqrt"}),
    "numerics off": Example({"numerics": False}),
    "representatives": Example({"parallel.representatives": True}, {"numerics": False, "parallel.pp": 2}),
    "faults": Example({"cluster.faults": [{"at": "1 ms", "device": 0, "fail": True}], "cluster.spares": 1}),
    "restart": Example({"train.checkpoint": {"every": 1}}),
    "simtrain launch": Example(),  # the command, not a key
    "async": Example({"parallel.mode": "async"}),
    "K-FAC": Example({"train.optimizer.name": "kfac"}),
    "SyncBN": Example({"parallel.sync_batchnorm": True}, model="mlp"),
    "prioritized sampling": Example({"data.sampling": "prioritized"}),
}

# Pairs refused by a feature's own needs, not by a row, and the line's start: parallel.overlap is DDP's flag
# (sharding.stage 0); sharded data parallelism overlaps with its own (scenario/parallel.py _no_flag_ignored).
DDP_FLAG = "parallel.overlap: sets DDP's bucketed all-reduce (sharding.stage 0)"
OWN_NEEDS = {(sharded, "DDP overlap"): DDP_FLAG for sharded in ("ZeRO 1", "ZeRO 2", "ZeRO 3", "HSDP", "offload")}
OWN_NEEDS[("DDP overlap", "ZeRO overlap")] = DDP_FLAG
# sharding.overlap_grad_reduce is for stages 1 and 2 (stage 3 gathers and reduces unit by unit already)
OWN_NEEDS[("ZeRO 3", "ZeRO overlap")] = "parallel.sharding.overlap_grad_reduce: stage 3 already"


def scenario_with(names) -> dict | None:
    """The scenario dict using the features `names`, or None where their examples set a key apart or need
    different models."""
    examples = [EXAMPLES[name] for name in names]
    models = {example.model for example in examples} - {None}
    if len(models) > 1:
        return None
    keys: dict = {}
    for example in examples:
        for key, value in example.sets.items():
            if keys.setdefault(key, value) != value:
                return None
    for example in examples:
        for key, value in example.needs.items():
            keys.setdefault(key, value)
    model, data = MODELS[models.pop() if models else "gpt"]
    raw = {"name": "support", "model": dict(model), "data": dict(data),
           "cluster": {"topology": "switch", "device": "h100-80gb",
                       "link": {"bandwidth": "100 GB/s", "latency": "2 us"}},
           "train": {"steps": 2, "optimizer": {"name": "adam", "lr": 0.01}}, "report": {"trace": False}}
    for key, value in keys.items():
        *parents, leaf = key.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    parallel = raw.setdefault("parallel", {})
    ranks = parallel.get("dp", 1) * parallel.get("pp", 1) * parallel.get("tp", 1) * parallel.get("cp", 1)
    raw["cluster"]["devices"] = ranks + raw["cluster"].get("spares", 0)
    return raw


def validation(raw: dict, launched: bool, tmp_path) -> tuple[str | None, object]:
    """(the line validation refuses `raw` with, None where it validates; the Scenario where it does)."""
    path = tmp_path / "launched.yaml"
    try:
        if launched:
            path.write_text(yaml.safe_dump(raw))
            return None, scenario_for(path, [], raw["cluster"]["devices"])
        scenario = validate_scenario(raw)
        preflight(scenario)
        return None, scenario
    except ScenarioError as error:  # the line, without its file's name
        return str(error).removeprefix(f"{path}: " if launched else "scenario: "), None


def case_of(scenario, launched: bool) -> Case:
    """`scenario` with all that validation knows of its run: simtrain launch checks the scenario alone; simtrain
    validate the job's layout and its pipeline schedule too."""
    if launched:
        return Case(scenario, launched=True)
    parallel = scenario.parallel
    layout = Layout.of(parallel, scenario.cluster.devices - scenario.cluster.spares)
    schedule = None
    if parallel.model_parallel:
        schedule = pipeline_schedule(parallel.pipeline, layout.pp, parallel.microbatches)
    return Case(scenario, layout, schedule)


def check(names, tmp_path):
    """The row that validation refuses the features `names` with (None where it validates), after checking that
    it refuses them with that row's line; None too where their examples make no one scenario."""
    raw = scenario_with(names)
    if raw is None:
        return None
    launched = "simtrain launch" in names
    with mock.patch.object(support, "REFUSED", ()):
        outside, scenario = validation(raw, launched, tmp_path)
    assert outside is None, f"{names}: refused outside the table: {outside}"
    case = case_of(scenario, launched)
    row = next((row for row in REFUSED if row.applies(case)), None)
    line, _ = validation(raw, launched, tmp_path)
    assert line == (row.message(case) if row else None), names
    return row


@pytest.mark.parametrize("row", REFUSED, ids=[" x ".join("|".join(group) for group in row.groups) for row in REFUSED])
def test_each_row_is_refused_with_its_line(row, tmp_path):
    firsts = [check(names, tmp_path) for names in itertools.product(*row.groups)]
    assert any(first is row for first in firsts), "no scenario of the row's features reaches it"


def test_every_pair_of_features_validates_unless_a_row_refuses_it(tmp_path):
    """Pairs whose examples make no one scenario (two precisions, the mlp's SyncBN and the gpt's attention) are
    left out; so are the pairs of OWN_NEEDS, which must be refused with their own line."""
    checked = 0
    for pair in itertools.combinations(EXAMPLES, 2):
        if pair in OWN_NEEDS:
            line, _ = validation(scenario_with(pair), False, tmp_path)
            assert line.startswith(OWN_NEEDS[pair]), pair
        elif scenario_with(pair) is not None:
            check(pair, tmp_path)
            checked += 1
    assert checked > 450  # of the 630 pairs of 36 features


def test_each_row_names_known_features_frameworks_and_the_key_at_fault():
    assert list(EXAMPLES) == [feature.name for feature in FEATURES]  # an example for every feature, in order
    for row in REFUSED:
        assert all(name in FEATURE for group in row.groups for name in group)
        assert set(row.built_by) <= {support.MEGATRON_CORE, support.TORCHTITAN}
        assert re.fullmatch(r"[a-z_]+(\.[a-z_]+)*", row.line.split(": ", 1)[0]), row.line


def test_no_row_is_a_combination_a_framework_runs():
    """The composition issue's check: simtrain runs every combination of these features that Megatron-Core or
    torchtitan runs (the last two, MoE under tp without sequence parallelism and split backwards with it, are
    built: tests/test_expert_model_parallel.py, tests/test_pipeline_schedules.py)."""
    assert [row.features for row in REFUSED if row.built_by] == []
    verdicts = {row.features: row.verdict for row in REFUSED}
    assert verdicts[("async", "K-FAC")] == "refused: neither Megatron-Core nor torchtitan runs it"
    assert Refusal(("MoE", "tp"), "", "", (support.TORCHTITAN,)).verdict == "not built in simtrain (torchtitan runs it)"


def test_the_table_imports_no_module_of_simtrain():
    """The scenario's validators read it from the layer below (pyproject.toml's one ignored import)."""
    tree = ast.parse(Path(support.__file__).read_text())
    modules = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    modules += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0]
    assert modules and all(not name.startswith("simtrain") for name in modules)
    assert not [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0]


def test_the_generated_page_lists_every_row_under_its_verdict():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", ROOT / "docs" / "hooks" / "reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = hook.support_page()
    not_built, neither = page.split("## Not built in simtrain")[1].split("## Refused: neither framework runs it")
    for row in REFUSED:
        assert hook._line(row.line) in (not_built if row.built_by else neither)
    assert "None: simtrain runs every combination of these features that Megatron-Core or torchtitan runs." \
        in not_built
    assert ("`parallel.pipeline.schedule: <schedule> splits backwards into I and W passes, not built with "
            "train.checkpointing <checkpointing> under parallel.tp or parallel.cp") in page
    assert "| dp | parallel.dp above 1 |  |" in page  # dp combines with every feature
