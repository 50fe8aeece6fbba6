"""Check the simulator against a real run: calibrate, then predict and measure configurations calibration did not see.

1. `simtrain calibrate --nproc 2 --model-of BASE` (real/calibrate.py): point-to-point
   α-β fit, then training steps of BASE's model (forward with the batch's draw,
   backward, ring all-reduce of each size, optimizer step; at three batch sizes,
   and at 3/4 and 5/4 of its width, widths this bench does not hold out) fitted
   to a fixed cost per pass, FLOP/s, the optimizer step's fixed cost and memory
   bandwidth, the ring exchange and the compute jitter -> calibration/device.yaml,
   topology.yaml, calibration.json;
2. for each configuration (BASE with other batch sizes, widths, depths, step
   counts): `simtrain run` on the calibration files (and `cluster.compute_jitter` and
   `compute_jitter_fixed` from calibration.json, unless --no-jitter) predicts the step time,
   `simtrain launch --nproc 2` measures it (warm-up steps not measured), `--launches`
   times, the configurations in turn (a change of the machine's speed falls on all of
   them), the measured step the median launch's;
3. calibrated again after the launches, and both calibrations pooled (`simtrain
   calibrate --refit` of the two: calibration_bracketing/): the machine's speed
   on this shared host drifts over the minutes the launches take, so the
   configurations are predicted both ways, from the calibration before (what
   a user who calibrates once gets: the model's error and the drift since)
   and bracketed (the machine's speed averaged over the launches' minutes, as
   a quiet machine would hold it: the model's error); and the two calibrations'
   measured steps compared (nothing fitted: real/step_fit.py measured_step_s):
   the run is steady when they lie at most MAX_DRIFT (5%) apart, the machine at
   one speed through it;
4. a table of predicted against measured step time (and compute, communication,
   optimizer, idle) with the error (predicted - measured) / measured, the
   geometric mean error over the unseen configurations, exp(mean |ln(predicted /
   measured)|) - 1 (the factor a prediction typically misses by: a geometric mean
   of the |errors| themselves is pulled to 0 by one near-exact configuration),
   the largest |error|, each way, and fidelity.json;
5. held-out rank counts (`--ranks`, default 3 and 4): BASE on more processes
   than calibration ran, on the same cores: predicted on a switch of that many
   ranks with the calibrated device, three ways: each rank computing as if it
   had a core of its own, on the calibrated links (`own_cores`); the ranks'
   compute sharing the calibrated host's cores (`cluster.host_cores`,
   hw/host_cores.py), on the same links (`shared_compute`); and their messages'
   software work on those cores too (`cluster.host_message_work`: δ per
   message and 1/γ per byte, the links then the ping-pong's wire:
   `shared_cores`); and measured with `simtrain launch --nproc N`, as often.

The machine's load is printed first (a busy machine slows the real run and not
the prediction).

    PYTHONPATH=. .venv/bin/python bench/fidelity.py --out runs/fidelity
"""
import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import yaml

import simtrain
from simtrain.real.calibrate import calibrate, refit
from simtrain.real.launch import launch
from simtrain.real.machine_load import MAX_DRIFT, drift_warning

WORLD = 2
# Launched steps: a step's time varies by half its median from step to step on a shared 2-core host, so a launch of
# 40 steps measured a mean that moved by 12.5% (standard deviation) from launch to launch, and of 240 steps by 5.2%
# (six launches of each, 2026-12-03 11:35 UTC): long enough that the measurement's own noise is well below the 15%
# to be checked
STEPS = 240
BASE = {
    "name": "fidelity", "seed": 0,
    "cluster": {"topology": "ring", "devices": WORLD},
    "model": {"name": "mlp", "hidden": [256, 256]},
    "data": {"name": "synthetic", "samples": 8192, "features": 256, "classes": 10},
    "train": {"steps": STEPS, "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}},
    # no overlap: a launched run all-reduces after its real backward (real/interpreter.py), so the prediction too
    "parallel": {"all_reduce": "ring", "overlap": False},
    "report": {"trace": False},
}
BASE_BATCH = 64
# The base itself (calibration measured its model's FLOP/s and optimizer: not counted in the error's mean),
# then configurations calibration did not see: (label, overrides of BASE)
SEEN = "base (seen by calibration)"
CONFIGURATIONS = [
    (SEEN, {}),
    ("batch 32", {"data.batch_size": 32}),
    ("batch 256", {"data.batch_size": 256}),
    ("width 512", {"model.hidden": [512, 512]}),
    ("width 128, 3 layers", {"model.hidden": [128, 128, 128]}),
    ("twice the steps, width 384", {"train.steps": 2 * STEPS, "model.hidden": [384, 384]}),
]
RENAMED = {"80 steps, width 384": "twice the steps, width 384"}  # runs before 2026-12-03 11:45 UTC (40 steps)


def scenario_dict(overrides: dict, cluster: dict | None = None) -> dict:
    scenario = json.loads(json.dumps(BASE))
    scenario["data"]["batch_size"] = BASE_BATCH
    for path, value in overrides.items():
        node = scenario
        *parents, leaf = path.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    if cluster:
        scenario["cluster"].update(cluster)
    return scenario


def calibrated_jitter(calibration: dict, jitter: bool) -> dict:
    """The cluster's compute noise as calibration fitted it (none with --no-jitter)."""
    return {"compute_jitter": calibration["compute_jitter"] if jitter else 0.0,
            "compute_jitter_fixed": calibration["compute_jitter_fixed_s"] if jitter else 0.0}


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/fidelity")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20, help="calibrate's timed repetitions")
    parser.add_argument("--no-jitter", dest="jitter", action="store_false",
                        help="predict without the calibrated compute jitter (no idle predicted)")
    parser.add_argument("--ranks", type=int, nargs="*", default=[3, 4],
                        help="held-out rank counts: BASE launched on this many processes")
    parser.add_argument("--launches", type=int, default=5,
                        help="launches of each configuration, in turn; the median launch's step is the measured one")
    parser.add_argument("--again", nargs="+", metavar="RUN", default=[],
                        help="measure nothing: refit each earlier run's calibration with this code and predict its "
                             "configurations again, against the steps it measured")
    args = parser.parse_args()
    if args.again:
        for run in args.again:
            predict_again(Path(run).absolute(), args.jitter)
        return
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, load average {load()}")
    base_file = out / "base.yaml"
    base_file.write_text(yaml.safe_dump(scenario_dict({})))
    calibration = calibrate(WORLD, out / "calibration", model_of=base_file, repeats=args.repeats)
    print_calibration("calibration", calibration)
    predictions, launches = {}, {label: [] for label, _ in CONFIGURATIONS}
    for label, overrides in CONFIGURATIONS:
        folder = configuration_folder(out, label)
        folder.mkdir(exist_ok=True)
        predictions[label] = predict(folder / "scenario.yaml", overrides, out / "calibration", calibration,
                                     args.jitter)
        (folder / "launch.yaml").write_text(yaml.safe_dump(scenario_dict(overrides)))
    for turn in range(args.launches):  # every configuration once, then again: the machine's drift falls on all
        for label, _ in CONFIGURATIONS:
            folder = configuration_folder(out, label)
            before = load()
            measured = launch(folder / "launch.yaml", [], WORLD, folder / f"real_{turn}", warmup=args.warmup)
            launches[label].append((measured, before))
            print(f"{label}, launch {turn + 1}: measured {measured['step_time_s'] * 1e3:.3f} ms "
                  f"(load before {before})", flush=True)
    after = calibrate(WORLD, out / "calibration_after", model_of=base_file, repeats=args.repeats)
    print_calibration("calibration after the launches", after)
    bracketing = refit([out / "calibration" / "calibration.json", out / "calibration_after" / "calibration.json"],
                       out / "calibration_bracketing")
    print_calibration("both pooled", bracketing)
    before_step, after_step = (one["measured_step_s"] for one in bracketing["pooled"])
    apart = after_step / before_step - 1
    steady = drift_warning([("before", before_step), ("after", after_step)]) is None
    print(f"the machine's speed: calibration's steps took {before_step * 1e3:.3f} ms before the launches and "
          f"{after_step * 1e3:.3f} ms after ({apart:+.1%}): {'steady' if steady else 'unsteady'} (at most "
          f"{MAX_DRIFT:.0%} apart)", flush=True)
    rows = []
    for label, overrides in CONFIGURATIONS:
        predicted = predictions[label]
        (measured, before), steps = median_launch(launches[label])
        bracketed = predict(configuration_folder(out, label) / "scenario_bracketing.yaml", overrides,
                            out / "calibration_bracketing", bracketing, args.jitter)["step_time_s"]
        row = {"configuration": label, "load_before": before, "launched_steps_s": steps,
               "predicted_step_s": predicted["step_time_s"], "measured_step_s": measured["step_time_s"],
               "error": (predicted["step_time_s"] - measured["step_time_s"]) / measured["step_time_s"],
               "bracketed_step_s": bracketed,
               "bracketed_error": (bracketed - measured["step_time_s"]) / measured["step_time_s"],
               "predicted_breakdown_s": predicted["breakdown_s"], "measured_breakdown_s": measured["breakdown_s"],
               "measured_unattributed_s": measured["measurement"]["unattributed_s"],
               "launch_warning": measured["measurement"]["warning"]}
        rows.append(row)
        warning = f"; {row['launch_warning']}" if row["launch_warning"] else ""
        print(f"{label}: predicted {row['predicted_step_s'] * 1e3:.3f} ms, measured {row['measured_step_s'] * 1e3:.3f} ms"
              f" (median of {', '.join(f'{step * 1e3:.3f}' for step in steps)}), error {row['error']:+.1%}; "
              f"bracketed {bracketed * 1e3:.3f} ms, error {row['bracketed_error']:+.1%}{warning}", flush=True)
    print("\n| configuration | predicted step | measured step | error | predicted compute / comm / optimizer | "
          "measured compute / comm / optimizer / idle |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        p, m = row["predicted_breakdown_s"], row["measured_breakdown_s"]
        print(f"| {row['configuration']} | {row['predicted_step_s'] * 1e3:.3f} ms | {row['measured_step_s'] * 1e3:.3f} ms "
              f"| {row['error']:+.1%} | {p['compute'] * 1e3:.3f} / {p['communication'] * 1e3:.3f} / "
              f"{p['optimizer'] * 1e3:.3f} ms | {m['compute'] * 1e3:.3f} / {m['communication'] * 1e3:.3f} / "
              f"{m['optimizer'] * 1e3:.3f} / {m['idle'] * 1e3:.3f} ms |")
    print("\nWhere the time goes: predicted - measured per step, by part (ms); idle includes host work between "
          "operations (unattributed), which the simulator does not model")
    print("| configuration | compute | communication | optimizer | idle (of which unattributed) | step |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        p, m = row["predicted_breakdown_s"], row["measured_breakdown_s"]
        parts = [f"{(p[kind] - m[kind]) * 1e3:+.3f}" for kind in ("compute", "communication", "optimizer")]
        print(f"| {row['configuration']} | {' | '.join(parts)} | {(p['idle'] - m['idle']) * 1e3:+.3f} "
              f"({row['measured_unattributed_s'] * 1e3:.3f}) | "
              f"{(row['predicted_step_s'] - row['measured_step_s']) * 1e3:+.3f} |")
    geomean, largest = unseen_errors(rows)
    bracketed_geomean, bracketed_largest = unseen_errors(rows, "bracketed_step_s")
    print(f"\ngeometric mean error over the unseen configurations: {geomean:.1%} (largest |error| {largest:.1%}); "
          f"bracketed: {bracketed_geomean:.1%} (largest {bracketed_largest:.1%}); machine load after: {load()}")
    relative = relative_to_seen(rows)
    print("relative to the base (the machine's change of speed since calibration taken out): "
          + ", ".join(f"{label} {error:+.1%}" for label, error in relative.items()))
    ranks_rows = [held_out_ranks(world, out, calibration, args) for world in args.ranks]
    if ranks_rows:
        print(f"\nheld-out rank counts on {calibration['host']['cores']} cores (calibrated at {WORLD} ranks):")
        print("| ranks | measured step | own cores | shared compute | shared cores (compute and messages) | "
              "measured compute / comm / optimizer / idle | shared cores: predicted compute / comm / optimizer / "
              "idle |")
        print("|---|---|---|---|---|---|---|")
        for row in ranks_rows:
            m, p = row["measured_breakdown_s"], row["predicted_breakdown_s"]["shared_cores"]
            predictions = " | ".join(f"{row['predicted_step_s'][model] * 1e3:.3f} ms ({row['error'][model]:+.1%})"
                                     for model in ("own_cores", "shared_compute", "shared_cores"))
            parts = ("compute", "communication", "optimizer", "idle")
            print(f"| {row['ranks']} | {row['measured_step_s'] * 1e3:.3f} ms | {predictions} | "
                  f"{' / '.join(f'{m[part] * 1e3:.3f}' for part in parts)} ms | "
                  f"{' / '.join(f'{p[part] * 1e3:.3f}' for part in parts)} ms |")
    (out / "fidelity.json").write_text(json.dumps({"calibration": calibration, "rows": rows,
                                                   "geomean_error": geomean, "max_abs_error": largest,
                                                   "bracketed_geomean_error": bracketed_geomean,
                                                   "bracketed_max_abs_error": bracketed_largest,
                                                   "calibrations_apart": apart, "steady": steady,
                                                   "relative_to_seen": relative, "ranks_rows": ranks_rows},
                                                  indent=2) + "\n")


def unseen_errors(rows: list[dict], predicted: str = "predicted_step_s") -> tuple[float, float]:
    """Over the configurations calibration did not see, predicted (the calibration before the launches, or
    `bracketed_step_s`): the geometric mean error, exp(mean |ln(predicted / measured)|) - 1, and the largest
    |predicted - measured| / measured."""
    unseen = [(row[predicted], row["measured_step_s"]) for row in rows if row["configuration"] != SEEN]
    geomean = math.exp(statistics.mean(abs(math.log(predicted / measured)) for predicted, measured in unseen)) - 1
    return geomean, max(abs(predicted - measured) / measured for predicted, measured in unseen)


def print_calibration(name: str, calibration: dict) -> None:
    """One line of what a calibration fitted."""
    wire, exchange = calibration["link_classes"]["intra_host"], calibration["all_reduce_exchange"]
    compute, optimizer = calibration["compute"]["fp32"], calibration["optimizer"]
    print(f"{name}: ping-pong α {wire['latency_s'] * 1e6:.1f} us, β {wire['bandwidth_Bps'] / 1e9:.2f} GB/s "
          f"(largest residual {wire['max_abs_residual']:.0%}); ring exchange in training steps α "
          f"{exchange['latency_s'] * 1e6:.1f} us, β {exchange['bandwidth_Bps'] / 1e9:.2f} GB/s (largest residual "
          f"{exchange['max_abs_residual']:.0%}); fp32 {compute['flops_per_s'] / 1e9:.1f} GFLOP/s and "
          f"{compute['pass_overhead_s'] * 1e6:.1f} us per pass (largest residual "
          f"{compute['max_abs_residual']:.0%}); optimizer {optimizer['overhead_s'] * 1e6:.1f} us and "
          f"{optimizer['bandwidth_Bps'] / 1e9:.2f} GB/s "
          f"(largest residual {optimizer['max_abs_residual']:.0%}); compute jitter "
          f"σ {calibration['compute_jitter']:.3f}, fixed {calibration['compute_jitter_fixed_s'] * 1e3:.3f} ms; "
          f"{calibration['load']['warning'] or 'machine quiet'}", flush=True)


def predict(scenario_file: Path, overrides: dict, calibrated: Path, calibration: dict, jitter: bool) -> dict:
    """`simtrain run` of BASE with `overrides` on the device and topology calibrated into folder `calibrated`
    (written to `scenario_file`): its report's data."""
    cluster = {"device": str(calibrated / "device.yaml"), "topology": str(calibrated / "topology.yaml"),
               "devices": None, **calibrated_jitter(calibration, jitter)}
    scenario_file.write_text(yaml.safe_dump(scenario_dict(overrides, cluster)))
    return simtrain.run(simtrain.load_scenario(scenario_file)).data


def relative_to_seen(rows: list[dict]) -> dict:
    """Each unseen configuration's predicted over measured step, over the base's: its error with what moves every
    configuration alike (the machine's speed since calibration) taken out."""
    seen = next(row for row in rows if row["configuration"] == SEEN)
    ratio = seen["predicted_step_s"] / seen["measured_step_s"]
    return {row["configuration"]: row["predicted_step_s"] / row["measured_step_s"] / ratio - 1
            for row in rows if row["configuration"] != SEEN}


def predict_again(run: Path, jitter: bool) -> None:
    """An earlier run of this benchmark (its --out) predicted again: its calibration refitted with this code
    (`simtrain calibrate --refit`, into RUN/refitted), its configurations predicted on the refitted files, against
    the steps it measured then."""
    recorded = json.loads((run / "fidelity.json").read_text())
    calibration = refit([run / "calibration" / "calibration.json"], run / "refitted")
    print(f"{run} (measured {calibration['date']}), refitted: optimizer "
          f"{calibration['optimizer']['bandwidth_Bps'] / 1e9:.2f} GB/s, compute jitter σ "
          f"{calibration['compute_jitter']:.3f}, fixed {calibration['compute_jitter_fixed_s'] * 1e3:.3f} ms")
    print("| configuration | measured step | predicted then | predicted by this code |\n|---|---|---|---|")
    overrides, again = dict(CONFIGURATIONS), []
    for row in recorded["rows"]:
        label = RENAMED.get(row["configuration"], row["configuration"])
        predicted = predict(run / "refitted" / f"{configuration_folder(run, label).name}.yaml", overrides[label],
                            run / "refitted", calibration, jitter)["step_time_s"]
        error = (predicted - row["measured_step_s"]) / row["measured_step_s"]
        again.append({**row, "predicted_step_s": predicted})
        print(f"| {label} | {row['measured_step_s'] * 1e3:.3f} ms | {row['predicted_step_s'] * 1e3:.3f} ms "
              f"({row['error']:+.1%}) | {predicted * 1e3:.3f} ms ({error:+.1%}) |")
    (then_geomean, then_largest), (now_geomean, now_largest) = unseen_errors(recorded["rows"]), unseen_errors(again)
    print(f"geometric mean error over the unseen configurations: then {then_geomean:.1%} (largest |error| "
          f"{then_largest:.1%}), now {now_geomean:.1%} (largest {now_largest:.1%})")
    then, now = relative_to_seen(recorded["rows"]), relative_to_seen(again)
    print("relative to the base, then and now: "
          + ", ".join(f"{label} {then[label]:+.1%} and {now[label]:+.1%}" for label in then) + "\n")


def configuration_folder(out: Path, label: str) -> Path:
    """Where a configuration's scenario files and launches go."""
    return out / label.replace(" ", "_").replace(",", "")


def median_launch(runs: list[tuple[dict, str]]) -> tuple[tuple[dict, str], list[float]]:
    """The launch (its report and the load before it) whose step time is the median of `runs` (the lower
    middle one of an even count), and every launch's step time in the order they ran."""
    ordered = sorted(runs, key=lambda run: run[0]["step_time_s"])
    return ordered[(len(ordered) - 1) // 2], [run[0]["step_time_s"] for run in runs]


def held_out_ranks(world: int, out: Path, calibration: dict, args) -> dict:
    """BASE on `world` processes: predicted with and without the host's cores shared, and measured."""
    folder = out / f"ranks_{world}"
    folder.mkdir(exist_ok=True)
    link = yaml.safe_load((out / "calibration" / "topology.yaml").read_text())["links"][0]
    calibrated = {"bandwidth": link["bandwidth"], "latency": link["latency"]}  # the wire and the software
    wire, software = calibration["link_classes"]["intra_host"], calibration["all_reduce_exchange"]
    per_byte = software["software_s_per_byte"]
    message_work = {"latency": software["software_latency_s"], "bandwidth": 1 / per_byte if per_byte else None}
    cores = calibration["host"]["cores"]
    models = {"own_cores": (None, calibrated, None), "shared_compute": (cores, calibrated, None),
              "shared_cores": (cores, {"bandwidth": wire["bandwidth_Bps"], "latency": wire["latency_s"] / 2},
                               message_work)}
    predicted = {}
    for model, (host_cores, links, work) in models.items():
        cluster = {"topology": "switch", "devices": world, "device": str(out / "calibration" / "device.yaml"),
                   "link": links, "host_cores": host_cores, "host_message_work": work,
                   **calibrated_jitter(calibration, args.jitter)}
        scenario_file = folder / f"scenario_{model}.yaml"
        scenario_file.write_text(yaml.safe_dump(scenario_dict({"cluster.devices": world}, cluster)))
        predicted[model] = simtrain.run(simtrain.load_scenario(scenario_file)).data
    launch_file = folder / "launch.yaml"
    launch_file.write_text(yaml.safe_dump(scenario_dict({"cluster.devices": world})))
    runs = []
    for turn in range(args.launches):
        before = load()
        runs.append((launch(launch_file, [], world, folder / f"real_{turn}", warmup=args.warmup), before))
    (measured, before), steps = median_launch(runs)
    step = measured["step_time_s"]
    row = {"ranks": world, "load_before": before, "measured_step_s": step, "launched_steps_s": steps,
           "measured_breakdown_s": measured["breakdown_s"], "launch_warning": measured["measurement"]["warning"],
           "predicted_step_s": {model: data["step_time_s"] for model, data in predicted.items()},
           "predicted_breakdown_s": {model: data["breakdown_s"] for model, data in predicted.items()},
           "error": {model: (data["step_time_s"] - step) / step for model, data in predicted.items()}}
    warning = f"; {row['launch_warning']}" if row["launch_warning"] else ""
    print(f"{world} ranks: measured {step * 1e3:.3f} ms; predicted " + ", ".join(
        f"{model} {row['predicted_step_s'][model] * 1e3:.3f} ms ({row['error'][model]:+.1%})" for model in models)
        + f" (load before {before}){warning}", flush=True)
    return row


if __name__ == "__main__":
    main()
