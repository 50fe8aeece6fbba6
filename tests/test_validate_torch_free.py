"""`simtrain validate` without torch for the built-in models and data (issue 30), and the checks that make it so.

- A fresh process validates shipped scenarios (data parallel, a gpt under tp x pp with sequence parallelism, a
  llama with the distributed optimizer, experts) and never imports torch, numpy or networkx (their builders'
  graphs are made when first read); `--help` imports none of them, nor simpy (issue 30's start-up).
- The built-in models' architecture as data (train/architecture.py) against the models train/models.py builds:
  parameters, the pipeline's units with and without tensor parallelism, checkpointing's blocks, at a few sizes.
- job_checks.check_job against the job's build on meta tensors (what preflight ran before): each bad scenario is
  refused by both with the same line.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from simtrain.errors import ScenarioError
from simtrain.hw.cluster import build_cluster
from simtrain.job import Job
from simtrain.job_checks import check_job, covered
from simtrain.scenario import ModelSpec, validate_scenario
from simtrain.train.architecture import ELEMENTWISE, architecture, checkpoint_blocks, units_of
from simtrain.train.checkpointing import split_blocks
from simtrain.train.data_shape import DIGITS_INFO, DatasetInfo, tokens_info
from simtrain.train.models import build_model
from simtrain.train.partition import model_units
from simtrain.train.tensor_parallel import ELEMENTWISE as ELEMENTWISE_MODULES

ROOT = Path(__file__).resolve().parents[1]

VALIDATE_WITHOUT_TORCH = """
import sys
from simtrain.cli import main
for args in {runs!r}:
    try:
        main(["validate", *args])
    except SystemExit as exit:
        assert exit.code in (0, None), (args, exit.code)
assert "torch" not in sys.modules, "validate imported torch"
assert "numpy" not in sys.modules, "validate imported numpy (the simulator's; hw/resolved_cluster.py needs none)"
assert "networkx" not in sys.modules, "validate imported networkx (a builder's graph is made when first read)"
"""

HELP_WITHOUT_GRAPHS = """
import sys
from simtrain.cli import main
try:
    main(["--help"])
except SystemExit as exit:
    assert exit.code in (0, None), exit.code
heavy = sorted(name for name in ("torch", "numpy", "networkx", "simpy") if name in sys.modules)
assert not heavy, f"--help imported {heavy}"
"""


def test_validate_of_built_in_models_imports_no_torch():
    runs = [["scenarios/quickstart.yaml"],
            ["scenarios/gpt_small.yaml", "--set", "parallel.tp=2", "--set", "parallel.pp=2",
             "--set", "parallel.sequence_parallel=true", "--set", "numerics=false"],
            ["scenarios/llama3-405b-8k.yaml"],  # tp x pp, the distributed optimizer over dp
            ["scenarios/moe_expert_parallel.yaml"]]
    done = subprocess.run([sys.executable, "-c", VALIDATE_WITHOUT_TORCH.format(runs=runs)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(": ok (") == len(runs)


def test_help_imports_no_simulator():
    done = subprocess.run([sys.executable, "-c", HELP_WITHOUT_GRAPHS], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Usage:" in done.stdout


IMAGES_3x7x5 = DatasetInfo(num_features=105, num_classes=4, image_shape=(3, 7, 5), input_shape=(105,))


@pytest.mark.parametrize("spec,info", [
    (ModelSpec(name="mlp", hidden=[64, 32]), DIGITS_INFO),
    (ModelSpec(name="mlp", hidden=[17, 5, 9], batchnorm=True), DIGITS_INFO),
    (ModelSpec(name="cnn", channels=[4, 8, 6], batchnorm=True), DIGITS_INFO),
    (ModelSpec(name="cnn", channels=[5, 3]), IMAGES_3x7x5),
    (ModelSpec(name="gpt", hidden=[32], layers=3, heads=4), tokens_info(16, 50)),
    (ModelSpec(name="gpt", hidden=[32], layers=4, heads=2, moe={"experts": 4, "shared_experts": 1, "every": 2}),
     tokens_info(8, 64)),
    (ModelSpec(name="llama", hidden=[48], layers=2, heads=6, kv_heads=2, ffn_hidden=100), tokens_info(16, 96)),
    (ModelSpec(name="gpt", hidden=[32], layers=2, heads=2, moe={"experts": 4, "expert_hidden": 24}),
     tokens_info(8, 64)),
    (ModelSpec(name="llama", hidden=[48], layers=4, heads=6, kv_heads=2, ffn_hidden=100,
               moe={"experts": 4, "shared_experts": 1, "every": 2}), tokens_info(16, 96)),
    (ModelSpec(name="llama", hidden=[48], layers=2, heads=6, kv_heads=2, moe={"experts": 2, "expert_hidden": 20}),
     tokens_info(16, 96)),
])
def test_architecture_is_the_built_model(spec, info):
    with torch.device("meta"):
        model = build_model(spec, info, seed=0)
    entries = architecture(spec, info)
    assert [entry.kind for entry in entries] == [type(module).__name__ for module in model]
    assert [entry.parameters for entry in entries] == [sum(p.numel() for p in module.parameters()) for module in model]
    assert sum(entry.parameters for entry in entries) == sum(p.numel() for p in model.parameters())
    for tensor_parallel in (False, True):
        assert units_of(entries, tensor_parallel) == model_units(model, tensor_parallel)
    assert checkpoint_blocks([entry.matrix for entry in entries]) == split_blocks(list(model))
    assert [entry.attention for entry in entries] == [hasattr(module, "recompute_core") for module in model]


def test_element_wise_kinds_are_tensor_parallels():
    assert ELEMENTWISE == tuple(kind.__name__ for kind in ELEMENTWISE_MODULES)


MLP = {"cluster": {"devices": 4}, "model": {"hidden": [8]}, "train": {"steps": 1}, "numerics": False}
GPT = {"cluster": {"devices": 4}, "data": {"name": "tokens", "seq_len": 16, "vocab": 64}, "train": {"steps": 1},
       "model": {"name": "gpt", "hidden": [32], "layers": 2, "heads": 4}, "numerics": False}
LLAMA = {**GPT, "model": {"name": "llama", "hidden": [48], "layers": 2, "heads": 6, "kv_heads": 2,
                          "ffn_hidden": 96}}


def _with(base: dict, **sections) -> dict:
    return {**base, **{key: {**base.get(key, {}), **value} for key, value in sections.items()}}


BAD = [
    _with(MLP, parallel={"dp": 3}),  # the layout
    _with(MLP, data={"name": "synthetic", "samples": 3, "test_fraction": 0.1}),  # an empty test split
    _with(GPT, data={"samples": 2}),
    _with(MLP, data={"validation_fraction": 0.9999}),
    _with(MLP, model={"name": "cnn"}, data={"name": "synthetic"}),  # no images
    _with(MLP, model={"name": "gpt", "hidden": [32], "heads": 4}),  # no tokens
    _with(MLP, model={"hidden": [8, 8]}, train={"checkpointing": {"segments": 4}}),
    _with(GPT, parallel={"tp": 2, "sequence_parallel": True}, data={"seq_len": 15}),
    _with(GPT, parallel={"cp": 2}, data={"seq_len": 6}),
    _with(GPT, cluster={"devices": 8}, parallel={"pp": 8}),
    _with(GPT, parallel={"pp": 2, "pipeline": {"split": [1, 2]}}),
    _with(GPT, parallel={"pp": 2, "pipeline": {"split": [1, 3]}}, train={"checkpointing": {"segments": 2}}),
    _with(MLP, parallel={"tp": 2}, model={"hidden": [8, 8, 8]}, train={"checkpointing": {"segments": 3}}),  # 2 units
    _with(GPT, parallel={"cp": 2}, train={"checkpointing": {"segments": 5}}),  # 4 blocks
    _with(GPT, parallel={"tp": 4}, model={"heads": 2, "hidden": [32]}),
    _with(GPT, parallel={"tp": 4}, data={"vocab": 66}),
    _with(LLAMA, parallel={"tp": 4}),  # 6 heads
    _with(LLAMA, parallel={"tp": 2}, model={"ffn_hidden": 97}),
    _with(MLP, parallel={"tp": 4}, model={"hidden": [6]}),
    _with(MLP, parallel={"tp": 2}, model={"hidden": []}),  # nothing to split
    _with(MLP, parallel={"sharding": {"stage": 2, "degree": 3}}),
    _with(MLP, parallel={"sharding": {"stage": 2, "offload": "optimizer"}}),
    _with(GPT, parallel={"pp": 2, "sharding": {"stage": 1, "degree": 3}}),
    _with(GPT, model={"moe": {"experts": 4}}, cluster={"devices": 6}, parallel={"ep": 4}),
    {**_with(GPT, model={"moe": {"experts": 4}}, parallel={"tp": 2, "sequence_parallel": True, "ep": 4}),
     "numerics": True},
    _with(LLAMA, model={"moe": {"experts": 4}}, parallel={"tp": 4, "sequence_parallel": True}),  # 6 heads
    _with(MLP, parallel={"all_reduce": "tree", "channels": 2}),
]


def _refusal(make) -> str | None:
    try:
        make()
    except ScenarioError as error:
        return str(error)
    return None


@pytest.mark.parametrize("raw", BAD, ids=range(len(BAD)))
def test_check_job_refuses_as_the_build_does(raw):
    scenario = validate_scenario(raw)
    assert covered(scenario)
    cluster = build_cluster(scenario.cluster, scenario.base_dir, record=False, seed=scenario.seed)
    built = _refusal(lambda: Job(scenario, cluster, range(cluster.size), numerics=False))
    checked = _refusal(lambda: check_job(scenario, cluster.shared_memory, cluster.size))
    assert built is not None and checked == built
