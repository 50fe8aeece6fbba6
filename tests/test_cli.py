"""The command line: outputs, determinism, and one-line errors with exit code 2."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import simtrain
from simtrain.cli import main, print_summary

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "scenarios" / "quickstart.yaml"
FAST = ["--set", "train.steps=20"]


def cli(*args):
    """Run the CLI in-process; return (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    return exit_info.value.code


def test_run_writes_every_output(tmp_path, capsys):
    assert cli("run", str(QUICKSTART), *FAST, "--out", str(tmp_path)) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["final_model.pt", "report.json", "scenario.resolved.yaml", "trace.json"]
    report = json.loads((tmp_path / "report.json").read_text())
    for key in ("sim_time_s", "steps", "step_time_s", "throughput_samples_per_s", "breakdown_s",
                "scaling_efficiency", "final_loss", "final_accuracy", "devices", "links", "wall_time_s",
                "simtrain_version"):
        assert key in report
    assert set(report["breakdown_s"]) == {"compute", "communication", "optimizer", "sampling", "bubble", "idle"}
    # A ring all-reduce of the 26,122 fp32 gradients on 4 devices: 2(N-1) steps of L + (S/N)/B (to the few bytes
    # by which tensor_split's chunks differ); compute is one device's, as weak scaling keeps it.
    ring = 2 * 3 * (5e-6 + 26122 * 4 / 4 / 50e9)
    assert report["breakdown_s"]["communication"] == pytest.approx(ring, rel=1e-4)
    alone = simtrain.run(simtrain.load_scenario(QUICKSTART, ["train.steps=20", "cluster.devices=1"])).data
    assert report["breakdown_s"]["compute"] == pytest.approx(alone["breakdown_s"]["compute"], rel=1e-12)
    assert report["steps"] == 20
    resolved = yaml.safe_load((tmp_path / "scenario.resolved.yaml").read_text())
    assert resolved["train"]["steps"] == 20 and resolved["cluster"]["link"]["bandwidth"] == 50e9
    trace = json.loads((tmp_path / "trace.json").read_text())
    kinds = {e.get("cat") for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"compute", "communication", "optimizer", "link"} <= kinds
    state = torch.load(tmp_path / "final_model.pt")
    assert all(torch.isfinite(t).all() for t in state.values())
    assert "step time" in capsys.readouterr().out


def test_float_noise_in_the_breakdown_prints_as_0(tmp_path, capsys):
    """An idle of 1e-21 s in a 34 us step is what subtracting sums of spans leaves: printed as 0; the quickstart's
    real idle (0.12 ns a step: a rank waits while a neighbour moves the few bytes more of a larger chunk) is not."""
    cli("run", str(QUICKSTART), *FAST, "--out", str(tmp_path), "-q")
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["breakdown_s"]["idle"] == pytest.approx(1.2e-10, rel=1e-6)
    print_summary(data)
    data["breakdown_s"]["idle"] = 1e-21
    print_summary(data)
    idle = [line for line in capsys.readouterr().out.splitlines() if " idle " in line]
    assert ["0.120 ns (0.0%)" in idle[0], "0 s (0.0%)" in idle[1]] == [True, True], idle


def test_trace_accounts_for_every_simulated_second(tmp_path):
    cli("run", str(QUICKSTART), *FAST, "--set", "parallel.all_reduce=naive", "--out", str(tmp_path), "-q")
    report = json.loads((tmp_path / "report.json").read_text())
    trace = json.loads((tmp_path / "trace.json").read_text())
    for rank in range(4):
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 0 and e["tid"] == rank]
        assert sum(e["dur"] for e in spans) == pytest.approx(report["sim_time_s"] * 1e6, rel=1e-9)
        idle = sum(e["dur"] for e in spans if e["cat"] == "idle") / 1e6
        # A collective is one span, its rank's first transfer to its last; a wait for a peer inside counts as idle.
        shown = sum(e["dur"] for e in spans if e["cat"] == "communication") / 1e6
        waits = shown - report["devices"][rank]["breakdown_s"]["communication"]
        assert waits >= -1e-15
        assert idle + waits == pytest.approx(report["devices"][rank]["breakdown_s"]["idle"], rel=1e-6, abs=1e-12)


def test_one_bucket_is_one_span_in_the_trace(tmp_path):
    """The quickstart's gradients fit one DDP bucket: one dp_allreduce span a step on each rank's communication
    stream, with the bytes the rank sent (every chunk of the 104,488-byte bucket once, its own two twice), over
    2(N-1) steps of L + (S/N)/B, though a rank waits 80 ps inside it for a neighbour sending a chunk 4 bytes
    larger."""
    chunks = [26124, 26124, 26120, 26120]  # tensor_split of 26,122 fp32 gradients in four
    cli("run", str(QUICKSTART), "--set", "train.steps=2", "--out", str(tmp_path), "-q")
    trace = json.loads((tmp_path / "trace.json").read_text())
    streams = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["pid"] == 0
               and e["args"]["name"].endswith("communication stream")}
    assert len(streams) == 4
    for tid in streams:
        rank = tid - 4
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 0 and e["tid"] == tid]
        sent = sum(chunks) + chunks[rank] + chunks[rank - 1]
        assert [(e["name"], e["args"]["bytes"]) for e in spans] == [("dp_allreduce", sent)] * 2
        for e in spans:
            assert e["dur"] / 1e6 == pytest.approx(6 * (5e-6 + 104488 / 4 / 50e9), rel=1e-4)


def test_same_scenario_same_bytes(tmp_path):
    outputs = []
    for run in ("a", "b"):
        out = tmp_path / run
        assert cli("run", str(QUICKSTART), *FAST, "--set", "parallel.all_reduce=tree", "--out", str(out), "-q") == 0
        report = json.loads((out / "report.json").read_text())
        report.pop("wall_time_s")
        outputs.append((report, (out / "final_model.pt").read_bytes(), (out / "trace.json").read_bytes()))
    assert outputs[0] == outputs[1]


@pytest.mark.slow
def test_validate_accepts_shipped_scenarios(capsys):
    for path in sorted((ROOT / "scenarios").glob("**/*.yaml")):  # scenarios/megatron/ too
        assert cli("validate", str(path)) == 0
    assert "ok" in capsys.readouterr().out


def write(tmp_path, text):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return str(path)


BAD_INPUTS = [
    ("name: [unclosed", [], "not valid YAML"),
    ("cluster: {devices: 4, colour: red}", [], "cluster.colour: unknown field"),
    ("cluster: {devices: four}", [], "cluster.devices"),
    ("cluster: {devices: 4, link: {bandwidth: '-5 GB/s'}}", [], "cluster.link.bandwidth: must not be negative"),
    ("cluster: {devices: 0}", [], "cluster.devices"),
    ("parallel: {all_reduce: allgather}", [], "parallel.all_reduce"),
    ("parallel: {scheme: ring}", [], "parallel.scheme: replaced by parallel.all_reduce (naive | ring | tree | "
     "hierarchical | dbtree) and parallel.mode (sync | async)"),
    ("cluster: {devices: 2, device: a200}", [], "cluster.device: unknown device 'a200'"),
    ("cluster: {devices: 2}", ["--set", "train.steps=-3"], "train.steps"),
    ("cluster: {devices: 4, topology: no/such/file.yaml}", [], "no/such/file.yaml"),
    ("cluster: {devices: 8, topology: torus-4x4.yaml}", [], "cluster.devices: 8 does not match"),
    ("cluster: {shared_memory: {bandwidth: 20 GB/s}}\nparallel: {mode: async}\ntrain: {precision: fp16}", [],
     "train.precision: fp16 runs with the synchronous schemes"),
    ("train: {precision: fp16, optimizer: {name: kfac}}", [], "train.optimizer.name: kfac does not run under fp16"),
    ("cluster: {devices: 2, shared_memory: {location: switch, host_link: {bandwidth: 1 GB/s}}}\n"
     "parallel: {mode: async}", [], "cluster.shared_memory.host_link: only for location host"),
    ("cluster: {devices: 2, overrides: {5: {slowdown: 2}}}", [], "cluster.overrides"),
    ("model: {batchnorm: true}\nparallel: {sync_batchnorm: true}\ntrain: {checkpointing: sqrt}", [],
     "parallel.sync_batchnorm: does not combine with train.checkpointing"),
]


@pytest.mark.parametrize("text,extra,expected", BAD_INPUTS)
def test_bad_scenarios_print_one_line_and_exit_2(tmp_path, capsys, text, extra, expected):
    path = write(tmp_path, text)
    if "torus-4x4" in text:
        (tmp_path / "torus-4x4.yaml").write_text((ROOT / "topologies" / "torus-4x4.yaml").read_text())
    assert cli("validate", path, *extra) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and expected in err


def test_disconnected_topology_file_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "split.yaml").write_text(
        "gpus: [a, b, c, d]\nswitches: []\nlinks:\n"
        "  - {between: [a, b], bandwidth: 1 GB/s, latency: 1 us}\n"
        "  - {between: [c, d], bandwidth: 1 GB/s, latency: 1 us}\n")
    path = write(tmp_path, "cluster: {topology: split.yaml}")
    assert cli("validate", path) == 2
    err = capsys.readouterr().err.strip()
    assert "disconnected" in err and "\n" not in err


@pytest.mark.parametrize("args,expected", [
    (["run", "missing.yaml"], "missing.yaml"),
    (["collective", "--algo", "butterfly"], "butterfly"),
    (["collective", "--devices", "0"], "--devices"),
    (["collective", "--devices", "4", "--bandwidth", "fast"], "--bandwidth"),
    (["collective", "--devices", "4", "--sizes", "1G:1K"], "--sizes"),
    (["collective", "--topology", "ring"], "--devices: required"),
    (["run", str(QUICKSTART), "--set", "nonsense"], "--set"),
])
def test_bad_command_lines_print_one_line_and_exit_2(capsys, args, expected):
    assert cli(*args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and expected in err


def test_a_failed_run_keeps_earlier_outputs(tmp_path, capsys):
    assert cli("run", str(QUICKSTART), *FAST, "--out", str(tmp_path), "-q") == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert cli("run", str(QUICKSTART), "--set", "cluster.devices=0", "--out", str(tmp_path)) == 2
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_collective_json_lines(capsys):
    assert cli("collective", "--algo", "ring", "--devices", "8", "--bandwidth", "100 GB/s", "--latency", "5 us",
               "--sizes", "1M:4M", "--no-numerics", "--json") == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["bytes"] for row in rows] == [2**20, 2**21, 2**22]
    for row in rows:
        expected = 2 * 7 * (5e-6 + row["bytes"] / 8 / 100e9)
        assert row["time_s"] == pytest.approx(expected, rel=1e-9)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * 7 / 8)


@pytest.mark.slow
def test_cli_shim_runs_from_a_clone():
    result = subprocess.run([sys.executable, str(ROOT / "cli.py"), "validate", str(QUICKSTART)],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0 and "ok" in result.stdout


GPT_SMALL = ROOT / "scenarios" / "gpt_small.yaml"


@pytest.mark.parametrize("scenario,overrides,expected", [
    (QUICKSTART, ["cluster.devices=16", "parallel.tp=3"], "parallel."),
    (GPT_SMALL, ["data.vocab=127", "parallel.tp=2"], "parallel.tp: the model cannot be split 2 ways"),
    (QUICKSTART, ["cluster.devices=16", "parallel.dp=2", "parallel.pp=2", "parallel.tp=2"], "parallel.dp: dp 2 x pp"),
])
def test_validate_refuses_what_run_refuses_with_the_same_line(tmp_path, capsys, scenario, overrides, expected):
    sets = [part for override in overrides for part in ("--set", override)]
    assert cli("run", str(scenario), *sets, "--out", str(tmp_path), "-q") == 2
    run_err = capsys.readouterr().err.strip()
    assert cli("validate", str(scenario), *sets) == 2
    validate_err = capsys.readouterr().err.strip()
    assert validate_err == run_err and "\n" not in run_err and expected in run_err
    assert not (tmp_path / "report.json").exists()  # refused before the clock started


def test_validate_no_numerics_checks_the_run_of_run_no_numerics(tmp_path, capsys):
    """--no-numerics is --set numerics=false, given last (as run's): a population needs numerics, mirrored ranks
    need them off."""
    assert cli("run", str(ROOT / "scenarios" / "pbt.yaml"), "--no-numerics", "--out", str(tmp_path), "-q") == 2
    run_err = capsys.readouterr().err.strip()
    assert cli("validate", str(ROOT / "scenarios" / "pbt.yaml"), "--no-numerics") == 2
    assert capsys.readouterr().err.strip() == run_err and "pbt: needs numerics" in run_err
    long_context = str(ROOT / "scenarios" / "llama3-70b-long-context.yaml")
    assert cli("validate", long_context, "--set", "numerics=true") == 2
    assert "needs numerics false" in capsys.readouterr().err
    assert cli("validate", long_context, "--set", "numerics=true", "--no-numerics") == 0
    assert capsys.readouterr().out.startswith(f"{long_context}: ok")


def test_a_transformer_left_on_eager_attention_is_told_fused_is_what_frameworks_run(tmp_path, capsys):
    """model.attention's default is eager (the papers' runs the shipped validations reproduce): run and validate
    say so in one note for a gpt or llama that leaves it unset; a scenario that sets it, an mlp, and --quiet
    hear nothing."""
    gpt = yaml.safe_load(GPT_SMALL.read_text())
    del gpt["model"]["attention"]
    unset = tmp_path / "gpt.yaml"
    unset.write_text(yaml.safe_dump(gpt))
    assert cli("validate", str(unset)) == 0
    (note,) = capsys.readouterr().err.splitlines()
    assert note.startswith("note: model.attention: eager by default") and "--set model.attention=fused" in note
    assert cli("run", str(unset), "--set", "train.steps=1", "--no-numerics", "--out", str(tmp_path / "a")) == 0
    assert capsys.readouterr().err.splitlines() == [note]
    assert cli("run", str(unset), "--set", "train.steps=1", "--no-numerics", "--out", str(tmp_path / "b"), "-q") == 0
    assert capsys.readouterr().err == ""
    assert cli("run", str(unset), "--set", "train.steps=1", "--no-numerics", "--out", str(tmp_path / "c"), "--set",
               "cluster.device={base: a100-40gb, memory: 1 KiB}") == 2  # out of memory: its one line alone
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: out of memory")
    for quiet in (["--set", "model.attention=eager"], ["--set", "model.attention=fused"], []):
        assert cli("validate", str(unset if quiet else QUICKSTART), *quiet) == 0
        assert capsys.readouterr().err == ""


@pytest.mark.parametrize("text,expected", [
    ("train: {stepz: 3}", "train.stepz: unknown field; did you mean `train.steps`?"),
    ("trian: {steps: 3}", "trian: unknown field; did you mean `train`?"),
    ("parallel: {pipeline: {microbatch: 2}}",
     "parallel.pipeline.microbatch: unknown field; did you mean `parallel.pipeline.microbatches`?"),
    ("parallel: {asynch: {}}", "parallel.asynch: unknown field; did you mean `parallel.async`?"),
    ("cluster: {devices: 4, colour: red}", "cluster.colour: unknown field"),
])
def test_unknown_keys_name_the_nearest_known_one(tmp_path, capsys, text, expected):
    assert cli("validate", write(tmp_path, text)) == 2
    assert capsys.readouterr().err.strip().endswith(expected)


def test_a_topology_file_against_a_device_count_suggests_null(tmp_path, capsys):
    (tmp_path / "torus-4x4.yaml").write_text((ROOT / "topologies" / "torus-4x4.yaml").read_text())
    assert cli("validate", write(tmp_path, "cluster: {devices: 8, topology: torus-4x4.yaml}")) == 2
    assert capsys.readouterr().err.strip().endswith(
        "cluster.devices: 8 does not match the 16 GPUs of torus-4x4.yaml; `cluster.devices: null` takes the "
        "file's count")


@pytest.mark.parametrize("args,expected", [
    (["topo", "--topology", str(ROOT / "topologies" / "torus-4x4.yaml"), "--devices", "8"],
     f"--devices: 8 does not match the 16 GPUs of {ROOT / 'topologies' / 'torus-4x4.yaml'}; leaving out --devices "
     "takes the file's count"),
    (["topo", "--topology", "hierarchical", "--devices", "6", "--gpus-per-node", "4"], "--gpus-per-node"),
    (["topo", "--topology", "ring"], "--devices: required by the ring builder"),
])
def test_topo_errors_name_its_options(capsys, args, expected):
    assert cli(*args) == 2
    err = capsys.readouterr().err.strip()
    assert "cluster." not in err and expected in err


def summary_lines(capsys, data) -> list[str]:
    capsys.readouterr()
    print_summary(data)
    return capsys.readouterr().out.splitlines()


def test_the_summary_shows_the_layout_precision_and_why_a_figure_is_missing(tmp_path, capsys):
    out = tmp_path / "run"
    # 256 samples: the loss curve's evaluation of gpt_small's 2048 was half the run
    assert cli("run", str(GPT_SMALL), "--set", "train.steps=4", "--set", "data.samples=256", "--set", "cluster.devices=8",
               "--set", "parallel.pp=2", "--set", "parallel.tp=2", "--set", "train.precision=fp16", "--out", str(out),
               "-q") == 0
    data = json.loads((out / "report.json").read_text())
    lines = summary_lines(capsys, data)
    text = "\n".join(lines)
    rows = summary_rows(text)
    assert [rows["layout"], rows["pipeline"]] == ["dp 2 × pp 2 × tp 2 × cp 1, ep 1", "1f1b, 4 microbatches"]
    scale = data["amp"]["loss_scale_final"]
    assert f"fp16, final loss scale {scale:g}, {data['amp']['skipped_steps']} skipped steps" in text
    assert data["scaling_efficiency"] is None and "n/a (model split: no one-device baseline)" in text
    # Memory: the ranks of a pipeline stage hold the same, one column per stage, within 80 columns.
    stages = data["parallel"]["stage_of_rank"]
    groups = [[rank for rank in range(8) if stages[rank] == stage] for stage in (0, 1)]
    header = next(line for line in lines if "ranks " in line)
    assert [part.strip() for part in header.strip("┃").split("┃")[1:]] == [
        f"ranks {','.join(f'{g[0]}-{g[1]}' for g in zip(group[::2], group[1::2]))}" for group in groups]
    assert max(len(line) for line in lines) <= 80


def test_an_async_summary_counts_updates(tmp_path, capsys):
    out = tmp_path / "run"
    scenario = ROOT / "scenarios" / "async_vs_sync_straggler.yaml"
    assert cli("run", str(scenario), "--set", "train.steps=10", "--out", str(out), "-q") == 0
    data = json.loads((out / "report.json").read_text())
    text = "\n".join(summary_lines(capsys, data))
    assert f"over {data['steps']} updates" in text and "│ update time" in text and " steps" not in text
    assert f"{data['devices_count']} asynchronous workers, {data['async']['consistency']} updates" in text
    assert "fp32 (no loss scaling)" in text


def test_quiet_still_says_where_the_outputs_went(tmp_path, capsys):
    assert cli("run", str(QUICKSTART), *FAST, "--out", str(tmp_path), "-q") == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == f"wrote {tmp_path}/report.json, scenario.resolved.yaml, trace.json, final_model.pt"
    assert captured.err == ""


def test_a_long_numerics_run_is_warned_once_with_the_no_numerics_hint(monkeypatch):
    """The pace is read from the steps after the first (whose wall time includes building the job): 10 s a step,
    96 steps left after the fourth is 960 s, past the 120 s the warning starts at."""
    from rich.console import Console

    from simtrain import progress

    def warnings(numerics: bool, seconds_per_step: float) -> list[str]:
        console = Console(record=True, width=400)
        clock = iter(range(0, 10_000, 1))
        monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock) * seconds_per_step)
        scenario = simtrain.load_scenario(QUICKSTART, [f"numerics={str(numerics).lower()}", "train.steps=100"])
        with progress.RunProgress(scenario, console) as bar:
            for step in range(100):
                bar.on_step(step, step * 1e-3, None)
        return [line for line in console.export_text().splitlines() if line.startswith("warning:")]

    (line,) = warnings(numerics=True, seconds_per_step=10.0)
    assert line.startswith("warning: about 960 s of wall time left with numerics on; --no-numerics")
    assert warnings(numerics=False, seconds_per_step=10.0) == []
    assert warnings(numerics=True, seconds_per_step=1.0) == []  # 96 s left: not long


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["collective", "--help"], ["report", "--help"],
                                  ["--version"]])
def test_help_starts_without_torch(args):
    """`simtrain --help` is read before anything runs: it imports neither torch nor the simulator (the start-up
    time bench/startup.py measures)."""
    code = ("import sys\nfrom simtrain.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "heavy = sorted(name for name in ('torch', 'numpy', 'simpy', 'simtrain.runner') if name in sys.modules)\n"
            "print('imported:', heavy, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    assert done.stderr.strip().splitlines()[-1] == "imported: []"


def test_summary_names_zero_and_hsdp_and_shows_tokens_per_device(tmp_path, capsys):
    """An HSDP run with numerics off: the title names ZeRO-3 and its shard groups (not the registry's
    "sharded"), the layout every degree, and tokens/s per device is the batch's tokens (dp 4 x 8 samples x 32
    tokens) over the step time and the 4 devices; a throughput below 1 prints to 3 figures, not "1"."""
    zero3 = ROOT / "scenarios" / "zero3.yaml"
    assert cli("run", str(zero3), "--set", "train.steps=2", "--set", "parallel.sharding.degree=2", "--no-numerics",
               "--out", str(tmp_path)) == 0
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["throughput_tokens_per_s_per_device"] == pytest.approx(4 * 8 * 32 / data["step_time_s"] / 4,
                                                                      rel=1e-12)
    out = capsys.readouterr().out
    assert "zero3: HSDP (ZeRO-3), ring on 4 devices" in out
    rows = summary_rows(out)
    assert rows["layout"] == "dp 4 × pp 1 × tp 1 × cp 1, ep 1"
    assert rows["sharding"] == "ZeRO-3 over 2 ranks × 2 replicas (HSDP)"
    assert rows["tokens/s per device"] == f"{data['throughput_tokens_per_s_per_device']:,.0f}"
    rows = summary_rows("\n".join(summary_lines(capsys, {**data, "throughput_samples_per_s": 0.59345,
                                                           "throughput_tokens_per_s_per_device": 37.98})))
    assert [rows["throughput"], rows["tokens/s per device"]] == ["0.593 samples/s", "38"]


def summary_rows(text: str) -> dict[str, str]:
    """The summary table's rows, label -> value."""
    cells = [line.strip("│ ").split("│") for line in text.splitlines() if line.count("│") == 3]
    return {label.strip(): value.strip() for label, value in cells}


def test_progress_draws_a_bar_on_a_terminal_and_nothing_piped(monkeypatch):
    """A run's bar (compare's too) and a sweep's are drawn only where the standard error is a terminal; piped, a
    sweep writes one line a point (a log's record), and --quiet (shown=False) nothing."""
    from rich.console import Console

    from simtrain import progress

    scenario = simtrain.load_scenario(QUICKSTART, ["train.steps=4"])

    def drawn(terminal: bool, shown: bool = True) -> tuple[str, str]:
        run_console = Console(record=True, width=200, force_terminal=terminal)
        with progress.RunProgress(scenario, run_console, label="[1/2] quickstart") as bar:
            for step in range(4):
                bar.on_step(step, (step + 1) * 1e-3, 2.5)
            bar.progress.refresh()
            during = run_console.export_text()
        sweep_console = Console(record=True, width=200, force_terminal=terminal)
        with progress.SweepProgress(3, sweep_console, shown=shown) as points:
            for done in range(1, 4):
                points.on_done(done, 3)
        return during, sweep_console.export_text()

    run_bar, sweep_bar = drawn(terminal=True)
    assert "[1/2] quickstart" in run_bar and "4/4" in run_bar and "loss 2.5000" in run_bar
    assert "sweep" in sweep_bar and "3/3 points" in sweep_bar
    assert drawn(terminal=False) == ("", "[1/3] points done\n[2/3] points done\n[3/3] points done\n")
    assert drawn(terminal=False, shown=False) == ("", "")


def test_piped_tables_are_never_cut_to_a_narrow_terminal(tmp_path):
    """Piped, the standard output holds every label and figure whole, however narrow the terminal (COLUMNS=30):
    the summary's figures as report.json has them, compare's columns."""
    environment = {**os.environ, "COLUMNS": "30", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "simtrain", "compare", str(QUICKSTART), "--variant",
                           "parallel.all_reduce=ring", "--variant", "parallel.all_reduce=tree", "--set",
                           "train.steps=3", "--set", "numerics=false", "--out", str(tmp_path / "compare")],
                          capture_output=True, text=True, cwd=tmp_path, env=environment)
    assert done.returncode == 0, done.stderr
    assert "…" not in done.stdout
    for text in ("parallel.all_reduce=ring", "parallel.all_reduce=tree", "staleness mean/max", "peak memory",
                 "time/sample"):
        assert text in done.stdout
    assert done.stderr.splitlines() == ["[1/2] parallel.all_reduce=ring", "[2/2] parallel.all_reduce=tree"]
    done = subprocess.run([sys.executable, "-m", "simtrain", "run", str(QUICKSTART), "--set", "train.steps=3",
                           "--set", "numerics=false", "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, cwd=tmp_path, env=environment)
    data = json.loads((tmp_path / "run" / "report.json").read_text())
    assert done.returncode == 0 and done.stderr == "" and "…" not in done.stdout
    assert f"{data['flops']['tflops_per_device']:.3g} (of {data['flops']['peak_tflops_per_device']:.3g} peak)" \
        in done.stdout and "model TFLOP/s per device" in done.stdout
