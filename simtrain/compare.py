"""Compare runs: several scenarios, or variants of one, side by side.

    simtrain compare scenarios/async_vs_sync_straggler.yaml \\
        --variant "parallel.mode=sync" --variant "parallel.mode=async" \\
        --variant "parallel.mode=async,parallel.async.consistency=locked"

Every scenario file is run once per variant (once if no variant is given). A
variant is a comma-separated list of `dotted.path=value` overrides, applied
after the `--set` overrides common to all runs; a comma only separates two
overrides when the next one starts with `path=`, so list values such as
`cluster.torus_shape=[2,4]` keep their commas. Each run's outputs go to
`OUT/<index>-<label>/` (report.json, trace.json, ...); the comparison writes

- `OUT/compare.json`: one row per run (the table's figures, plus the label,
  scenario file and overrides);
- `OUT/loss_vs_time.png`: every run's training-set loss (`train_loss_curve`,
  the curve `time_to_target_s` reads) against simulated time, with the target
  as a dashed line when a run sets `train.target_loss`; not drawn when no run
  has a loss (numerics off).

A row's bytes are every kind of communication the run logged: the parallel
dimensions' (report.json's `parallel`), the sharded optimizer's all-gathers,
reduce-scatters and HSDP all-reduces (`sharding`) and the experts'
all-to-alls (`moe`).

    rows = compare_runs(["a.yaml"], [["parallel.mode=sync"], ["parallel.mode=async"]], [], Path("out"))

Given two run folders instead (each with a report.json, as `simtrain run` and
`simtrain launch` write them), it puts their timing figures side by side with
the relative error of one against the other: the measured run is the
reference when one of the two is measured (`"measured": true`), else the
second folder. `OUT/compare.json` gets the rows.

    simtrain compare runs/quickstart runs/quickstart-real
    rows = compare_reports(Path("runs/quickstart"), Path("runs/quickstart-real"))
"""
import json
import re
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the Agg backend)

from .errors import ScenarioError, one_line  # noqa: E402
from .report import Report, finite_or_none  # noqa: E402
from .runner import run as run_scenario  # noqa: E402
from .scenario import load_scenario  # noqa: E402
from .units import noise_free  # noqa: E402
from .user_files import read_text_file  # noqa: E402

LOSS_PLOT = "loss_vs_time.png"  # in OUT, when a run has a loss
_SPLIT = re.compile(r",\s*(?=[A-Za-z_][\w.]*=)")  # a comma followed by the next `path=`


@dataclass
class RunSpec:
    """One run of a comparison: a scenario file and its overrides."""

    label: str
    scenario_file: str
    overrides: list[str]


def parse_variant(text: str) -> list[str]:
    """`"a.b=1,c=[2,3]"` -> ["a.b=1", "c=[2,3]"]; ScenarioError if a part is not path=value."""
    parts = [part.strip() for part in _SPLIT.split(text.strip())]
    for part in parts:
        key, sep, _ = part.partition("=")
        if not sep or not key.strip():
            raise ScenarioError(f"--variant {text!r}: expected path=value[,path=value...], got {part!r}")
    return parts


def plan_runs(files: list[str], variants: list[list[str]], common: list[str]) -> list[RunSpec]:
    """Every file with every variant, in that order; labels name what differs."""
    if not files:
        raise ScenarioError("compare: give at least one scenario file")
    runs = []
    for file in files:
        for variant in variants or [[]]:
            parts = ([Path(file).stem] if len(files) > 1 or not variants else []) + [",".join(variant)]
            label = " ".join(part for part in parts if part)
            runs.append(RunSpec(label=label, scenario_file=file, overrides=[*common, *variant]))
    return runs


def summary_row(label: str, data: dict) -> dict:
    """The comparison's figures of one report.json, in units that compare sync steps with async updates:
    samples trained, simulated time, time per sample, time to the target loss."""
    step = data["step_time_s"]
    staleness = data.get("async", {})
    throughput = data["throughput_samples_per_s"]
    return {
        "label": label,
        # the async section's consistency, else the all-reduce algorithm: "async/hogwild", "data_parallel/ring"
        "scheme": data["scheme"] + "/" + (staleness["consistency"] if staleness else data["all_reduce"]),
        "devices": data["devices_count"],
        "steps": data["steps"],
        "steps_are": "updates" if staleness else "steps",  # an async step is one worker's update
        "samples": round(throughput * data["sim_time_s"]) if throughput else 0,
        "sim_time_s": data["sim_time_s"],
        "time_per_sample_s": 1 / throughput if throughput else None,
        "time_to_target_s": data.get("time_to_target_s"),
        "final_loss": data["final_loss"],
        "final_accuracy": data["final_accuracy"],
        "idle_share": noise_free(data["breakdown_s"]["idle"], step) / step if step else None,
        "status": data["status"],
        "step_time_s": step,
        "bytes_by_kind": bytes_by_kind(data),
        "mfu": data["flops"]["mfu"],
        "peak_memory_bytes": max(device["peak_memory_bytes"] for device in data["devices"]),
        "staleness_mean": staleness.get("staleness_mean"),
        "staleness_max": staleness.get("staleness_max"),
    }


def bytes_by_kind(data: dict) -> dict | None:
    """The bytes a run's communication moved by kind, every rank's over the run: the parallel section's kinds,
    `sharded` (the sharding section's all-gathers, reduce-scatters and HSDP all-reduces) and `expert` (the MoE
    all-to-alls); None: a run without a parallel section (async)."""
    if "parallel" not in data:
        return None
    moved = dict(data["parallel"]["bytes_by_kind"])
    moved["sharded"] = sum(data["sharding"]["bytes_by_kind"].values()) if "sharding" in data else 0
    moved["expert"] = sum(data["moe"]["all_to_all_bytes"]) if "moe" in data else 0
    return moved


def compare_runs(runs: list[RunSpec], out_dir: Path, watch=None) -> list[dict]:
    """Run each RunSpec, write its outputs, compare.json and the plot. watch(index, spec, scenario), if given, is
    a context manager around each run; what it enters as, if not None, has its on_step (progress.RunProgress)."""
    scenarios = [load_scenario(spec.scenario_file, spec.overrides) for spec in runs]  # every mistake first
    rows, curves = [], []
    for index, (spec, scenario) in enumerate(zip(runs, scenarios)):
        with nullcontext() if watch is None else watch(index, spec, scenario) as watcher:
            report: Report = run_scenario(scenario, on_step=None if watcher is None else watcher.on_step)
        report.write(out_dir / f"{index}-{_slug(spec.label or scenario.name)}")
        row = summary_row(spec.label or scenario.name, report.data)
        rows.append({**row, "scenario_file": spec.scenario_file, "overrides": spec.overrides})
        curves.append((row["label"] + f" ({row['scheme']})", report.data["train_loss_curve"],
                       scenario.train.target_loss))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compare.json").write_text(json.dumps(finite_or_none(rows), indent=2, allow_nan=False) + "\n")
    plot = out_dir / LOSS_PLOT
    if any(loss is not None for _, curve, _ in curves for _, _, loss in curve):
        plot_loss_vs_time(curves, plot)
    else:  # numerics off: no run has a loss to draw (nor does an earlier comparison's plot stand)
        plot.unlink(missing_ok=True)
    return rows


TIMING_FIGURES = (  # (row label, how to read it from report.json)
    ("step time", lambda data: data["step_time_s"]),
    ("compute", lambda data: data["breakdown_s"]["compute"]),
    ("communication", lambda data: data["breakdown_s"]["communication"]),
    ("optimizer", lambda data: data["breakdown_s"]["optimizer"]),
    ("idle", lambda data: data["breakdown_s"]["idle"]),
    ("throughput (samples/s)", lambda data: data["throughput_samples_per_s"]),
)


def read_report(folder) -> dict:
    """A run folder's report.json; ScenarioError naming the folder if it has none or it is not one."""
    path = Path(folder) / "report.json"
    try:
        data = json.loads(read_text_file(path, f"run folder {folder}: report.json", ScenarioError))
    except ValueError as error:
        raise ScenarioError(f"{path}: not JSON ({one_line(str(error))})") from None
    if not isinstance(data, dict) or not all(key in data for key in ("step_time_s", "breakdown_s")):
        raise ScenarioError(f"{path}: not a report.json of simtrain run or launch (no step_time_s, breakdown_s)")
    return data


def compare_reports(first, second) -> list[dict]:
    """Timing figures of two run folders side by side, with the error of the other against the reference
    (the measured one, else `second`): (other - reference) / reference."""
    reports = [read_report(first), read_report(second)]
    reference = 0 if reports[0].get("measured") and not reports[1].get("measured") else 1
    other = 1 - reference
    rows = []
    for label, read in TIMING_FIGURES:
        try:
            values = [noise_free(read(data), data["step_time_s"]) for data in reports]
        except (KeyError, TypeError):
            raise ScenarioError(f"{first} and {second}: a report.json lacks {label}") from None
        error = None if None in values else 0.0 if values[other] == values[reference] \
            else (values[other] - values[reference]) / values[reference] if values[reference] else None
        rows.append({"figure": label, "values": values, "error": error})
    return rows


def plot_loss_vs_time(curves: list[tuple], path: Path) -> None:
    """One training-set loss line per run against simulated time (ms), a dashed line at each target."""
    figure, axes = plt.subplots(figsize=(9, 5.5), dpi=120)
    targets = []
    for label, curve, target in curves:
        axes.plot([t * 1e3 for _, t, _ in curve], [loss for _, _, loss in curve], label=label, linewidth=1.6,
                  marker=".", markersize=3)
        if target is not None and target not in targets:
            targets.append(target)
    for target in targets:
        axes.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target loss {target:g}")
    axes.set_xlabel("simulated time (ms)")
    axes.set_ylabel("training-set loss")
    axes.set_yscale("log")
    axes.set_title("loss against simulated time")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, metadata={"Software": None})
    plt.close(figure)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", text).strip("_")[:80] or "run"
