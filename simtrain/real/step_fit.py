"""Fits the parts of training steps timed on every rank (real/step_timing.py): what calibrate writes from them.

Pure functions over recorded timings. `fit_step_timings(ranks, world, sizes)`
takes, per rank, the samples `time_steps` returned with the work of each case
counted as the simulator counts it (`cases`: FLOPs and kernels of the forward
and backward, bytes and operators of the optimizer step), and gives:

- `compute`: t = c x kernels + FLOPs / R (fit.py fit_overhead_rate) over each
  (rank, case)'s mean forward span, drawing the batch included (a launched
  run's forward span holds both: real/interpreter.py), and mean backward.
  Earlier calibrations timed the draw apart (a `draw` sample, 2026-12-03 and
  before): it is added back to the forward;
- `optimizer`: the bandwidth B that fits t = c x operators + bytes / B to each
  (rank, case)'s mean optimizer step, c the compute fit's (least squares of
  relative errors), with its residuals;
- `all_reduce`: per size, what a launched run counts as communication: in each
  iteration the least time a rank spent in the all-reduce (the rank that
  arrived last; what the others spent beyond it was waiting for it, idle), then
  the mean over iterations; `all_reduce_fit`, α and β of one exchange of the
  ring (fit.py fit_ring_all_reduce);
- `compute_jitter` and `compute_jitter_fixed_s`: the σ and s of the
  simulator's lognormal compute noise under which ranks wait for each other
  at the all-reduce as long as they did here (fit.py fit_compute_jitter): per
  case, the mean over iterations of what each rank spent in the all-reduce
  beyond the rank that arrived last, against the mean forward span and
  backward, with its residuals per case (`idle_residuals`);
- `spreads`: (third - first quartile) / median of each repeated timing, for
  machine_load.py's check.

Every time is fitted as its mean over the iterations, not its median: the
simulator charges a span's mean (its compute noise keeps the mean,
hw/device.py), and a launched run's step is the mean of its steps. On a busy
host the times are skewed to the right: the mean of a forward, backward or
all-reduce was 1-38% above its median in sixteen calibrations on 2 cores
(docs/validation/fidelity.md), so fitting medians predicted every part low.

`exchange_software_cost(exchange, classes)` splits one exchange of the ring
into the wire, as a ping-pong sees it (the slowest link class's α-β), and what
training's exchange costs beyond it (δ per message, 1/γ per byte; each at least
0: a measured ring cheaper than the wire is noise), so that a topology whose
links are α + δ and 1/(1/β + 1/γ) gives the ring its measured time.

    fits = fit_step_timings(recorded["ranks"], world=2, sizes=recorded["sizes_bytes"])
    fits["all_reduce_fit"].latency_s, fits["compute"]["flops_per_s"]
"""
import statistics

import numpy as np

from .fit import AlphaBeta, fit_compute_jitter, fit_overhead_rate, fit_ring_all_reduce, modelled_wait
from .machine_load import relative_spread


def fit_step_timings(ranks: list[dict], world: int, sizes: list[int]) -> dict:
    """The fits of every rank's step samples (see the module's docstring); ValueError where the samples
    allow none."""
    cases = ranks[0]["cases"]
    forward_spans = [_forward_spans(rank, len(cases)) for rank in ranks]
    kernels, flops, seconds = [], [], []
    for rank_index, rank in enumerate(ranks):
        for c, case in enumerate(cases):
            kernels += [case["forward_kernels"], case["backward_kernels"]]
            flops += [case["forward_flops"], case["backward_flops"]]
            seconds += [statistics.mean(forward_spans[rank_index][c]), statistics.mean(rank["backward"][c])]
    compute_fit = fit_overhead_rate(kernels, flops, seconds)
    compute = {"flops_per_s": compute_fit.flops_per_s, "kernel_overhead_s": compute_fit.overhead_s,
               "max_abs_residual": compute_fit.max_residual, "residuals": compute_fit.residuals,
               "points": [{"pass": ("forward", "backward")[k % 2], "kernels": n, "flops": f, "seconds": t}
                          for k, (n, f, t) in enumerate(zip(kernels, flops, seconds))]}
    optimizer = _fit_optimizer(ranks, cases, compute_fit.overhead_s)
    all_reduce = []
    for size_index, size in enumerate(sizes):
        last_arrival = [min(times) for times in zip(*(rank["all_reduce"][size_index] for rank in ranks))]
        all_reduce.append({"bytes": max(world, size // 4) * 4, "time_s": statistics.mean(last_arrival)})
    exchange = fit_ring_all_reduce(world, [row["bytes"] for row in all_reduce], [row["time_s"] for row in all_reduce])
    repeats = len(ranks[0]["all_reduce"][0]) // len(cases)  # each size's samples: every case's iterations in turn
    idle = [statistics.mean(statistics.mean(times) - min(times) for s in range(len(sizes))
                            for times in zip(*(rank["all_reduce"][s][c * repeats:(c + 1) * repeats] for rank in ranks)))
            for c in range(len(cases))]
    forward = [statistics.mean([t for spans in forward_spans for t in spans[c]]) for c in range(len(cases))]
    backward = [statistics.mean([t for rank in ranks for t in rank["backward"][c]]) for c in range(len(cases))]
    jitter = fit_compute_jitter(idle, forward, backward, world)
    spreads = {f"{label} ({case['label']})": max(relative_spread(rank[part][c]) for rank in ranks)
               for c, case in enumerate(cases) for part, label in (("forward", "forward"), ("backward", "backward"))}
    spreads.update({f"all-reduce of {size} B": max(relative_spread(rank["all_reduce"][s]) for rank in ranks)
                    for s, size in enumerate(sizes)})
    return {"compute": compute, "optimizer": optimizer, "all_reduce": all_reduce, "all_reduce_fit": exchange,
            "idle_s": dict(zip((case["label"] for case in cases), idle)),
            "compute_jitter": jitter.sigma, "compute_jitter_fixed_s": jitter.fixed_s,
            "idle_residuals": _idle_residuals(idle, modelled_wait(jitter, forward, backward, world)),
            "spreads": spreads}


def _forward_spans(rank: dict, cases: int) -> list[list[float]]:
    """A rank's forward spans per case, the batch's draw inside (added back where it was timed apart)."""
    if "draw" not in rank:
        return rank["forward"]
    return [[d + f for d, f in zip(rank["draw"][c], rank["forward"][c])] for c in range(cases)]


def _idle_residuals(idle_s, modelled_s) -> list[float]:
    """(measured - modelled) / measured waiting per case."""
    return [float((i - m) / i) if i > 0 else 0.0 for i, m in zip(idle_s, modelled_s)]


def _fit_optimizer(ranks: list[dict], cases: list[dict], overhead_s: float) -> dict:
    """The bandwidth that fits t = overhead x operators + bytes / bandwidth to the mean optimizer steps."""
    nbytes = np.array([case["update_bytes"] for _ in ranks for case in cases], dtype=np.float64)
    kernels = np.array([case["update_kernels"] for _ in ranks for case in cases], dtype=np.float64)
    t = np.array([statistics.mean(rank["optimizer"][c]) for rank in ranks for c in range(len(cases))])
    weights = 1.0 / t
    inverse_bandwidth = float(np.sum(nbytes * (t - overhead_s * kernels) * weights**2)
                              / np.sum((nbytes * weights) ** 2))
    if inverse_bandwidth <= 0:
        raise ValueError("the optimizer steps took less than the fixed cost of their operators")
    fitted = overhead_s * kernels + nbytes * inverse_bandwidth
    residuals = [float(r) for r in (t - fitted) / t]
    return {"bandwidth_Bps": 1.0 / inverse_bandwidth, "seconds": t.tolist(), "bytes": nbytes.tolist(),
            "kernels": kernels.tolist(), "residuals": residuals, "max_abs_residual": max(map(abs, residuals))}


def exchange_software_cost(exchange: AlphaBeta, classes: dict[str, AlphaBeta]) -> dict:
    """What one exchange of training's ring costs beyond the wire of its slowest link class (largest α):
    {"wire": that class, "software_latency_s": δ, "software_s_per_byte": 1/γ}, each at least 0."""
    wire = max(classes, key=lambda kind: classes[kind].latency_s)
    return {"wire": wire, "software_latency_s": max(0.0, exchange.latency_s - classes[wire].latency_s),
            "software_s_per_byte": max(0.0, 1 / exchange.bandwidth_Bps - 1 / classes[wire].bandwidth_Bps)}
