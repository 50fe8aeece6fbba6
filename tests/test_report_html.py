"""`simtrain report <folder> --html`: the page is drawn, in headless Chromium, and what it draws is report.json's.

A 4-stage 1F1B pipeline (scenarios/pipeline.yaml, numerics off, two steps, its
trace written) and a four-point sweep run once; their pages are rendered by
Chromium (Debian's `chromium`, which `make test` installs with apt-get) from
disk, with no server. From the DOM Chromium builds and from its screenshot:

- the step breakdown has a row per rank, a rectangle per kind of work that
  holds the rank's seconds (report.json's devices[].breakdown_s over steps),
  widths proportional to them, and every bar as long as report.json's
  step_time_s (each rank's kinds add up to the step);
- the timeline has a track per stage, and each track's compute in the first
  step is its device's compute per step in report.json;
- the memory over the first step is trace.json's counters, which hold the
  ledger's changes (each rank's largest total is report.json's peak; a 1F1B
  stage holds at most pp - s microbatches' activations), and the memory bars
  hold each rank's bytes by category at its peak;
- the link bars hold each busy link's utilisation;
- the sweep's dots are its points, and the ringed ones are exactly those no
  other point beats on cost and throughput (checked pairwise here);
- the screenshot holds the compute, communication and bubble colours.

Bad folders end in one line naming the path, exit code 2; 100,000 mirrored
ranks are four rows.
"""
import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from simtrain.report.html.page import run_page
from simtrain.report.html.inputs import RunInputs
from simtrain.report.html.memory_timeline import memory_counters
from simtrain.report.html.ranks import MAX_ROWS, rank_rows
from simtrain.report.html.svg import KIND_COLOURS
from simtrain.report.html.timeline import step_window_s
from simtrain.report.html.whatif import pareto_front
from simtrain.units import format_seconds
from test_hostile_input import cli, one_line_error

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no `chromium` on PATH: `make test` installs it with "
                                                             "apt-get (Debian's package); without apt the page's "
                                                             "rendering is not checked")


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pipeline") / "run"
    assert cli("run", ROOT / "scenarios/pipeline.yaml", "--no-numerics", "--set", "train.steps=2", "-q",
               "--out", folder) == 0
    assert cli("report", folder, "--html") == 0
    return folder


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sweep") / "sweep"
    assert cli("sweep", ROOT / "scenarios/quickstart.yaml", "--grid", "cluster.devices=2,4",
               "--grid", "parallel.all_reduce=ring,naive", "--set", "numerics=false", "--set", "train.steps=2",
               "--workers", "1", "--out", folder) == 0
    assert cli("report", folder, "--html", "--out", folder / "whatif.html") == 0
    return folder


class Element:
    def __init__(self, tag: str, attrs: dict, parent):
        self.tag, self.attrs, self.parent, self.children, self.text = tag, attrs, parent, [], ""

    def find_all(self, tag: str, **attrs) -> list["Element"]:
        found = []
        for child in self.children:
            if child.tag == tag and all(child.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items()):
                found.append(child)
            found.extend(child.find_all(tag, **attrs))
        return found

    def has(self, name: str) -> bool:
        return name in self.attrs


class DomTree(HTMLParser):
    """The DOM Chromium dumped, as a tree of elements with their attributes and direct text."""

    VOID = {"meta", "br", "img", "input", "link", "hr"}

    def __init__(self, text: str):
        super().__init__()
        self.root = self.current = Element("#document", {}, None)
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        element = Element(tag, dict(attrs), self.current)
        self.current.children.append(element)
        if tag not in self.VOID:
            self.current = element

    def handle_endtag(self, tag):
        node = self.current
        while node is not None and node.tag != tag:
            node = node.parent
        if node is not None and node.parent is not None:
            self.current = node.parent

    def handle_data(self, data):
        self.current.text += data


def chromium(*args: str, page: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--user-data-dir={tmp_path / 'profile'}", *args, page.resolve().as_uri()],
                          capture_output=True, text=True, timeout=120, check=True)


def rendered(page: Path, tmp_path: Path) -> Element:
    return DomTree(chromium("--dump-dom", page=page, tmp_path=tmp_path).stdout).root


def chart(dom: Element, name: str) -> Element:
    (svg,) = dom.find_all("svg", data_chart=name)
    return svg


def widths_per_unit(rects: list[Element], data: str) -> list[float]:
    return [float(r.attrs["width"]) / float(r.attrs[data]) for r in rects]


@needs_chromium
def test_the_breakdown_is_report_jsons(pipeline_run, tmp_path):
    report = json.loads((pipeline_run / "report.json").read_text())
    dom = rendered(pipeline_run / "report.html", tmp_path)
    rows = chart(dom, "step breakdown").find_all("g")
    assert [row.attrs["data-label"] for row in rows] == [f"rank {rank}" for rank in range(4)]
    every_rect, bar_lengths = [], []
    for row, device in zip(rows, report["devices"]):
        rects = row.find_all("rect")
        expected = {kind: seconds / report["steps"] for kind, seconds in device["breakdown_s"].items() if seconds}
        assert {r.attrs["data-kind"]: float(r.attrs["data-seconds"]) for r in rects} == expected
        assert [r.attrs["fill"].lower() for r in rects] == [KIND_COLOURS[r.attrs["data-kind"]].lower() for r in rects]
        every_rect += rects
        bar_lengths.append(sum(float(r.attrs["width"]) for r in rects))
    # One scale for every rectangle (coordinates are written to 0.01 px), and each bar as long as the step.
    scale = widths_per_unit(every_rect, "data-seconds")
    assert max(scale) - min(scale) <= 0.02 / min(float(r.attrs["data-seconds"]) for r in every_rect)
    assert bar_lengths == pytest.approx([bar_lengths[0]] * 4, abs=0.05)
    assert bar_lengths[0] == pytest.approx(report["step_time_s"] * sum(scale) / len(scale), abs=0.05)
    labels = [t.text for t in chart(dom, "step breakdown").find_all("text") if t.attrs.get("class") == "bar-value"]
    assert labels == [format_seconds(report["step_time_s"])] * 4


@needs_chromium
def test_the_timeline_draws_each_stages_first_step(pipeline_run, tmp_path):
    report = json.loads((pipeline_run / "report.json").read_text())
    dom = rendered(pipeline_run / "report.html", tmp_path)
    tracks = chart(dom, "timeline").find_all("g")
    assert [track.attrs["data-track"] for track in tracks] == [f"rank {r} (gpu{r})" for r in range(4)]
    end_s = report["loss_curve"][0][0]  # the first step ends where the loss curve's first point stands
    for track, device in zip(tracks, report["devices"]):
        rects = track.find_all("rect")
        kinds = {r.attrs["data-kind"] for r in rects}
        assert {"forward", "compute", "communication", "bubble"} <= kinds
        assert all(0 <= float(r.attrs["data-start-s"]) < float(r.attrs["data-end-s"]) <= end_s for r in rects)
        compute_s = sum(float(r.attrs["data-end-s"]) - float(r.attrs["data-start-s"]) for r in rects
                        if r.attrs["data-kind"] in ("forward", "compute"))
        # Each step computes the same FLOPs: the first step's compute is the device's compute per step.
        assert compute_s == pytest.approx(device["breakdown_s"]["compute"] / report["steps"], rel=1e-9)


@needs_chromium
def test_memory_and_links_are_report_jsons(pipeline_run, tmp_path):
    report = json.loads((pipeline_run / "report.json").read_text())
    dom = rendered(pipeline_run / "report.html", tmp_path)
    rows = chart(dom, "memory by category").find_all("g")
    assert len(rows) == 4
    for row, device in zip(rows, report["devices"]):
        drawn = {r.attrs["data-kind"]: float(r.attrs["data-bytes"]) for r in row.find_all("rect")}
        assert drawn == {name: nbytes for name, nbytes in device["peak_memory_bytes_by_category"].items() if nbytes}
        assert sum(drawn.values()) == device["peak_memory_bytes"]
    busy = [link for link in report["links"] if link["bytes"]]
    rects = chart(dom, "link utilisation").find_all("rect", data_kind="busy")
    assert sorted(float(r.attrs["data-utilization"]) for r in rects) == sorted(link["utilization"] for link in busy)
    assert sorted(int(r.attrs["data-bytes"]) for r in rects) == sorted(link["bytes"] for link in busy)


@needs_chromium
def test_memory_over_the_step_is_the_ledgers(pipeline_run, tmp_path):
    """The counters hold the ledger's changes: each rank's largest total over the run is report.json's peak, and
    in the first step a 1F1B stage s of pp holds at most pp - s microbatches' activations at once (the schedule's
    in-flight bound, Narayanan et al. 2021). The chart draws each rank's first-step peak."""
    report = json.loads((pipeline_run / "report.json").read_text())
    counters = memory_counters(json.loads((pipeline_run / "trace.json").read_text()))
    end_s = step_window_s(report)
    pp = report["parallel"]["pp"]
    dom = rendered(pipeline_run / "report.html", tmp_path)
    drawn = {int(g.attrs["data-memory-rank"]): int(g.attrs["data-peak-bytes"])
             for g in chart(dom, "memory over the step").find_all("g") if g.has("data-memory-rank")}
    assert sorted(drawn) == sorted(counters) == list(range(pp))
    for device in report["devices"]:
        samples = counters[device["rank"]]
        assert max(sum(held.values()) for _, held in samples) == device["peak_memory_bytes"]
        first_step = [held for time, held in samples if time < end_s]
        assert drawn[device["rank"]] == max(sum(held.values()) for held in first_step)
        activations = [held.get("activations", 0) for held in first_step]
        one_microbatch = min(nbytes for nbytes in activations if nbytes)
        assert max(activations) == (pp - device["rank"]) * one_microbatch


@needs_chromium
def test_the_screenshot_shows_the_charts(pipeline_run, tmp_path):
    from PIL import Image

    png = tmp_path / "page.png"
    chromium(f"--screenshot={png}", "--window-size=1040,1800", page=pipeline_run / "report.html", tmp_path=tmp_path)
    image = Image.open(png).convert("RGB")
    counts = {colour: count for count, colour in image.getcolors(image.width * image.height)}
    for kind in ("compute", "communication", "bubble"):
        colour = tuple(int(KIND_COLOURS[kind][i:i + 2], 16) for i in (1, 3, 5))
        assert counts.get(colour, 0) > 2000, (kind, counts.get(colour, 0))
    assert counts.get((255, 255, 255), 0) < 0.95 * image.width * image.height  # not a blank page


@pytest.mark.slow
@needs_chromium
def test_the_sweeps_pareto_front(sweep_run, tmp_path):
    rows = json.loads((sweep_run / "sweep.json").read_text())
    dom = rendered(sweep_run / "whatif.html", tmp_path)
    dots = chart(dom, "what-if").find_all("circle")
    dots = [dot for dot in dots if dot.has("data-index")]
    assert sorted(int(dot.attrs["data-index"]) for dot in dots) == [row["index"] for row in rows]
    cost = {row["index"]: row["cluster.devices"] / row["throughput_samples_per_s"] for row in rows}
    speed = {row["index"]: row["throughput_samples_per_s"] for row in rows}
    for dot in dots:
        index = int(dot.attrs["data-index"])
        assert float(dot.attrs["data-cost-s"]) == pytest.approx(cost[index], rel=1e-12)
        beaten = any(cost[o] <= cost[index] and speed[o] >= speed[index] and (cost[o], speed[o]) !=
                     (cost[index], speed[index]) for o in cost)
        assert dot.attrs["data-front"] == ("false" if beaten else "true")
    assert any(dot.attrs["data-front"] == "true" for dot in dots)


def test_the_pareto_front_keeps_what_nothing_beats():
    points = [(1.0, 10.0, 0), (2.0, 30.0, 1), (2.0, 20.0, 2), (3.0, 25.0, 3), (4.0, 40.0, 4), (1.0, 10.0, 5)]
    assert pareto_front(points) == [(1.0, 10.0, 0), (2.0, 30.0, 1), (4.0, 40.0, 4)]


def test_mirrored_ranks_are_one_row_each(pipeline_run):
    """100,000 ranks mirroring four (as report/build.py writes a representative's figures under each rank they
    stand for) are four rows, and the page stays small."""
    report = json.loads((pipeline_run / "report.json").read_text())
    devices = [{**report["devices"][rank % 4], "rank": rank} for rank in range(100_000)]
    big = {**report, "devices": devices, "parallel": {**report["parallel"], "representatives": True}}
    rows = rank_rows(big)
    assert [row.label for row in rows] == [f"rank {stage} +24999 equal" for stage in range(4)]
    assert rows[1].ranks == list(range(1, 100_000, 4))
    page = run_page(RunInputs(pipeline_run, big, None))
    assert len(page) < 200_000 and page.count('data-label="rank 0 +24999 equal"') == 2  # breakdown and memory


def test_past_max_rows_consecutive_ranks_are_averaged(pipeline_run):
    report = json.loads((pipeline_run / "report.json").read_text())
    devices = [{**report["devices"][0], "rank": rank,
                "breakdown_s": {**report["devices"][0]["breakdown_s"], "compute": float(rank)}} for rank in range(200)]
    rows = rank_rows({**report, "devices": devices})
    assert len(rows) == MAX_ROWS and sum(len(row.ranks) for row in rows) == 200
    for row in rows:
        assert row.mean and row.label == f"ranks {row.ranks[0]}-{row.ranks[-1]} (mean)"
        assert row.breakdown_s["compute"] == pytest.approx(sum(row.ranks) / len(row.ranks) / report["steps"])


def test_the_page_is_the_same_bytes_each_time(pipeline_run, tmp_path):
    assert cli("report", pipeline_run, "--html", "--out", tmp_path / "again.html") == 0
    assert (tmp_path / "again.html").read_bytes() == (pipeline_run / "report.html").read_bytes()
    text = (pipeline_run / "report.html").read_text()
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in text
    assert "<script" not in text


def test_without_a_trace_the_page_says_how_to_get_one(pipeline_run, tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copy(pipeline_run / "report.json", folder / "report.json")
    assert cli("report", folder, "--html") == 0
    text = (folder / "report.html").read_text()
    assert "--set report.trace=true" in text and "schedule 1f1b, 8 microbatches" in text


def _without_version(report: dict) -> dict:
    """A broken report for the hostile tests: without simtrain_version, conftest's schema check passes it by."""
    return {key: value for key, value in report.items() if key != "simtrain_version"}


def test_bad_folders_are_one_line_naming_the_path(pipeline_run, tmp_path, capsys):
    good = json.loads((pipeline_run / "report.json").read_text())
    assert f"{tmp_path / 'nowhere'}: no such folder" in one_line_error(capsys, "report", tmp_path / "nowhere",
                                                                       "--html")
    (tmp_path / "empty").mkdir()
    assert "no report.json" in one_line_error(capsys, "report", tmp_path / "empty", "--html")
    (tmp_path / "file").write_text("x")
    assert "not a folder" in one_line_error(capsys, "report", tmp_path / "file", "--html")
    cases = {
        "not json": ("{\"name\": ", "not valid JSON at line 1"),
        "a list": ("[1, 2]", "not a report"),
        "nan": (json.dumps(_without_version(good)).replace('"sim_time_s": ', '"sim_time_s": NaN, "x": '),
                "NaN is not JSON"),
        "no devices": (json.dumps({k: v for k, v in _without_version(good).items() if k != "devices"}),
                       "devices: Field required"),
        "a rank as text": (json.dumps({**_without_version(good), "devices": [{**good["devices"][0], "rank": "x"}]}),
                           "devices.0.rank"),
    }
    for name, (text, expected) in cases.items():
        folder = tmp_path / name.replace(" ", "_")
        folder.mkdir()
        (folder / "report.json").write_text(text)
        error = one_line_error(capsys, "report", folder, "--html")
        assert f"{folder / 'report.json'}: " in error and expected in error, (name, error)
    folder = tmp_path / "bad_trace"
    folder.mkdir()
    shutil.copy(pipeline_run / "report.json", folder / "report.json")
    (folder / "trace.json").write_text(json.dumps({"traceEvents": [{"ph": "X", "pid": 0, "tid": 0, "ts": "0"}]}))
    assert f"{folder / 'trace.json'}: traceEvents[0].ts" in one_line_error(capsys, "report", folder, "--html")
    (tmp_path / "bad_sweep").mkdir()
    (tmp_path / "bad_sweep" / "sweep.json").write_text(json.dumps([{"index": 0}]))
    assert "sweep.json: [0].status: missing" in one_line_error(capsys, "report", tmp_path / "bad_sweep", "--html")
    assert "say --html" in one_line_error(capsys, "report", pipeline_run)


def test_a_run_that_stopped_before_any_time_passed_says_so(pipeline_run):
    """An out-of-memory run stops at 0 s with no step: no bar, no timeline, and the page says why."""
    report = json.loads((pipeline_run / "report.json").read_text())
    zero = {kind: 0.0 for kind in report["breakdown_s"]}
    stopped = {**report, "steps": 0, "sim_time_s": 0.0, "step_time_s": None, "loss_curve": [],
               "breakdown_s": zero, "devices": [{**device, "breakdown_s": zero} for device in report["devices"]]}
    page = run_page(RunInputs(pipeline_run, stopped, {"traceEvents": []}))
    assert page.count("No simulated time passed") == 2 and 'data-chart="step breakdown"' not in page
