"""`simtrain launch` trains what `simtrain run` simulates, for real, and reports measured times.

Reference: the simulated run of the same scenario on as many devices
(`simtrain.run`), whose numerics are real torch; the launched run is N gloo
processes, each building only its own rank's replica and running the same
step program with the real interpreter. Final parameters must agree within 1e-5.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import simtrain
from simtrain.cli import main
from simtrain.compare import compare_reports
from simtrain.real.launch import launch
from simtrain.real.processes import torchrun_world

STEPS, WARMUP = 5, 1


def write_scenario(folder: Path, all_reduce="ring", optimizer=None, **extra) -> Path:
    scenario = {
        "name": "launched", "seed": 7,
        "cluster": {"topology": "ring", "devices": 4},
        "model": {"name": "mlp", "hidden": [32, 16]},
        "data": {"name": "digits", "batch_size": 16},
        "train": {"steps": STEPS, "optimizer": optimizer or {"name": "sgd", "lr": 0.1, "momentum": 0.9}},
        "parallel": {"all_reduce": all_reduce},
    }
    for section, fields in extra.items():
        scenario[section] = {**scenario[section], **fields}
    path = folder / "scenario.yaml"
    path.write_text(yaml.safe_dump(scenario))
    return path


def assert_same_parameters(launched: Path, report) -> None:
    measured = torch.load(launched / "final_model.pt")
    simulated = report.final_model.state_dict()
    assert measured.keys() == simulated.keys()
    for name, tensor in simulated.items():
        torch.testing.assert_close(measured[name], tensor, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def ring_of_two(tmp_path_factory):
    """The scenario launched on 2 gloo processes (ring programs), shared by the tests that read its outputs."""
    folder = tmp_path_factory.mktemp("ring_of_two")
    path = write_scenario(folder)
    return path, folder / "real", launch(path, [], 2, folder / "real", warmup=WARMUP)


def check_launched(path: Path, out: Path, data: dict, world: int) -> None:
    assert_same_parameters(out, simtrain.run(simtrain.load_scenario(path, [f"cluster.devices={world}"])))
    assert data["measured"] is True and data["devices_count"] == world
    assert data["steps"] == STEPS - WARMUP and data["measurement"]["warmup_steps"] == WARMUP
    # the measured parts fit in the measured step: no span counted twice
    assert sum(seconds for part, seconds in data["breakdown_s"].items() if part != "idle") <= data["step_time_s"]
    assert data["breakdown_s"]["compute"] > 0 and data["breakdown_s"]["communication"] > 0
    assert data["measurement"]["forward_s"] + data["measurement"]["backward_s"] == pytest.approx(
        data["breakdown_s"]["compute"])
    assert len(data["loss_curve"]) == STEPS
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk["final_loss"] == pytest.approx(data["final_loss"])


@pytest.mark.gloo
def test_launch_on_two_processes_trains_the_parameters_run_simulates(ring_of_two):
    check_launched(*ring_of_two, world=2)


TECHNIQUES = {"train": {"precision": "fp16", "checkpointing": "sqrt"}, "data": {"sampling": "prioritized"}}


@pytest.mark.gloo
@pytest.mark.parametrize("world, all_reduce, optimizer, collective, extra", [
    (4, "tree", None, "programs", {}),
    (2, "ring", None, "native", {}),
    (2, "naive", {"name": "kfac", "lr": 0.05, "inv_update_steps": 2}, "programs", {}),
    (2, "ring", {"name": "adam", "lr": 0.01}, "programs", TECHNIQUES),
    (2, "ring", None, "programs", {"model": {"batchnorm": True}, "parallel": {"sync_batchnorm": True}}),
])
def test_launch_trains_the_parameters_run_simulates(tmp_path, world, all_reduce, optimizer, collective, extra):
    path = write_scenario(tmp_path, all_reduce, optimizer, **extra)
    data = launch(path, [], world, tmp_path / "real", collective=collective, warmup=WARMUP)
    check_launched(path, tmp_path / "real", data, world)


@pytest.mark.gloo
@pytest.mark.parametrize("world, layout, extra", [
    (2, {"pp": 2}, {}),
    (2, {"tp": 2}, {}),
    (4, {"pp": 2, "tp": 2}, {}),
    (4, {"pp": 2, "dp": 2, "pipeline": {"schedule": "gpipe"}}, {"train": {"precision": "fp16"}}),
    (2, {"sharding": {"stage": 3}}, {}),
    (4, {"pp": 2, "sharding": {"stage": 1}}, {"train": {"precision": "bf16"}}),
])
def test_launch_runs_pipeline_and_tensor_parallel_layouts_as_run_simulates(tmp_path, world, layout, extra):
    """Pipeline activations and gradients go as Send/Recv programs, tensor-parallel all-reduces on their own
    groups, a sharded rank's gathers and reduce-scatters on its shard group's (and at the end the fp32 shards
    gathered into the whole model), over real gloo: the parameters equal the simulated run's, whose messages took
    the simulated mailbox."""
    path = write_scenario(tmp_path, model={"hidden": [32, 32, 32]}, parallel=layout, **extra)
    data = launch(path, [], world, tmp_path / "real", warmup=WARMUP)
    simulated = simtrain.run(simtrain.load_scenario(path, [f"cluster.devices={world}"]))
    assert_same_parameters(tmp_path / "real", simulated)
    assert data["measured"] is True and data["devices_count"] == world
    assert {key: data["parallel"][key] for key in ("pp", "tp")} == {"pp": layout.get("pp", 1),
                                                                    "tp": layout.get("tp", 1)}
    # the measured loss of each step is the mean of the last stage's microbatch losses, as simulated
    assert [loss for _, loss in data["loss_curve"]] == pytest.approx(
        [loss for _, loss in simulated.data["loss_curve"]], abs=1e-5)


@pytest.mark.gloo
def test_launch_runs_experts_as_run_simulates(tmp_path):
    """Expert parallelism under data parallelism alone: each process builds its own experts, its tokens cross to
    the other's by real all-to-alls; the parameters equal the simulated run's."""
    path = write_scenario(tmp_path, model={"name": "gpt", "hidden": 16, "layers": 2, "heads": 2,
                                           "moe": {"experts": 4, "top_k": 2, "aux_loss_coeff": 0.0}},
                          data={"name": "tokens", "batch_size": 4, "seq_len": 8, "vocab": 32, "samples": 256},
                          parallel={"ep": 2})
    launch(path, [], 2, tmp_path / "real", warmup=WARMUP)
    assert_same_parameters(tmp_path / "real", simtrain.run(simtrain.load_scenario(path, ["cluster.devices=2"])))


@pytest.mark.gloo
def test_the_trace_shows_every_rank_s_measured_spans(ring_of_two):
    _, out, _ = ring_of_two
    trace = json.loads((out / "trace.json").read_text())
    spans = [event for event in trace["traceEvents"] if event["ph"] == "X"]
    for rank in (0, 1):
        names = [span["name"] for span in spans if span["tid"] == rank]
        # one forward, backward, all-reduce and optimizer step per measured step, in program order
        assert names.count("forward") == STEPS - WARMUP and names.count("dp_allreduce") == STEPS - WARMUP
        kinds = [span["name"] for span in sorted((s for s in spans if s["tid"] == rank), key=lambda s: s["ts"])
                 if span["name"] != "idle"]
        assert kinds[:4] == ["forward", "backward", "dp_allreduce", "optimizer step"]


@pytest.mark.gloo
def test_torchrun_starts_the_group(tmp_path):
    path = write_scenario(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]),
                                                                    os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",  # a free port
               "-m", "simtrain", "launch", str(path), "--warmup", str(WARMUP), "--out", str(tmp_path / "real"), "-q"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert_same_parameters(tmp_path / "real", simtrain.run(simtrain.load_scenario(path, ["cluster.devices=2"])))
    assert json.loads((tmp_path / "real" / "report.json").read_text())["devices_count"] == 2


def test_torchrun_variables_are_read(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    assert torchrun_world() is None
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert torchrun_world() is None  # MASTER_ADDR missing: not torchrun's group
    monkeypatch.setenv("MASTER_ADDR", "node0")
    assert torchrun_world() == (3, 8, 1)


@pytest.mark.gloo
def test_compare_puts_a_run_and_a_launch_side_by_side(tmp_path, capsys, ring_of_two):
    path, real, _ = ring_of_two
    simtrain.run(simtrain.load_scenario(path, ["cluster.devices=2"])).write(tmp_path / "sim")
    rows = {row["figure"]: row for row in compare_reports(tmp_path / "sim", real)}
    simulated = json.loads((tmp_path / "sim" / "report.json").read_text())
    measured = json.loads((real / "report.json").read_text())
    step = rows["step time"]
    assert step["values"] == [simulated["step_time_s"], measured["step_time_s"]]
    assert step["error"] == pytest.approx((simulated["step_time_s"] - measured["step_time_s"])
                                         / measured["step_time_s"])
    # the measured run is the reference whichever comes first
    swapped = {row["figure"]: row for row in compare_reports(real, tmp_path / "sim")}
    assert swapped["step time"]["error"] == pytest.approx(step["error"])
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", str(tmp_path / "sim"), str(real), "--out", str(tmp_path / "cmp")])
    assert exit_info.value.code == 0
    assert "throughput" in capsys.readouterr().out
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text())["kinds"] == ["simulated", "measured"]


@pytest.mark.gloo
def test_launch_lists_the_files_it_wrote(tmp_path, capsys):
    path = write_scenario(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", str(path), "--nproc", "2", "--set", "report.trace=false", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 0
    printed = "".join(capsys.readouterr().out.splitlines())  # the console wraps long lines
    wrote = [name.strip() for name in printed.split(f"wrote {tmp_path / 'out'}/")[1].split(",")]
    assert sorted(wrote) == sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "final_model.pt", "report.json", "scenario.resolved.yaml"]


@pytest.mark.parametrize("overrides, options, message", [
    (["parallel.mode=async"], [], "parallel.mode: async runs simulated only"),
    (["numerics=false"], [], "numerics: launch trains for real"),
    ([], ["--warmup", "5"], "--warmup: 5 warm-up steps leave none of train.steps 5"),
    ([], ["--backend", "nccl"], "--backend: nccl needs CUDA tensors"),
    (["model.name=nosuchpackage.module:model"], [], "model.name: cannot import"),  # before any process starts
])
def test_what_launch_does_not_run_is_one_line(tmp_path, capsys, overrides, options, message):
    path = write_scenario(tmp_path)
    sets = [part for override in overrides for part in ("--set", override)]
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", str(path), "--nproc", "2", *sets, *options, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert message in error and "\n" not in error and "Traceback" not in error
    assert not (tmp_path / "out").exists()


def test_launch_refuses_nccl_where_it_may_reduce_in_a_switch(tmp_path, capsys):
    """NVLS runs on the NVSwitch itself: no process of the group can stand for it (before any process starts)."""
    topology = str(Path(simtrain.__file__).parents[1] / "topologies" / "dgx-h100-1node.yaml")
    path = write_scenario(tmp_path, all_reduce="nccl", cluster={"topology": topology, "devices": 8})
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", str(path), "--nproc", "8", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "parallel.all_reduce: nccl may reduce in the switches ['n0-nvswitch']" in error and "\n" not in error
    assert not (tmp_path / "out").exists()
