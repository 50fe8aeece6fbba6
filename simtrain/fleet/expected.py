"""What a fleet's failure model expects, in closed form: failures, hosts in repair, the checkpoint interval.

Every unit fails independently after an exponential time of mean its `mtbf`
(failures.py), so over a horizon T a component of n units fails `T n / mtbf`
times on average, and a job's unplanned failures come every
`M = 1 / sum(n / mtbf)` seconds (planned stops, `maintenance`, lose no work
and are left out of M). The hosts a failure takes go to repair for their
component's `repair`: by Little's law the pool lends, on average,
`sum(n / mtbf x hosts per failure x repair)` hosts at any time; a pool
smaller than that runs dry again and again, and `spare_pool_warning` says so
before a run (`simtrain validate`, and report.json's `fleet`).

Young's interval `sqrt(2 delta M)` (J. W. Young, CACM 1974) and Daly's
`sqrt(2 delta M) (1 + sqrt(delta / 2M) / 3 + delta / 18M) - delta` (J. T.
Daly, FGCS 2006; M when delta >= 2M), for the blocking part of a checkpoint
delta, are what `fleet.checkpoint.interval: young` or `daly` takes.

    rates = failure_rates(fleet, inventory)
    job_mtbf_s(rates), hosts_in_repair(fleet, inventory), spare_pool_warning(fleet, inventory)
    checkpoint_interval_s(fleet, costs.blocking_s, rates)
"""
import math

from .failures import failure_rates
from .inventory import Inventory

PLANNED = ("maintenance",)


def job_mtbf_s(rates: dict[str, float]) -> float | None:
    """Mean time between the job's unplanned failures (s); None: nothing fails."""
    total = sum(rate for component, rate in rates.items() if component not in PLANNED)
    return 1 / total if total else None


def young_s(delta_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * delta_s * mtbf_s)


def daly_s(delta_s: float, mtbf_s: float) -> float:
    if delta_s >= 2 * mtbf_s:
        return mtbf_s
    return young_s(delta_s, mtbf_s) * (1 + math.sqrt(delta_s / (2 * mtbf_s)) / 3 + delta_s / (18 * mtbf_s)) - delta_s


def checkpoint_interval_s(fleet, blocking_s: float, rates: dict[str, float]) -> float:
    """`fleet.checkpoint.interval` in seconds: as given, or Young's or Daly's for the job's failures (the horizon
    when nothing fails)."""
    interval = fleet.checkpoint.interval
    if not isinstance(interval, str):
        return interval
    mtbf = job_mtbf_s(rates)
    if mtbf is None:
        return fleet.horizon
    return max((young_s if interval == "young" else daly_s)(blocking_s, mtbf), 1e-9)


def hosts_lost_per_s(fleet, inventory: Inventory) -> dict[str, float]:
    """Hosts the job loses per second, by component (a failure of unit u takes hosts_lost(u); units alike in
    rate), slow GPUs that fail included (as gpu)."""
    rates = failure_rates(fleet, inventory)
    lost = {}
    for component, rate in rates.items():
        count = inventory.count(component)
        per_failure = sum(len(inventory.hosts_lost(component, unit)) for unit in range(count)) / count
        if per_failure:
            lost[component] = rate * per_failure
    stragglers = fleet.stragglers
    if stragglers is not None and stragglers.fails:
        lost["gpu"] = lost.get("gpu", 0.0) + inventory.gpus / stragglers.mtbf * stragglers.fails
    return lost


def hosts_in_repair(fleet, inventory: Inventory) -> float:
    """Hosts away in repair at any time, on average: the pool's expected loan (Little's law)."""
    return sum(rate * getattr(fleet.components, component).repair
               for component, rate in hosts_lost_per_s(fleet, inventory).items())


def spare_pool_warning(fleet, inventory: Inventory) -> str | None:
    """One line when `fleet.spares` is smaller than the hosts the failure model expects in repair at once."""
    if fleet.spares is None:
        return None
    in_repair = hosts_in_repair(fleet, inventory)
    if fleet.spares >= in_repair:
        return None
    lost_per_day = sum(hosts_lost_per_s(fleet, inventory).values()) * 86400
    return (f"fleet.spares: {fleet.spares} hosts cannot cover the expected failures: the job's {inventory.hosts} "
            f"hosts lose {lost_per_day:.3g} a day ({lost_per_day * fleet.horizon / 86400:.0f} over the horizon) and "
            f"{in_repair:.3g} are in repair at once on average; give at least {math.ceil(in_repair)} or null")
