"""simtrain sweep on a multi-node Ray cluster that the test starts on this machine: Ray's own test cluster
(ray.cluster_utils.Cluster), a head node and a second node with one CPU each, each its own raylet and worker
processes, reached by address as `simtrain sweep --ray HOST:PORT` reaches a real one.

A cheap 48-point sweep (numerics off, one step) gives the local process pool's rows on the cluster, with points
run on both nodes; killed (SIGKILL) once half its points are in rows.jsonl, the same command finishes it with the
same rows and without running a recorded point again. bench/sweep_ray_10k.py runs 10,000 points the same way.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from simtrain.cli import main
from simtrain.studies.sweep import parse_grid, run_sweep

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = "scenarios/quickstart.yaml"
COMMON = ["numerics=false", "train.steps=1", "report.trace=false"]
GRIDS = ["cluster.link.bandwidth=" + ",".join(f"{10 + 5 * i} GB/s" for i in range(6)),
         "cluster.link.latency=" + ",".join(f"{i + 1} us" for i in range(8))]
POINTS = 48
KILL_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def cluster():
    """Two nodes (two raylets) on this machine, shut down after the module's tests."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def pool_rows(tmp_path_factory):
    return run_sweep(QUICKSTART, [parse_grid(grid) for grid in GRIDS], COMMON, tmp_path_factory.mktemp("pool"),
                     workers=2)


def journal_records(out: Path) -> list[dict]:
    """The rows.jsonl lines after the header, up to the last whole one (a sweep may be writing, or was killed)."""
    text = (out / "rows.jsonl").read_text() if (out / "rows.jsonl").exists() else ""
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()[1:]]


def sweep_arguments(address: str, out: Path) -> list[str]:
    return ["sweep", QUICKSTART, *(w for g in GRIDS for w in ("--grid", g)), *(w for s in COMMON for w in ("--set", s)),
            "--ray", address, "--out", str(out)]


def test_a_sweep_on_the_cluster_gives_the_process_pools_rows_with_points_on_both_nodes(cluster, pool_rows, tmp_path):
    import ray

    assert len(pool_rows) == POINTS and all(row["status"] == "ok" for row in pool_rows)
    assert run_sweep(QUICKSTART, [parse_grid(grid) for grid in GRIDS], COMMON, tmp_path,
                     ray_address=cluster.address) == pool_rows
    nodes = {cluster.head_node.node_id, *(node.node_id for node in cluster.worker_nodes)}
    assert len(nodes) == 2 and {record["node"] for record in journal_records(tmp_path)} == nodes
    assert not ray.is_initialized()  # the connection the sweep made is closed


def test_a_sweep_killed_half_way_resumes_without_running_a_recorded_point_again(cluster, pool_rows, tmp_path, capsys):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "simtrain", *sweep_arguments(cluster.address, out)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while len(journal_records(out)) < POINTS // 2:
            assert process.poll() is None and time.monotonic() < deadline, "the sweep ended before half its points"
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    recorded = {record["row"]["index"] for record in journal_records(out)}
    assert POINTS // 2 <= len(recorded) < POINTS and not (out / "sweep.json").exists()
    reports = {index: (out / "runs" / f"{index:04d}" / "report.json").stat() for index in recorded}
    with pytest.raises(SystemExit) as code:
        main(sweep_arguments(cluster.address, out))
    assert code.value.code == 0
    progress = [line for line in capsys.readouterr().err.splitlines() if line.endswith("points done")]
    assert progress[0] == f"[{len(recorded)}/{POINTS}] points done" and len(progress) == 1 + POINTS - len(recorded)
    assert json.loads((out / "sweep.json").read_text()) == pool_rows
    assert sorted(record["row"]["index"] for record in journal_records(out)) == list(range(POINTS))  # each once
    for index, before in reports.items():
        after = (out / "runs" / f"{index:04d}" / "report.json").stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
