"""A 10,000-point `simtrain sweep` on a two-node Ray cluster this script starts on this machine, stopped half way
and resumed.

The cluster is Ray's own multi-node test cluster (`ray.cluster_utils.Cluster`): a head node and a second node,
one CPU each, each its own raylet and worker processes. The sweep is the command line's, run in a subprocess and
connecting by address (`--ray HOST:PORT`): the quickstart scenario with numerics off and one step, over 100 link
bandwidths x 100 link latencies. Once `OUT/rows.jsonl` holds half the points the sweep is killed (SIGKILL: no
clean-up), then the same command runs again and finishes. The script checks that every point is in rows.jsonl
exactly once (none ran twice) and prints the wall time, the points per second, the cost of a point beside the
same run in-process, and the peak memory of the sweep's process and of the whole cluster.

    .venv/bin/python bench/sweep_ray_10k.py [--per-axis 100] [--stop-at 0.5]

`--per-axis 10` is a 100-point check of the same path.
"""
import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = "scenarios/quickstart.yaml"
COMMON = ["numerics=false", "train.steps=1", "report.trace=false"]
POLL_S = 0.5


def axis(path: str, low: float, high: float, count: int, unit: str) -> str:
    return f"{path}=" + ",".join(f"{low + (high - low) * i / max(count - 1, 1):.6g} {unit}" for i in range(count))


def journal_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def tree_rss_bytes(root_pid: int) -> int:
    """The resident memory of `root_pid` and every process below it (Linux /proc)."""
    parents, rss = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                status = (entry / "status").read_text()
            except OSError:  # it ended while we looked
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            rss[int(entry.name)] = next((int(line.split()[1]) * 1024 for line in status.splitlines()
                                         if line.startswith("VmRSS:")), 0)
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    below, total = [root_pid], 0
    while below:
        pid = below.pop()
        total += rss.get(pid, 0)
        below.extend(children.get(pid, []))
    return total


def run_sweep_command(command: list[str], journal: Path, stop_at_lines: int | None, peak: dict) -> dict:
    """Run the sweep's command line; kill it once the journal has `stop_at_lines` lines. Returns its wall time,
    and the points it recorded after its first and the seconds between (the rate once it is under way)."""
    start, lines, cpu = time.perf_counter(), journal_lines(journal), children_cpu_s()
    first_row = None
    with tempfile.TemporaryFile("w+") as log:  # a pipe nobody read would fill with progress lines and stop the sweep
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, text=True)
        while process.poll() is None:
            time.sleep(POLL_S)
            peak["cluster_bytes"] = max(peak["cluster_bytes"], tree_rss_bytes(os.getpid()))
            now, recorded = time.perf_counter(), journal_lines(journal)
            if first_row is None and recorded > max(lines, 1):
                first_row = (now, recorded)
            if stop_at_lines is not None and recorded >= stop_at_lines:
                process.send_signal(signal.SIGKILL)
                process.wait()
                break
        else:
            if process.returncode != 0:
                log.seek(0)
                raise SystemExit(f"the sweep failed ({process.returncode}): {log.read()[-2000:]}")
    end, recorded = time.perf_counter(), journal_lines(journal)
    return {"wall_s": end - start, "first_row_s": first_row[0] - start, "cpu_s": children_cpu_s() - cpu,
            "steady_points": recorded - first_row[1], "steady_s": end - first_row[0]}


def children_cpu_s() -> float:
    """CPU time of this script's children that ended: the sweep's processes, once each is waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def in_process_seconds_per_point(grids: list[str], count: int) -> float:
    """One point run the way a worker runs it, in this process, averaged over `count` points (after one warm-up)."""
    from simtrain.scenario import load_scenario
    from simtrain.studies.sweep import parse_grid, run_one

    first, second = (parse_grid(grid) for grid in grids)
    scenarios = [load_scenario(SCENARIO, [*COMMON, f"{first.path}={first.texts[i % len(first.texts)]}",
                                          f"{second.path}={second.texts[i // len(first.texts) % len(second.texts)]}"])
                 for i in range(count + 1)]
    run_one(scenarios[0])
    start = time.perf_counter()
    for scenario in scenarios[1:]:
        run_one(scenario)
    return (time.perf_counter() - start) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-axis", type=int, default=100, help="values on each of the two axes")
    parser.add_argument("--stop-at", type=float, default=0.5, help="the share of points after which it is killed")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    sys.path.insert(0, str(ROOT))
    from ray.cluster_utils import Cluster

    grids = [axis("cluster.link.bandwidth", 10, 100, args.per_axis, "GB/s"),
             axis("cluster.link.latency", 1, 10, args.per_axis, "us")]
    points = args.per_axis ** 2
    print(f"{points} points of {SCENARIO} ({' '.join(COMMON)}); one run in this process: "
          f"{in_process_seconds_per_point(grids, 100) * 1e3:.1f} ms", flush=True)
    peak = {"cluster_bytes": 0}
    start = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        print(f"two-node Ray cluster at {cluster.address} up in {time.perf_counter() - start:.1f} s", flush=True)
        with tempfile.TemporaryDirectory() as out:
            journal = Path(out) / "rows.jsonl"
            command = [sys.executable, "-m", "simtrain", "sweep", SCENARIO, *(w for g in grids for w in ("--grid", g)),
                       *(w for s in COMMON for w in ("--set", s)), "--ray", cluster.address, "--out", out]
            stop_lines = 1 + int(points * args.stop_at)
            first = run_sweep_command(command, journal, stop_lines, peak)
            before = journal_lines(journal) - 1
            print(f"killed after {first['wall_s']:.1f} s with {before} points in rows.jsonl", flush=True)
            second = run_sweep_command(command, journal, None, peak)
            records = [json.loads(line) for line in journal.read_text().splitlines()[1:]]
            indices = [record["row"]["index"] for record in records]
            rows = json.loads((Path(out) / "sweep.json").read_text())
            nodes = sorted({record["node"] for record in records})
        driver_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    finally:
        cluster.shutdown()
    assert sorted(indices) == list(range(points)), "a point is missing from rows.jsonl, or ran twice"
    assert [row["index"] for row in rows] == list(range(points)) and all(row["status"] == "ok" for row in rows)
    wall = first["wall_s"] + second["wall_s"]
    steady = (first["steady_points"] + second["steady_points"]) / (first["steady_s"] + second["steady_s"])
    print(f"resumed: {points - before} points in {second['wall_s']:.1f} s; none ran twice; points ran on "
          f"{len(nodes)} nodes ({', '.join(str(sum(record['node'] == node for record in records)) for node in nodes)})")
    print(f"{points} points in {wall:.1f} s of sweep: {points / wall:.1f} points/s; under way "
          f"(after the first row: {first['first_row_s']:.1f} s, then {second['first_row_s']:.1f} s) "
          f"{steady:.1f} points/s, {2 / steady * 1e3:.1f} CPU-ms a point on the cluster's 2 CPUs")
    print(f"the sweep's process (start, validation, journal, outputs): {first['cpu_s'] + second['cpu_s']:.1f} CPU-s, "
          f"{(first['cpu_s'] + second['cpu_s']) / points * 1e3:.2f} ms a point")
    print(f"peak memory: the sweep's process {driver_peak / 2**20:.0f} MiB; the whole cluster with it "
          f"{peak['cluster_bytes'] / 2**20:.0f} MiB (sampled every {POLL_S} s)")


if __name__ == "__main__":
    main()
