"""A sweep records each point in OUT/rows.jsonl the moment it finishes and resumes from it: stopped half way (even
in the middle of a line), the same sweep runs only the points not recorded and ends with the rows, sweep.json and
sweep.csv of a sweep never stopped; an OUT that holds another sweep is refused in one line."""
import json
import shutil

import pytest

from simtrain.cli import main
from simtrain.errors import ScenarioError
from simtrain.studies.sweep import in_window, parse_grid, plan_points, run_sweep
from simtrain.studies.sweep_journal import SweepJournal

QUICKSTART = "scenarios/quickstart.yaml"
COMMON = ["numerics=false", "train.steps=2", "report.trace=false"]
GRIDS = ["cluster.devices=2,4", "parallel.all_reduce=ring,naive,tree"]
POINTS = 6


class Stop(Exception):
    """Raised from on_done: the sweep's process stopped there (a Ctrl-C, a kill)."""


def sweep(out, **options):
    return run_sweep(QUICKSTART, [parse_grid(grid) for grid in GRIDS], COMMON, out, **options)


def journal_records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]


def report_files(out, indices) -> dict:
    """Each report's inode and modification time: a report written again is a new file."""
    return {index: ((out / "runs" / f"{index:04d}" / "report.json").stat().st_ino,
                    (out / "runs" / f"{index:04d}" / "report.json").stat().st_mtime_ns) for index in indices}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The sweep never stopped, and what rows.jsonl held each time a point finished."""
    out = tmp_path_factory.mktemp("uninterrupted")
    seen = []

    def on_done(finished, total):
        records = journal_records(out)
        newest = records[-1]["row"]
        report = json.loads((out / "runs" / f"{newest['index']:04d}" / "report.json").read_text())
        seen.append((finished, total, len(records) - 1, newest["step_time_s"] == report["step_time_s"]))

    return sweep(out, workers=1, on_done=on_done), out, seen


def test_each_point_is_on_disk_with_its_report_when_it_finishes(uninterrupted):
    rows, out, seen = uninterrupted
    assert seen == [(finished, POINTS, finished, True) for finished in range(1, POINTS + 1)]
    records = journal_records(out)
    assert records[0]["sweep"]["grids"] == GRIDS and records[0]["sweep"]["set"] == COMMON
    assert [record["row"] for record in records[1:]] == rows  # one process: they finish in product order
    assert json.loads((out / "sweep.json").read_text()) == rows


def test_a_sweep_stopped_half_way_resumes_running_only_the_points_not_recorded(uninterrupted, tmp_path):
    rows, done_out, _ = uninterrupted

    def stop_after_three(finished, total):
        if finished == 3:
            raise Stop

    with pytest.raises(Stop):
        sweep(tmp_path, workers=1, on_done=stop_after_three)
    assert not (tmp_path / "sweep.json").exists()
    journal = tmp_path / "rows.jsonl"
    lines = journal.read_bytes().splitlines(keepends=True)
    assert len(lines) == 1 + 3
    journal.write_bytes(b"".join(lines[:-1]) + lines[-1][:len(lines[-1]) // 2])  # killed while writing point 2's line
    kept = report_files(tmp_path, [0, 1])
    progress = []
    assert sweep(tmp_path, workers=1, on_done=lambda finished, total: progress.append((finished, total))) == rows
    assert progress == [(2, POINTS), (3, POINTS), (4, POINTS), (5, POINTS), (6, POINTS)]
    assert report_files(tmp_path, [0, 1]) == kept  # finished points did not run again
    assert sorted(record["row"]["index"] for record in journal_records(tmp_path)[1:]) == list(range(POINTS))
    for name in ("sweep.json", "sweep.csv"):
        assert (tmp_path / name).read_bytes() == (done_out / name).read_bytes()


def test_the_same_command_on_a_finished_sweep_runs_nothing_and_restart_runs_everything(uninterrupted, tmp_path):
    rows, done_out, _ = uninterrupted
    out = tmp_path / "out"
    shutil.copytree(done_out, out)
    kept = report_files(out, range(POINTS))
    progress = []
    assert sweep(out, workers=1, on_done=lambda finished, total: progress.append(finished)) == rows
    assert progress == [POINTS] and report_files(out, range(POINTS)) == kept
    progress.clear()
    assert sweep(out, workers=1, restart=True, on_done=lambda finished, total: progress.append(finished)) == rows
    assert progress == list(range(1, POINTS + 1))
    assert all(kept[index] != again for index, again in report_files(out, range(POINTS)).items())
    assert len(journal_records(out)) == 1 + POINTS


def test_ctrl_c_says_how_far_the_sweep_got_and_the_same_command_finishes_it(uninterrupted, tmp_path, capsys,
                                                                           monkeypatch):
    """Ctrl-C arrives while the third point runs (in the sweep's own process, --workers 1)."""
    import simtrain.studies.sweep as sweep_module

    rows, _, _ = uninterrupted
    arguments = ["sweep", QUICKSTART, *(w for g in GRIDS for w in ("--grid", g)),
                 *(w for s in COMMON for w in ("--set", s)), "--workers", "1", "--out", str(tmp_path)]
    run_one, calls = sweep_module.run_one, []

    def interrupted_at_the_third(scenario):
        calls.append(scenario)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return run_one(scenario)

    monkeypatch.setattr(sweep_module, "run_one", interrupted_at_the_third)
    with pytest.raises(SystemExit) as code:
        main(arguments)
    assert code.value.code == 130
    err = capsys.readouterr().err.splitlines()
    assert err[:3] == ["[1/6] points done", "[2/6] points done",
                       f"stopped: 2 points are in {tmp_path}/rows.jsonl; the same command resumes the sweep"]
    monkeypatch.undo()
    with pytest.raises(SystemExit) as code:
        main(arguments)
    assert code.value.code == 0
    assert capsys.readouterr().err.splitlines() == [f"[{done}/6] points done" for done in range(2, 7)]
    assert json.loads((tmp_path / "sweep.json").read_text()) == rows


@pytest.mark.parametrize("change,message", [
    (lambda scenario: (GRIDS[:1] + ["parallel.all_reduce=ring,naive"], COMMON),
     "holds the rows of another sweep (--grid: cluster.devices=2,4; parallel.all_reduce=ring,naive,tree there, "
     "cluster.devices=2,4; parallel.all_reduce=ring,naive now)"),
    (lambda scenario: (GRIDS, [*COMMON[:2], "report.trace=true"]), "(--set: "),
    (lambda scenario: scenario.write_text(scenario.read_text() + "# edited\n") and (GRIDS, COMMON),
     "(the scenario file's contents: sha256 "),
])
def test_an_out_holding_another_sweep_is_refused_in_one_line(uninterrupted, tmp_path, capsys, change, message):
    scenario = tmp_path / "quickstart.yaml"
    shutil.copy(QUICKSTART, scenario)
    out = tmp_path / "out"
    arguments = lambda grids, common: ["sweep", str(scenario), *(w for g in grids for w in ("--grid", g)),  # noqa: E731
                                       *(w for s in common for w in ("--set", s)), "--workers", "1", "--out", str(out)]
    with pytest.raises(SystemExit) as code:
        main(arguments(GRIDS, COMMON))
    assert code.value.code == 0
    before = (out / "rows.jsonl").read_bytes()
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        main(arguments(*change(scenario)))
    error = capsys.readouterr().err.strip()
    assert code.value.code == 2 and "\n" not in error
    assert error.startswith(f"error: --out {out}: ") and message in error
    assert error.endswith("give another --out, or --restart to discard them")
    assert (out / "rows.jsonl").read_bytes() == before


@pytest.mark.parametrize("damage,message", [
    (lambda lines: [b"not json\n", *lines[1:]], "rows.jsonl does not start with a sweep's header"),
    (lambda lines: [*lines[:2], b'{"row": [1, 2]}\n', *lines[2:]], "line 3 of rows.jsonl is not a row of this sweep"),
    (lambda lines: [*lines, lines[1].replace(b'"index":0,', b'"index":99,')], "line 8 of rows.jsonl is not a row"),
    (lambda lines: [*lines, lines[1].replace(b'"index":0,', b'"index":1,')], "line 8 of rows.jsonl is not a row"),
    (lambda lines: [*lines[:3], b"\xff\xfe garbage\n", *lines[3:]], "line 4 of rows.jsonl is not a row"),
])
def test_a_damaged_journal_is_refused_in_one_line(uninterrupted, tmp_path, damage, message):
    """A journal edited by hand, or by a disk gone bad: a row for a point out of range, or with another point's
    grid values, is no row of this sweep."""
    _, done_out, _ = uninterrupted
    shutil.copytree(done_out, tmp_path / "out")
    journal = tmp_path / "out" / "rows.jsonl"
    journal.write_bytes(b"".join(damage(journal.read_bytes().splitlines(keepends=True))))
    with pytest.raises(ScenarioError, match="give another --out, or --restart") as error:
        sweep(tmp_path / "out", workers=1)
    assert message in str(error.value)


def test_a_journal_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "rows.jsonl").mkdir()
    with pytest.raises(ScenarioError, match=r"--out .*: cannot write .*rows.jsonl: Is a directory"):
        sweep(tmp_path, workers=1)


def test_two_sweeps_cannot_write_one_out_at_once(uninterrupted, tmp_path):
    _, done_out, _ = uninterrupted
    shutil.copytree(done_out, tmp_path / "out")
    header = json.loads((tmp_path / "out" / "rows.jsonl").read_text().splitlines()[0])["sweep"]
    writing = SweepJournal.open(tmp_path / "out", header, POINTS, lambda row: True)
    try:
        with pytest.raises(ScenarioError, match=r"another sweep is writing .*rows.jsonl"):
            sweep(tmp_path / "out", workers=1)
    finally:
        writing.close()
    assert len(sweep(tmp_path / "out", workers=1)) == POINTS


def test_at_most_a_window_of_points_is_handed_out_and_unfinished():
    """in_window with a worker pool whose newest point finishes first: every point's outcome comes back once, no
    more than `window` are handed out and unfinished at any time, and points are drawn (validated) only as the
    window has room; a point the schema refused needs no worker, even ten in a row."""
    drawn, handed, finished, most = [], set(), [], 0
    refused = lambda index: index % 7 == 3 or 30 <= index < 40  # noqa: E731

    def jobs():
        for index in range(50):
            drawn.append(index)
            yield index, f"scenario {index}", "refused" if refused(index) else None

    def submit(scenario):
        handed.add(scenario)
        return scenario

    def wait_some(handles):
        nonlocal most
        most = max(most, len(handles))
        return [(handles[-1], {"report": handles[-1]})]

    for index, outcome in in_window(jobs(), 4, submit, wait_some):
        finished.append(index)
        assert outcome == ({"error": "refused"} if refused(index) else {"report": f"scenario {index}"})
        assert len(drawn) - len(finished) <= 4
    assert sorted(finished) == list(range(50)) and most == 4
    assert handed == {f"scenario {index}" for index in range(50) if not refused(index)}
    assert finished[:2] == [3, 2]  # the refused point at once; then the newest of the window first


def test_ten_thousand_points_are_a_sweep_and_one_more_is_not():
    hundred = [parse_grid("seed=" + ",".join(map(str, range(100)))), parse_grid("train.steps=" + ",".join(
        map(str, range(1, 101))))]
    assert len(plan_points(hundred)) == 10_000
    with pytest.raises(ScenarioError, match="10100 runs, more than a sweep takes"):
        plan_points([*hundred[:1], parse_grid("train.steps=" + ",".join(map(str, range(1, 102))))])
