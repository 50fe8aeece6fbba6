"""`simtrain calibrate`: the α-β fit against closed forms, and files that `simtrain run` takes as they are.

References: exact α + n/β data (the fit must give α and β back); the written
device and topology files loaded by the catalog and the topology loader, and a
scenario naming them run by `simtrain.run`; training steps recorded on this
machine (real/step_timing.py's samples of 2 gloo ranks:
tests/fixtures/calibration_widths.json, and calibration_steps.json, recorded
before the update had a fixed cost of its own), whose fits are checked against
means and least squares computed here and against the simulator's ring on the
topology they give; the jitter's model drawn with a seeded Generator; models
built in plain torch for the widened cases' bytes; quartiles by hand for the
load check, and sums of means by hand for the measured step that tells
calibrations' machine speeds apart.
"""
import copy
import json
import os
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import simtrain
import simtrain.train.data
import simtrain.train.models
from simtrain.cost import measure_step_cost
from simtrain.op_cost import OperatorRecorder
from simtrain.train.data import ShardLoader
from simtrain.train.replica import Replica
from simtrain.train.precision import update_bytes
from simtrain.cli import main
from simtrain.hw.catalog import resolve_device
from simtrain.hw.topology_builders import load_topology_file
from simtrain.comm.bench import benchmark_all_reduce
from simtrain.real.calibrate import _topology, calibrate
from simtrain.real.fit import (AlphaBeta, ComputeJitter, fit_alpha_beta, fit_compute_jitter, fit_pass_costs,
                               fit_update_costs, modelled_wait)
from simtrain.real.machine_load import drift_warning, load_warning, relative_spread
from simtrain.real.step_fit import exchange_software_cost, fit_step_timings, measured_step_s, pooled_samples
from simtrain.real.step_timing import GEMM_SIZES, step_cases, widened
from simulated_steps import one_step

SIZES = [4, 64, 1024, 16384]


def test_the_fit_gives_alpha_and_beta_back():
    sizes = [4 ** k for k in range(1, 12)]
    fit = fit_alpha_beta(sizes, [20e-6 + n / 3e9 for n in sizes])
    assert fit.latency_s == pytest.approx(20e-6, rel=1e-9)
    assert fit.bandwidth_Bps == pytest.approx(3e9, rel=1e-9)
    assert fit.max_residual < 1e-9 and fit.bandwidth_resolved
    times = [(20e-6 + n / 3e9) * (1.1 if k % 2 else 0.9) for k, n in enumerate(sizes)]
    noisy = fit_alpha_beta(sizes, times)
    assert noisy.residuals == pytest.approx([(t - noisy.time_s(n)) / t for n, t in zip(sizes, times)])

    def relative_squares(alpha, bandwidth):  # relative to the fitted line, whose weights the fit converged to
        return sum(((t - alpha - n / bandwidth) / noisy.time_s(n)) ** 2 for n, t in zip(sizes, times))

    best = relative_squares(noisy.latency_s, noisy.bandwidth_Bps)  # least squares: any other line is worse
    for alpha, bandwidth in ((1.01, 1), (0.99, 1), (1, 1.01), (1, 0.99)):
        assert relative_squares(noisy.latency_s * alpha, noisy.bandwidth_Bps * bandwidth) > best


def test_a_bandwidth_the_noise_hides_is_a_lower_bound():
    fit = fit_alpha_beta([64, 1024, 16384], [2e-3, 1.9e-3, 1.8e-3])  # shrinking times: no bandwidth to see
    assert not fit.bandwidth_resolved
    assert fit.bandwidth_Bps == pytest.approx(16384 / 1.8e-3) and fit.latency_s >= 0


def test_one_lucky_fast_message_does_not_pull_the_line_down():
    sizes = [4 ** k for k in range(1, 12)]
    times = [20e-6 + n / 3e9 for n in sizes]
    times[3] /= 10  # a round trip ten times faster than the rest of its size class
    fit = fit_alpha_beta(sizes, times)
    assert fit.latency_s == pytest.approx(20e-6, rel=0.2) and fit.bandwidth_Bps == pytest.approx(3e9, rel=0.1)
    assert fit.residuals[3] < -5 and max(abs(r) for k, r in enumerate(fit.residuals) if k != 3) < 0.2


def test_a_latency_below_zero_is_clamped():
    fit = fit_alpha_beta([1000, 2000, 4000], [0.9e-6, 2e-6, 4.1e-6])
    assert fit.latency_s == 0.0 and fit.bandwidth_Bps == pytest.approx(1e9, rel=0.1)
    with pytest.raises(ValueError):
        fit_alpha_beta([64, 64], [1e-6, 1e-6])


def scenario_file(folder, **extra):
    path = folder / "scenario.yaml"
    path.write_text(yaml.safe_dump({
        "name": "calibrated", "seed": 1, "model": {"name": "mlp", "hidden": [32]},
        "data": {"name": "digits", "batch_size": 16}, "train": {"steps": 3}, "parallel": {"all_reduce": "ring"},
        **extra}))
    return path


@pytest.mark.gloo
@pytest.mark.parametrize("with_model", [False, True])
def test_calibrate_writes_files_run_takes(tmp_path, with_model):
    model_of = scenario_file(tmp_path) if with_model else None
    summary = calibrate(2, tmp_path / "calibration", model_of=model_of, sizes=SIZES, repeats=2)
    out = tmp_path / "calibration"
    written = json.loads((out / "calibration.json").read_text())
    assert written["device"] == summary["device"]
    fit = written["pingpong"]["0-1"]
    assert len(fit["one_way_s"]) == len(fit["residuals"]) == len(SIZES)
    assert fit["bandwidth_Bps"] > 0 and fit["latency_s"] >= 0
    assert len(written["all_reduce"]) == len(SIZES)
    device = resolve_device(str(out / "device.yaml"))
    assert device.peak_flops["fp32"] == pytest.approx(summary["compute"]["fp32"]["flops_per_s"])
    assert device.efficiency == 1.0
    topology = load_topology_file(out / "topology.yaml")
    assert topology.devices == ["rank0", "rank1"]
    # a transfer between the two ranks takes the fitted α, and the ring exchange's software cost beyond it
    path = topology.path("rank0", "rank1")
    latency = sum(topology.link(a, b)["latency"] for a, b in zip(path, path[1:]))
    assert latency == pytest.approx(written["link_classes"]["intra_host"]["latency_s"]
                                    + written["all_reduce_exchange"]["software_latency_s"])
    assert len(written["step_samples"]) == 2 and written["load"]["cores"] >= 1
    # the update's own fixed cost, fitted on updates of three sizes where the model is widened
    assert written["device"]["update_overhead"] == written["optimizer"]["overhead_s"]
    assert len(set(written["optimizer"]["bytes"])) == (3 if with_model else len(GEMM_SIZES))
    cores = len(os.sched_getaffinity(0))  # the cores the ranks could run on, for cluster.host_cores
    assert written["host"] == {"cores": cores, "ranks": 2, "rates_per_core": 2 <= cores}
    scenario = scenario_file(tmp_path, cluster={"device": "calibration/device.yaml",
                                                "topology": "calibration/topology.yaml"})
    report = simtrain.run(simtrain.load_scenario(scenario))
    assert report.data["devices_count"] == 2 and report.data["devices"][0]["device"] == device.name
    assert report.data["step_time_s"] > 0
    # fitted again by this same code, the recorded measurements give back every file as written
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--refit", str(out / "calibration.json"), "--out", str(tmp_path / "refitted")])
    assert exit_info.value.code == 0
    for name in ("calibration.json", "device.yaml", "topology.yaml"):
        assert (tmp_path / "refitted" / name).read_text() == (out / name).read_text()
    # pooled with itself, every mean is the same: the same device and links
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--refit", str(out / "calibration.json"), "--refit", str(out / "calibration.json"),
              "--out", str(tmp_path / "pooled")])
    assert exit_info.value.code == 0
    device, pooled_device = (yaml.safe_load((folder / "device.yaml").read_text())
                             for folder in (out, tmp_path / "pooled"))
    assert pooled_device["peak_flops"] == pytest.approx(device["peak_flops"], rel=1e-9)
    for key in ("memory_bandwidth", "pass_overhead", "update_overhead"):
        assert pooled_device[key] == pytest.approx(device[key], rel=1e-9)
    assert (tmp_path / "pooled" / "topology.yaml").read_text() == (out / "topology.yaml").read_text()
    pooled = json.loads((tmp_path / "pooled" / "calibration.json").read_text())
    assert pooled["all_reduce"] == written["all_reduce"] and pooled["date"] == written["date"]
    assert pooled["step_samples"][0]["backward"][0] == 2 * written["step_samples"][0]["backward"][0]
    assert pooled["pooled"] == 2 * [{"date": written["date"], "measured_step_s": written["measured_step_s"]}]
    assert "unsteady" not in (pooled["load"]["warning"] or "") and written["pooled"] is None
    # pooled with the same calibration measured 20% slower, the machine's speed moved: said, and averaged
    slower = json.loads(json.dumps(written))
    for rank in slower["step_samples"]:
        for part in ("forward", "backward", "optimizer", "all_reduce"):
            rank[part] = json.loads(json.dumps(rank[part]), parse_float=lambda t: 1.2 * float(t))
    (tmp_path / "slower.json").write_text(json.dumps(slower))
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--refit", str(out / "calibration.json"), "--refit", str(tmp_path / "slower.json"),
              "--out", str(tmp_path / "unsteady")])
    assert exit_info.value.code == 0
    unsteady = json.loads((tmp_path / "unsteady" / "calibration.json").read_text())
    assert [one["measured_step_s"] for one in unsteady["pooled"]] == pytest.approx(
        [written["measured_step_s"], 1.2 * written["measured_step_s"]], rel=1e-12)
    assert unsteady["measured_step_s"] == pytest.approx(1.1 * written["measured_step_s"], rel=1e-12)
    assert "machine unsteady" in unsteady["load"]["warning"] and "20% apart" in unsteady["load"]["warning"]


@pytest.mark.parametrize("arguments, message", [
    (["--refit", "missing.json"], "--refit: cannot read missing.json: No such file or directory"),
    (["--refit", "scenario.yaml"], "--refit: scenario.yaml is no JSON file"),
    (["--refit", "other.json"], "--refit: other.json is no calibration.json of simtrain calibrate (no 'date')"),
    (["--refit", "other.json", "--nproc", "2"], "--refit: measures nothing, so --nproc has no use"),
    (["--refit", "c/calibration.json", "--out", "c"], "--out: would write over c/calibration.json"),
    (["--refit", "a.json", "--refit", "b.json"], "--refit: b.json measured sizes_bytes [4, 64], a.json [4, 16]: "
                                                 "only calibrations of the same ranks, hosts, model, sizes and cases "
                                                 "pool"),
    (["--refit", "a.json", "--refit", "narrow.json"], "--refit: narrow.json measured cases ['batch 16'], a.json "
                                                      "['batch 16', '0.75 x width, batch 16']"),
    (["--refit", "wide.json"], "--refit: wide.json measured the case '2 x width, batch 16', which this version does "
                               "not build (it builds batch 8, batch 16, batch 32, 0.75 x width, batch 16, 1.25 x "
                               "width, batch 16)"),
])
def test_a_refit_of_something_else_is_one_line(tmp_path, monkeypatch, capsys, arguments, message):
    monkeypatch.chdir(tmp_path)
    scenario_file(tmp_path)
    (tmp_path / "other.json").write_text('{"ranks": 2}')
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "calibration.json").write_text("{}")
    def cases(*labels):
        return 2 * [{"cases": [{"label": label} for label in labels]}]
    recorded = {"date": "2026-12-03 12:00 UTC", "ranks": 2, "backend": "gloo", "hosts": ["h", "h"],
                "model_of": "scenario.yaml", "sizes_bytes": [4, 16], "load": {}, "host": {}, "pingpong": {},
                "compute": {}, "device": {}, "step_samples": cases("batch 16", "0.75 x width, batch 16")}
    (tmp_path / "a.json").write_text(json.dumps(recorded))
    (tmp_path / "b.json").write_text(json.dumps({**recorded, "sizes_bytes": [4, 64]}))
    (tmp_path / "narrow.json").write_text(json.dumps({**recorded, "step_samples": cases("batch 16")}))
    (tmp_path / "wide.json").write_text(json.dumps({**recorded, "step_samples": cases("2 x width, batch 16")}))
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--out", "out", *arguments])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert message in error and "\n" not in error
    assert (tmp_path / "c" / "calibration.json").read_text() == "{}" and not (tmp_path / "out").exists()


@pytest.mark.parametrize("device, message", [
    ("missing.yaml", "cluster.device: device file missing.yaml not found"),
    ("bad.yaml", "device file"),
])
def test_a_bad_device_file_is_one_line(tmp_path, capsys, device, message):
    (tmp_path / "bad.yaml").write_text("name: x\npeak_flops: {fp32: 1}\nmemory: 1GB\nmemory_bandwidth: 1GB/s\n")
    scenario = scenario_file(tmp_path, cluster={"device": device, "devices": 2})
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(scenario)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert message in error and "\n" not in error


def test_calibrate_needs_two_ranks(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--nproc", "1", "--out", str(tmp_path / "c")])
    assert exit_info.value.code == 2


def test_the_pass_fit_gives_overhead_and_rate_back():
    flops = [1e6, 4e6, 16e6, 8e6, 64e6]
    fit = fit_pass_costs(flops, [400e-6 + f / 50e9 for f in flops])
    assert fit.overhead_s == pytest.approx(400e-6, rel=1e-9) and fit.flops_per_s == pytest.approx(50e9, rel=1e-9)
    assert fit.max_residual < 1e-9
    # no fixed cost to see (times below the line through the origin at small work), or times that fall as the
    # work grows: no fixed cost, the rate through the origin
    for fallback in (fit_pass_costs([1e6, 4e6], [10e-6, 80e-6]), fit_pass_costs([1e6, 4e6], [80e-6, 40e-6])):
        assert fallback.overhead_s == 0.0 and fallback.flops_per_s > 0


def test_calibration_times_the_model_at_other_widths_too(tmp_path):
    """The scenario's model at half, one and two times its batch, and at 3/4 and 5/4 of its width: the widened
    cases' updates count the bytes of the same model built in plain torch at those widths (digits: 64 features,
    10 classes)."""
    cases = step_cases(scenario_file(tmp_path), rank=0, world=2)
    assert [case.label for case in cases] == ["batch 8", "batch 16", "batch 32", "0.75 x width, batch 16",
                                              "1.25 x width, batch 16"]
    optimizer = simtrain.scenario.load_scenario(scenario_file(tmp_path)).train.optimizer
    for case, width in zip(cases, (32, 32, 32, 24, 40)):
        model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, 10))
        assert case.update_bytes == update_bytes(list(model.parameters()), "fp32", optimizer)


@pytest.mark.parametrize("model, factor, widths", [
    ({"name": "mlp", "hidden": [256, 100]}, 0.75, {"hidden": [192, 75]}),
    ({"name": "cnn", "channels": [16, 32]}, 1.25, {"channels": [20, 40]}),
    ({"name": "gpt", "hidden": 64, "heads": 4}, 1.25, {"hidden": [80]}),
    ({"name": "gpt", "hidden": 64, "heads": 8}, 0.75, {"hidden": [48]}),
    ({"name": "llama", "hidden": 64, "heads": 8, "ffn_hidden": 160}, 1.25, {"hidden": [80], "ffn_hidden": 200}),
    ({"name": "llama", "hidden": 96, "heads": 8}, 1.25, {"hidden": [128]}),  # 120, to a multiple of 2 x 8
])
def test_a_model_widened_keeps_its_heads_whole(model, factor, widths):
    spec = simtrain.scenario.ModelSpec.model_validate(model)
    wider = widened(spec, factor)
    assert {key: getattr(wider, key) for key in widths} == widths
    simtrain.scenario.ModelSpec.model_validate(wider.model_dump())  # a model the scenario accepts
    assert widened(simtrain.scenario.ModelSpec(name="mypackage.models:build"), factor) is None


def test_the_update_fit_gives_its_own_fixed_cost_and_bandwidth_back():
    """Updates of several sizes: the α-β fit, whatever the passes' fixed cost; of one size: the passes' fixed
    cost, and the bandwidth the bytes over the mean time beyond it (a lower bound when that is within the
    standard error of the mean: here 5 us beyond it, 1e6 / 5e-6)."""
    sizes = [1e6, 2e6, 8e6, 2e6]
    fit = fit_update_costs(sizes, [120e-6 + n / 20e9 for n in sizes], pass_overhead_s=400e-6)
    assert fit.latency_s == pytest.approx(120e-6, rel=1e-9) and fit.bandwidth_Bps == pytest.approx(20e9, rel=1e-9)
    assert fit.bandwidth_resolved and fit.max_residual < 1e-9
    quick = fit_update_costs([1e6, 1e6], [395e-6, 405e-6], pass_overhead_s=400e-6)
    assert quick.latency_s == 400e-6 and quick.bandwidth_Bps == pytest.approx(1e6 / 5e-6)
    assert quick.bandwidth_resolved is False
    slow = fit_update_costs([1e6, 1e6], [450e-6, 460e-6], pass_overhead_s=400e-6)
    assert slow.bandwidth_resolved and slow.bandwidth_Bps == pytest.approx(1e6 / 55e-6)


@pytest.mark.parametrize("devices", [1, 2])
def test_a_pass_overhead_is_charged_once_a_pass(devices):
    """Closed form: each forward and each backward costs F/R + a (on 2 devices the backward is charged in
    pieces, as its buckets' all-reduces start: a once, on the first), each update bytes/BW + a_u."""
    device = {"name": "host", "peak_flops": {"fp32": 1e11, "tf32": 1e11, "fp16": 1e11, "bf16": 1e11},
              "memory": "8 GiB", "memory_bandwidth": "20 GB/s", "efficiency": 1.0, "pass_overhead": "300 us",
              "update_overhead": "120 us"}
    steps = 3
    scenario = simtrain.scenario.validate_scenario({
        "name": "passes", "cluster": {"devices": devices, "device": device}, "model": {"name": "mlp", "hidden": [32]},
        "data": {"name": "digits", "batch_size": 8}, "train": {"steps": steps, "optimizer": {"momentum": 0.9}},
        "parallel": {"bucket_cap_mb": 0.001}, "report": {"trace": False}})
    report = simtrain.run(scenario)
    model = simtrain.train.models.build_model(scenario.model, simtrain.train.data.load_dataset(
        "digits", {}, 0).info, scenario.seed)
    cost = measure_step_cost(model, torch.zeros(8, 64), torch.zeros(8, dtype=torch.long))
    step_bytes = update_bytes(list(model.parameters()), "fp32", scenario.train.optimizer)
    for rank in range(devices):
        spent = report.data["devices"][rank]["breakdown_s"]
        compute = spent["compute"] + spent.get("overlapped_compute", 0.0)
        assert compute == pytest.approx(steps * ((cost.forward_flops + cost.backward_flops) / 1e11 + 2 * 300e-6),
                                        rel=1e-9)
        assert spent["optimizer"] == pytest.approx(steps * (step_bytes / 20e9 + 120e-6), rel=1e-9)


def test_a_kernel_overhead_is_charged_per_operator():
    """Closed form on one device: compute = F/R + c x kernels per pass, the update = B/BW + c x its operators."""
    device = {"name": "host", "peak_flops": {"fp32": 1e11, "tf32": 1e11, "fp16": 1e11, "bf16": 1e11},
              "memory": "8 GiB", "memory_bandwidth": "20 GB/s", "efficiency": 1.0, "kernel_overhead": "5 us"}
    steps = 3
    scenario = simtrain.scenario.validate_scenario({
        "name": "overhead", "cluster": {"devices": 1, "device": device}, "model": {"name": "mlp", "hidden": [32]},
        "data": {"name": "digits", "batch_size": 8}, "train": {"steps": steps, "optimizer": {"momentum": 0.9}},
        "report": {"trace": False}})
    report = simtrain.run(scenario)
    job_model = simtrain.train.models.build_model(scenario.model, simtrain.train.data.load_dataset(
        "digits", {}, 0).info, scenario.seed)
    x, y = torch.zeros(8, 64), torch.zeros(8, dtype=torch.long)
    cost = measure_step_cost(job_model, x, y)
    assert cost.forward_kernels > 0 and cost.backward_kernels > 0
    spent = report.data["devices"][0]["breakdown_s"]
    expected = steps * ((cost.forward_flops + cost.backward_flops) / 1e11
                        + 5e-6 * (cost.forward_kernels + cost.backward_kernels))
    assert spent["compute"] == pytest.approx(expected, rel=1e-9)
    # the update: its bytes at 20 GB/s, and 5 us for each operator a real update dispatches (its second: the
    # first creates the optimizer's state), counted on a replica that has run a backward
    kernels = (spent["optimizer"] / steps - update_bytes(list(job_model.parameters()), "fp32",
                                                         scenario.train.optimizer) / 20e9) / 5e-6
    data = simtrain.train.data.load_dataset("digits", {}, 0)
    replica = Replica(job_model, ShardLoader(data.train, 1, 0, 8, 0), scenario.train)
    replica.backward(replica.loader.batch_loss(replica.model(x), y))
    replica.step()
    with OperatorRecorder() as recorder:
        replica.step()
    assert recorder.kernels >= 3 * len(replica.params)  # SGD with momentum: 3 operators a parameter at least
    assert kernels == pytest.approx(recorder.kernels, abs=1e-6)


HOST = {"name": "host", "peak_flops": {"fp32": 1e11, "tf32": 1e11, "fp16": 1e11, "bf16": 1e11}, "memory": "8 GiB",
        "memory_bandwidth": "20 GB/s", "efficiency": 1.0}


def stage_kernels(chunk, x: torch.Tensor, y: torch.Tensor | None) -> tuple[int, int]:
    """(forward, backward) operators of plain torch through a copy of a pipeline stage's chunk on `x`, ending with
    the cross entropy against `y` when given (the last stage), its input needing a gradient but on the first."""
    chunk = copy.deepcopy(chunk)  # a Parameter's copy leaves its .grad behind: autograd's first accumulation
    with torch.enable_grad():
        with OperatorRecorder() as forward:
            output = chunk(x)
            if y is not None:
                output = torch.nn.functional.cross_entropy(output, y)
        arrived = None if y is not None else torch.ones_like(output)  # the gradient the next stage sends back
        with OperatorRecorder() as backward:
            torch.autograd.backward(output, arrived)
    return forward.kernels, backward.kernels


@pytest.mark.parametrize("schedule, passes", [("1f1b", 2), ("zero_bubble", 3)])
def test_a_pipeline_on_a_calibrated_host_pays_each_kernel_pass_and_update(schedule, passes):
    """Closed form under pp 2 x dp 2 (no reference: the pipeline was not charged fixed costs before): over the same
    run on the host without them, each rank's compute costs m x (its stage's forward and backward kernels) x
    kernel_overhead + m x passes x pass_overhead a step (a zero-bubble W runs apart: a pass of its own), its update
    its optimizer step's operators x kernel_overhead + update_overhead; plain torch counts the kernels. Numerics off,
    replayed from the measured costs, computes at the same cost."""
    steps, m, batch = 2, 4, 8
    overheads = {"kernel_overhead": "5 us", "pass_overhead": "300 us", "update_overhead": "120 us"}

    def run(device, numerics=True):
        return one_step(simtrain.scenario.validate_scenario({
            "name": "fixed", "numerics": numerics, "cluster": {"devices": 4, "device": device},
            "model": {"name": "mlp", "hidden": [32, 32]}, "data": {"name": "digits", "batch_size": batch},
            "train": {"steps": steps, "optimizer": {"momentum": 0.9}},
            "parallel": {"pp": 2, "pipeline": {"schedule": schedule, "microbatches": m}}, "report": {"trace": False}}))

    plain, calibrated, replayed = run(HOST), run({**HOST, **overheads}), run({**HOST, **overheads}, numerics=False)
    replicas = calibrated.scheme.replicas
    chunks = {calibrated.layout.coordinates(rank)["pp"]: replica.model.chunks[0]
              for rank, replica in enumerate(replicas)}
    x, y = torch.zeros(batch // m, 64), torch.zeros(batch // m, dtype=torch.long)
    stage_kernels_of = {0: sum(stage_kernels(chunks[0], x, None)),
                        1: sum(stage_kernels(chunks[1], chunks[0](x).detach().requires_grad_(), y))}
    for rank, replica in enumerate(replicas):
        kernels = stage_kernels_of[calibrated.layout.coordinates(rank)["pp"]]
        with OperatorRecorder() as update:
            replica.step()  # its optimizer's state made by the run's steps: what each update dispatches
        compute, optimizer = ([job.cluster.log.total(rank, kind) for job in (calibrated, plain, replayed)]
                              for kind in ("compute", "optimizer"))
        assert kernels > 0 and update.kernels > 0
        assert compute[0] - compute[1] == pytest.approx(steps * m * (kernels * 5e-6 + passes * 300e-6), rel=1e-9)
        assert optimizer[0] - optimizer[1] == pytest.approx(steps * (update.kernels * 5e-6 + 120e-6), rel=1e-9)
        assert compute[2] == pytest.approx(compute[0], rel=1e-12)  # (an update on meta tensors checks no overflow)


RECORDED = json.loads((Path(__file__).parent / "fixtures" / "calibration_widths.json").read_text())
# recorded before 2026-12-03 15:45 UTC: the draw timed apart, each size's all-reduces one list, one model's width
RECORDED_BEFORE = json.loads((Path(__file__).parent / "fixtures" / "calibration_steps.json").read_text())


def test_the_ring_is_fitted_to_the_last_arrival_of_each_all_reduce():
    """Per size: the mean over cases and rounds of the least time a rank spent (what launch counts as
    communication), and the exchange's α-β the least-squares line through those means over 2(N-1) exchanges of n/N
    bytes; per case, the wait: what each rank spent beyond the least, over the sizes and rounds."""
    ranks, world, sizes = RECORDED["ranks"], RECORDED["world"], RECORDED["sizes_bytes"]
    cases = ranks[0]["cases"]
    fits = fit_step_timings(ranks, world, sizes)
    for s, row in enumerate(fits["all_reduce"]):
        assert row["time_s"] == pytest.approx(statistics.mean(
            min(a, b) for c in range(len(cases)) for a, b in zip(ranks[0]["all_reduce"][s][c],
                                                                 ranks[1]["all_reduce"][s][c])), rel=1e-12)
    for c, case in enumerate(cases):
        waits = [abs(a - b) / 2 for s in range(len(sizes))
                 for a, b in zip(ranks[0]["all_reduce"][s][c], ranks[1]["all_reduce"][s][c])]
        assert fits["idle_s"][case["label"]] == pytest.approx(statistics.mean(waits), rel=1e-12)
    # and the waiting the fitted jitter gives back per case, against it
    jitter = ComputeJitter(fits["compute_jitter"], fits["compute_jitter_fixed_s"])
    for c, residual in enumerate(fits["idle_residuals"]):
        forward = statistics.mean(t for rank in ranks for t in rank["forward"][c])
        backward = statistics.mean(t for rank in ranks for t in rank["backward"][c])
        modelled = modelled_wait(jitter, [forward], [backward], world)[0]
        idle = fits["idle_s"][cases[c]["label"]]
        assert residual == pytest.approx((idle - modelled) / idle)
    exchange, exchanges = fits["all_reduce_fit"], 2 * (world - 1)
    n = [row["bytes"] / world for row in fits["all_reduce"]]
    t = [row["time_s"] / exchanges for row in fits["all_reduce"]]
    assert exchange.residuals == pytest.approx([(ti - exchange.time_s(ni)) / ti for ni, ti in zip(n, t)])

    def relative_squares(alpha, bandwidth):
        return sum(((ti - alpha - ni / bandwidth) / exchange.time_s(ni)) ** 2 for ni, ti in zip(n, t))
    best = relative_squares(exchange.latency_s, exchange.bandwidth_Bps)
    for alpha, bandwidth in ((1.01, 1), (0.99, 1), (1, 1.01), (1, 0.99)):
        assert relative_squares(exchange.latency_s * alpha, exchange.bandwidth_Bps * bandwidth) > best


def test_compute_and_optimizer_are_fitted_to_the_spans_a_launched_step_has():
    """Each span's mean over its iterations; one fixed cost a pass and the rate are the least squares of relative
    errors over the passes (t = a + F/R: moving either adds to the sum), and the update's own fixed cost and
    bandwidth the α-β fit of the updates, which moved three sizes of bytes (t = a_u + bytes/B)."""
    ranks, cases = RECORDED["ranks"], RECORDED["ranks"][0]["cases"]
    fits = fit_step_timings(ranks, RECORDED["world"], RECORDED["sizes_bytes"])
    passes, updates = [], []
    for rank in ranks:
        for c, case in enumerate(cases):
            passes += [(case["forward_flops"], statistics.mean(rank["forward"][c])),
                       (case["backward_flops"], statistics.mean(rank["backward"][c]))]
            updates.append((case["update_bytes"], statistics.mean(rank["optimizer"][c])))
    overhead, rate = fits["compute"]["pass_overhead_s"], fits["compute"]["flops_per_s"]
    assert overhead > 0 and rate > 0
    assert [point["seconds"] for point in fits["compute"]["points"]] == pytest.approx([t for _, t in passes])
    assert fits["compute"]["residuals"] == pytest.approx([(t - overhead - f / rate) / t for f, t in passes])

    def relative_squares(a, r):
        return sum(((t - a - f / r) / t) ** 2 for f, t in passes)
    best = relative_squares(overhead, rate)
    for a, r in ((1.01, 1), (0.99, 1), (1, 1.01), (1, 0.99)):
        assert relative_squares(overhead * a, rate * r) > best
    assert len({n for n, _ in updates}) == 3
    update = fit_alpha_beta(*zip(*updates))
    optimizer = fits["optimizer"]
    assert (optimizer["overhead_s"], optimizer["bandwidth_Bps"]) == (update.latency_s, update.bandwidth_Bps)
    assert optimizer["bandwidth_resolved"] and 0 < optimizer["overhead_s"] < overhead
    assert optimizer["residuals"] == pytest.approx(update.residuals)


def test_an_update_of_one_size_takes_the_passes_fixed_cost():
    """Calibrations of one model's width (before 2026-12-03 15:45 UTC, or a user's model) cannot tell the
    update's fixed cost from its bandwidth: a_u is the passes' a, and B the bytes over the mean beyond it."""
    ranks = RECORDED_BEFORE["ranks"]
    fits = fit_step_timings(ranks, RECORDED_BEFORE["world"], RECORDED_BEFORE["sizes_bytes"])
    optimizer, overhead = fits["optimizer"], fits["compute"]["pass_overhead_s"]
    assert len(set(optimizer["bytes"])) == 1 and optimizer["overhead_s"] == overhead
    mean = statistics.mean(statistics.mean(rank["optimizer"][c]) for rank in ranks for c in range(len(rank["cases"])))
    assert optimizer["bandwidth_Bps"] == pytest.approx(optimizer["bytes"][0] / (mean - overhead), rel=1e-9)


def test_a_forward_span_with_its_draw_inside_fits_as_one_timed_apart():
    """Calibration now times the forward as launch's interpreter does, the draw inside it: a record so made (here
    the recorded one, each draw added to its forward) fits exactly as the record that timed the draw apart."""
    ranks = json.loads(json.dumps(RECORDED_BEFORE["ranks"]))
    for rank in ranks:
        rank["forward"] = [[d + f for d, f in zip(draws, forwards)]
                           for draws, forwards in zip(rank.pop("draw"), rank["forward"])]
    apart = fit_step_timings(RECORDED_BEFORE["ranks"], RECORDED_BEFORE["world"], RECORDED_BEFORE["sizes_bytes"])
    inside = fit_step_timings(ranks, RECORDED_BEFORE["world"], RECORDED_BEFORE["sizes_bytes"])
    assert inside["compute"] == apart["compute"] and inside["optimizer"] == apart["optimizer"]
    assert inside["compute_jitter_fixed_s"] == apart["compute_jitter_fixed_s"] > 0


def test_all_reduces_kept_by_case_fit_as_those_kept_as_one_list_a_size():
    """Calibration now keeps each size's all-reduces per case, a round each (the cases and sizes take turns): the
    recorded samples so kept (each size's list split into its cases' iterations) fit exactly as they did."""
    ranks, cases = json.loads(json.dumps(RECORDED_BEFORE["ranks"])), len(RECORDED_BEFORE["ranks"][0]["cases"])
    for rank in ranks:
        rank["all_reduce"] = [[times[c * len(times) // cases:(c + 1) * len(times) // cases] for c in range(cases)]
                              for times in rank["all_reduce"]]
    assert isinstance(ranks[0]["all_reduce"][0][0], list)
    one_list = fit_step_timings(RECORDED_BEFORE["ranks"], RECORDED_BEFORE["world"], RECORDED_BEFORE["sizes_bytes"])
    by_case = fit_step_timings(ranks, RECORDED_BEFORE["world"], RECORDED_BEFORE["sizes_bytes"])
    for key in ("all_reduce", "all_reduce_fit", "idle_s", "compute_jitter", "compute_jitter_fixed_s", "spreads"):
        assert by_case[key] == one_list[key]


def test_pooled_calibrations_fit_the_mean_of_all_their_samples():
    """Two calibrations pooled (`--refit` twice): each pass is fitted to the mean over both calibrations' samples,
    each all-reduce size to the mean over both of the rank that arrived last."""
    ranks, world, sizes = RECORDED["ranks"], RECORDED["world"], RECORDED["sizes_bytes"]
    slower = json.loads(json.dumps(ranks), parse_float=lambda t: 1.5 * float(t))
    pooled = [{**pooled_samples([a, b]), "cases": a["cases"]} for a, b in zip(ranks, slower)]
    fits = fit_step_timings(pooled, world, sizes)
    backward = [statistics.mean(rank["backward"][0]) for rank in ranks]
    n = len(ranks[0]["backward"][0])
    assert fits["compute"]["points"][1]["seconds"] == pytest.approx(backward[0] * 1.25)  # (n m + n 1.5 m) / 2n
    assert len(pooled[0]["backward"][0]) == 2 * n
    for s, row in enumerate(fits["all_reduce"]):
        last = [min(times) for by_case in zip(*(rank["all_reduce"][s] for rank in ranks)) for times in zip(*by_case)]
        assert row["time_s"] == pytest.approx(1.25 * statistics.mean(last))


def test_the_measured_step_sums_each_cases_mean_parts_and_tells_a_slower_machine():
    """Nothing fitted: per rank, each case's mean forward (the draw inside), backward and update and its all-reduce's
    mean over the sizes, summed over the cases, then the mean over the ranks; a calibration whose every sample took
    1.25 times as long measured a step 1.25 times as long, and pooled with the first is said to be unsteady."""
    ranks = RECORDED["ranks"]
    by_hand = []
    for rank in ranks:
        cases = range(len(rank["cases"]))
        by_hand.append(sum(statistics.mean(rank["forward"][c]) + statistics.mean(rank["backward"][c])
                           + statistics.mean(rank["optimizer"][c])
                           + statistics.mean(statistics.mean(by_case[c]) for by_case in rank["all_reduce"])
                           for c in cases))
    step = measured_step_s(ranks)
    assert step == pytest.approx(statistics.mean(by_hand), rel=1e-12)
    slower = json.loads(json.dumps(ranks), parse_float=lambda t: 1.25 * float(t))
    assert measured_step_s(slower) == pytest.approx(1.25 * step, rel=1e-12)
    assert drift_warning([("12:00", step), ("12:04", 1.04 * step)]) is None
    unsteady = drift_warning([("12:00", step), ("12:04", measured_step_s(slower))])
    assert f"{step * 1e3:.3f} ms (12:00) and {1.25 * step * 1e3:.3f} ms (12:04), 25% apart" in unsteady
    assert unsteady.startswith("machine unsteady") and "\n" not in unsteady


def test_the_topology_gives_the_simulated_ring_its_fitted_time(tmp_path):
    """Closed form: on the written topology the simulator's ring all-reduce of n bytes over 2 ranks takes
    2 (α_x + (n/2)/β_x), the exchange's fit, once the wire and the software cost are added back together."""
    exchange = AlphaBeta(300e-6, 0.8e9, [0.0])
    wire = {"intra_host": AlphaBeta(40e-6, 4e9, [0.0])}
    software = exchange_software_cost(exchange, wire)
    assert software["software_latency_s"] == pytest.approx(260e-6)
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(_topology("t", ["h", "h"], ["h"], wire, software)))
    sizes = [8, 1 << 16, 1 << 22]
    simulated = benchmark_all_reduce(load_topology_file(tmp_path / "topology.yaml"), "ring", sizes, False)
    for size, row in zip(sizes, simulated):
        assert row.time_s == pytest.approx(2 * exchange.time_s(size / 2), rel=1e-9)
    # a ring measured cheaper than the wire: noise, no software cost, the wire alone
    assert exchange_software_cost(AlphaBeta(10e-6, 8e9, [0.0]), wire) == {
        "wire": "intra_host", "software_latency_s": 0.0, "software_s_per_byte": 0.0}


@pytest.mark.parametrize("sigma, fixed", [(0.3, 0.0), (0.1, 0.8e-3), (0.0, 1.4e-3)])
def test_the_jitter_is_the_sigma_and_fixed_part_under_which_ranks_wait_as_measured(sigma, fixed):
    """Reference: the model itself, drawn with its own seeded Generator, apart from the fit's draws: two ranks'
    forward and backward times, each lognormal with its mean and variance t² (e^σ² - 1) + s²; each waits for
    the slower. From the mean waits of three cases the fit gives back σ's part of the variance, e^σ² - 1 (σ
    below about 0.1 adds too little to tell apart), and s, and the waits of those cases and of a step twice
    the longest."""
    generator = np.random.default_rng(29)
    forward, backward = np.array([0.4e-3, 0.8e-3, 1.6e-3, 3.2e-3]), np.array([0.5e-3, 1.1e-3, 2.0e-3, 4.0e-3])

    def spans(mean, shape):
        log_variance = np.log1p((mean**2 * np.expm1(sigma**2) + fixed**2) / mean**2)[:, None]
        return mean[:, None] * np.exp(np.sqrt(log_variance) * generator.standard_normal(shape) - log_variance / 2)
    a, b = (spans(forward, (4, 200_000)) + spans(backward, (4, 200_000)) for _ in range(2))
    idle = (np.abs(a - b) / 2).mean(axis=1)  # each rank's mean wait for the other
    fitted = fit_compute_jitter(idle[:3], forward[:3], backward[:3])
    assert np.expm1(fitted.sigma**2) == pytest.approx(np.expm1(sigma**2), abs=0.01)
    assert fitted.fixed_s == pytest.approx(fixed, abs=0.05 * 1.4e-3)
    assert modelled_wait(fitted, forward, backward) == pytest.approx(idle, rel=0.03)


def test_no_wait_is_no_jitter():
    assert fit_compute_jitter([0.0, 0.0], [1e-3, 2e-3], [1e-3, 2e-3]) == (0.0, 0.0)


def test_a_loaded_machine_is_said_in_one_line():
    assert relative_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((4 - 2) / 3)
    assert load_warning(0.7, {"forward": 0.1, "all-reduce": 0.3}, cores=2) is None
    loaded = load_warning(3.5, {"forward": 0.1}, cores=2)
    assert "load average 3.50 above its 2 cores" in loaded and "\n" not in loaded
    spread = load_warning(0.7, {"forward": 0.6, "all-reduce": 0.9}, cores=2)
    assert "all-reduce spread over 90%" in spread and "load average" not in spread
    # the recorded steps' all-reduces (load 0.7 on 2 cores) spread past what is trusted
    fits = fit_step_timings(RECORDED["ranks"], RECORDED["world"], RECORDED["sizes_bytes"])
    assert "spread over" in load_warning(0.0, fits["spreads"], cores=2)
