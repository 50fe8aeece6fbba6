"""Measurements fitted to what the simulator charges: α-β, overhead and rate, the ring exchange, jitter.

A message of n bytes takes t(n) = α + n / β: a fixed latency α and a
bandwidth β (Hockney's model, the one the simulator's links follow: a hop's
latency, then the bytes at the link's rate). `fit_alpha_beta` finds α and
1/β by least squares of relative errors, (t - fit) / fit, so that every size
counts alike (a plain fit over sizes that span six orders of magnitude would
be all large messages, and α would be noise). The weights 1/fit² come from
the fit itself, by iteratively reweighted least squares from weights 1/t²:
weighing by the measured times instead would let one message that came back
unusually fast (a busy host's lucky round trip) pull the whole line down. α
below 0 is clamped to 0 and β refitted. The residuals are relative to the
measurement: (measured - fitted) / measured, one per point. When the times do
not grow with the size at all (noise larger than the transfer times), β is
not resolved: it is set to its lower bound, the largest message over its
time, α is fitted with it, and `bandwidth_resolved` is False.

    fit = fit_alpha_beta([64, 4096, 1 << 20], [21e-6, 23e-6, 290e-6])
    fit.latency_s, fit.bandwidth_Bps, fit.residuals

The same for a training step's passes: a forward or backward of F FLOPs
takes t = a + F / R, a fixed cost a per pass (on a host, the work around the
kernels: Python's frames and dispatch, the batch's draw, the autograd engine's
start, the interpreter's spans) and a rate R: `fit_pass_costs(flops, times)`,
weighted least squares of relative errors. An optimizer step of n bytes takes
t = a_u + n / B, a fixed cost of its own (the optimizer's Python around its
kernels, not a pass's) and a memory bandwidth B: `fit_update_costs(bytes,
times, a)`, an α-β fit.

A ring all-reduce of n bytes over N ranks is 2(N - 1) exchanges of n/N bytes
(every rank sends a chunk to its right and receives one from its left, then
waits for both): `fit_ring_all_reduce(N, sizes, times)` fits α and β to one
exchange, t(n) / 2(N - 1) = α + (n/N) / β, so that a topology whose links
give that α and β times the ring as it was measured. Its residuals are the
all-reduce's own.

Ranks whose compute varies from step to step wait for each other at the
all-reduce. The simulator draws each compute span's time from a lognormal of
mean t (hw/device.py): its variance t² (e^σ² - 1) grows with the span
(`cluster.compute_jitter`, σ), plus s² that does not (`compute_jitter_fixed`,
s: a host's scheduler waking a rank late, whatever it computed before). Each
rank's step computes T = F' + B', a forward and a backward so drawn; over N
ranks, each waits on average E[max T - mean T] (half the mean |T_a - T_b| for
two). `modelled_wait` computes that by drawing the model itself, from normals
drawn once with a fixed seed (so it is deterministic, and smooth in σ and s),
and `fit_compute_jitter(idle, forward, backward, world)` finds the σ and s
whose waits are closest, in relative error, to those calibration measured at
each all-reduce over its cases (for each σ of a grid the best s, by
golden-section search since the waits grow with s; then σ by golden-section
search around the grid's best). Measured on 2 ranks of a 2-core host, the
wait hardly grows with the compute (0.60, 0.92, 0.83 ms at batches 32, 64,
128: docs/validation/fidelity.md), which σ alone cannot give.

    fit = fit_ring_all_reduce(2, [1024, 1 << 20], [400e-6, 1.4e-3])
    jitter = fit_compute_jitter([0.6e-3, 0.9e-3], [0.4e-3, 0.8e-3], [0.5e-3, 1.0e-3])  # .sigma, .fixed_s
"""
import functools
from statistics import NormalDist
from typing import NamedTuple

import numpy as np

from ..hw.device import span_sigma
from ..limits import MAX_COMPUTE_JITTER, MAX_COMPUTE_JITTER_FIXED


class AlphaBeta(NamedTuple):
    latency_s: float  # α
    bandwidth_Bps: float  # β
    residuals: list[float]  # (measured - fitted) / measured, per point
    bandwidth_resolved: bool = True  # False: the times did not grow with the size; β is a lower bound

    def time_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps

    @property
    def max_residual(self) -> float:
        return max(abs(r) for r in self.residuals)


_ITERATIONS = 50


def _weighted_line(n: np.ndarray, t: np.ndarray, weights: np.ndarray) -> tuple[float, float]:
    """(α, 1/β) minimizing sum((weights * (t - α - n/β))²), α clamped at 0."""
    design = np.stack([np.ones_like(n), n], axis=1) * weights[:, None]
    (alpha, inverse_beta), *_ = np.linalg.lstsq(design, t * weights, rcond=None)
    if alpha < 0:  # latency too small to see: the best line through the origin
        return 0.0, float(np.sum(n * t * weights**2) / np.sum((n * weights) ** 2))
    return float(alpha), float(inverse_beta)


def fit_alpha_beta(sizes_bytes, times_s) -> AlphaBeta:
    """The α and β that fit t(n) = α + n/β to (sizes_bytes, times_s), relative errors weighted alike."""
    n = np.asarray(sizes_bytes, dtype=np.float64)
    t = np.asarray(times_s, dtype=np.float64)
    if len(n) < 2 or len(set(n.tolist())) < 2:
        raise ValueError("an α-β fit needs at least two message sizes")
    if np.any(t <= 0):
        raise ValueError("times must be positive")
    alpha, inverse_beta = _weighted_line(n, t, 1.0 / t)
    if inverse_beta <= 0:  # noise hides the bandwidth: β at least the largest message over its time
        largest = int(np.argmax(n))
        inverse_beta = t[largest] / n[largest]
        alpha = max(0.0, float(np.sum((t - n * inverse_beta) / t**2) / np.sum(1.0 / t**2)))
        fitted = alpha + n * inverse_beta
        return AlphaBeta(float(alpha), float(1.0 / inverse_beta), [float(r) for r in (t - fitted) / t], False)
    for _ in range(_ITERATIONS):  # reweigh by the fitted line while it keeps a positive bandwidth
        weights = 1.0 / (alpha + n * inverse_beta)
        next_alpha, next_inverse_beta = _weighted_line(n, t, weights)
        if next_inverse_beta <= 0:
            break
        converged = np.isclose(next_alpha, alpha, rtol=1e-12, atol=0) and np.isclose(next_inverse_beta,
                                                                                   inverse_beta, rtol=1e-12, atol=0)
        alpha, inverse_beta = next_alpha, next_inverse_beta
        if converged:
            break
    fitted = alpha + n * inverse_beta
    return AlphaBeta(float(alpha), float(1.0 / inverse_beta), [float(r) for r in (t - fitted) / t])


class PassCosts(NamedTuple):
    overhead_s: float  # a, per pass
    flops_per_s: float  # R
    residuals: list[float]  # (measured - fitted) / measured, per pass

    @property
    def max_residual(self) -> float:
        return max(abs(r) for r in self.residuals)


def fit_pass_costs(flops, times_s) -> PassCosts:
    """The fixed cost a of a pass and the rate R that fit t = a + FLOPs / R to forward and backward passes,
    relative errors weighted alike (weights 1/t). Where the passes leave no positive a (no fixed cost to see)
    or R (noise), a is 0 and R is fitted alone."""
    f = np.asarray(flops, dtype=np.float64)
    t = np.asarray(times_s, dtype=np.float64)
    if np.any(t <= 0) or np.any(f <= 0):
        raise ValueError("times and FLOPs must be positive")
    design = np.stack([np.ones_like(f), f], axis=1)
    solution = _least_squares(design, t, 1.0 / t)
    fitted = design @ solution
    return PassCosts(float(solution[0]), float(1.0 / solution[1]), [float(r) for r in (t - fitted) / t])


def fit_update_costs(update_bytes, times_s, pass_overhead_s: float) -> AlphaBeta:
    """The fixed cost a_u of an optimizer step and the bandwidth B that fit t = a_u + bytes / B: the α-β fit
    (`fit_alpha_beta`) where the steps moved several sizes. Steps of one size cannot tell a_u from B: a_u is
    then the passes' fixed cost and B the bytes over the steps' mean time beyond it; where that is within the
    standard error of the mean, B is not resolved, and is the least bandwidth that puts the bytes within it."""
    n = np.asarray(update_bytes, dtype=np.float64)
    t = np.asarray(times_s, dtype=np.float64)
    if np.any(t <= 0) or np.any(n <= 0):
        raise ValueError("update times and bytes must be positive")
    if len(set(n.tolist())) > 1:
        return fit_alpha_beta(n, t)
    hidden = float(np.std(t, ddof=1) / np.sqrt(len(t))) if len(t) > 1 else 0.0
    excess = float(np.mean(t)) - pass_overhead_s
    inverse_bandwidth = max(hidden, excess, 1e-9) / float(n[0])
    fitted = pass_overhead_s + n * inverse_bandwidth
    return AlphaBeta(pass_overhead_s, 1.0 / inverse_bandwidth, [float(r) for r in (t - fitted) / t],
                     bool(excess > hidden))


def _least_squares(design: np.ndarray, t: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The coefficients of design's columns (a fixed cost, then a rate's inverse) that fit t, weights w; where the
    fixed cost comes out below 0, or the rate at or below 0 (noise), the fixed cost is 0 and the rate is fitted
    alone."""
    solution, *_ = np.linalg.lstsq(design * w[:, None], t * w, rcond=None)
    if solution[0] < 0 or solution[1] <= 0:
        solution = np.concatenate([[0.0], np.linalg.lstsq(design[:, 1:] * w[:, None], t * w, rcond=None)[0]])
    return solution


def fit_ring_all_reduce(world: int, sizes_bytes, times_s) -> AlphaBeta:
    """The α and β of one exchange of a ring all-reduce over `world` ranks, fitted to its times per size:
    t(n) = 2(world - 1) (α + (n / world) / β)."""
    exchanges = 2 * (world - 1)
    return fit_alpha_beta([n / world for n in sizes_bytes], [t / exchanges for t in times_s])


class ComputeJitter(NamedTuple):
    sigma: float  # cluster.compute_jitter: the part of the noise that grows with the span
    fixed_s: float  # cluster.compute_jitter_fixed: the part that does not


_WAIT_DRAWS = 8192  # draws per rank and span
_WAIT_SEED = 0x1D1E
_SIGMA_GRID = 17  # σ from 0 to MAX_COMPUTE_JITTER, before a golden section around the best


def modelled_wait(jitter: ComputeJitter, forward_s, backward_s, world: int = 2) -> np.ndarray:
    """Each rank's mean wait at the all-reduce, per case: E[max T - mean T] over `world` ranks whose step computes
    T = F' + B', each span of mean forward_s or backward_s drawn as hw/device.py draws it."""
    forward, backward = np.asarray(forward_s, dtype=np.float64), np.asarray(backward_s, dtype=np.float64)
    normals = _normals(world)

    def spans(mean: float, z: np.ndarray) -> np.ndarray:
        sigma = span_sigma(mean, jitter.sigma, jitter.fixed_s)
        return mean * np.exp(sigma * z - sigma * sigma / 2)
    waits = []
    for f, b in zip(forward, backward):
        steps = spans(f, normals[0]) + spans(b, normals[1])  # [rank][draw]
        waits.append(float(np.mean(steps.max(axis=0) - steps.mean(axis=0))))
    return np.array(waits)


@functools.cache
def _normals(world: int) -> np.ndarray:
    """The standard normals every modelled wait over `world` ranks draws its spans from, [span][rank][draw]:
    a Latin hypercube (each span of each rank takes every one of _WAIT_DRAWS equal-probability strata of the
    normal once, at its middle; a seeded permutation pairs them), so the wait is within about 1% with few
    draws."""
    quantiles = np.array([NormalDist().inv_cdf((i + 0.5) / _WAIT_DRAWS) for i in range(_WAIT_DRAWS)])
    generator = np.random.default_rng(_WAIT_SEED)
    return np.stack([np.stack([generator.permutation(quantiles) for _ in range(world)]) for _ in range(2)])


def fit_compute_jitter(idle_s, forward_s, backward_s, world: int = 2) -> ComputeJitter:
    """The σ (at most MAX_COMPUTE_JITTER) and s (at most MAX_COMPUTE_JITTER_FIXED) under which `world` ranks whose
    forward and backward take forward_s and backward_s on average wait idle_s for each other, per case, as
    nearly as relative errors go."""
    idle = np.asarray(idle_s, dtype=np.float64)
    if np.any(np.asarray(forward_s) <= 0) or np.any(np.asarray(backward_s) <= 0) or np.any(idle < 0):
        raise ValueError("compute times must be positive and waits not negative")
    if not np.any(idle > 0):
        return ComputeJitter(0.0, 0.0)
    scale = np.maximum(idle, 1e-3 * idle.max())
    largest_fixed = min(8 * idle.max(), MAX_COMPUTE_JITTER_FIXED)

    def error(sigma: float, fixed: float) -> float:
        return float(np.sum(((modelled_wait(ComputeJitter(sigma, fixed), forward_s, backward_s, world) - idle)
                             / scale) ** 2))

    def best_fixed(sigma: float) -> tuple[float, float]:  # (error, s): the waits grow with s, one least error
        fixed = _golden_section(lambda f: error(sigma, f), 0.0, largest_fixed)
        return error(sigma, fixed), fixed

    sigmas = np.linspace(0.0, MAX_COMPUTE_JITTER, _SIGMA_GRID)
    best = min(sigmas, key=lambda sigma: best_fixed(sigma)[0])
    step = sigmas[1] - sigmas[0]
    sigma = _golden_section(lambda x: best_fixed(x)[0], max(0.0, best - step), min(MAX_COMPUTE_JITTER, best + step))
    return ComputeJitter(float(sigma), float(best_fixed(sigma)[1]))


def _golden_section(f, low: float, high: float, iterations: int = 20) -> float:
    """The x in [low, high] where f is least, for f with one minimum there (golden-section search; an end
    itself where f is least there, as at a bound of 0)."""
    ends = ((f(low), low), (f(high), high))
    ratio = (np.sqrt(5.0) - 1) / 2
    a, b = low + (1 - ratio) * (high - low), low + ratio * (high - low)
    fa, fb = f(a), f(b)
    for _ in range(iterations):
        if fa <= fb:
            high, b, fb = b, a, fa
            a = low + (1 - ratio) * (high - low)
            fa = f(a)
        else:
            low, a, fa = a, b, fb
            b = low + ratio * (high - low)
            fb = f(b)
    return min((fa, a), (fb, b), *ends)[1]
