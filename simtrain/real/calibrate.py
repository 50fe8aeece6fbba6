"""`simtrain calibrate`: measure the machine a group of processes runs on, and write what `simtrain run` takes.

    simtrain calibrate --nproc 2 --out calibration/ [--model-of scenario.yaml]
    simtrain run scenario.yaml --set cluster.device=calibration/device.yaml \\
                               --set cluster.topology=calibration/topology.yaml
    simtrain calibrate --refit calibration/calibration.json --out refitted/
    simtrain calibrate --refit before/calibration.json --refit after/calibration.json --out pooled/

`refit` fits again what earlier calibrations measured, with this version's
models, measuring nothing: when simtrain models a machine better, old
measurements predict with the new models; several calibrations of the same
ranks and model are pooled (on a host whose speed drifts, calibrations
before and after the runs to predict fit the machine as those runs found it),
and their measured steps compared: the warning says when the machine's speed
moved between them by more than machine_load.py's MAX_DRIFT.

One process per rank (spawned, or torchrun's group; real/processes.py), all
measuring at once where training runs at once:

- **point to point**: for every pair of ranks, a ping-pong (blocking send and
  receive, the other ranks waiting at a barrier) over message sizes; half the
  median round trip is the one-way time, fitted to t(n) = α + n/β
  (real/fit.py). The pairs of ranks on one host are fitted together, and so
  are the pairs across hosts;
- **training steps** (real/step_timing.py): the step program a launched step
  runs (forward with its batch's draw, backward, simtrain's ring all-reduce,
  optimizer step), through launch's interpreter, on a replica of the
  scenario's model (`--model-of`) at half, one and two times its batch size
  and at 3/4 and 5/4 of its width, or of square Linear layers, with the
  all-reduce of a buffer of each size, the cases and sizes taking turns (so
  that the machine's changes of speed fall on all alike), every rank at once;
  each all-reduce follows compute, as in training, where gloo's threads have
  gone idle. Fitted (real/step_fit.py), each time as its mean over the
  iterations: fp32's rate R and a fixed cost a per pass, to t = a + FLOPs / R
  over the forward spans (the batch draw included, as a launched run's forward
  span holds it) and backwards, FLOPs counted as the simulator counts them
  (cost.py); the optimizer step's own fixed cost a_u and the memory bandwidth
  B, to t = a_u + bytes / B over the optimizer steps (bytes as
  train/precision.py update_bytes charges them); one exchange of the ring to
  the all-reduce's times as launch counts them (the rank that arrived last),
  and from it the exchange's software cost beyond the ping-pong's wire; the
  compute jitter under which ranks wait at the all-reduce as they did
  (`compute_jitter`, the part that grows with a span, and
  `compute_jitter_fixed_s`, the part that does not);
- **half precision**: forward and backward in bf16 and fp16 back to back on
  the same models and batches, the same fit (their rates go into device.yaml).

Written to the output folder: `device.yaml` (a device file: the achieved
rates as peak FLOP/s with efficiency 1, the fixed cost per pass, the memory
bandwidth, the host's memory shared among its ranks), `topology.yaml` (each
rank linked to its host's switch with latency (α + δ)/2 and bandwidth
1/(1/β + 1/γ), so a transfer between two ranks of a host takes what an
exchange of training's ring took; across hosts each rank also has a link to
one spine with the cross-host fit) and `calibration.json` (every measurement,
every fit with its residuals, `compute_jitter` and `compute_jitter_fixed_s` for
`cluster.compute_jitter` and `compute_jitter_fixed`, `measured_step_s` (one
step of each case as measured, nothing fitted: step_fit.py), `pooled` (each
pooled calibration's date and measured step, or null), and the machine's load:
a `warning` when it was loaded or, pooled, unsteady, machine_load.py), and
`host`: the cores the ranks ran on (`cores`, for `cluster.host_cores`: a run of
more ranks than cores shares them, hw/host_cores.py) and the ranks a host ran.
The fitted rates are one core's when every rank had a core to itself
(`rates_per_core`); calibrating more ranks than cores fits shared ones, and
says so in the warning.

    summary = calibrate(2, Path("calibration"))
"""
import copy
import json
import os
import socket
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import yaml

from ..comm.bench import benchmark_all_reduce
from ..cost import measure_step_cost
from ..errors import SimtrainError
from ..hw.topology_builders import load_topology_file
from ..loss import cross_entropy
from ..scenario import load_scenario
from ..train.precision import DTYPES
from .fit import fit_alpha_beta, fit_pass_costs
from .machine_load import drift_warning, host_cores, load_average, load_warning
from .processes import join, spawn, torchrun_world
from .step_fit import exchange_software_cost, fit_step_timings, measured_step_s, pooled_samples
from .step_timing import GEMM_SIZES, step_cases, time_steps

SIZES = tuple(4 ** k for k in range(1, 12))  # 4 B to 4 MiB
HALF_DTYPES = ("bf16", "fp16")  # timed back to back; fp32, training's, in its step loop


def calibrate(nproc: int | None, out: Path, backend: str = "gloo", model_of=None, sizes=SIZES,
              repeats: int = 20) -> dict | None:
    """Measure, fit and write out/; returns calibration.json's content on rank 0 (None on the others)."""
    if backend == "nccl" and not torch.cuda.is_available():
        raise SimtrainError("--backend: nccl needs CUDA devices, and torch sees none here; use gloo")
    if model_of is not None:
        load_scenario(model_of)  # a mistake is one line, before any process starts
    group = torchrun_world()
    world = group.world if group is not None else nproc
    if world is None:
        raise SimtrainError("--nproc: required outside torchrun")
    if world < 2:
        raise SimtrainError(f"--nproc: point-to-point needs at least 2 ranks, got {world}")
    model_of = None if model_of is None else str(model_of)
    args = (model_of, list(sizes), repeats, backend)
    if group is None:
        measured = spawn(_rank_main, world, args=args, backend=backend)[0]
    else:
        join(backend)
        try:
            measured = _rank_main(group.rank, group.world, *args)
            dist.barrier()
        finally:
            dist.destroy_process_group()
    if measured is None:  # a rank of torchrun's group other than 0
        return None
    ranks, hosts, pairs, load = measured
    return _fit_and_write(ranks, hosts, pairs, load, sizes=list(sizes), model_of=model_of, backend=backend,
                          out=Path(out), machine=_this_machine(hosts))


class Machine(NamedTuple):
    """What calibration.json records of the machine measured."""

    when: str  # when it was measured (UTC)
    memory: int  # bytes of RAM per rank: the host's over the ranks it ran
    cores: int  # CPU cores the ranks could run on (machine_load.host_cores)
    cpu_count: int


def _this_machine(hosts: list[str]) -> Machine:
    ranks_per_host = max(map(hosts.count, hosts))
    return Machine(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks_per_host, host_cores(),
                   os.cpu_count())


def refit(recorded: list[Path], out: Path) -> dict:
    """Fit again, with this version's models, what earlier calibrations measured (their calibration.json), and
    write out/ as `calibrate` does; nothing is measured. Several calibrations of the same ranks, hosts, model,
    sizes and cases are pooled: every step sample of each (their means are fitted), the half-precision points of
    each, and each size's one-way ping-pong time as the mean of theirs. The work of the fp32 step samples
    (FLOPs, kernels, the update's bytes) is counted again as this version counts it, on the model of the
    recorded `model_of` scenario, which must still be there (the cases it recorded: calibrations before 2026-12-03
    15:45 UTC timed no widened model); the half-precision points are kept as recorded."""
    summaries = [_recorded(path) for path in recorded]
    summary = summaries[0]
    for path, other in zip(recorded[1:], summaries[1:]):
        for key in ("ranks", "hosts", "backend", "model_of", "sizes_bytes", "cases"):
            if _measured(other, key) != _measured(summary, key):
                raise SimtrainError(f"--refit: {path} measured {key} {_measured(other, key)!r}, {recorded[0]} "
                                    f"{_measured(summary, key)!r}: only calibrations of the same ranks, hosts, "
                                    "model, sizes and cases pool")
    world, hosts, labels = summary["ranks"], summary["hosts"], _measured(summary, "cases")
    pairs = [(a, b) for a in range(world) for b in range(a + 1, world)]
    measured = []
    for rank in range(world):
        built = {case.label: case for case in step_cases(summary["model_of"], rank, world)}
        missing = [label for label in labels if label not in built]
        if missing:
            raise SimtrainError(f"--refit: {recorded[0]} measured the case {missing[0]!r}, which this version does "
                                f"not build (it builds {', '.join(built)})")
        cases = [built[label] for label in labels]  # the recorded cases, in their order
        for case in cases:  # the batch shape the counts are taken on, as a timed step draws it
            x, y = case.replica.loader.next_batch()
            case.replica.last_batch = (case.replica.precision.cast_input(x), y)
        measured.append({
            "pingpong": {f"{a}-{b}": _mean_one_way(summaries, f"{a}-{b}") if a == rank else None for a, b in pairs},
            "steps": {**pooled_samples([one["step_samples"][rank] for one in summaries]),
                      "cases": _case_records(cases)},
            "half_precision": {dtype: [point for one in summaries for point in one["compute"][dtype]["points"]]
                               if rank == 0 else [] for dtype in HALF_DTYPES}})
    dates = list(dict.fromkeys(one["date"] for one in summaries))
    machine = Machine(" and ".join(dates), summary["device"]["memory"], summary["host"]["cores"],
                      summary["load"]["cores"])
    pooled = [{"date": one["date"], "measured_step_s": measured_step_s(one["step_samples"])} for one in summaries]
    return _fit_and_write(measured, hosts, pairs, max(one["load"]["load_average_before"] for one in summaries),
                          summary["sizes_bytes"], summary["model_of"], summary["backend"], out, machine,
                          pooled if len(summaries) > 1 else None)


def _measured(summary: dict, key: str):
    """What a calibration measured: `key` of its calibration.json, or for "cases" its cases' labels."""
    if key == "cases":
        return [case["label"] for case in summary["step_samples"][0]["cases"]]
    return summary[key]


def _mean_one_way(summaries: list[dict], pair: str) -> list[float]:
    """Each size's one-way time between a pair of ranks: the mean over the calibrations pooled."""
    return [statistics.mean(times) for times in zip(*(one["pingpong"][pair]["one_way_s"] for one in summaries))]


_RECORDED_KEYS = ("date", "ranks", "backend", "hosts", "model_of", "sizes_bytes", "load", "host", "pingpong",
                  "compute", "device", "step_samples")


def _recorded(path: Path) -> dict:
    """An earlier calibration.json, checked for what refit reads (one line naming --refit if it lacks it)."""
    try:
        summary = json.loads(Path(path).read_text())
    except OSError as error:
        raise SimtrainError(f"--refit: cannot read {path}: {error.strerror}") from None
    except ValueError as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise SimtrainError(f"--refit: {path} is no JSON file: {error}") from None
    missing = [key for key in _RECORDED_KEYS if not isinstance(summary, dict) or key not in summary]
    if missing:
        raise SimtrainError(f"--refit: {path} is no calibration.json of simtrain calibrate (no {missing[0]!r})")
    if summary["model_of"] is not None and not Path(summary["model_of"]).is_file():
        raise SimtrainError(f"--refit: the scenario it calibrated the model of, {summary['model_of']}, is gone")
    return summary


def _case_records(cases) -> list[dict]:
    """What calibration.json records of each case's work, counted as the simulator counts it."""
    costs = [case.replica.step_cost() for case in cases]
    return [{"label": case.label, "forward_flops": cost.forward_flops, "forward_kernels": cost.forward_kernels,
             "backward_flops": cost.backward_flops, "backward_kernels": cost.backward_kernels,
             "update_bytes": case.update_bytes}
            for case, cost in zip(cases, costs)]


def _rank_main(rank: int, world: int, model_of, sizes: list[int], repeats: int, backend: str):
    """This rank's measurements; rank 0 returns (every rank's, their hosts, the pairs, the load average before
    measuring), the others None."""
    load = load_average()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(device)
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    pairs = [(a, b) for a in range(world) for b in range(a + 1, world)]
    pingpong = {f"{a}-{b}": _ping_pong(rank, a, b, sizes, repeats, device) for a, b in pairs}
    cases = step_cases(model_of, rank, world, device)
    steps = time_steps(rank, world, cases, sizes, repeats, device)
    steps["cases"] = _case_records(cases)
    half = _half_precision_rates(cases, repeats, device)
    measured = [None] * world if rank == 0 else None
    dist.gather_object({"pingpong": pingpong, "steps": steps, "half_precision": half}, measured, dst=0)
    return None if rank != 0 else (measured, hosts, pairs, load)


def _sync(device) -> None:
    if device != "cpu":
        torch.cuda.synchronize(device)


def _ping_pong(rank: int, a: int, b: int, sizes, repeats: int, device) -> list[float] | None:
    """Rank a's one-way seconds per size between ranks a and b: half the median round trip (None on other
    ranks). The median, not the mean: a round trip the scheduler held up (a busy host) is one outlier."""
    times = []
    for size in sizes:
        dist.barrier()
        if rank not in (a, b):
            continue
        buffer = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        peer = b if rank == a else a
        round_trips = []
        for round_ in range(repeats + 2):  # two warm-up round trips
            start = time.perf_counter()
            if rank == a:
                dist.send(buffer, peer)
                dist.recv(buffer, peer)
            else:
                dist.recv(buffer, peer)
                dist.send(buffer, peer)
            _sync(device)
            if round_ >= 2:
                round_trips.append(time.perf_counter() - start)
        times.append(statistics.median(round_trips) / 2)
    dist.barrier()
    return times if rank == a else None


def _timed(fn, repeats: int, device) -> float:
    """Mean seconds of fn() over `repeats` calls, after two (a span's mean, as the fp32 steps' fit takes)."""
    fn(), fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.mean(samples)


def _half_precision_rates(cases, repeats: int, device) -> dict:
    """{dtype: [{pass, flops, kernels, seconds}, ...]} for bf16 and fp16: forward and backward of a copy of each
    case's model in the dtype on one batch, back to back (training's own dtype is timed in its step loop)."""
    points = {}
    for dtype in HALF_DTYPES:
        points[dtype] = []
        for case in cases:
            model = copy.deepcopy(case.replica.model).to(device=device, dtype=DTYPES[dtype])
            x, y = case.replica.last_batch
            x = (x.to(DTYPES[dtype]) if x.is_floating_point() else x).to(device)
            cost = measure_step_cost(model, x, y)
            forward_s = _timed(lambda: cross_entropy(model(x), y), repeats, device)

            def forward_backward():
                cross_entropy(model(x), y).backward()
            backward_s = max(_timed(forward_backward, repeats, device) - forward_s, 1e-9)
            points[dtype].append({"pass": "forward", "batch": len(x), "flops": cost.forward_flops,
                                  "kernels": cost.forward_kernels, "seconds": forward_s})
            points[dtype].append({"pass": "backward", "batch": len(x), "flops": cost.backward_flops,
                                  "kernels": cost.backward_kernels, "seconds": backward_s})
    return points


def _fit_and_write(measured: list[dict], hosts: list[str], pairs, load: float, sizes, model_of, backend: str,
                   out: Path, machine: Machine, pooled: list[dict] | None = None) -> dict:
    """Fit the measurements of every rank, write device.yaml, topology.yaml and calibration.json; a fit the
    measurements do not allow is a one-line SimtrainError. `pooled`: each calibration's date and measured step
    when several are pooled (refit)."""
    try:
        return _fit_and_write_checked(measured, hosts, pairs, load, sizes, model_of, backend, out, machine, pooled)
    except ValueError as error:
        raise SimtrainError(f"--sizes: {error} (on this host now; measure larger sizes, more --repeats, or "
                            "on a quieter host)") from None


def _fit_and_write_checked(measured: list[dict], hosts: list[str], pairs, load: float, sizes, model_of,
                           backend: str, out: Path, machine: Machine, pooled: list[dict] | None) -> dict:
    world = len(measured)
    host_names = list(dict.fromkeys(hosts))
    one_way = {pair: measured[int(pair.split("-")[0])]["pingpong"][pair] for pair in measured[0]["pingpong"]}
    pair_fits = {pair: fit_alpha_beta(sizes, times) for pair, times in one_way.items()}
    classes = {}
    for kind, same_host in (("intra_host", True), ("inter_host", False)):
        chosen = [f"{a}-{b}" for a, b in pairs if (hosts[a] == hosts[b]) == same_host]
        if chosen:
            classes[kind] = fit_alpha_beta([s for _ in chosen for s in sizes],
                                           [t for pair in chosen for t in one_way[pair]])
    steps = fit_step_timings([rank["steps"] for rank in measured], world, sizes)
    compute = {"fp32": steps["compute"]}
    for dtype in HALF_DTYPES:
        points = [point for rank in measured for point in rank["half_precision"][dtype]]
        fit = fit_pass_costs([p["flops"] for p in points], [p["seconds"] for p in points])
        compute[dtype] = {"flops_per_s": fit.flops_per_s, "pass_overhead_s": fit.overhead_s,
                          "max_abs_residual": fit.max_residual, "points": points, "residuals": fit.residuals}
    ranks_per_host = max(hosts.count(host) for host in host_names)
    name = f"calibrated-{host_names[0]}" if len(host_names) == 1 else f"calibrated-{len(host_names)}-hosts"
    out.mkdir(parents=True, exist_ok=True)
    when = machine.when
    device = {"name": name,
              "peak_flops": {"fp32": compute["fp32"]["flops_per_s"], "tf32": compute["fp32"]["flops_per_s"],
                             "fp16": compute["fp16"]["flops_per_s"], "bf16": compute["bf16"]["flops_per_s"]},
              "memory": int(machine.memory), "memory_bandwidth": steps["optimizer"]["bandwidth_Bps"],
              "efficiency": 1.0,
              "pass_overhead": compute["fp32"]["pass_overhead_s"], "update_overhead": steps["optimizer"]["overhead_s"]}
    what = f"the model of {model_of}" if model_of else "square Linear layers of " + ", ".join(map(str, GEMM_SIZES))
    _write_yaml(out / "device.yaml", device, [
        f"Measured by simtrain calibrate, {when}, {world} ranks ({backend}) on {', '.join(host_names)}.",
        f"Training steps of {what} (real/step_timing.py), every rank at once, each part its mean: fp32's rate",
        "and pass_overhead fitted to t = pass_overhead + FLOPs / rate over the forwards (the batch draw included)",
        "and backwards; memory_bandwidth and update_overhead to t = update_overhead + bytes / memory_bandwidth",
        "over the optimizer steps. fp16, bf16: the first fit to forwards and backwards back to back; tf32 is",
        "fp32's (a CPU has no TF32), so efficiency is 1. memory: the host's RAM over its ranks."])
    software = exchange_software_cost(steps["all_reduce_fit"], classes)
    topology = _topology(name, hosts, host_names, classes, software)
    _write_yaml(out / "topology.yaml", topology, [
        f"Measured by simtrain calibrate, {when}: each link class's ping-pong α-β fit (t = α + n/β) plus the",
        "software cost of an exchange of simtrain's ring all-reduce, timed in training steps (δ per message,",
        "1/γ per byte); each rank's link to its host switch has latency (α + δ)/2 and bandwidth 1/(1/β + 1/γ)."])
    predicted = list(benchmark_all_reduce(load_topology_file(out / "topology.yaml"), "ring", list(sizes), False))
    all_reduce = []
    for row, prediction in zip(steps["all_reduce"], predicted):
        all_reduce.append({**row, "busbw_GBps": row["bytes"] / row["time_s"] * 2 * (world - 1) / world / 1e9,
                           "predicted_time_s": prediction.time_s,
                           "error": (prediction.time_s - row["time_s"]) / row["time_s"]})
    cores = machine.cores
    shared = (f"{ranks_per_host} ranks on {cores} cores: the fitted rates are shared, not one core's; "
              f"calibrate with --nproc {cores} to predict other rank counts with cluster.host_cores")
    warnings = [load_warning(load, steps["spreads"], machine.cpu_count), shared if ranks_per_host > cores else None,
                drift_warning([(one["date"], one["measured_step_s"]) for one in pooled]) if pooled else None]
    warning = "; ".join(filter(None, warnings)) or None
    summary = {
        "date": when, "ranks": world, "backend": backend, "hosts": hosts, "model_of": model_of,
        "sizes_bytes": list(sizes),
        "load": {"load_average_before": load, "cores": machine.cpu_count, "spreads": steps["spreads"],
                 "warning": warning},
        "host": {"cores": cores, "ranks": ranks_per_host, "rates_per_core": ranks_per_host <= cores},
        "measured_step_s": measured_step_s([rank["steps"] for rank in measured]),
        "pooled": pooled,
        "pingpong": {pair: {"one_way_s": one_way[pair], "latency_s": fit.latency_s,
                            "bandwidth_Bps": fit.bandwidth_Bps, "bandwidth_resolved": fit.bandwidth_resolved,
                            "residuals": fit.residuals}
                     for pair, fit in pair_fits.items()},
        "link_classes": {kind: {"latency_s": fit.latency_s, "bandwidth_Bps": fit.bandwidth_Bps,
                                "bandwidth_resolved": fit.bandwidth_resolved, "max_abs_residual": fit.max_residual}
                         for kind, fit in classes.items()},
        "all_reduce_exchange": {**_alpha_beta_json(steps["all_reduce_fit"]), **software},
        "all_reduce": all_reduce,
        "compute": compute,
        "optimizer": steps["optimizer"],
        "idle_s": steps["idle_s"],
        "compute_jitter": steps["compute_jitter"],
        "compute_jitter_fixed_s": steps["compute_jitter_fixed_s"],
        "idle_residuals": steps["idle_residuals"],
        "device": device,
        "step_samples": [rank["steps"] for rank in measured],  # every rank's seconds (real/step_timing.py)
    }
    (out / "calibration.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _alpha_beta_json(fit) -> dict:
    return {"latency_s": fit.latency_s, "bandwidth_Bps": fit.bandwidth_Bps,
            "bandwidth_resolved": fit.bandwidth_resolved, "residuals": fit.residuals,
            "max_abs_residual": fit.max_residual}


def _topology(name: str, hosts: list[str], host_names: list[str], classes: dict, software: dict) -> dict:
    """A switch per host (and a spine across hosts) whose links give each class's ping-pong α and β plus the
    ring exchange's software cost."""
    switches = [f"host{k}-switch" for k in range(len(host_names))] + (["spine"] if len(host_names) > 1 else [])

    def link(rank: int, switch: str, fit, latency_s: float) -> dict:
        return {"between": [f"rank{rank}", switch],
                "bandwidth": f"{1 / (1 / fit.bandwidth_Bps + software['software_s_per_byte'])!r} B/s",  # the unit
                # written: a loaded host's link can measure under 1 MB/s, which a bare number may not be (units.py)
                "latency": (latency_s + software["software_latency_s"]) / 2}
    links = []
    intra = classes.get("intra_host")
    if intra is not None:
        links += [link(rank, f"host{host_names.index(host)}-switch", intra, intra.latency_s)
                  for rank, host in enumerate(hosts)]
    inter = classes.get("inter_host")
    if inter is not None:
        links += [link(rank, "spine", inter, max(inter.latency_s, intra.latency_s if intra else 0.0))
                  for rank in range(len(hosts))]
    used = {node for link in links for node in link["between"]}
    return {"name": name, "gpus": [f"rank{rank}" for rank in range(len(hosts))],
            "switches": [switch for switch in switches if switch in used], "links": links}


def _write_yaml(path: Path, data: dict, comments: list[str]) -> None:
    text = "".join(f"# {line}\n" for line in comments) + yaml.safe_dump(data, sort_keys=False)
    path.write_text(text)
