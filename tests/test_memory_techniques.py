"""Activation memory from the real graph, gradient checkpointing, the memory plan, out of memory.

References: the tensors autograd saves, computed by hand; plain (un-checkpointed)
torch for gradients and BatchNorm statistics; the memory ledgers of a real run;
closed-form byte counts for a model too large to build.
"""
import json

import pytest
import torch
import torch.nn.functional as F

import simtrain
from simtrain.cli import main
from simtrain.cost import measure_step_cost
from simtrain.memory_plan import plan_memory
from simtrain.scenario import CheckpointSegments, ModelSpec, validate_scenario
from simtrain.train.checkpointing import apply_checkpointing
from simtrain.train.data import load_dataset
from simtrain.train.models import build_model
from simtrain.units import format_bytes

DIGITS = load_dataset("digits", {}, seed=0)


def scenario(hidden, steps=2, devices=1, batch=64, precision="fp32", checkpointing="none", **extra):
    raw = {
        "name": "mem", "seed": 1,
        "cluster": {"topology": "ring", "devices": devices, **extra.pop("cluster", {})},
        "model": {"name": "mlp", "hidden": list(hidden), **extra.pop("model", {})},
        "data": {"name": "digits", "batch_size": batch},
        "train": {"steps": steps, "precision": precision, "checkpointing": checkpointing,
                  "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}},
        "report": {"trace": False},
    }
    return validate_scenario(raw)


def test_fp16_activations_are_what_autograd_saves_and_about_half_of_fp32():
    batch = 32
    model = build_model(ModelSpec(name="mlp", hidden=[128]), DIGITS.info, seed=0)  # Linear(64,128)-ReLU-Linear(128,10)
    x, y = DIGITS.train.tensors[0][:batch], DIGITS.train.tensors[1][:batch]
    fp32 = measure_step_cost(model, x, y).activation_bytes
    fp16 = measure_step_cost(model.half(), x.half(), y).activation_bytes
    # fp16: ReLU's output h (32 x 128 x 2 B), saved again by Linear2; the logits are upcast for the
    # loss (the cast saves nothing), so log_softmax saves its fp32 output (32 x 10 x 4 B); nll_loss
    # saves that again and its fp32 0-dim total_weight (4 B). fp32: h is 4 B per element.
    assert fp16 == batch * 128 * 2 + batch * 10 * 4 + 4 == 9_476
    assert fp32 == batch * 128 * 4 + batch * 10 * 4 + 4
    assert 0.5 < fp16 / fp32 < 0.55  # the fp32 loss keeps it a little above half


def run_16_blocks(checkpointing):
    # 15 hidden Linear+ReLU blocks and the head: 16 blocks, sqrt -> 4 segments of 4.
    return simtrain.run(scenario([256] * 15, checkpointing=checkpointing))


def test_sqrt_checkpointing_of_16_blocks_halves_activations_for_about_one_more_forward():
    plain, checkpointed = run_16_blocks("none"), run_16_blocks("sqrt")
    activations = [r.data["devices"][0]["peak_memory_bytes_by_category"]["activations"]
                   for r in (plain, checkpointed)]
    # Without checkpointing: 15 ReLU outputs (64 x 256 x 4 B) + log-probs + total_weight.
    assert activations[0] == 15 * 64 * 256 * 4 + 64 * 10 * 4 + 4
    assert activations[0] >= 2 * activations[1]
    compute = [r.data["breakdown_s"]["compute"] for r in (plain, checkpointed)]
    assert 1.15 <= compute[1] / compute[0] <= 1.45
    # Recomputation changes no number: the trained weights are bit-identical.
    for (name, a), (_, b) in zip(plain.final_model.state_dict().items(), checkpointed.final_model.state_dict().items()):
        assert torch.equal(a, b), name


def test_checkpointed_batchnorm_updates_running_statistics_once_per_step():
    model = build_model(ModelSpec(name="mlp", hidden=[32, 32, 32], batchnorm=True), DIGITS.info, seed=0)
    checkpointed = apply_checkpointing(build_model(ModelSpec(name="mlp", hidden=[32, 32, 32], batchnorm=True),
                                                   DIGITS.info, seed=0), CheckpointSegments(segments=3))
    assert len(checkpointed.segments) == 3
    for start in (0, 32, 64):
        x, y = DIGITS.train.tensors[0][start:start + 32], DIGITS.train.tensors[1][start:start + 32]
        for net in (model, checkpointed):
            F.cross_entropy(net(x), y).backward()
    for (name, a), (_, b) in zip(model.state_dict().items(), checkpointed.state_dict().items()):
        assert torch.equal(a, b), name  # running_mean, running_var, num_batches_tracked included
    for a, b in zip(model.parameters(), checkpointed.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.slow
def test_memory_plan_is_what_the_run_holds():
    spec = scenario([64, 64, 64, 64], devices=4, batch=16, precision="fp16", checkpointing="sqrt")
    report = simtrain.run(spec)
    for plan, device in zip(plan_memory(spec), report.data["devices"]):
        assert plan.peak_bytes == device["peak_memory_bytes"]
        assert plan.by_category == device["peak_memory_bytes_by_category"]


@pytest.mark.slow
def test_memory_plan_of_a_model_too_big_for_this_host():
    width, depth, batch = 60_000, 4, 512
    spec = scenario([width] * depth, batch=batch, precision="fp16",
                    cluster={"device": {"base": "h100-80gb", "memory": "2 TiB"}})
    widths = [64, *[width] * depth, 10]
    params = sum(a * b + b for a, b in zip(widths, widths[1:]))  # 14.4 billion: 58 GB in fp32
    # fp16 ReLU outputs, then the fp32 log-probs and total_weight (see the fp16 test above).
    per_sample = depth * width * 2 + 10 * 4
    (plan,) = plan_memory(spec)
    held = {"weights": 2 * params, "master_weights": 4 * params, "gradients": 6 * params,
            "optimizer_state": 4 * params}  # SGD momentum on the fp32 master
    assert plan.by_category == {**held, "activations": batch * per_sample + 4, "comm_buffers": 0}
    free = 2 * 2 ** 40 - sum(held.values()) - 4
    assert plan.largest_batch == free // per_sample


def test_a_batch_that_does_not_fit_stops_with_out_of_memory_on_that_device(tmp_path, capsys):
    # Rank 2 has 512 KiB, the others 40 GiB. The weights, gradients and momentum take 306 KiB;
    # a batch of 300 needs 300 x 1,064 B of activations more.
    spec = {"cluster": {"overrides": {2: {"memory": "512 KiB"}}}}
    path = tmp_path / "oom.yaml"
    raw = scenario([128, 128], devices=4, batch=300, **spec).model_dump(mode="json")
    path.write_text(json.dumps(raw))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(path), "--out", str(tmp_path / "out"), "--quiet"])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("error: out of memory on rank 2 ")
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["status"] == "out_of_memory" and data["steps"] == 0
    oom = data["out_of_memory"]
    assert oom["rank"] == 2 and oom["capacity_bytes"] == 2 ** 19
    params = 64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10
    per_sample, held = 2 * 128 * 4 + 10 * 4, 3 * params * 4  # weights, gradients, momentum
    assert oom["bytes_by_category"]["activations"] == 300 * per_sample + 4  # the category that overflowed
    assert oom["largest_batch_size_that_fits"] == (2 ** 19 - held - 4) // per_sample == 198
    assert f"largest per-device batch size that fits is {oom['largest_batch_size_that_fits']}" in message


def test_the_out_of_memory_line_gives_the_steps_peak_that_simtrain_memory_gives(tmp_path, capsys):
    """Ranks 1 to 3 have 200 KiB: the weights, gradients and momentum (306 KiB) overflow them before any
    activation is held. The line and report.json give the peak the whole step would reach, `simtrain memory`'s
    figure for that rank, and name the same rank; what the device held when it stopped is kept beside it."""
    small = {"memory": "200 KiB"}
    spec = {"cluster": {"overrides": {1: small, 2: small, 3: small}}}
    path = tmp_path / "oom.yaml"
    path.write_text(json.dumps(scenario([128, 128], devices=4, batch=300, **spec).model_dump(mode="json")))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(path), "--out", str(tmp_path / "out"), "--quiet"])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip()
    with pytest.raises(SystemExit):
        main(["memory", str(path), "--json"])
    planned = {plan["rank"]: plan for plan in map(json.loads, capsys.readouterr().out.splitlines())}
    oom = json.loads((tmp_path / "out" / "report.json").read_text())["out_of_memory"]
    rank = oom["rank"]
    assert message.startswith(f"error: out of memory on rank {rank} ")
    assert oom["needed_bytes"] == planned[rank]["peak_bytes"] > oom["stopped_at_bytes"] > oom["capacity_bytes"]
    assert oom["bytes_by_category"] == planned[rank]["bytes_by_category"]
    assert oom["bytes_by_category"]["activations"] > 0
    assert f"needs {format_bytes(planned[rank]['peak_bytes'])} of 200.0 KiB at its peak" in message


def test_memory_no_search_gives_the_same_peaks_without_the_largest_batch(tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    path.write_text(json.dumps(scenario([128, 128], devices=2, batch=30).model_dump(mode="json")))

    def planned(*flags) -> str:
        with pytest.raises(SystemExit) as exit_info:
            main(["memory", str(path), *flags])
        assert exit_info.value.code == 0
        return capsys.readouterr().out

    searched = [json.loads(line) for line in planned("--json").splitlines()]
    alone = [json.loads(line) for line in planned("--json", "--no-search").splitlines()]
    assert [plan["largest_batch_size"] for plan in alone] == [None, None]
    assert all(plan["largest_batch_size"] > 30 for plan in searched)
    assert alone == [{**plan, "largest_batch_size": None} for plan in searched]
    assert "largest batch" in planned() and "largest batch" not in planned("--no-search")
