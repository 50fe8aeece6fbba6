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

The same for compute: a forward or backward of F FLOPs in k kernels takes
t = c k + F / R, a fixed cost per kernel c (on a host, Python's and torch's
dispatch of each operator) and a rate R: `fit_overhead_rate(kernels, flops,
times)`, weighted least squares of relative errors.

A ring all-reduce of n bytes over N ranks is 2(N - 1) exchanges of n/N bytes
(every rank sends a chunk to its right and receives one from its left, then
waits for both): `fit_ring_all_reduce(N, sizes, times)` fits α and β to one
exchange, t(n) / 2(N - 1) = α + (n/N) / β, so that a topology whose links
give that α and β times the ring as it was measured. Its residuals are the
all-reduce's own.

Ranks whose compute varies from step to step wait for each other at the
all-reduce: the simulator draws each compute span's time from a lognormal of
mean 1 and sigma σ (`cluster.compute_jitter`), so a rank whose forward F and
backward B vary so waits, on average, half the mean |T_a - T_b| of two ranks'
T = F X + B Y; taking T_a - T_b as normal (variance 2 (F² + B²)(e^σ² - 1)),
that is sqrt((F² + B²)(e^σ² - 1) / π). `fit_compute_jitter(idle, forward,
backward)` solves it for σ over the cases measured (least squares in
e^σ² - 1), from the waiting calibration measured at each all-reduce.

    fit = fit_ring_all_reduce(2, [1024, 1 << 20], [400e-6, 1.4e-3])
    sigma = fit_compute_jitter([0.1e-3, 0.2e-3], [0.4e-3, 0.8e-3], [0.5e-3, 1.0e-3])
"""
from typing import NamedTuple

import numpy as np

from ..limits import MAX_COMPUTE_JITTER


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


class OverheadRate(NamedTuple):
    overhead_s: float  # per kernel
    flops_per_s: float
    residuals: list[float]  # (measured - fitted) / measured, per point

    @property
    def max_residual(self) -> float:
        return max(abs(r) for r in self.residuals)


def fit_overhead_rate(kernels, flops, times_s) -> OverheadRate:
    """The per-kernel overhead c and the rate R that fit t = c x kernels + flops / R, relative errors weighted
    alike (weights 1/t). Where the best c is below 0, or leaves no positive rate (noise), c is 0 and R alone
    is fitted."""
    k = np.asarray(kernels, dtype=np.float64)
    f = np.asarray(flops, dtype=np.float64)
    t = np.asarray(times_s, dtype=np.float64)
    if np.any(t <= 0) or np.any(f <= 0):
        raise ValueError("times and FLOPs must be positive")
    w = 1.0 / t
    (overhead, inverse_rate), *_ = np.linalg.lstsq(np.stack([k, f], axis=1) * w[:, None], t * w, rcond=None)
    if overhead < 0 or inverse_rate <= 0:
        overhead = 0.0
        inverse_rate = float(np.sum(f * t * w**2) / np.sum((f * w) ** 2))
    fitted = overhead * k + f * inverse_rate
    return OverheadRate(float(overhead), float(1.0 / inverse_rate), [float(r) for r in (t - fitted) / t])


def fit_ring_all_reduce(world: int, sizes_bytes, times_s) -> AlphaBeta:
    """The α and β of one exchange of a ring all-reduce over `world` ranks, fitted to its times per size:
    t(n) = 2(world - 1) (α + (n / world) / β)."""
    exchanges = 2 * (world - 1)
    return fit_alpha_beta([n / world for n in sizes_bytes], [t / exchanges for t in times_s])


def fit_compute_jitter(idle_s, forward_s, backward_s) -> float:
    """The σ of lognormal compute noise under which two ranks whose forward and backward take forward_s and
    backward_s on average wait idle_s for each other, per case, at most MAX_COMPUTE_JITTER."""
    idle, square = np.asarray(idle_s, dtype=np.float64), np.asarray(forward_s) ** 2 + np.asarray(backward_s) ** 2
    if np.any(square <= 0) or np.any(idle < 0):
        raise ValueError("compute times must be positive and waits not negative")
    variance = float(np.sum(np.pi * idle**2 * square) / np.sum(square**2))  # e^σ² - 1, least squares
    return min(float(np.sqrt(np.log1p(variance))), MAX_COMPUTE_JITTER)
