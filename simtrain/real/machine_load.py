"""Whether a host-clock measurement can be trusted: the machine's load and the spread of repeated timings.

A measured time is the program's own only when nothing else wants the cores:
when more threads are runnable than there are cores, a rank that blocks (on a
peer, on gloo's threads) loses its core for a scheduling slice, and its timings
grow and scatter. Two signs, either enough:

- the load average (1 minute, /proc/loadavg) above the number of cores, read
  before the measurement started (the measuring processes are not counted);
- the spread of repeated timings of one thing, (third quartile - first
  quartile) / median, above `MAX_SPREAD`.

`load_warning(load, spreads)` says so in one line, naming the largest spread,
or returns None; calibrate.py keeps it in calibration.json and launch.py in
report.json's `measurement`, and the CLI prints it.

A quiet machine also holds its speed: a prediction from a calibration is of a
run at the speed the calibration found. On a shared host that speed moves by
a fifth within minutes, with no sign in the load or the CPU's steal time, and
every prediction from that calibration misses a later run alike.
`drift_warning(steps)` compares calibrations of the same steps made at
other times (step_fit.py `measured_step_s`, pooled by `calibrate --refit`):
one line when they lie more than `MAX_DRIFT` apart.

    load = load_average()
    ... measure ...
    warning = load_warning(load, {"all-reduce": relative_spread(times)})
"""
import os
import statistics

MAX_SPREAD = 0.5  # interquartile range over median above which repeated timings are not one figure
# Calibrations' measured steps further apart than this (largest over smallest - 1) are of a machine whose speed
# moved: a third of the 15% a prediction is held to (docs/validation/fidelity.md)
MAX_DRIFT = 0.05


def load_average() -> float:
    """The 1-minute load average: processes runnable or waiting on disk, averaged."""
    return os.getloadavg()[0]


def host_cores() -> int:
    """The CPU cores this process may run on (its affinity; the host's cores when nothing restricts it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def relative_spread(samples_s) -> float:
    """(third quartile - first quartile) / median of repeated timings."""
    if len(samples_s) < 2:
        return 0.0
    first, median, third = statistics.quantiles(samples_s, n=4, method="inclusive")
    return (third - first) / median


def load_warning(load: float, spreads: dict[str, float], cores: int | None = None) -> str | None:
    """One line when the load average `load` exceeds the cores or a spread exceeds MAX_SPREAD; else None."""
    cores = cores or os.cpu_count()
    reasons = []
    if load > cores:
        reasons.append(f"load average {load:.2f} above its {cores} cores")
    if spreads:
        widest = max(spreads, key=spreads.get)
        if spreads[widest] > MAX_SPREAD:
            reasons.append(f"repeated timings of {widest} spread over {spreads[widest]:.0%} of their median "
                           f"(interquartile range; at most {MAX_SPREAD:.0%} trusted)")
    if not reasons:
        return None
    return f"machine loaded: {'; '.join(reasons)}: these timings, and a fit to them, cannot be trusted"


def drift_warning(steps: list[tuple[str, float]]) -> str | None:
    """One line when calibrations' measured steps of the same cases ((when, seconds) of each) lie more than
    MAX_DRIFT apart; else None."""
    (fast_when, fastest), (slow_when, slowest) = (min(steps, key=lambda step: step[1]),
                                                  max(steps, key=lambda step: step[1]))
    apart = slowest / fastest - 1
    if apart <= MAX_DRIFT:
        return None
    return (f"machine unsteady: the calibrations measured the same steps in {fastest * 1e3:.3f} ms "
            f"({fast_when}) and {slowest * 1e3:.3f} ms ({slow_when}), {apart:.0%} apart (at most "
            f"{MAX_DRIFT:.0%} trusted): a prediction from one alone misses a run at the other's speed by as much")
