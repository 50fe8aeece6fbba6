"""What report.html is drawn from: a run's folder (report.json, and trace.json when the run wrote one) or a
sweep's (sweep.json and each point's runs/<index, 4 digits>/report.json), read and checked.

A folder that does not exist, one with neither file, a file that is not strict
JSON or lacks a field the page draws is the user's mistake: a `ReportInputError`
whose one line names the file (and the field), which the CLI prints with exit
code 2.

    run = read_run(Path("runs/pipeline"))        # run.report: dict, run.trace: dict | None
    sweep = read_sweep(Path("runs/sweep"))       # sweep.rows, sweep.devices_by_index
    kind = folder_kind(Path("runs/sweep"))       # "run" or "sweep"
"""
import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from ...errors import SimtrainError, one_line
from ..core import ReportCore


class ReportInputError(SimtrainError):
    """A run's or a sweep's folder that cannot be drawn: the line names the file and the field."""


@dataclass(frozen=True)
class RunInputs:
    folder: Path
    report: dict  # report.json, its core checked against report/core.py's ReportCore
    trace: dict | None  # trace.json (Chrome trace events); None: the run wrote none


@dataclass(frozen=True)
class SweepInputs:
    folder: Path
    rows: list[dict]  # sweep.json, in product order
    grid_paths: list[str]  # the grids' scenario fields, the first grid first
    devices_by_index: dict[int, int]  # a run's devices (its jobs'), from runs/<index, 4 digits>/report.json


def folder_kind(folder: Path) -> str:
    """'run' (the folder holds report.json) or 'sweep' (sweep.json); a ReportInputError otherwise."""
    if not folder.exists():
        raise ReportInputError(f"{folder}: no such folder")
    if not folder.is_dir():
        raise ReportInputError(f"{folder}: not a folder (give a run's folder, which holds report.json, "
                               "or a sweep's, which holds sweep.json)")
    if (folder / "report.json").exists():
        return "run"
    if (folder / "sweep.json").exists():
        return "sweep"
    raise ReportInputError(f"{folder}: no report.json (a run's folder) or sweep.json (a sweep's) in it")


def read_json(path: Path):
    """A strict JSON file's value (NaN and Infinity refused), or a ReportInputError naming the file."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    try:
        text = path.read_bytes().decode("utf-8")
    except IsADirectoryError:
        raise ReportInputError(f"{path}: a folder, not a file") from None
    except OSError as error:
        raise ReportInputError(f"{path}: cannot read it ({error.strerror})") from None
    except UnicodeDecodeError:
        raise ReportInputError(f"{path}: not UTF-8 text") from None
    try:
        return json.loads(text, parse_constant=refuse)
    except json.JSONDecodeError as error:
        raise ReportInputError(f"{path}: not valid JSON at line {error.lineno}, column {error.colno}: "
                               f"{error.msg}") from None
    except (ValueError, RecursionError) as error:
        raise ReportInputError(f"{path}: not valid JSON: {one_line(str(error))}") from None


def read_report(path: Path) -> dict:
    """report.json, its core fields checked (ReportCore: the figures every chart reads)."""
    report = read_json(path)
    if not isinstance(report, dict):
        raise ReportInputError(f"{path}: not a report (a JSON object expected, found {type(report).__name__})")
    core = {key: value for key, value in report.items() if key in ReportCore.model_fields}
    try:
        ReportCore.model_validate(core, strict=False)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise ReportInputError(f"{path}: {field}: {one_line(first['msg'])}") from None
    parallel = report.get("parallel")
    if parallel is not None and not isinstance(parallel, dict):
        raise ReportInputError(f"{path}: parallel: a JSON object expected")
    return report


def read_run(folder: Path) -> RunInputs:
    """A run's folder: report.json, and trace.json when there is one (its events checked)."""
    report = read_report(folder / "report.json")
    trace_path = folder / "trace.json"
    trace = read_json(trace_path) if trace_path.exists() else None
    if trace is not None:
        _check_trace(trace, trace_path)
    return RunInputs(folder, report, trace)


def _check_trace(trace, path: Path) -> None:
    """The fields the timeline reads: each complete event ("ph": "X") with numbers for pid, tid, ts and dur,
    strings for cat and name; a thread's name a string."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ReportInputError(f"{path}: traceEvents: a list of events expected")
    for index, event in enumerate(events):
        if not isinstance(event, dict):
            raise ReportInputError(f"{path}: traceEvents[{index}]: an object expected")
        if event.get("ph") == "X":
            for field in ("pid", "tid", "ts", "dur"):
                value = event.get(field)
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ReportInputError(f"{path}: traceEvents[{index}].{field}: a number expected")
            for field in ("cat", "name"):
                if not isinstance(event.get(field), str):
                    raise ReportInputError(f"{path}: traceEvents[{index}].{field}: a string expected")
        elif event.get("ph") == "M" and not isinstance((event.get("args") or {}).get("name"), str):
            raise ReportInputError(f"{path}: traceEvents[{index}].args.name: a string expected")


SWEEP_FIELDS = ("index", "status", "step_time_s", "throughput_samples_per_s")


def read_sweep(folder: Path) -> SweepInputs:
    """A sweep's folder: sweep.json's rows, and the devices of each point that ran (its report.json)."""
    path = folder / "sweep.json"
    rows = read_json(path)
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise ReportInputError(f"{path}: a list of rows (JSON objects) expected")
    for position, row in enumerate(rows):
        for field in SWEEP_FIELDS:
            if field not in row:
                raise ReportInputError(f"{path}: [{position}].{field}: missing")
        if isinstance(row["index"], bool) or not isinstance(row["index"], int):
            raise ReportInputError(f"{path}: [{position}].index: an integer expected")
        for field in ("step_time_s", "throughput_samples_per_s"):
            value = row[field]
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ReportInputError(f"{path}: [{position}].{field}: a number or null expected")
    # A row is {"index", each grid's value, the figures from step_time_s on, ...} (studies/sweep.py's headline_row)
    grid_paths = []
    for key in (rows[0] if rows else {}):
        if key == "step_time_s":
            break
        if key != "index":
            grid_paths.append(key)
    devices_by_index = {}
    for row in rows:
        if row["status"] == "ok" and row["throughput_samples_per_s"]:
            report = read_report(folder / "runs" / f"{row['index']:04d}" / "report.json")  # sweep_journal.py's
            devices_by_index[row["index"]] = len(job_devices(report))
    return SweepInputs(folder, rows, grid_paths, devices_by_index)


def job_devices(report: dict) -> list[dict]:
    """The devices of the run's jobs (a spare that never joined one left out); every device if no job ran."""
    devices = report["devices"]
    in_jobs = [device for device in devices if device["job"] is not None]
    return in_jobs or devices
