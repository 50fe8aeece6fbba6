"""Fits the parts of training steps timed on every rank (real/step_timing.py): what calibrate writes from them.

Pure functions over recorded timings. `fit_step_timings(ranks, world, sizes)`
takes, per rank, the samples `time_steps` returned with the work of each case
counted as the simulator counts it (`cases`: FLOPs of the forward and
backward, bytes of the optimizer step), and gives:

- `compute`: the fixed cost a per pass (`pass_overhead_s`) and the rate R
  (fit.py fit_pass_costs) of each (rank, case)'s mean forward span, drawing
  the batch included (a launched run's forward span holds both:
  real/interpreter.py), and mean backward: t = a + FLOPs / R, with its
  residuals. Earlier calibrations timed the draw apart (a `draw` sample,
  2026-12-03 and before): it is added back to the forward;
- `optimizer`: the fixed cost a_u per optimizer step (`overhead_s`) and the
  memory bandwidth B (fit.py fit_update_costs) of each (rank, case)'s mean
  optimizer step: t = a_u + bytes / B, with its residuals
  (`bandwidth_resolved` false where the steps did not grow with their bytes,
  within their noise: B is then a lower bound). Calibrations of one model's
  update alone (before 2026-12-03 15:45 UTC, or a user's model, which
  calibration cannot widen) give a_u the passes' a;
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

`measured_step_s(ranks)` fits nothing: one step of every case as the ranks
measured it, so that calibrations of the same cases at other times tell how
the machine's speed moved between them (machine_load.py `drift_warning`).

Every time is fitted as its mean over the iterations, not its median: the
simulator charges a span's mean (its compute noise keeps the mean,
hw/device.py), and a launched run's step is the mean of its steps. On a busy
host the times are skewed to the right: the mean of a forward, backward or
all-reduce was up to 38% above its median in sixteen calibrations on 2 cores
(docs/validation/fidelity.md), so fitting medians predicted every part low.

The fixed cost is a pass's, not a kernel's: calibration varies the batch and
the width, not the depth, so a cost per kernel would be told from a cost per
pass only by the forward (13 kernels here) against the backward (36), and the
two passes' fixed costs were alike (about 0.5 ms each) although their kernels
are not; fitted per kernel, it left the rate a third low, and models with other
kernel counts wrong both ways (docs/validation/fidelity.md). An optimizer
step's fixed cost is not a pass's either: given the passes' a, the bandwidth of
one model's update predicted the update of a model twice as wide 10-32% short
in ten steady runs; calibration times the model at three widths
(real/step_timing.py) so that the update's own fixed cost and bandwidth are
fitted apart.

`exchange_software_cost(exchange, classes)` splits one exchange of the ring
into the wire, as a ping-pong sees it (the slowest link class's α-β), and what
training's exchange costs beyond it (δ per message, 1/γ per byte; each at least
0: a measured ring cheaper than the wire is noise), so that a topology whose
links are α + δ and 1/(1/β + 1/γ) gives the ring its measured time.

    fits = fit_step_timings(recorded["ranks"], world=2, sizes=recorded["sizes_bytes"])
    fits["all_reduce_fit"].latency_s, fits["compute"]["flops_per_s"]
"""
import statistics

from .fit import AlphaBeta, fit_compute_jitter, fit_pass_costs, fit_ring_all_reduce, fit_update_costs, modelled_wait
from .machine_load import relative_spread


def fit_step_timings(ranks: list[dict], world: int, sizes: list[int]) -> dict:
    """The fits of every rank's step samples (see the module's docstring); ValueError where the samples
    allow none."""
    cases = ranks[0]["cases"]
    ranks = [kept_samples(rank) for rank in ranks]
    flops, seconds = [], []
    for rank in ranks:
        for c, case in enumerate(cases):
            flops += [case["forward_flops"], case["backward_flops"]]
            seconds += [statistics.mean(rank["forward"][c]), statistics.mean(rank["backward"][c])]
    fit = fit_pass_costs(flops, seconds)
    compute = {"flops_per_s": fit.flops_per_s, "pass_overhead_s": fit.overhead_s,
               "max_abs_residual": fit.max_residual, "residuals": fit.residuals,
               "points": [{"pass": ("forward", "backward")[k % 2], "flops": f, "seconds": t}
                          for k, (f, t) in enumerate(zip(flops, seconds))]}
    update_bytes = [case["update_bytes"] for _ in ranks for case in cases]
    update_seconds = [statistics.mean(rank["optimizer"][c]) for rank in ranks for c in range(len(cases))]
    update = fit_update_costs(update_bytes, update_seconds, fit.overhead_s)
    optimizer = {"overhead_s": update.latency_s, "bandwidth_Bps": update.bandwidth_Bps,
                 "bandwidth_resolved": update.bandwidth_resolved, "seconds": update_seconds, "bytes": update_bytes,
                 "residuals": update.residuals, "max_abs_residual": update.max_residual}
    all_reduces = [rank["all_reduce"] for rank in ranks]  # [rank][size][case][round]
    all_reduce = []
    for size_index, size in enumerate(sizes):
        last_arrival = [min(times) for c in range(len(cases))
                        for times in zip(*(rank[size_index][c] for rank in all_reduces))]
        all_reduce.append({"bytes": max(world, size // 4) * 4, "time_s": statistics.mean(last_arrival)})
    exchange = fit_ring_all_reduce(world, [row["bytes"] for row in all_reduce], [row["time_s"] for row in all_reduce])
    idle = [statistics.mean(statistics.mean(times) - min(times) for s in range(len(sizes))
                            for times in zip(*(rank[s][c] for rank in all_reduces)))
            for c in range(len(cases))]
    forward = [statistics.mean([t for rank in ranks for t in rank["forward"][c]]) for c in range(len(cases))]
    backward = [statistics.mean([t for rank in ranks for t in rank["backward"][c]]) for c in range(len(cases))]
    jitter = fit_compute_jitter(idle, forward, backward, world)
    spreads = {f"{label} ({case['label']})": max(relative_spread(rank[part][c]) for rank in ranks)
               for c, case in enumerate(cases) for part, label in (("forward", "forward"), ("backward", "backward"))}
    spreads.update({f"all-reduce of {size} B": max(relative_spread([t for times in rank[s] for t in times])
                                                   for rank in all_reduces)
                    for s, size in enumerate(sizes)})
    return {"compute": compute, "optimizer": optimizer, "all_reduce": all_reduce, "all_reduce_fit": exchange,
            "idle_s": dict(zip((case["label"] for case in cases), idle)),
            "compute_jitter": jitter.sigma, "compute_jitter_fixed_s": jitter.fixed_s,
            "idle_residuals": _idle_residuals(idle, modelled_wait(jitter, forward, backward, world)),
            "spreads": spreads}


def kept_samples(rank: dict) -> dict:
    """A rank's recorded step samples as `time_steps` keeps them now: {"forward" (the batch's draw inside) |
    "backward" | "optimizer": [[seconds] per case], "all_reduce": [[[seconds] per case] per size], "cases"}.
    Older records are read too: calibrations until the morning of 2026-12-03 timed the draw apart (added back to
    the forward here), and until 12:00 UTC kept each size's all-reduces as one list, every case's iterations
    together in turn (split here)."""
    cases = len(rank["cases"])
    forward = rank["forward"]
    if "draw" in rank:
        forward = [[d + f for d, f in zip(rank["draw"][c], forward[c])] for c in range(cases)]
    all_reduce = rank["all_reduce"]
    if all_reduce and not isinstance(all_reduce[0][0], list):
        all_reduce = [[times[c * len(times) // cases:(c + 1) * len(times) // cases] for c in range(cases)]
                      for times in all_reduce]
    return {"forward": forward, "backward": rank["backward"], "optimizer": rank["optimizer"],
            "all_reduce": all_reduce, "cases": rank["cases"]}


def measured_step_s(ranks: list[dict]) -> float:
    """One step of each case as measured, the cases' summed: its mean forward (the draw inside), backward and
    update, and its all-reduce's mean over the sizes, averaged over the ranks. No model is fitted to it, so
    calibrations of the same cases compare by it: the machine's speed as each found it."""
    per_rank = []
    for kept in map(kept_samples, ranks):
        per_rank.append(sum(sum(statistics.mean(kept[part][c]) for part in ("forward", "backward", "optimizer"))
                            + statistics.mean(statistics.mean(by_case[c]) for by_case in kept["all_reduce"])
                            for c in range(len(kept["cases"]))))
    return statistics.mean(per_rank)


def pooled_samples(records: list[dict]) -> dict:
    """One rank's step samples of several calibrations of the same cases (`kept_samples` of each), each list the
    calibrations' one after the other (their cases not included)."""
    kept = [kept_samples(record) for record in records]
    pooled = {part: [sum((one[part][c] for one in kept), []) for c in range(len(kept[0][part]))]
              for part in ("forward", "backward", "optimizer")}
    pooled["all_reduce"] = [[sum((one["all_reduce"][s][c] for one in kept), []) for c in range(len(by_case))]
                            for s, by_case in enumerate(kept[0]["all_reduce"])]
    return pooled


def _idle_residuals(idle_s, modelled_s) -> list[float]:
    """(measured - modelled) / measured waiting per case."""
    return [float((i - m) / i) if i > 0 else 0.0 for i, m in zip(idle_s, modelled_s)]


def exchange_software_cost(exchange: AlphaBeta, classes: dict[str, AlphaBeta]) -> dict:
    """What one exchange of training's ring costs beyond the wire of its slowest link class (largest α):
    {"wire": that class, "software_latency_s": δ, "software_s_per_byte": 1/γ}, each at least 0."""
    wire = max(classes, key=lambda kind: classes[kind].latency_s)
    return {"wire": wire, "software_latency_s": max(0.0, exchange.latency_s - classes[wire].latency_s),
            "software_s_per_byte": max(0.0, 1 / exchange.bandwidth_Bps - 1 / classes[wire].bandwidth_Bps)}
