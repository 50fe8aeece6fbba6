"""`simtrain calibrate`: measure the machine a group of processes runs on, and write what `simtrain run` takes.

    simtrain calibrate --nproc 2 --out calibration/ [--model-of scenario.yaml]
    simtrain run scenario.yaml --set cluster.device=calibration/device.yaml \\
                               --set cluster.topology=calibration/topology.yaml

One process per rank (spawned, or torchrun's group; real/processes.py), all
measuring at once where training runs at once:

- **point to point**: for every pair of ranks, a ping-pong (blocking send and
  receive, the other ranks waiting at a barrier) over message sizes; half the
  median round trip is the one-way time, fitted to t(n) = α + n/β
  (real/fit.py). The pairs of ranks on one host are fitted together, and so
  are the pairs across hosts;
- **all-reduce**: simtrain's ring program (what `simtrain launch` runs) over
  sizes, every rank at once, the median of `repeats` (the slowest rank's);
  busbw = size / time x 2(N-1)/N as nccl-tests reports it, next to what the
  fitted topology predicts for it;
- **compute**: forward and backward times per dtype (fp32, bf16, fp16; tf32
  is fp32 on a CPU) of the scenario's model on batches of half, one and two
  times its batch size (`--model-of`), or of square Linear layers, every rank
  at once, fitted to t = c x kernels + FLOPs / R (real/fit.py; FLOPs and
  kernels counted as the simulator counts them, cost.py): each dtype's rate
  R, and the overhead per kernel c (fp32's goes into device.yaml);
- **memory bandwidth**: the scenario's optimizer step (the bytes the simulator
  charges for it, train/precision.py update_bytes, over its time less the
  fitted overhead of each operator it dispatches), or a copy of a large buffer.

Written to the output folder: `device.yaml` (a device file: the achieved
rates as peak FLOP/s with efficiency 1, the memory bandwidth, the host's
memory shared among its ranks), `topology.yaml` (each rank linked to its
host's switch with latency α/2 and bandwidth β, so a transfer between two
ranks of a host takes α + n/β; across hosts each rank also has a link to one
spine with the cross-host fit) and `calibration.json` (every measurement,
the fits and their residuals).

    summary = calibrate(2, Path("calibration"))
"""
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from ..comm import ALL_REDUCE
from ..comm.bench import benchmark_all_reduce
from ..comm.gloo import run_program
from ..cost import measure_step_cost
from ..op_cost import OperatorRecorder
from ..errors import SimtrainError
from ..hw.topology_builders import load_topology_file
from ..loss import cross_entropy
from ..scenario import load_scenario
from ..train.data import ShardLoader, load_dataset
from ..train.models import build_model
from ..train.optim import build_optimizer
from ..train.precision import DTYPES, update_bytes
from .fit import fit_alpha_beta, fit_overhead_rate
from .processes import join, spawn, torchrun_world

SIZES = tuple(4 ** k for k in range(1, 12))  # 4 B to 4 MiB
GEMM_SIZES = (128, 256, 512)
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")


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
    return _fit_and_write(*measured, sizes=list(sizes), model_of=model_of, backend=backend, out=Path(out))


def _rank_main(rank: int, world: int, model_of, sizes: list[int], repeats: int, backend: str):
    """This rank's measurements; rank 0 returns (every rank's, their hosts, the pairs), the others None."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(device)
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    pairs = [(a, b) for a in range(world) for b in range(a + 1, world)]
    pingpong = {f"{a}-{b}": _ping_pong(rank, a, b, sizes, repeats, device) for a, b in pairs}
    all_reduce = _all_reduce_times(rank, world, sizes, repeats, device)
    compute = _compute_rates(model_of, repeats, device)
    bandwidth = _memory_bandwidth(model_of, repeats, device)
    measured = [None] * world if rank == 0 else None
    dist.gather_object({"pingpong": pingpong, "all_reduce": all_reduce, "compute": compute,
                        "memory_bandwidth": bandwidth}, measured, dst=0)
    return None if rank != 0 else (measured, hosts, pairs)


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


def _all_reduce_times(rank: int, world: int, sizes, repeats: int, device) -> list[float]:
    """This rank's median seconds per ring all-reduce (simtrain's program over point-to-point calls), per size."""
    times = []
    for size in sizes:
        buffer = torch.ones(max(world, size // 4), dtype=torch.float32, device=device)
        dist.barrier()
        times.append(_timed(lambda: run_program(ALL_REDUCE["ring"](rank, world, buffer)), repeats, device))
    return times


def _timed(fn, repeats: int, device) -> float:
    """Median seconds of fn() over `repeats` calls, after two."""
    fn(), fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _compute_rates(model_of, repeats: int, device) -> dict:
    """{dtype: [{pass, flops, kernels, seconds}, ...]}: forward and backward of the model on batches of half,
    one and two times its batch size, or of square Linear layers."""
    if model_of is not None:
        scenario = load_scenario(model_of)
        data = load_dataset(scenario.data.name, scenario.data.loader_options(), scenario.seed)
        batch = scenario.data.batch_size
        cases = []
        for size in sorted({max(1, batch // 2), batch, 2 * batch}):
            x, y = ShardLoader(data.train, 1, 0, size, scenario.seed).next_batch()
            cases.append((build_model(scenario.model, data.info, scenario.seed), x, y))
    else:
        cases = []
        for n in GEMM_SIZES:
            torch.manual_seed(n)
            cases.append((torch.nn.Sequential(torch.nn.Linear(n, n)), torch.randn(n, n), torch.randint(0, n, (n,))))
    points = {}
    for dtype in COMPUTE_DTYPES:
        points[dtype] = []
        for model, x, y in cases:
            model = model.to(device=device, dtype=DTYPES[dtype])
            x = (x.to(DTYPES[dtype]) if x.is_floating_point() else x).to(device)
            x.requires_grad_(model_of is None)  # a lone Linear: the input's gradient too, as inside a model
            y = y.to(device)
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


def _memory_bandwidth(model_of, repeats: int, device) -> dict:
    """Bytes, operators and seconds of the scenario's optimizer step (bytes as the simulator counts them), or
    of a copy of a large buffer."""
    if model_of is None:
        source = torch.ones(1 << 23, device=device)  # 32 MiB
        target = torch.empty_like(source)
        return {"what": "copy of 32 MiB", "bytes": 2 * source.nbytes, "kernels": 1,
                "seconds": _timed(lambda: target.copy_(source), repeats, device)}
    scenario = load_scenario(model_of)
    data = load_dataset(scenario.data.name, scenario.data.loader_options(), scenario.seed)
    model = build_model(scenario.model, data.info, scenario.seed).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = build_optimizer(params, scenario.train.optimizer)
    seconds = _timed(optimizer.step, repeats, device)
    with OperatorRecorder() as recorder:
        optimizer.step()
    return {"what": f"{scenario.train.optimizer.name} step of {model_of}'s model", "seconds": seconds,
            "bytes": update_bytes(params, "fp32", scenario.train.optimizer), "kernels": recorder.kernels}


def _fit_and_write(measured: list[dict], hosts: list[str], pairs, sizes, model_of, backend: str, out: Path) -> dict:
    """Fit the measurements of every rank, write device.yaml, topology.yaml and calibration.json; a fit the
    measurements do not allow is a one-line SimtrainError."""
    try:
        return _fit_and_write_checked(measured, hosts, pairs, sizes, model_of, backend, out)
    except ValueError as error:
        raise SimtrainError(f"--sizes: {error} (on this host now; measure larger sizes, more --repeats, or "
                            "on a quieter host)") from None


def _fit_and_write_checked(measured: list[dict], hosts: list[str], pairs, sizes, model_of, backend: str,
                           out: Path) -> dict:
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
    compute = {}
    for dtype in COMPUTE_DTYPES:
        pooled = [point for rank in measured for point in rank["compute"][dtype]]
        fit = fit_overhead_rate([p["kernels"] for p in pooled], [p["flops"] for p in pooled],
                                [p["seconds"] for p in pooled])
        compute[dtype] = {"flops_per_s": fit.flops_per_s, "kernel_overhead_s": fit.overhead_s,
                          "max_abs_residual": fit.max_residual, "points": pooled, "residuals": fit.residuals}
    overhead = compute["fp32"]["kernel_overhead_s"]  # the step's fixed cost per operator, the rest is bytes
    bandwidth = statistics.mean(
        work["bytes"] / (work["seconds"] - overhead * work["kernels"] if work["seconds"] > overhead * work["kernels"]
                         else work["seconds"]) for work in (rank["memory_bandwidth"] for rank in measured))
    ranks_per_host = max(hosts.count(host) for host in host_names)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks_per_host
    name = f"calibrated-{host_names[0]}" if len(host_names) == 1 else f"calibrated-{len(host_names)}-hosts"
    out.mkdir(parents=True, exist_ok=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    device = {"name": name,
              "peak_flops": {"fp32": compute["fp32"]["flops_per_s"], "tf32": compute["fp32"]["flops_per_s"],
                             "fp16": compute["fp16"]["flops_per_s"], "bf16": compute["bf16"]["flops_per_s"]},
              "memory": int(memory), "memory_bandwidth": bandwidth, "efficiency": 1.0,
              "kernel_overhead": compute["fp32"]["kernel_overhead_s"]}
    what = f"the model of {model_of}" if model_of else f"square Linear layers of {', '.join(map(str, GEMM_SIZES))}"
    _write_yaml(out / "device.yaml", device, [
        f"Measured by simtrain calibrate, {when}, {world} ranks ({backend}) on {', '.join(host_names)}.",
        "t = overhead x kernels + FLOPs / rate fitted to forwards and backwards per dtype, every rank at once,",
        f"of {what}: peak_flops the rates (tf32: fp32's; a CPU has no TF32), so efficiency is 1;",
        "kernel_overhead fp32's overhead.",
        "memory: the host's RAM over its ranks.",
        f"memory_bandwidth: {measured[0]['memory_bandwidth']['what']}: bytes over its time less kernel_overhead"
        " per operator."])
    topology = _topology(name, hosts, host_names, classes)
    _write_yaml(out / "topology.yaml", topology, [
        f"Measured by simtrain calibrate, {when}: ping-pong between every pair of ranks, α-β fit",
        "(t = α + n/β); each rank's link to its host switch has latency α/2, bandwidth β."])
    predicted = list(benchmark_all_reduce(load_topology_file(out / "topology.yaml"), "ring", list(sizes), False))
    all_reduce = []
    for index, size in enumerate(sizes):
        seconds = max(rank["all_reduce"][index] for rank in measured)
        nbytes = max(world, size // 4) * 4
        busbw = nbytes / seconds * 2 * (world - 1) / world / 1e9
        all_reduce.append({"bytes": nbytes, "time_s": seconds, "busbw_GBps": busbw,
                           "predicted_time_s": predicted[index].time_s,
                           "error": (predicted[index].time_s - seconds) / seconds})
    summary = {
        "date": when, "ranks": world, "backend": backend, "hosts": hosts, "model_of": model_of,
        "sizes_bytes": list(sizes),
        "pingpong": {pair: {"one_way_s": one_way[pair], "latency_s": fit.latency_s,
                            "bandwidth_Bps": fit.bandwidth_Bps, "bandwidth_resolved": fit.bandwidth_resolved,
                            "residuals": fit.residuals}
                     for pair, fit in pair_fits.items()},
        "link_classes": {kind: {"latency_s": fit.latency_s, "bandwidth_Bps": fit.bandwidth_Bps,
                                "bandwidth_resolved": fit.bandwidth_resolved, "max_abs_residual": fit.max_residual}
                         for kind, fit in classes.items()},
        "all_reduce": all_reduce,
        "compute": compute,
        "memory_bandwidth_Bps": bandwidth,
        "memory_bandwidth_what": measured[0]["memory_bandwidth"]["what"],
        "device": device,
    }
    (out / "calibration.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _topology(name: str, hosts: list[str], host_names: list[str], classes: dict) -> dict:
    """A switch per host (and a spine across hosts) whose links reproduce the fitted α and β."""
    switches = [f"host{k}-switch" for k in range(len(host_names))] + (["spine"] if len(host_names) > 1 else [])
    links = []
    intra = classes.get("intra_host")
    for rank, host in enumerate(hosts):
        if intra is not None:
            links.append({"between": [f"rank{rank}", f"host{host_names.index(host)}-switch"],
                          "bandwidth": intra.bandwidth_Bps, "latency": intra.latency_s / 2})
    for rank in range(len(hosts)):
        if "inter_host" in classes:
            inter = classes["inter_host"]
            links.append({"between": [f"rank{rank}", "spine"], "bandwidth": inter.bandwidth_Bps,
                          "latency": max(inter.latency_s, intra.latency_s if intra else 0.0) / 2})
    used = {node for link in links for node in link["between"]}
    return {"name": name, "gpus": [f"rank{rank}" for rank in range(len(hosts))],
            "switches": [switch for switch in switches if switch in used], "links": links}


def _write_yaml(path: Path, data: dict, comments: list[str]) -> None:
    text = "".join(f"# {line}\n" for line in comments) + yaml.safe_dump(data, sort_keys=False)
    path.write_text(text)
