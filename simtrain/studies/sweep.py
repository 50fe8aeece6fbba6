"""A sweep: one scenario run at every point of a grid, in local processes or on a Ray cluster.

    simtrain sweep scenarios/quickstart.yaml --grid "cluster.devices=8,16,32,64" \\
        --grid "cluster.topology=ring,switch,topologies/dgx-a100-2node.yaml" --workers 2 --out runs/sweep

A grid is `dotted.path=v1,v2,...`: each value is parsed as YAML, and a comma
inside brackets, braces or quotes belongs to its value (`model.hidden=[64,64],[256]`).
The runs are the product of the grids, the first grid outermost; each is the
scenario with the `--set` overrides, then its grid values. A point the schema
refuses becomes a row with its error, as does a run that fails (any exception)
or runs out of memory, and the sweep goes on. Each point is recorded the moment
it finishes: its report.json in `OUT/runs/<index>/`, then its row, one line of
`OUT/rows.jsonl` (sweep_journal.py). Running the same sweep into the same OUT
again runs only the points not recorded there (`restart` runs them all), and
then the sweep writes

- `OUT/sweep.json` and `OUT/sweep.csv`: one row per run, in product order,
  with the grid values and the report's headline figures (`ROW_FIGURES`);
- `OUT/sweep.png`: one figure (`metric`, step time by default) against the
  first grid's values, a line per combination of the other grids' values.

Rows depend neither on the worker count, nor on the order runs finish in, nor
on where a sweep was stopped and resumed (the host's wall time is not in them).
Runs go to `workers` spawned processes, or, with `ray_address`, are submitted
as tasks to a Ray cluster (`pip install simtrain[ray]`; "local" starts one on
this machine for the sweep): each task gets the validated scenario and returns
its report, so only files the scenario reads when it runs (a topology file, a
user's model module) must be at the same path on Ray's workers. Either way at
most `IN_FLIGHT_PER_WORKER` points per worker are handed out and unfinished
(validated just before), and no report stays in memory once it is on disk: a
10,000-point sweep holds its rows, not its reports.

    rows = run_sweep("scenarios/quickstart.yaml", [parse_grid("cluster.devices=2,4")], [], Path("out"), workers=2)
"""
import csv
import hashlib
import itertools
import json
import math
import multiprocessing
import socket
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from contextlib import closing, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the Agg backend)

from ..errors import ScenarioError, SimtrainError, one_line  # noqa: E402
from ..limits import MAX_SWEEP_RUNS  # noqa: E402
from ..report import finite_or_none  # noqa: E402
from ..runner import run as run_scenario  # noqa: E402
from ..scenario import load_scenario  # noqa: E402
from ..user_files import parse_yaml_text  # noqa: E402
from ..version import __version__  # noqa: E402
from .sweep_journal import SweepJournal  # noqa: E402

# Each row figure and its axis label in sweep.png; a time's unit (s to ns) and a size's (B to TiB) fit its values.
FIGURE_LABELS = {"step_time_s": "step time", "throughput_samples_per_s": "throughput (samples/s)",
                 "scaling_efficiency": "scaling efficiency (%)", "sim_time_s": "simulated time",
                 "compute_s": "compute per step", "communication_s": "communication per step",
                 "idle_s": "idle per step", "bubble_s": "pipeline bubble per step", "peak_memory_bytes": "peak memory",
                 "final_loss": "final loss (train set, cross entropy)", "final_accuracy": "final accuracy (%)",
                 "effective_training_time": "effective training time (%; fleet)"}
ROW_FIGURES = tuple(FIGURE_LABELS)
MAX_PLOT_LABELS = 12  # sweep.png names each line in a legend, and each of the first grid's values, up to this many


@dataclass(frozen=True)
class Grid:
    """One axis of a sweep: a scenario field and the values it takes, as written and as parsed."""

    path: str
    texts: tuple[str, ...]
    values: tuple


def parse_grid(text: str) -> Grid:
    """`"cluster.devices=8,16"` -> Grid; ScenarioError naming --grid if it is not path=v1,v2,..."""
    path, sep, values = text.partition("=")
    path = path.strip()
    if not sep or not path:
        raise ScenarioError(f"--grid {text!r}: expected dotted.path=value[,value...]")
    texts = tuple(part.strip() for part in _split_values(values))
    if not all(texts):
        raise ScenarioError(f"--grid {path}: an empty value in {values!r}")
    values = tuple(parse_yaml_text(value, f"--grid {path}", ScenarioError) for value in texts)
    for index, value in enumerate(values):
        if value in values[:index]:
            raise ScenarioError(f"--grid {path}: the value {texts[index]} is given twice")
    return Grid(path, texts, values)


def _split_values(text: str) -> list[str]:
    """Split at commas outside brackets, braces and quotes."""
    parts, depth, quote, start = [], 0, None, 0
    for index, char in enumerate(text):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    return [*parts, text[start:]]


def plan_points(grids: list[Grid]) -> list[tuple[int, ...]]:
    """Every combination of the grids' value indices, the first grid outermost."""
    paths = [grid.path for grid in grids]
    if not grids:
        raise ScenarioError("sweep: give at least one --grid")
    repeated = sorted({path for path in paths if paths.count(path) > 1})
    if repeated:
        raise ScenarioError(f"--grid {repeated[0]}: given twice")
    count = 1
    for grid in grids:
        count *= len(grid.values)
    if count > MAX_SWEEP_RUNS:
        raise ScenarioError(f"--grid: {count} runs, more than a sweep takes ({MAX_SWEEP_RUNS})")
    return list(itertools.product(*(range(len(grid.values)) for grid in grids)))


def run_sweep(scenario_file: str, grids: list[Grid], common: list[str], out_dir: Path, workers: int = 1,
              ray_address: str | None = None, metric: str = "step_time_s", on_done=None,
              restart: bool = False) -> list[dict]:
    """Run the sweep's points not in OUT's journal yet (every point with `restart`), recording each as it finishes;
    write its rows, CSV and plot; return the rows. on_done(finished, total) follows each point, and comes once
    before any when points were resumed."""
    if metric not in ROW_FIGURES:
        raise ScenarioError(f"--metric: {metric!r} is not one of {', '.join(ROW_FIGURES)}")
    load_scenario(scenario_file, common)  # the file and the common overrides are good before anything runs
    points = plan_points(grids)
    with nullcontext() if ray_address is None else ray_connection(ray_address) as ray:  # before OUT is touched
        journal = SweepJournal.open(out_dir, sweep_identity(scenario_file, grids, common), len(points),
                                    partial(is_row_of, grids, points), restart)
        try:
            if journal.rows and on_done is not None:
                on_done(len(journal.rows), len(points))
            jobs = _jobs(scenario_file, grids, common, points, journal.rows)
            with closing(_run_all(jobs, len(points) - len(journal.rows), workers, ray)) as outcomes:
                for index, outcome in outcomes:
                    row = finite_or_none(headline_row(index, point_values(grids, points[index]), outcome))
                    journal.record(index, row, outcome.get("report"), outcome.get("node"))
                    if on_done is not None:
                        on_done(len(journal.rows), len(points))
            rows = [journal.rows[index] for index in range(len(points))]
        finally:
            journal.close()
    (out_dir / "sweep.json").write_text(json.dumps(rows, indent=2, allow_nan=False) + "\n")
    write_csv(rows, grids, out_dir / "sweep.csv")
    plot_sweep(rows, grids, metric, out_dir / "sweep.png")
    return rows


def sweep_identity(scenario_file: str, grids: list[Grid], common: list[str]) -> dict:
    """What makes two sweeps the same, as OUT's journal records it: resuming a sweep needs all of it equal."""
    return {"scenario": scenario_file, "scenario_sha256": hashlib.sha256(Path(scenario_file).read_bytes()).hexdigest(),
            "set": list(common), "grids": [f"{grid.path}={','.join(grid.texts)}" for grid in grids],
            "simtrain": __version__}


def point_values(grids: list[Grid], point: tuple[int, ...]) -> dict:
    return {grid.path: grid.values[value] for grid, value in zip(grids, point)}


def is_row_of(grids: list[Grid], points: list[tuple[int, ...]], row: dict) -> bool:
    """Whether a row read back from a journal is this sweep's row of its point: its columns, its grid values."""
    columns = {"index", "status", "error", *ROW_FIGURES, *(grid.path for grid in grids)}
    return set(row) == columns and all(row[path] == value for path, value in finite_or_none(
        point_values(grids, points[row["index"]])).items())


def _jobs(scenario_file: str, grids: list[Grid], common: list[str], points: list, finished: dict):
    """(index, scenario, None) for each point not finished, in product order, or (index, None, error) where the
    schema refuses it; each point is validated only when a worker is about to take it."""
    for index, point in enumerate(points):
        if index in finished:
            continue
        overrides = [f"{grid.path}={grid.texts[value]}" for grid, value in zip(grids, point)]
        try:
            scenario, error = load_scenario(scenario_file, [*common, *overrides]), None
        except SimtrainError as refusal:
            scenario, error = None, one_line(str(refusal))
        yield index, scenario, error


IN_FLIGHT_PER_WORKER = 2  # points handed to a worker (a process, a Ray CPU) and not finished: one runs, one waits


def _run_all(jobs, total: int, workers: int, ray):
    """(index, outcome) for every job, in the order they finish: on the Ray cluster `ray` is connected to, if any."""
    if ray is not None:
        yield from _run_on_ray(jobs, ray)
        return
    if workers == 1 or total <= 1:
        for index, scenario, error in jobs:
            yield index, run_one(scenario) if error is None else {"error": error}
        return
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch state inherited
    pool = ProcessPoolExecutor(max_workers=min(workers, total), mp_context=context)
    try:
        yield from in_window(jobs, IN_FLIGHT_PER_WORKER * min(workers, total), partial(pool.submit, run_one),
                             lambda futures: [(future, future.result()) for future in
                                              wait(futures, return_when=FIRST_COMPLETED).done])
    finally:
        pool.shutdown(cancel_futures=True)


def in_window(jobs, window: int, submit, wait_some):
    """(index, outcome) of every job as it finishes, with at most `window` submitted and not yet finished: jobs are
    drawn (and validated) only as the window has room. submit(scenario) -> handle; wait_some(handles) -> the
    [(handle, outcome)] finished. A point the schema refused needs no worker: its error is its outcome at once."""
    jobs, pending = iter(jobs), {}
    while True:
        drawn = 0
        for index, scenario, error in itertools.islice(jobs, window - len(pending)):
            drawn += 1
            if error is None:
                pending[submit(scenario)] = index
            else:
                yield index, {"error": error}
        if not pending:
            if drawn == 0:  # every job is drawn, and every one handed out has finished
                return
            continue
        for handle, outcome in wait_some(list(pending)):
            yield pending.pop(handle), outcome


def _run_on_ray(jobs, ray):
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    task = ray.remote(run_one_on_ray)
    yield from in_window(jobs, IN_FLIGHT_PER_WORKER * cpus, task.remote,
                         lambda references: [(reference, ray.get(reference)) for reference in
                                             ray.wait(references, num_returns=1)[0]])


@contextmanager
def ray_connection(address: str):
    """The `ray` module, connected to the cluster at `address` for the sweep: a caller's own connection is kept,
    one made here is closed after."""
    try:
        import ray
    except ImportError:
        raise ScenarioError("--ray: Ray is not installed (pip install 'simtrain[ray]')") from None
    started = not ray.is_initialized()
    if started:
        _connect_ray(ray, address)
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


RAY_CONNECT_TIMEOUT_S = 10  # a Ray head answers a TCP connect in milliseconds, even on a loaded host


def _connect_ray(ray, address: str) -> None:
    """ray.init on `address`; an address Ray cannot use, or host:port where no head answers (Ray itself would
    retry for minutes), is one line naming --ray."""
    if address not in ("local", "auto") and not address.startswith("ray://"):
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=RAY_CONNECT_TIMEOUT_S).close()
        except (ValueError, OverflowError, OSError) as error:
            raise ScenarioError(f"--ray {address!r}: no Ray head answers at host:port "
                                f"({one_line(str(error)) or type(error).__name__})") from None
    try:
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    except (ValueError, ConnectionError, RuntimeError) as error:
        raise ScenarioError(f"--ray {address!r}: {one_line(str(error))}") from None


def run_one(scenario) -> dict:
    """One run of a sweep: {"report": report.json's text}, or {"error": one line} if it failed."""
    try:
        return {"report": run_scenario(scenario).to_json()}
    except SimtrainError as error:
        return {"error": one_line(str(error))}
    except Exception as error:  # noqa: BLE001  (a failing run is a row, not a crashed sweep)
        return {"error": f"{type(error).__name__}: {one_line(str(error))}"}


def run_one_on_ray(scenario) -> dict:
    """run_one as a Ray task: its outcome, and the node that ran it (for the journal, not the row)."""
    import ray

    return {**run_one(scenario), "node": ray.get_runtime_context().get_node_id()}


def headline_row(index: int, values: dict, outcome: dict) -> dict:
    """A sweep's row: the run's grid values, status and headline figures (None where there are none)."""
    row = {"index": index, **values, **{figure: None for figure in ROW_FIGURES}}
    if "report" not in outcome:
        return {**row, "status": "error", "error": outcome["error"]}
    data = json.loads(outcome["report"])
    breakdown = data["breakdown_s"]
    row.update({figure: data[figure] for figure in ("step_time_s", "throughput_samples_per_s",
                                                    "scaling_efficiency", "sim_time_s", "final_loss",
                                                    "final_accuracy")})
    row.update({f"{kind}_s": breakdown[kind] for kind in ("compute", "communication", "idle", "bubble")})
    row["peak_memory_bytes"] = max(device["peak_memory_bytes"] for device in data["devices"])
    if data.get("fleet") is not None:
        row["effective_training_time"] = data["fleet"]["effective_training_time"]
    error = data["out_of_memory"]["message"] if data["status"] == "out_of_memory" else None
    return {**row, "status": data["status"], "error": error}


def write_csv(rows: list[dict], grids: list[Grid], path: Path) -> None:
    columns = ["index", *(grid.path for grid in grids), "status", *ROW_FIGURES, "error"]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for row in rows:
            writer.writerow(["" if row[column] is None else
                             json.dumps(row[column]) if isinstance(row[column], (list, dict)) else row[column]
                             for column in columns])


def plot_sweep(rows: list[dict], grids: list[Grid], metric: str, path: Path) -> None:
    """`metric` against the first grid's values, one line per combination of the other grids' values."""
    first, others = grids[0], grids[1:]
    # Finite numbers are placed at their value, as floats (numpy cannot take the log of an int past 2^64).
    numeric = all(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                  for value in first.values)
    positions = [float(value) for value in first.values] if numeric else list(range(len(first.values)))
    figure, axes = plt.subplots(figsize=(8, 5), dpi=120)
    unit, scale = axis_unit(metric, [row[metric] for row in rows if row[metric] is not None])
    lines: dict[tuple, list] = {}
    for row, texts in zip(rows, point_texts(grids)):  # rows in product order: the first grid's value is outermost
        value = None if row[metric] is None else row[metric] * scale
        lines.setdefault(texts[1:], [None] * len(first.values))[first.texts.index(texts[0])] = value
    for key, points in lines.items():
        xs = [x for x, y in zip(positions, points) if y is not None]
        ys = [y for y in points if y is not None]
        label = ", ".join(f"{grid.path}={text}" for grid, text in zip(others, key)) or FIGURE_LABELS[metric]
        axes.plot(xs, ys, marker="o", linewidth=1.6, label=label)
    if numeric and min(positions) > 0 and max(positions) / min(positions) >= 8:
        axes.set_xscale("log", base=2)
    step = math.ceil(len(positions) / MAX_PLOT_LABELS)  # past that many values, every step-th is labelled
    axes.set_xticks(positions[::step], list(first.texts)[::step])
    axes.set_xlabel(f"{first.path} (as given)")
    axes.set_ylabel(FIGURE_LABELS[metric] + (f" ({unit})" if unit else ""))
    axes.grid(True, alpha=0.3)
    if len(lines) <= MAX_PLOT_LABELS:
        axes.set_title(f"{FIGURE_LABELS[metric]} against {first.path}")
        axes.legend(fontsize=8)
    else:  # a legend that long would not fit: the title says what the lines are
        axes.set_title(f"{FIGURE_LABELS[metric]} against {first.path}: {len(lines)} lines, one per combination "
                       f"of {', '.join(grid.path for grid in others)}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, metadata={"Software": None})
    plt.close(figure)


def axis_unit(metric: str, values: list[float]) -> tuple[str, float]:
    """The unit a figure's axis shows its values in, and the factor to it: seconds and bytes in a unit that fits
    the largest value (34e-6 s: µs), shares in percent, the rest as they are ("" when the label names it)."""
    largest = max((abs(value) for value in values), default=0.0)
    if metric.endswith("_s") and not metric.endswith("_per_s"):  # seconds, not a rate
        return next(((unit, 1 / size) for unit, size in (("s", 1), ("ms", 1e-3), ("µs", 1e-6)) if largest >= size),
                    ("ns", 1e9))
    if metric.endswith("_bytes"):
        return next(((unit, 1 / 1024**power) for power, unit in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB"))
                     if largest >= 1024**power), ("B", 1.0))
    return "", 100.0 if metric in ("scaling_efficiency", "final_accuracy", "effective_training_time") else 1.0


def point_texts(grids: list[Grid]) -> list[tuple[str, ...]]:
    """Every point's grid values as written on the command line, in product order."""
    return list(itertools.product(*(grid.texts for grid in grids)))
