"""The `simtrain` command line: run, launch, calibrate, sweep, compare, memory, validate, collective, topo, import,
pbt replay, report, replay, torchtitan, megatron.

    simtrain run scenarios/quickstart.yaml --set cluster.devices=16 --set parallel.all_reduce=tree
    simtrain run scenarios/pbt.yaml                 # a scenario with a pbt section runs a population
    simtrain pbt replay runs/pbt/report.json --member best --out replay.yaml
    simtrain sweep scenarios/quickstart.yaml --grid cluster.devices=4,8,16 --grid parallel.all_reduce=ring,tree
    simtrain compare scenarios/async_vs_sync_straggler.yaml --variant parallel.mode=sync --variant parallel.mode=async
    simtrain launch scenarios/quickstart.yaml --nproc 2     # the same training for real, on gloo, measured
    simtrain compare runs/quickstart runs/quickstart-real   # simulated against measured
    simtrain calibrate --nproc 2 --out calibration/ --model-of scenarios/quickstart.yaml
    simtrain memory scenarios/quickstart.yaml --set train.precision=fp16 --set train.checkpointing=sqrt
    simtrain validate scenarios/quickstart.yaml
    simtrain collective --algo ring --topology ring --devices 16 --bandwidth "100 GB/s" --sizes 1K:1G --no-numerics
    simtrain topo --topology topologies/dgx-a100-2node.yaml
    simtrain import torchtitan scenarios/torchtitan/llama3_8b.toml --devices 64 --out llama3_8b.yaml
    simtrain report runs/quickstart --html            # report.html: the run's figures drawn, one page
    simtrain torchtitan --cluster scenarios/quickstart.yaml --ranks 8 -- --module llama3 --config llama3_debugmodel
    simtrain megatron --cluster scenarios/quickstart.yaml --ranks 4 -- train_gpt.py --tp 2   # torchrun's way

A user's mistake prints one line naming the field or file and exits with 2.

What needs torch or the simulator (the runner, the collectives, the cluster) is imported inside the command
that uses it: `simtrain --help` and a command's `--help` start without torch.
A run whose job a fault stopped (hw/faults.py) writes its report (status
failed, and why), prints its summary and exits with 3.
"""
import functools
import json
import sys
from collections import Counter
from contextlib import nullcontext
from pathlib import Path


import click
import yaml
from rich.console import Console
from rich.table import Table

from .errors import ScenarioError, SimtrainError, TopologyError, one_line
from .limits import MAX_COLLECTIVE_BYTES, MAX_PROCESSES, MAX_STEPS
from .cli_collective import collective, topo
from .cli_frameworks import megatron, torchtitan
from .cli_import import import_group
from .cli_report import report
from .cli_replay import replay as replay_traces
from .progress import RunProgress, SweepProgress
from .scenario import load_scenario, validate_scenario
from .units import format_bytes, format_seconds, parse_size
from .user_files import load_yaml_file, output_folder, read_text_file, user_path
from .views import (attention_note, batch_line, console, preset_line, print_calibration, print_comparison,
                    print_memory_plans, print_summary, print_sweep)

err_console = Console(stderr=True)
JOB_FAILED_EXIT_CODE = 3  # a fault stopped the job; its report is written


def _errors_name_the_file(command):
    """A command on one scenario file: the errors found once it has loaded (a user's model, a topology
    builder's check) name the file too, as the loader's own do."""
    @functools.wraps(command)
    def wrapper(**options):
        try:
            return command(**options)
        except (ScenarioError, TopologyError) as error:
            if str(error).startswith(f"{options['scenario_file']}: "):
                raise
            raise type(error)(f"{options['scenario_file']}: {error}") from error
    return wrapper


@click.group()
@click.version_option(package_name="simtrain")
def cli():
    """Simulate distributed training: real torch numerics on simulated GPUs and links."""


@cli.command()
@click.argument("scenario_file")
@click.option("--set", "overrides", multiple=True, metavar="PATH=VALUE", help="Override a field (value parsed as YAML).")
@click.option("--out", "out_dir", default=None, help="Output folder (default runs/<name>/).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no summary: only where the outputs went.")
@click.option("--no-numerics", is_flag=True, help="Meta tensors: times, bytes and memory without arithmetic "
              "(as --set numerics=false).")
@_errors_name_the_file
def run(scenario_file, overrides, out_dir, quiet, no_numerics):
    """Train the scenario's model on its simulated cluster and report.

    Exit codes: 0 the job ran; 2 a mistake in the input (one line naming the field), or out of memory;
    3 a fault stopped the job (cluster.faults, cluster.random_faults): report.json is written, with
    status failed and the reason."""
    from .runner import run as run_scenario

    scenario = load_scenario(scenario_file, [*overrides, *(["numerics=false"] if no_numerics else [])])
    out = output_folder(out_dir, "--out") if out_dir else output_folder(Path("runs") / scenario.name, "name")
    if scenario.pbt is not None:
        from .studies.pbt import run_population
        from .studies.pbt_replay import plot_population
    run = run_scenario if scenario.pbt is None else run_population
    if quiet:
        report = run(scenario)
    else:
        with RunProgress(scenario, err_console) as progress:
            report = run(scenario, on_step=progress.on_step)
    written = report.write(out)
    if scenario.pbt is not None:
        plot_population(report.data["pbt"], out / "pbt.png")
        written.append(out / "pbt.png")
    if report.data.get("fleet") is not None:
        from .fleet.plot import plot_fleet
        plot_fleet(report.data["fleet"], out / "fleet.png")
        written.append(out / "fleet.png")
        if report.data["fleet"]["spares_warning"]:
            err_console.print(f"warning: {report.data['fleet']['spares_warning']}", markup=False, highlight=False,
                              soft_wrap=True)
    if report.data.get("moe") is not None:
        from .report.moe_plot import plot_moe
        plot_moe(report.data["moe"], out / "moe.png")
        written.append(out / "moe.png")
    if report.data["status"] == "out_of_memory":
        raise SimtrainError(f"{report.data['out_of_memory']['message']} (wrote {out}/report.json)")
    if not quiet:
        if attention_note(scenario):  # after the run: a run that fails says its one line alone
            err_console.print(attention_note(scenario), markup=False, highlight=False, soft_wrap=True)
        print_summary(report.data)
    console.print(f"wrote {out}/" + ", ".join(path.name + "/" * path.is_dir() for path in written), soft_wrap=True)
    if report.data["status"] == "failed":
        err_console.print(f"job failed: {one_line(report.data['failure'])} (wrote {out}/report.json)",
                          markup=False, highlight=False, soft_wrap=True)
        sys.exit(JOB_FAILED_EXIT_CODE)


@cli.command()
@click.argument("scenario_file")
@click.option("--nproc", type=click.IntRange(1, MAX_PROCESSES), default=None,
              help="Processes (ranks) to spawn; under torchrun, its group instead.")
@click.option("--backend", type=click.Choice(("gloo", "nccl")), default="gloo", show_default=True)
@click.option("--collective", type=click.Choice(("programs", "native")), default="programs", show_default=True,
              help="programs: simtrain's collective programs over send/recv; native: dist.all_reduce.")
@click.option("--warmup", type=click.IntRange(0, MAX_STEPS), default=3, show_default=True,
              help="Steps run before the measured ones.")
@click.option("--set", "overrides", multiple=True, metavar="PATH=VALUE", help="Override a field (value parsed as YAML).")
@click.option("--out", "out_dir", default=None, help="Output folder (default runs/<name>-real/).")
@click.option("--quiet", "-q", is_flag=True, help="No summary.")
@_errors_name_the_file
def launch(scenario_file, nproc, backend, collective, warmup, overrides, out_dir, quiet):
    """Train the scenario for real on torch.distributed (one process per rank) and report measured times."""
    from .real.launch import launch as launch_real

    scenario = load_scenario(scenario_file, overrides)
    for field in ("kineto", "chakra"):
        if getattr(scenario.report, field):
            raise ScenarioError(f"report.{field}: simtrain launch writes trace.json only (the real run's own "
                                f"traces come from torch.profiler); set report.{field}: false")
    out = output_folder(out_dir, "--out") if out_dir else output_folder(Path("runs") / f"{scenario.name}-real", "name")
    data = launch_real(scenario_file, overrides, nproc, out, backend=backend, collective=collective, warmup=warmup)
    if data is not None and data["measurement"]["warning"]:
        err_console.print(data["measurement"]["warning"], markup=False, highlight=False, soft_wrap=True)
    if data is not None and not quiet:
        print_summary(data)
        # launch trains for real (numerics on): final_model.pt always; trace.json as report.trace asks
        written = ["report.json", *(["trace.json"] if scenario.report.trace else []), "final_model.pt",
                   "scenario.resolved.yaml"]
        console.print(f"wrote {out}/" + ", ".join(written))


@cli.command()
@click.option("--nproc", type=click.IntRange(2, MAX_PROCESSES), default=None,
              help="Processes (ranks) to spawn; under torchrun, its group instead.")
@click.option("--out", "out_dir", default="calibration", show_default=True,
              help="Folder for device.yaml, topology.yaml and calibration.json.")
@click.option("--backend", type=click.Choice(("gloo", "nccl")), default="gloo", show_default=True)
@click.option("--model-of", "model_of", default=None, metavar="SCENARIO",
              help="Time training steps of this scenario's model, batch and optimizer (default: square Linear "
                   "layers trained with SGD).")
@click.option("--sizes", default="4:4M", show_default=True, help="MIN:MAX message bytes, x4 apart (K, M = 1024^n).")
@click.option("--repeats", type=click.IntRange(1, 100_000), default=20, show_default=True,
              help="Timed repetitions of each measurement.")
@click.option("--refit", "recorded", multiple=True, metavar="CALIBRATION_JSON",
              help="Measure nothing: fit again what this earlier calibration.json measured, with this version's "
                   "models; given again, calibrations of the same ranks and model are pooled.")
@click.pass_context
def calibrate(context, nproc, out_dir, backend, model_of, sizes, repeats, recorded):
    """Measure point-to-point, all-reduce and compute on real processes; write a device and a topology file."""
    from .real.calibrate import calibrate as calibrate_real
    from .real.calibrate import refit

    out = output_folder(out_dir, "--out")
    if recorded:
        given = [f"--{name.replace('_', '-')}" for name in ("nproc", "backend", "model_of", "sizes", "repeats")
                 if context.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
        if given:
            raise SimtrainError(f"--refit: measures nothing, so {given[0]} has no use (the recorded one is kept)")
        for path in recorded:
            if (out / "calibration.json").resolve() == Path(user_path(path, "--refit")).resolve():
                raise SimtrainError(f"--out: would write over {path}, a calibration to refit; give another folder")
        print_calibration(refit([Path(path) for path in recorded], out))
        console.print(f"wrote {out}/device.yaml, topology.yaml, calibration.json (refitted from "
                      f"{' and '.join(recorded)})")
        return
    low, sep, high = sizes.partition(":")
    low = parse_size(low, "--sizes")
    high = parse_size(high, "--sizes") if sep else low
    if low < 4 or high < 4 * low or high > MAX_COLLECTIVE_BYTES:
        raise SimtrainError(f"--sizes: need 4 <= MIN, 4 x MIN <= MAX <= {format_bytes(MAX_COLLECTIVE_BYTES)} "
                            f"(two sizes for a fit), got {sizes!r}")
    size_list = []
    while low <= high:
        size_list.append(low)
        low *= 4
    summary = calibrate_real(nproc, out, backend=backend, model_of=model_of, sizes=size_list, repeats=repeats)
    if summary is None:
        return
    print_calibration(summary)
    console.print(f"wrote {out}/device.yaml, topology.yaml, calibration.json")


@cli.group()
def pbt():
    """Population-based training: read back what a population found."""


@pbt.command()
@click.argument("report_file")
@click.option("--member", default="best", show_default=True, help="best, or a member id.")
@click.option("--out", "out_file", required=True, help="The scenario file to write.")
def replay(report_file, member, out_file):
    """Write a member's lineage (the hyperparameters its weights were trained with) as a single-run scenario."""
    from .studies.pbt_replay import pick_member, replay_scenario

    report_path = user_path(report_file, "REPORT", ScenarioError)
    try:
        data = json.loads(read_text_file(report_path, "REPORT", ScenarioError))
    except ValueError as error:
        raise ScenarioError(f"{report_file}: not JSON ({one_line(str(error))})") from None
    if not isinstance(data, dict) or "pbt" not in data:
        raise ScenarioError(f"{report_file}: not the report.json of a population (no pbt section)")
    resolved_path = report_path.parent / "scenario.resolved.yaml"
    resolved = load_yaml_file(user_path(resolved_path, "REPORT's scenario.resolved.yaml", ScenarioError),
                              str(resolved_path), ScenarioError)
    try:
        picked = pick_member(data["pbt"], member)
        scenario = replay_scenario(resolved, data["pbt"], picked)
    except (KeyError, IndexError, TypeError, ValueError) as error:  # a report or scenario edited by hand
        raise ScenarioError(f"{report_file}: its pbt section or scenario.resolved.yaml is not as simtrain wrote "
                            f"it ({one_line(repr(error))})") from None
    validate_scenario(scenario, source=out_file)
    try:
        Path(out_file).write_text(yaml.safe_dump(scenario, sort_keys=False))
    except OSError as error:
        raise SimtrainError(f"--out: cannot write {out_file} ({one_line(error.strerror or str(error))})") from None
    console.print(f"wrote {out_file}: the lineage of member {picked}, {len(scenario['train']['schedule'])} schedule "
                  f"entries, {scenario['train']['steps']} steps")


@cli.command()
@click.argument("scenario_files", nargs=-1, required=True)
@click.option("--variant", "variants", multiple=True, metavar="PATH=VALUE[,PATH=VALUE...]",
              help="One run per variant of every file (repeatable).")
@click.option("--set", "overrides", multiple=True, metavar="PATH=VALUE", help="Override a field in every run.")
@click.option("--out", "out_dir", default=None, help="Output folder (default runs/compare-<first name>/).")
@click.option("--quiet", "-q", is_flag=True, help="No progress: no line a run, no bar over its steps.")
def compare(scenario_files, variants, overrides, out_dir, quiet):
    """Run several scenarios (or variants of one) and compare them: a table and a loss-vs-time PNG; or put
    two run folders (a simulated and a measured run) side by side."""
    from .compare import LOSS_PLOT, compare_runs, parse_variant, plan_runs

    if any(Path(file).is_dir() for file in scenario_files):
        _compare_folders(scenario_files, variants, overrides, out_dir)
        return

    runs = plan_runs(list(scenario_files), [parse_variant(v) for v in variants], list(overrides))
    out = output_folder(out_dir or Path("runs") / f"compare-{Path(scenario_files[0]).stem}", "--out")

    def watch(index, spec, scenario):
        if quiet:
            return nullcontext()
        label = f"[{index + 1}/{len(runs)}] {spec.label or spec.scenario_file}"
        err_console.print(label, markup=False, highlight=False)
        return RunProgress(scenario, err_console, label=label)

    rows = compare_runs(runs, out, watch=watch)
    print_comparison(rows)
    plot = f", {LOSS_PLOT}" if (out / LOSS_PLOT).exists() else " (no loss plot: no run has a loss, numerics off)"
    console.print(f"wrote {out}/compare.json{plot} and one folder per run")


def _compare_folders(folders, variants, overrides, out_dir) -> None:
    """`simtrain compare RUN_A RUN_B`: two reports' timing figures and the relative error."""
    from .compare import compare_reports, read_report
    from .report import finite_or_none

    if len(folders) != 2 or not all(Path(folder).is_dir() for folder in folders):
        raise SimtrainError(f"compare: give scenario files, or exactly two run folders, got {' '.join(folders)}")
    if variants or overrides:
        raise SimtrainError("--variant, --set: for scenario files, not run folders")
    out = output_folder(out_dir or Path("runs") / f"compare-{Path(folders[0]).name}", "--out")
    rows = compare_reports(*folders)
    kinds = ["measured" if read_report(folder).get("measured") else "simulated" for folder in folders]
    table = Table(title=f"{folders[0]} ({kinds[0]}) against {folders[1]} ({kinds[1]})")
    for header in ("figure", f"{folders[0]}", f"{folders[1]}", "error"):
        table.add_column(header, justify="left" if header == "figure" else "right")
    for row in rows:
        values = ["-" if value is None else (f"{value:,.0f}" if row["figure"].startswith("throughput")
                                             else format_seconds(value)) for value in row["values"]]
        table.add_row(row["figure"], *values, "-" if row["error"] is None else f"{row['error']:+.1%}")
    console.print(table)
    console.print("error: (the other - the reference) / the reference; the reference is the measured run "
                  "(else the second)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(finite_or_none(
        {"runs": list(folders), "kinds": kinds, "rows": rows}), indent=2, allow_nan=False) + "\n")
    console.print(f"wrote {out}/compare.json")


@cli.command()
@click.argument("scenario_file")
@click.option("--grid", "grids", multiple=True, required=True, metavar="PATH=V1,V2,...",
              help="A field and its values (repeatable); the sweep runs every combination.")
@click.option("--set", "overrides", multiple=True, metavar="PATH=VALUE", help="Override a field in every run.")
@click.option("--workers", type=click.IntRange(1, 256), default=2, show_default=True, help="Local processes.")
@click.option("--ray", "ray_address", default=None, metavar="ADDRESS",
              help="Submit the runs to this Ray cluster instead (pip install 'simtrain[ray]').")
@click.option("--metric", default="step_time_s", show_default=True, help="The figure sweep.png plots.")
@click.option("--out", "out_dir", default=None, help="Output folder (default runs/sweep-<name>/).")
@click.option("--restart", is_flag=True,
              help="Run every point again, discarding the rows --out holds (without it, the sweep resumes).")
@click.option("--quiet", "-q", is_flag=True, help="No progress over the points.")
def sweep(scenario_file, grids, overrides, workers, ray_address, metric, out_dir, restart, quiet):
    """Run a scenario at every point of a grid: sweep.csv, sweep.json, sweep.png and a table. Each point's row is
    in OUT/rows.jsonl as soon as it finishes: the same command again resumes a sweep that was stopped."""
    from .studies.sweep import parse_grid, plan_points, point_texts, run_sweep

    parsed = [parse_grid(grid) for grid in grids]
    out = output_folder(out_dir or Path("runs") / f"sweep-{Path(scenario_file).stem}", "--out")
    progress = SweepProgress(len(plan_points(parsed)), err_console, shown=not quiet)
    try:
        with progress:
            rows = run_sweep(scenario_file, parsed, list(overrides), out, workers=workers, ray_address=ray_address,
                             metric=metric, on_done=progress.on_done, restart=restart)
    except KeyboardInterrupt:
        err_console.print(f"stopped: {progress.done} points are in {out}/rows.jsonl; the same command resumes the "
                          "sweep",
                          markup=False, highlight=False, soft_wrap=True)
        raise
    print_sweep(rows, [grid.path for grid in parsed], [list(texts) for texts in point_texts(parsed)])
    console.print(f"wrote {out}/sweep.csv, sweep.json, sweep.png and runs/<index>/report.json")


@cli.command()
@click.argument("scenario_file")
@click.option("--set", "overrides", multiple=True, metavar="PATH=VALUE", help="Override a field (value parsed as YAML).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per device.")
@click.option("--no-search", is_flag=True, help="The given layout's peaks alone: no search for the largest batch "
                                                "that fits (largest_batch_size null) nor for layouts that fit.")
@_errors_name_the_file
def memory(scenario_file, overrides, as_json, no_search):
    """Peak memory per device of one training step, by category, and the largest batch that fits (no training)."""
    from .memory_plan import plan_host_memory, plan_memory

    scenario = load_scenario(scenario_file, overrides)
    plans = plan_memory(scenario)
    host = plan_host_memory(scenario) if scenario.parallel.sharding.offload != "none" else None
    if as_json:
        for plan in plans:
            click.echo(json.dumps({"rank": plan.rank, "device": plan.device, "capacity_bytes": plan.capacity_bytes,
                                   "peak_bytes": plan.peak_bytes, "bytes_by_category": plan.by_category,
                                   "fits": plan.fits, "largest_batch_size": None if no_search else plan.largest_batch}))
        if host is not None:  # ZeRO-Offload: the host's share, every rank's together
            click.echo(json.dumps({"host": host.location, "capacity_bytes": host.capacity_bytes,
                                   "peak_bytes": host.peak_bytes, "bytes_by_category": host.by_category}))
        return
    print_memory_plans(scenario, plans, search=not no_search)
    if host is not None:
        console.print(f"host memory (cluster.shared_memory), every rank's offloaded state: peak "
                      f"{format_bytes(host.peak_bytes)} = " + ", ".join(
                          f"{category} {format_bytes(nbytes)}" for category, nbytes in host.by_category.items()
                          if nbytes), soft_wrap=True)
    if not no_search and not all(plan.fits for plan in plans):
        from .layout_search import layouts_that_fit

        layouts = layouts_that_fit(scenario)
        console.print("layouts that fit the same global batch: " + ("; ".join(fit.summary() for fit in layouts)
                                                                     or "none found"), soft_wrap=True)


@cli.command()
@click.argument("scenario_file")
@click.option("--set", "overrides", multiple=True, metavar="PATH=VALUE")
@click.option("--no-numerics", is_flag=True, help="Check the run of `simtrain run --no-numerics` (as --set "
              "numerics=false).")
@_errors_name_the_file
def validate(scenario_file, overrides, no_numerics):
    """Check a scenario as `simtrain run` does before simulating (the cluster, its faults, the host's memory,
    the layout and each rank's share of the model, on meta tensors) without running it."""
    from .preflight import preflight
    from .schemes import scheme_name

    scenario = load_scenario(scenario_file, [*overrides, *(["numerics=false"] if no_numerics else [])])
    resolved = preflight(scenario)
    counts = Counter(spec.name for spec in resolved.device_specs)  # one per device, in rank order
    devices = ", ".join(f"{count} x {name}" for name, count in counts.items())
    console.print(f"{scenario_file}: ok ({scenario.name}: {devices}, {scenario.cluster.topology}, "
                  f"{scheme_name(scenario.parallel)}, all_reduce {scenario.parallel.all_reduce}; "
                  f"{batch_line(scenario, sum(counts.values()))})", soft_wrap=True)
    if scenario.model.preset is not None:
        console.print(preset_line(scenario), soft_wrap=True, markup=False, highlight=False)
    if attention_note(scenario):
        err_console.print(attention_note(scenario), markup=False, highlight=False, soft_wrap=True)
    if scenario.fleet is not None:
        from .fleet.expected import spare_pool_warning
        from .fleet.inventory import job_inventory
        warning = spare_pool_warning(scenario.fleet, job_inventory(scenario, resolved.topology()))
        if warning:
            err_console.print(f"warning: {warning}", markup=False, highlight=False, soft_wrap=True)


cli.add_command(collective)
cli.add_command(topo)
cli.add_command(import_group)
cli.add_command(report)
cli.add_command(replay_traces)
cli.add_command(torchtitan)
cli.add_command(megatron)


def main(argv=None) -> None:
    """Entry point: one line and exit code 2 for a user's mistake, never a traceback."""
    try:
        code = cli.main(args=argv, prog_name="simtrain", standalone_mode=False)
    except SimtrainError as error:
        err_console.print(f"error: {one_line(str(error))}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except click.exceptions.Abort:
        err_console.print("aborted", markup=False)
        sys.exit(130)
    except click.ClickException as error:
        err_console.print(f"error: {one_line(error.format_message())}", markup=False, highlight=False,
                          soft_wrap=True)
        sys.exit(2)
    sys.exit(code or 0)
