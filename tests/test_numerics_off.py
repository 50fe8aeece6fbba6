"""Numerics off: the same job on meta tensors gives the same simulated times, bytes and memory.

Reference: the numerics-on run of the same scenario. Only what needs values
differs: losses and accuracies are null, weight norms and the training-set
loss curve are empty, and no final_model.pt is written.
"""
import json

import pytest

import simtrain
from simtrain.cli import main
from simtrain.scenario import validate_scenario
from simtrain.train.data import load_dataset

TECHNIQUES = {
    "ring": {},
    "naive on a switch": {"cluster": {"topology": "switch"}, "parallel": {"all_reduce": "naive"}},
    "tree, adam, bf16": {"parallel": {"all_reduce": "tree"},
                         "train": {"precision": "bf16", "optimizer": {"name": "adam", "lr": 1e-3}}},
    "fp16 + checkpointing": {"train": {"precision": "fp16", "checkpointing": "sqrt"}},
    "kfac": {"train": {"optimizer": {"name": "kfac", "lr": 0.1, "inv_update_steps": 2}}},
    "sync batchnorm": {"model": {"batchnorm": True}, "parallel": {"sync_batchnorm": True}},
    "async locked": {"parallel": {"mode": "async", "async": {"consistency": "locked"}}},
    "zero 2, adam": {"parallel": {"sharding": {"stage": 2}}, "train": {"optimizer": {"name": "adam", "lr": 1e-3}}},
    "zero 3, bf16": {"parallel": {"sharding": {"stage": 3}}, "train": {"precision": "bf16"}},
    "zero 2, optimizer offloaded": {"cluster": {"shared_memory": {"host": "dgx-a100"}},
                                    "parallel": {"sharding": {"stage": 2, "offload": "optimizer"}}},
    "zero 3, optimizer and parameters offloaded": {
        "cluster": {"shared_memory": {"host": "dgx-a100"}},
        "parallel": {"sharding": {"stage": 3, "offload": "optimizer_and_parameters"}},
        "train": {"optimizer": {"name": "adam", "lr": 1e-3}}},
    "straggler and jitter": {"cluster": {"overrides": {1: {"slowdown": 1.7}}, "compute_jitter": 0.3}},
    "pipeline 1f1b, bf16, checkpointing": {"parallel": {"pp": 3, "pipeline": {"microbatches": 4}},
                                           "train": {"precision": "bf16", "checkpointing": "sqrt"}},
    "pipeline interleaved": {"cluster": {"devices": 2}, "model": {"hidden": [40, 24, 24]},
                             "parallel": {"pp": 2, "pipeline": {"schedule": "interleaved", "virtual_stages": 2,
                                                                "microbatches": 2}}},
    "dp x pp x tp": {"cluster": {"devices": 8}, "parallel": {"tp": 2, "pp": 2, "pipeline": {"microbatches": 2}}},
    "pp x tp, fp16 overflow vote": {"cluster": {"devices": 4}, "train": {"precision": "fp16"},
                                    "parallel": {"tp": 2, "pp": 2, "pipeline": {"microbatches": 2}}},
    "gpt, vocabulary-parallel": {"cluster": {"devices": 4},
                                 "model": {"name": "gpt", "hidden": 32, "layers": 2, "heads": 4},
                                 "data": {"name": "tokens", "batch_size": 8, "samples": 256, "seq_len": 8, "vocab": 16},
                                 "parallel": {"tp": 2, "pp": 2, "pipeline": {"microbatches": 2}}},
}
NEEDS_VALUES = ("final_loss", "final_accuracy", "loss_curve", "train_loss_curve", "weight_norms", "wall_time_s")


def scenario(extra: dict, numerics: bool):
    return validate_scenario({
        "name": "numerics", "seed": 4, "numerics": numerics,
        "cluster": {"topology": "ring", "devices": 3, **extra.get("cluster", {})},
        "model": {"name": "mlp", "hidden": [40, 24], **extra.get("model", {})},
        "data": {"name": "digits", "batch_size": 24, **extra.get("data", {})},
        "train": {"steps": 6, **extra.get("train", {})},
        "parallel": extra.get("parallel", {}),
    })


@pytest.mark.parametrize("name", TECHNIQUES)
def test_numerics_off_gives_the_same_times_bytes_and_memory(name):
    on = simtrain.run(scenario(TECHNIQUES[name], numerics=True)).data
    off = simtrain.run(scenario(TECHNIQUES[name], numerics=False)).data
    assert off["final_loss"] is None and off["final_accuracy"] is None and off["train_loss_curve"] == []
    assert [t for t, _ in off["loss_curve"]] == [t for t, _ in on["loss_curve"]]
    assert all(loss is None for _, loss in off["loss_curve"])
    same = {key: value for key, value in on.items() if key not in NEEDS_VALUES}
    assert json.dumps({key: off[key] for key in same}, sort_keys=True) == json.dumps(same, sort_keys=True)


# (replica forwards replayed, and run every step): the step engine (data parallelism alone) runs no replica's
# forward, it replays each model part's measured cost; ZeRO runs one replica's once in all
FORWARDS = {"ring": (0, 0), "zero 3, bf16": (0, 0)}  # the step engine replays its measured chunks


@pytest.mark.parametrize("name", FORWARDS)
def test_numerics_off_runs_a_replica_once_per_batch_shape(name, monkeypatch):
    """On meta tensors a forward and backward computes shapes alone, the same each step: the job's replicas run
    their model for training once in all at most (`run_forward`), each its optimizer once, and the report is
    the one of running them every step."""
    from simtrain.train.replica import Replica

    forwards, optimizer_steps = [], []
    run_forward, built = Replica.run_forward, Replica.__init__
    monkeypatch.setattr(Replica, "run_forward", lambda self, x, y: forwards.append(1) or run_forward(self, x, y))

    def counted(self, *args, **kwargs):
        built(self, *args, **kwargs)
        self.optimizer.register_step_post_hook(lambda *_: optimizer_steps.append(1))

    monkeypatch.setattr(Replica, "__init__", counted)
    replayed = simtrain.run(scenario(TECHNIQUES[name], numerics=False)).data
    assert len(forwards) == FORWARDS[name][0]
    assert len(optimizer_steps) == (3 if name == "ring" else 0)  # ZeRO steps an optimizer of its own shard

    def every_step(self, *args, **kwargs):
        counted(self, *args, **kwargs)
        self.run_every_step()

    forwards.clear()
    monkeypatch.setattr(Replica, "__init__", every_step)
    assert simtrain.run(scenario(TECHNIQUES[name], numerics=False)).data | {"wall_time_s": 0} == (
        replayed | {"wall_time_s": 0})
    assert len(forwards) == FORWARDS[name][1]


def test_run_no_numerics_writes_no_model(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(scenario({}, numerics=True).model_dump(mode="json")))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(path), "--no-numerics", "--quiet", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["report.json", "scenario.resolved.yaml",
                                                                   "trace.json"]
    assert json.loads((tmp_path / "out" / "report.json").read_text())["final_loss"] is None


def test_prioritized_sampling_needs_numerics():
    with pytest.raises(simtrain.ScenarioError, match="data.sampling: prioritized needs numerics"):
        validate_scenario({"numerics": False, "data": {"sampling": "prioritized"}})


def test_token_data_is_shapes_alone_without_numerics():
    """A 51,200-token vocabulary's successor table would take 21 GB; numerics off draws no sequence."""
    splits = load_dataset("tokens", {"samples": 64, "seq_len": 2048, "vocab": 51200}, seed=0, values=False)
    x, y = splits.train[0]
    assert x.is_meta and y.is_meta and x.shape == (2048,) and len(splits.train) + len(splits.test) == 64
