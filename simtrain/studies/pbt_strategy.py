"""Population-based training's decisions, as pure functions over plain data: who copies whom, and the
hyperparameters a copy explores.

Population-based training (Jaderberg et al., "Population Based Training of
Neural Networks", DeepMind 2017) trains a population at once; at each round
the weaker members **exploit** (copy the weights and optimizer state of) a
stronger one, then **explore** (perturb the hyperparameters they copied).
The rules and their names are Ray Tune's `PopulationBasedTraining`'s:

- `truncation` (Ray's rule): members ordered by score; the bottom
  `quantile_fraction` (ceil(n * fraction) members, at most half) each copy a
  member of the top fraction, chosen at random. `quantile_fraction: 0`: no
  member copies (random search).
- `binary_tournament` (the paper's other rule): each member picks another at
  random and copies it if that one scores better. `quantile_fraction` is not used.
- explore, per hyperparameter: a list of values moves to a neighbouring value
  (one index down or up at random, clamped at the ends), or with probability
  `resample_probability` takes a value drawn from the whole list (also when
  the current value is not in the list); a range is multiplied by a random
  choice of `perturbation_factors`, or with probability `resample_probability`
  drawn anew from the range (uniform, or uniform in log for log_uniform).
  Unlike Ray, a perturbed value is clipped to its range: a momentum of
  0.99 x 1.2 would not be a momentum.

A score that is not a number (a member that diverged) is the worst score.
Members are identified by integers; every random draw comes from the
`random.Random` passed in, in member order, so the same inputs give the same
decisions.

    bottom, top = quantiles({0: 0.3, 1: 0.1, 2: 0.5, 3: 0.2}, "min", 0.25)   # [2], [1]
    donors = choose_donors(scores, ready=[0, 1, 2, 3], rule="truncation", mode="min",
                           quantile_fraction=0.25, rng=random.Random(0))        # {2: 1}
    new = explore({"train.optimizer.lr": 0.1}, mutations, 0.25, (1.2, 0.8), rng)
"""
import math
import random

from ..scenario import RangeSpec


def sample(mutation, rng: random.Random):
    """A value drawn from a mutation: a list's element, a uniform or log-uniform range's value."""
    if isinstance(mutation, list):
        return rng.choice(mutation)
    if mutation.uniform is not None:
        return rng.uniform(*mutation.uniform)
    low, high = mutation.log_uniform
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def initial_hyperparameters(mutations: dict, rng: random.Random) -> dict:
    """One member's starting values: each hyperparameter drawn from its mutation, in the mutations' order."""
    return {path: sample(mutation, rng) for path, mutation in mutations.items()}


def explore(values: dict, mutations: dict, resample_probability: float, factors, rng: random.Random) -> dict:
    """The copied `values` perturbed (or resampled) by Ray's rule, hyperparameter by hyperparameter."""
    explored = dict(values)
    for path, mutation in mutations.items():
        value = values[path]
        if isinstance(mutation, list):
            if rng.random() < resample_probability or value not in mutation:
                explored[path] = rng.choice(mutation)
            else:
                index = mutation.index(value) + rng.choice((-1, 1))
                explored[path] = mutation[min(max(index, 0), len(mutation) - 1)]
        elif rng.random() < resample_probability:
            explored[path] = sample(mutation, rng)
        else:
            explored[path] = _clip(value * rng.choice(factors), mutation)
    return explored


def _clip(value: float, mutation: RangeSpec) -> float:
    low, high = mutation.uniform or mutation.log_uniform
    return min(max(value, low), high)


def _badness(score: float, mode: str) -> float:
    if math.isnan(score):
        return math.inf
    return score if mode == "min" else -score


def quantiles(scores: dict[int, float], mode: str, fraction: float) -> tuple[list[int], list[int]]:
    """(bottom, top): the ceil(n * fraction) worst and best members (at most n // 2 each), worst first and
    best last; ties are broken by member id (the lower id counts as better)."""
    ordered = sorted(scores, key=lambda member: (-_badness(scores[member], mode), -member))  # worst first
    count = min(math.ceil(len(ordered) * fraction), len(ordered) // 2)
    return ordered[:count], ordered[len(ordered) - count:]


def choose_donors(scores: dict[int, float], ready: list[int], rule: str, mode: str, quantile_fraction: float,
                  rng: random.Random) -> dict[int, int]:
    """recipient -> donor for the members of `ready` that copy another this round; `scores` are every
    member's latest (the ready members' included)."""
    donors = {}
    if rule == "truncation":
        bottom, top = quantiles(scores, mode, quantile_fraction)
        for member in ready:
            if member in bottom:
                donors[member] = rng.choice(top)
        return donors
    for member in ready:
        other = rng.choice([candidate for candidate in sorted(scores) if candidate != member])
        if _badness(scores[other], mode) < _badness(scores[member], mode):
            donors[member] = other
    return donors
