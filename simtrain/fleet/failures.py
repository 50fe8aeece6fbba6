"""Where a fleet's failures and slowdowns come from: drawn from every component's rate, or replayed from a log.

Every unit of every component fails after an exponential time of mean its
`mtbf`, independently and memorylessly, so the job's next failure comes after
an exponential time of mean `1 / sum(units / mtbf)`, of a component drawn in
proportion to its rate, on a unit drawn uniformly. A GPU slows down after an
exponential time of mean the stragglers' `mtbf` and is slow for `duration`;
with chance `fails` it then fails (a GPU that degrades before it fails:
strike("gpu", unit, "slow_gpu")) rather than coming back to speed.
Each is a simpy process that calls back into the run (simulation.py), drawing
from its own seeded numpy Generator only when the previous event happened.

    env.process(drawn(env, rng, failure_rates(fleet, inventory), inventory, strike))
    env.process(replayed(env, fleet.failures, strike))
    env.process(slowdowns(env, rng, fleet.stragglers, inventory.gpus, set_slow, strike))
"""
import numpy as np

from .inventory import Inventory


def failure_rates(fleet, inventory: Inventory) -> dict[str, float]:
    """Failures per second of the whole job, per component that fails (in COMPONENTS' order)."""
    rates = {}
    for component, count in inventory.counts().items():
        mtbf = getattr(fleet.components, component).mtbf
        if mtbf is not None and count:
            rates[component] = count / mtbf
    return rates


def drawn(env, rng: np.random.Generator, rates: dict[str, float], inventory: Inventory, strike):
    """Failures as they come: strike(component, unit) at each."""
    if not rates:
        return
    names = list(rates)
    total = sum(rates.values())
    weights = np.array([rates[name] for name in names]) / total
    while True:
        yield env.timeout(rng.exponential(1 / total))
        component = names[int(rng.choice(len(names), p=weights))]
        strike(component, int(rng.integers(inventory.count(component))))


def replayed(env, failures: list, strike):
    """The failures of a log (fleet.failures, in time order), at their times."""
    for failure in failures:
        if failure.at > env.now:
            yield env.timeout(failure.at - env.now)
        strike(failure.component, failure.unit)


def slowdowns(env, rng: np.random.Generator, spec, gpus: int, set_slow, strike):
    """Slow GPUs: set_slow(+1) when one slows down, set_slow(-1) when it is back to speed or has failed."""
    def slow_for_a_while(unit: int, then_fails: bool):
        yield env.timeout(spec.duration)
        set_slow(-1)
        if then_fails:
            strike("gpu", unit, "slow_gpu")

    while True:
        yield env.timeout(rng.exponential(spec.mtbf / gpus))
        unit, then_fails = int(rng.integers(gpus)), bool(rng.random() < spec.fails)
        set_slow(+1)
        env.process(slow_for_a_while(unit, then_fails))
