"""`simtrain compare`: every figure of the table comes from each run's report."""
import json
from pathlib import Path

import pytest

from simtrain.cli import main
from simtrain.compare import parse_variant, plan_runs
from simtrain.errors import ScenarioError
from simtrain.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]
STRAGGLER = ROOT / "scenarios" / "async_vs_sync_straggler.yaml"
SMALL = ["--set", "data.batch_size=16", "--set", "model.hidden=[32]", "--set", "data.samples=4096"]


def test_variants_split_only_before_the_next_path():
    assert parse_variant("parallel.mode=async, cluster.torus_shape=[2,4],x=1") == [
        "parallel.mode=async", "cluster.torus_shape=[2,4]", "x=1"]
    with pytest.raises(ScenarioError, match="--variant"):
        parse_variant("parallel.mode")
    runs = plan_runs(["a.yaml"], [["x=1"], ["x=2"]], ["y=3"])
    assert [(r.label, r.overrides) for r in runs] == [("x=1", ["y=3", "x=1"]), ("x=2", ["y=3", "x=2"])]


def test_compare_runs_every_variant_and_writes_table_json_and_plot(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", str(STRAGGLER), *SMALL, "--set", "train.steps=40", "--set", "train.target_loss=2.0",
              "--variant", "parallel.mode=sync,train.steps=5", "--variant", "parallel.async.consistency=locked",
              "--out", str(tmp_path)])
    assert exit_info.value.code == 0
    rows = json.loads((tmp_path / "compare.json").read_text())
    assert [row["scheme"] for row in rows] == ["data_parallel/ring", "async/locked"]
    for index, row in enumerate(rows):
        folder = next(tmp_path.glob(f"{index}-*"))
        report = json.loads((folder / "report.json").read_text())
        assert row["sim_time_s"] == report["sim_time_s"] and row["final_loss"] == report["final_loss"]
        assert row["time_to_target_s"] == report["time_to_target_s"]
        reached = [t for _, t, loss in report["train_loss_curve"] if loss <= 2.0]
        assert report["time_to_target_s"] == (reached[0] if reached else None)
        assert row["idle_share"] == pytest.approx(report["breakdown_s"]["idle"] / report["step_time_s"])
    assert rows[0]["steps"] == 5 and rows[0]["staleness_mean"] is None
    assert rows[1]["steps"] == 40 and rows[1]["staleness_max"] >= 1
    # Comparable units: a sync step trains all 8 devices' batches of 16, an async update one worker's batch.
    assert [(row["steps_are"], row["samples"]) for row in rows] == [("steps", 5 * 8 * 16), ("updates", 40 * 16)]
    for row in rows:
        assert row["time_per_sample_s"] == pytest.approx(row["sim_time_s"] / row["samples"], rel=1e-12)
    png = (tmp_path / "loss_vs_time.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    out = capsys.readouterr().out
    assert "async/" in out and "data_parallel" in out  # the rows' scheme column (compare.json has it whole)
    assert "5 steps, 640 samples" in out and "40 updates, 640 samples" in out


def test_float_noise_compares_as_zero(tmp_path):
    # idle = step time - the rest is never exactly 0 in floating point; two runs of one scenario compare equal.
    from simtrain.compare import compare_reports
    from simtrain.units import noise_free

    assert noise_free(3e-19, 1e-3) == 0.0 and noise_free(2e-12, 1e-3) == 2e-12 and noise_free(None, 1.0) is None
    for name in ("a", "b"):
        report = {"step_time_s": 1e-3, "throughput_samples_per_s": 1e6,
                  "breakdown_s": {"compute": 6e-4, "communication": 4e-4, "optimizer": 0.0,
                                  "idle": 1e-19 if name == "a" else -2e-20}}
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(report))
    rows = {row["figure"]: row for row in compare_reports(tmp_path / "a", tmp_path / "b")}
    assert rows["idle"]["values"] == [0.0, 0.0] and rows["idle"]["error"] == 0.0
    assert rows["optimizer"]["error"] == 0.0 and rows["compute"]["error"] == 0.0


def test_compare_reports_a_bad_variant_before_running_anything(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", str(STRAGGLER), "--variant", "parallel.mode=sync", "--variant", "parallel.all_reduce=fast",
              "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_compare_counts_sharded_and_expert_bytes_and_draws_no_empty_loss_plot(tmp_path, capsys):
    """Numerics off: FSDP's all-gathers and reduce-scatters and the experts' all-to-alls are counted (not "0 B"),
    every row has its step time and MFU from its report, and no loss plot is drawn (no run has a loss)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", str(ROOT / "scenarios" / "zero3.yaml"), str(ROOT / "scenarios" / "moe_expert_parallel.yaml"),
              "--set", "train.steps=2", "--set", "numerics=false", "--out", str(tmp_path)])
    assert exit_info.value.code == 0
    rows = json.loads((tmp_path / "compare.json").read_text())
    reports = [json.loads((next(tmp_path.glob(f"{index}-*")) / "report.json").read_text()) for index in (0, 1)]
    fsdp, moe = reports
    assert rows[0]["bytes_by_kind"]["sharded"] == sum(fsdp["sharding"]["bytes_by_kind"].values()) > 0
    assert rows[0]["bytes_by_kind"]["dp_allreduce"] == 0 and rows[0]["bytes_by_kind"]["expert"] == 0
    assert rows[1]["bytes_by_kind"]["expert"] == sum(moe["moe"]["all_to_all_bytes"]) > 0
    for row, report in zip(rows, reports):
        assert row["step_time_s"] == report["step_time_s"] and row["mfu"] == report["flops"]["mfu"] > 0
    assert not (tmp_path / "loss_vs_time.png").exists()
    out = " ".join(capsys.readouterr().out.split())
    assert f"sharded {format_bytes(rows[0]['bytes_by_kind']['sharded'])}" in out
    assert f"{rows[1]['mfu']:.1%}" in out and "no loss plot" in out
