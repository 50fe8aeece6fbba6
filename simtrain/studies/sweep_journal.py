"""A sweep's journal: each finished point's row on disk the moment it finishes, so that a sweep stopped half way
(Ctrl-C, a killed process, a lost Ray head) resumes without running a finished point again.

    journal = SweepJournal.open(Path("runs/sweep"), identity, point_count=4, is_row=lambda row: True)
    journal.rows                          # {index: row} of the points an earlier run of this sweep finished
    journal.record(2, row, report_text)   # runs/0002/report.json, then one flushed line of rows.jsonl
    journal.close()

`OUT/rows.jsonl` is append-only. Its first line names the sweep, `{"sweep": identity}` (sweep.py's
`sweep_identity`: the scenario file's SHA-256, the --set overrides, the grids as written, simtrain's version);
then one line per finished point, `{"row": row}` (with `"node"`, the Ray node that ran it, on a Ray cluster), in
the order the points finish. A point's report.json is written (to a temporary name, then renamed) before its
line, so a line always has its report. A last line cut short by a crash is dropped and its point runs again.
A journal of another sweep, or any other line that is not a row of this sweep, is refused in one line naming
--out; `restart` discards the journal and the reports instead. One sweep at a time writes a journal (an
exclusive lock on rows.jsonl).
"""
import fcntl
import json
import os
from pathlib import Path

from ..errors import ScenarioError

JOURNAL_NAME = "rows.jsonl"
# What the identity's fields are called in a refusal, in the order they are compared.
IDENTITY_FIELDS = {"simtrain": "simtrain's version", "scenario_sha256": "the scenario file's contents",
                   "set": "--set", "grids": "--grid"}
SWEEP_OUTPUTS = ("sweep.json", "sweep.csv", "sweep.png")


class SweepJournal:
    """The rows of one sweep's finished points, read from OUT/rows.jsonl and appended to as points finish."""

    def __init__(self, out_dir: Path, file, rows: dict[int, dict]):
        self.out_dir, self._file, self.rows = out_dir, file, rows

    @classmethod
    def open(cls, out_dir: Path, identity: dict, point_count: int, is_row, restart: bool = False) -> "SweepJournal":
        """The journal in `out_dir` (created, with its header, where there is none): the rows it holds, checked
        to be this sweep's (`identity`, `is_row(row)` for each row of a point below `point_count`)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / JOURNAL_NAME
        try:
            file = open(path, "a+b")  # noqa: SIM115  (held open, and locked, until close)
        except OSError as error:  # a folder of that name, no permission
            raise ScenarioError(f"--out {out_dir}: cannot write {path}: {error.strerror}") from None
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.close()
            raise ScenarioError(f"--out {out_dir}: another sweep is writing {path}") from None
        try:
            file.seek(0)
            text = file.read()
            complete = text[:text.rfind(b"\n") + 1]  # a last line without its newline was cut short by a crash
            lines = complete.decode("utf-8", "replace").split("\n")[:-1]
            if restart or not lines:
                _discard_outputs(out_dir)
                file.truncate(0)
                file.write(_line({"sweep": identity}))
                file.flush()
                return cls(out_dir, file, {})
            _check_identity(out_dir, lines[0], identity)
            rows = {}
            for number, line in enumerate(lines[1:], start=2):
                row = _parse_row(line, point_count, is_row)
                if row is None:
                    raise ScenarioError(f"--out {out_dir}: line {number} of {JOURNAL_NAME} is not a row of this "
                                        f"sweep; give another --out, or --restart to run every point again")
                rows[row["index"]] = row
            file.truncate(len(complete))
            return cls(out_dir, file, rows)
        except BaseException:
            file.close()
            raise

    def record(self, index: int, row: dict, report: str | None, node: str | None = None) -> None:
        """The point's report.json (when it ran), then its row's line, flushed: a crash after this loses nothing."""
        if report is not None:
            run_dir = self.out_dir / "runs" / f"{index:04d}"
            run_dir.mkdir(parents=True, exist_ok=True)
            partial = run_dir / f".report.json.{os.getpid()}.tmp"
            partial.write_text(report)
            partial.replace(run_dir / "report.json")
        self._file.write(_line({"row": row} if node is None else {"row": row, "node": node}))
        self._file.flush()
        self.rows[index] = row

    def close(self) -> None:
        self._file.close()  # closing the file releases its lock


def _line(record: dict) -> bytes:
    return (json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n").encode()


def _check_identity(out_dir: Path, header: str, identity: dict) -> None:
    try:
        recorded = json.loads(header)["sweep"]
        differing = [field for field in IDENTITY_FIELDS if recorded[field] != identity[field]]
    except (ValueError, TypeError, KeyError):
        raise ScenarioError(f"--out {out_dir}: {JOURNAL_NAME} does not start with a sweep's header; give another "
                            f"--out, or --restart to run every point again") from None
    if differing:
        field = differing[0]
        raise ScenarioError(f"--out {out_dir}: holds the rows of another sweep ({IDENTITY_FIELDS[field]}: "
                            f"{_shown(field, recorded[field])} there, {_shown(field, identity[field])} now); "
                            f"give another --out, or --restart to discard them")


def _shown(field: str, value) -> str:
    if isinstance(value, list):  # the overrides or the grids, as written
        return "; ".join(map(str, value)) or "none"
    return f"sha256 {str(value)[:12]}" if field == "scenario_sha256" else str(value)


def _parse_row(line: str, point_count: int, is_row) -> dict | None:
    """The row a line records, or None if it records none (not JSON, no index in range, not this sweep's)."""
    try:
        row = json.loads(line)["row"]
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(row, dict):
        return None
    index = row.get("index")
    if type(index) is not int or not 0 <= index < point_count or not is_row(row):
        return None
    return row


def _discard_outputs(out_dir: Path) -> None:
    """Remove what an earlier sweep wrote here (its reports and outputs), so that none outlives the new journal."""
    for name in SWEEP_OUTPUTS:
        (out_dir / name).unlink(missing_ok=True)
    runs = out_dir / "runs"
    if runs.is_dir():
        for run_dir in sorted(runs.iterdir()):
            if run_dir.name.isdigit() and run_dir.is_dir():
                for report in (run_dir / "report.json", *run_dir.glob(".report.json.*.tmp")):
                    report.unlink(missing_ok=True)
                if not any(run_dir.iterdir()):
                    run_dir.rmdir()
