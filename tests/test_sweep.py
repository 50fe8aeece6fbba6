"""simtrain sweep: the product of grids, rows independent of workers and finishing order, failures as rows."""
import json

import pytest

import simtrain
from simtrain.cli import main
from simtrain.errors import ScenarioError
from simtrain.studies.sweep import FIGURE_LABELS, ROW_FIGURES, axis_unit, parse_grid, plan_points, run_sweep

QUICKSTART = "scenarios/quickstart.yaml"
COMMON = ["train.steps=4", "report.trace=false"]
GRIDS = ["cluster.devices=2,4", "parallel.all_reduce=ring,naive"]


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    out = tmp_path_factory.mktemp("serial")
    return run_sweep(QUICKSTART, [parse_grid(g) for g in GRIDS], COMMON, out, workers=1), out


def test_rows_are_the_product_in_order_with_the_runs_figures(serial):
    rows, out = serial
    assert [(row["cluster.devices"], row["parallel.all_reduce"]) for row in rows] == [
        (2, "ring"), (2, "naive"), (4, "ring"), (4, "naive")]
    alone = simtrain.run(simtrain.load_scenario(QUICKSTART,
                                                [*COMMON, "cluster.devices=4", "parallel.all_reduce=naive"]))
    assert rows[3]["step_time_s"] == alone.data["step_time_s"]
    assert rows[3]["communication_s"] == alone.data["breakdown_s"]["communication"]
    assert rows[3]["final_loss"] == alone.data["final_loss"]
    assert json.loads((out / "runs" / "0003" / "report.json").read_text())["step_time_s"] == alone.data["step_time_s"]
    assert json.loads((out / "sweep.json").read_text()) == rows
    csv_lines = (out / "sweep.csv").read_text().splitlines()
    assert csv_lines[0].startswith("index,cluster.devices,parallel.all_reduce,status,step_time_s")
    assert len(csv_lines) == 5
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_rows_do_not_depend_on_the_worker_count(serial, tmp_path):
    rows, _ = serial
    assert run_sweep(QUICKSTART, [parse_grid(g) for g in GRIDS], COMMON, tmp_path, workers=2) == rows


@pytest.mark.slow
def test_a_sweep_on_a_real_local_ray_instance_gives_the_same_rows(serial, tmp_path, monkeypatch):
    """Ray (the `ray` extra, installed by `make install`) starts a local instance for the sweep, runs each point as
    a task, and closes it after: the rows are the local processes' rows, whatever order the tasks finish in."""
    import ray

    rows, _ = serial
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    progress = []
    assert run_sweep(QUICKSTART, [parse_grid(g) for g in GRIDS], COMMON, tmp_path, ray_address="local",
                     on_done=lambda finished, total: progress.append((finished, total))) == rows
    assert progress == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert not ray.is_initialized()  # the instance it started is shut down


def test_a_failing_run_is_a_row_with_its_error(tmp_path):
    grids = [parse_grid("cluster.devices=0,2"), parse_grid("cluster.device={base: a100-40gb, memory: 100 KiB},a100-40gb")]
    rows = run_sweep(QUICKSTART, grids, COMMON, tmp_path, workers=1)
    assert [row["status"] for row in rows] == ["error", "error", "out_of_memory", "ok"]
    assert rows[0]["error"].startswith(f"{QUICKSTART}: cluster.devices")
    assert "largest per-device batch size" in rows[2]["error"]
    assert rows[2]["step_time_s"] is None and rows[3]["step_time_s"] > 0


def test_grids_parse_yaml_values_and_keep_bracketed_commas():
    grid = parse_grid("model.hidden=[64,64], [128],'a,b'")
    assert grid.values == ([64, 64], [128], "a,b")
    assert len(plan_points([grid, parse_grid("cluster.devices=2,4")])) == 6
    for text, message in [("cluster.devices", "expected dotted.path=value"), ("cluster.devices=2,,4", "empty value"),
                          ("cluster.devices=2,2", "given twice")]:
        with pytest.raises(ScenarioError, match=message):
            parse_grid(text)
    with pytest.raises(ScenarioError, match="given twice"):
        plan_points([parse_grid("seed=1,2"), parse_grid("seed=3")])


def test_cli_prints_a_table_and_refuses_bad_grids_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_code:
        main(["sweep", QUICKSTART, "--grid", "cluster.devices=2", "--set", "train.steps=2", "--workers", "1",
              "--out", str(tmp_path)])
    assert exit_code.value.code == 0
    assert "1 runs" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_code:
        main(["sweep", QUICKSTART, "--grid", "cluster.devices=2", "--metric", "speed", "--out", str(tmp_path / "b")])
    assert exit_code.value.code == 2
    assert capsys.readouterr().err.strip() == "error: --metric: 'speed' is not one of step_time_s, " \
        "throughput_samples_per_s, scaling_efficiency, sim_time_s, compute_s, communication_s, idle_s, bubble_s, " \
        "peak_memory_bytes, final_loss, final_accuracy, effective_training_time"


@pytest.mark.parametrize("metric,values,expected", [
    ("step_time_s", [34e-6, 17e-6], ("µs", 1e6)),
    ("sim_time_s", [0.5, 2.0], ("s", 1.0)),
    ("communication_s", [3e-3], ("ms", 1e3)),
    ("idle_s", [0.0], ("ns", 1e9)),
    ("peak_memory_bytes", [237.3 * 1024], ("KiB", 1 / 1024)),
    ("peak_memory_bytes", [24.2 * 1024**3, 6 * 1024**3], ("GiB", 1 / 1024**3)),
    ("scaling_efficiency", [0.42], ("", 100.0)),
    ("throughput_samples_per_s", [3.7e6], ("", 1.0)),
])
def test_sweep_axes_show_figures_in_a_unit_that_fits(metric, values, expected):
    assert axis_unit(metric, values) == expected


def test_every_row_figure_has_an_axis_label_not_its_key():
    assert set(FIGURE_LABELS) == set(ROW_FIGURES)
    assert all("_" not in label for label in FIGURE_LABELS.values())


def test_scaling_efficiency_is_the_devices_own_work_over_the_step_and_stays_under_100_percent(tmp_path):
    """ZeRO shards the update: a device of 4 updates a quarter of the model. Its baseline is its own work alone
    (its batch's compute, its shard's update), so the efficiency is (compute + optimizer) / step time, as under
    DDP, never above 1; one device's whole-model update as the baseline gave 267% at stage 3 here."""
    fast = ["train.steps=3", "numerics=false", "model.hidden=512", "cluster.link.bandwidth=5000 GB/s",
            "cluster.link.latency=1 ns"]
    rows = run_sweep("scenarios/zero3.yaml", [parse_grid("parallel.sharding.stage=0,3")], fast, tmp_path, workers=1)
    for row in rows:
        data = json.loads((tmp_path / "runs" / f"{row['index']:04d}" / "report.json").read_text())
        own_work_s = data["breakdown_s"]["compute"] + data["breakdown_s"]["optimizer"]
        assert row["scaling_efficiency"] == pytest.approx(own_work_s / data["step_time_s"], rel=1e-6)
        assert 0.9 < row["scaling_efficiency"] <= 1.0
