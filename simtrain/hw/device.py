"""One simulated GPU: a compute stream on the virtual clock and a memory ledger.

    device = Device(env, rank=0, node="gpu0", spec=CATALOG["a100-40gb"], log=log)
    yield device.compute(flops=2e9, dtype="fp32", name="forward+backward")
    yield device.memory_bound(nbytes=4e6, name="optimizer", kind="optimizer")
    device.memory.alloc("activations", 1 << 20)

The compute stream is in-order, like a CUDA stream: work queued while earlier
work runs starts when that work ends. A kernel of F FLOPs in dtype d takes
F / (peak[d] * efficiency); memory-bound work of B bytes takes B / (HBM
bandwidth * efficiency). Every span goes to the cluster's event log.

The compute model (`cluster.compute_model`) says what compute work costs:
`flops` charges its FLOPs alone, as above; `roofline` charges work whose
operators were measured (op_cost.py) as the sum over them of
max(F / (peak[d] * efficiency), B / (HBM bandwidth * efficiency)), and
unmeasured work by its FLOPs; `kernels` charges measured work as the
roofline does with each GEMM's FLOPs at the share of its tiles' waves it
fills and each fused attention kernel's at its generation's published
fraction of peak (kernel_model.py). A measured operator's d is its own rate dtype
(op_cost.py: its operands'; an fp8 precision's scaled GEMMs fp8, its
attention bf16), the work's dtype where it has none; under `flops` too, the
FLOPs of operators of another rate dtype than the work's are charged at
their own rate, the rest of the work's FLOPs at its dtype's.

Work that runs while a communication kernel holds `sm_margin` of the device's
M streaming multiprocessors (Transformer Engine's `set_sm_margin`,
strategies/tp_overlap.py) runs on the other M - sm_margin: either model's time
times M / (M - sm_margin). Its FLOPs are its FLOPs. A device without an SM
count (`DeviceSpec.streaming_multiprocessors` None) has no margin taken.

Heterogeneous and noisy devices: a `slowdown` multiplies every span on the
stream (a straggler), and a `jitter` sigma multiplies each compute span by
its own lognormal factor exp(sigma * z - sigma^2 / 2), z ~ N(0, 1) drawn from
the device's own seeded numpy Generator: mean 1, so the device's average
speed is unchanged; sigma is the standard deviation of log(factor). Its
spread grows with the span. A host adds noise that does not (its scheduler
waking a rank late, whatever the rank computed before): `jitter_fixed`, s
seconds, gives a span of mean t the variance t^2 (e^(sigma^2) - 1) + s^2,
still lognormal with mean t, so its log's standard deviation is
`span_sigma(t, sigma, s)` = sqrt(log(e^(sigma^2) + (s / t)^2)).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import simpy

from ..errors import OutOfMemory
from ..units import format_bytes
from .catalog import DeviceSpec
from .eventlog import EventLog
from .kernel_model import kernel_seconds

if TYPE_CHECKING:  # the operator recorder's (torch), and the jitter's generator: no import at run time
    import numpy as np

    from ..op_cost import OpCosts


class MemoryLedger:
    """Bytes held per category on one device: current, per-category peak, total peak.

    `peak_breakdown` is the per-category split at the moment the total peaked,
    so it adds up to `peak_total`. The standard categories are always present;
    techniques add their own (in first-use order). Once `record_changes` is
    called (a scenario's run that records its spans), every change is kept in
    `changes` as (time, category, bytes the category then holds): memory over
    the step, the trace's counters (report/trace.py). Users' code under
    simtrain.dist does not keep them: its tensors are freed when Python's
    collector runs, a moment no clock orders.
    """

    CATEGORIES = ("weights", "gradients", "optimizer_state", "activations", "comm_buffers")

    def __init__(self, device: str, capacity_bytes: float):
        self.device = device
        self.capacity_bytes = capacity_bytes
        self._env: simpy.Environment | None = None
        self.changes: list[tuple[float, str, int]] | None = None
        self.current: dict[str, int] = dict.fromkeys(self.CATEGORIES, 0)
        self.peak: dict[str, int] = dict.fromkeys(self.CATEGORIES, 0)
        self.total = 0
        self.peak_total = 0
        self.peak_breakdown: dict[str, int] = dict(self.current)

    def record_changes(self, env: simpy.Environment) -> None:
        """From now on keep every change in `changes`, at `env`'s time."""
        self._env, self.changes = env, []

    def alloc(self, category: str, nbytes: int) -> None:
        """Hold nbytes more in category; OutOfMemory if the device would overflow."""
        nbytes = int(nbytes)
        now = self.current.get(category, 0) + nbytes
        self.current[category] = now
        self.total += nbytes
        if self.changes is not None:
            self.changes.append((self._env.now, category, now))
        if now > self.peak.get(category, 0):
            self.peak[category] = now
        if self.total > self.peak_total:
            self.peak_total = self.total
            self.peak_breakdown = dict(self.current)
        if self.total > self.capacity_bytes:
            raise self._out_of_memory()

    def _out_of_memory(self) -> OutOfMemory:
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.current.items() if v)
        return OutOfMemory(self.device, int(self.capacity_bytes), self.current,
                           f"out of memory on {self.device}: needs {format_bytes(sum(self.current.values()))} of "
                           f"{format_bytes(int(self.capacity_bytes))} ({parts})")

    def release_all(self) -> None:
        """Every byte is freed (the program holding them was stopped); peaks stay."""
        if self.changes is not None:
            self.changes.extend((self._env.now, category, 0) for category, held in self.current.items() if held)
        self.current = dict.fromkeys(self.current, 0)
        self.total = 0

    def free(self, category: str, nbytes: int) -> None:
        """Release nbytes from category (a bug if more than it holds)."""
        nbytes = int(nbytes)
        held = self.current.get(category, 0)
        if nbytes > held:
            raise ValueError(f"{self.device}: freeing {nbytes} B of {category} but only {held} B held")
        self.current[category] = held - nbytes
        self.total -= nbytes
        if self.changes is not None:
            self.changes.append((self._env.now, category, held - nbytes))


class Device:
    """A simulated GPU with an in-order compute stream and a memory ledger."""

    def __init__(self, env: simpy.Environment, rank: int, node: str, spec: DeviceSpec, log: EventLog,
                 slowdown: float = 1.0, jitter: float = 0.0, rng: np.random.Generator | None = None,
                 compute_model: str = "flops", jitter_fixed: float = 0.0):
        self.env = env
        self.rank = rank
        self.node = node
        self.spec = spec
        self.log = log
        self.slowdown = slowdown
        self.jitter = jitter
        self.jitter_fixed = jitter_fixed
        self.compute_model = compute_model
        if (jitter or jitter_fixed) and rng is None:
            raise ValueError(f"rank {rank}: compute jitter needs a seeded Generator")
        self._rng = rng
        self.memory = MemoryLedger(f"rank {rank} ({node}, {spec.name})", spec.memory_bytes)
        self._stream_free_at = 0.0
        self._measured_s: dict[tuple, float] = {}  # (OpCosts, dtype) -> roofline or kernel seconds on this spec
        self._other_rates: dict[tuple, dict[str, float]] = {}  # (OpCosts, dtype) -> FLOPs of the other rate dtypes

    def abort(self) -> None:
        """The device stops now (lost, or its job torn down): the work on its stream ends here (its spans
        are cut) and the memory its program held is freed."""
        now = self.env.now
        if self._stream_free_at > now:
            self.log.cut(self.rank, now)
            self._stream_free_at = now
        self.memory.release_all()

    def compute_time(self, flops: float, dtype: str, ops: OpCosts | None = None, sm_margin: int = 0) -> float:
        """Seconds the stream needs for `flops` of arithmetic in `dtype` (before jitter), those of the operators
        `ops` (when given) of a rate dtype of their own at its rate; under the roofline or the kernel compute model,
        for the operators `ops` when they are given; on the SMs that `sm_margin` leaves."""
        if ops is not None and self.compute_model != "flops":
            measured_s = self._measured_s.get((ops, dtype))
            if measured_s is None:  # a step charges the same few dozen operator groups again and again
                measured_s = self._measured_s[ops, dtype] = self._measured_seconds(ops, dtype)
            seconds = measured_s * self.slowdown
        else:
            seconds = self._flops_seconds(flops, dtype, ops) * self.slowdown
        return seconds / self.sm_share(sm_margin) if sm_margin else seconds

    def _measured_seconds(self, ops: OpCosts, dtype: str) -> float:
        """Seconds operators `ops` take under the roofline or the kernel compute model, their rate dtype "" at
        `dtype`'s."""
        spec = self.spec
        rates = {"": spec.flops_rate(dtype)}
        for *_, rate, _ in ops:
            if rate not in rates:
                rates[rate] = spec.flops_rate(rate)
        bytes_rate = spec.memory_bandwidth * spec.efficiency
        if self.compute_model == "roofline":
            return roofline_seconds(by_cost(ops), rates, bytes_rate)
        attention_scale = (1.0 if spec.attention_efficiency is None
                           else spec.attention_efficiency / spec.efficiency)
        return kernel_seconds(ops, rates, bytes_rate, spec.streaming_multiprocessors, attention_scale)

    def _flops_seconds(self, flops: float, dtype: str, ops: OpCosts | None) -> float:
        """Seconds `flops` take at `dtype`'s rate, less the FLOPs of `ops` of another rate dtype, at theirs."""
        others = {} if ops is None else self._other_rates.get((ops, dtype))
        if others is None:  # worked out once per operator groups, as the roofline's seconds are
            others = self._other_rates[ops, dtype] = {}
            for operator_flops, _, count, rate in by_cost(ops):
                if operator_flops and rate and rate != dtype:
                    others[rate] = others.get(rate, 0.0) + operator_flops * count
        if not others:
            return flops / self.spec.flops_rate(dtype)
        return ((flops - sum(others.values())) / self.spec.flops_rate(dtype)
                + sum(rate_flops / self.spec.flops_rate(rate) for rate, rate_flops in others.items()))

    def sm_share(self, sm_margin: int) -> float:
        """The share of the device's streaming multiprocessors work runs on while a communication kernel holds
        `sm_margin` of them (1 on a device without an SM count)."""
        sms = self.spec.streaming_multiprocessors
        if sms is None:
            return 1.0
        if not 0 <= sm_margin < sms:
            raise ValueError(f"rank {self.rank}: a margin of {sm_margin} of {self.spec.name}'s {sms} SMs")
        return (sms - sm_margin) / sms

    def memory_bound_time(self, nbytes: float) -> float:
        """Seconds the stream needs to read and write `nbytes` of HBM."""
        return nbytes / (self.spec.memory_bandwidth * self.spec.efficiency) * self.slowdown

    def fixed_time(self, kernels: int, passes: int = 0, updates: int = 0) -> float:
        """Seconds the fixed costs of `kernels` kernels, `passes` passes and `updates` optimizer steps take (0 on
        a device without kernel_overhead, pass_overhead and update_overhead)."""
        spec = self.spec
        return (kernels * spec.kernel_overhead_s + passes * spec.pass_overhead_s
                + updates * spec.update_overhead_s) * self.slowdown

    def compute(self, flops: float, dtype: str, name: str, kind: str = "compute", kernels: int = 0,
                ops: OpCosts | None = None, sm_margin: int = 0, passes: int = 0) -> simpy.Event:
        """Queue `kernels` kernels of `flops` in all, in `dtype` (operators `ops`, when measured), on the SMs
        a communication kernel holding `sm_margin` of them leaves, starting `passes` passes; the event fires
        when they have run."""
        seconds = self.compute_time(flops, dtype, ops, sm_margin)
        if self.spec.has_fixed_costs:  # a calibrated host's; no GPU's
            seconds += self.fixed_time(kernels, passes)
        if self.jitter or self.jitter_fixed:
            sigma = span_sigma(seconds, self.jitter, self.jitter_fixed)
            seconds *= math.exp(sigma * self._rng.standard_normal() - sigma * sigma / 2)
        return self.run_for(seconds, name, kind, flops=flops)

    def memory_bound(self, nbytes: float, name: str, kind: str, kernels: int = 0, updates: int = 0) -> simpy.Event:
        """Queue memory-bound work touching `nbytes` of HBM in `kernels` kernels (an optimizer step, a copy),
        `updates` optimizer steps."""
        seconds = self.memory_bound_time(nbytes)
        if self.spec.has_fixed_costs:  # a calibrated host's; no GPU's
            seconds += self.fixed_time(kernels, updates=updates)
        return self.run_for(seconds, name, kind, nbytes=nbytes)

    def run_for(self, seconds: float, name: str, kind: str, nbytes: float = 0, flops: float = 0) -> simpy.Event:
        """Queue `seconds` of work on the stream; logged as one span of `kind`."""
        start = max(self.env.now, self._stream_free_at)
        end = start + seconds
        self._stream_free_at = end
        self.log.span(self.rank, kind, name, start, end, nbytes=nbytes, flops=flops)
        return self.env.timeout(end - self.env.now)


def span_sigma(seconds: float, sigma: float, fixed_s: float) -> float:
    """The standard deviation of log(time) of a compute span of mean `seconds` under lognormal noise whose
    variance is seconds^2 (e^(sigma^2) - 1) + fixed_s^2 (sigma itself where fixed_s is 0, and for an empty span,
    which stays empty)."""
    if not fixed_s or seconds <= 0:
        return sigma
    return math.sqrt(math.log(math.exp(sigma * sigma) + (fixed_s / seconds) ** 2))


def roofline_seconds(ops, flops_rates: dict[str, float], bytes_rate: float) -> float:
    """Seconds operators `ops` (by_cost's groups of op_cost.py's OpCosts) take, each bound by its arithmetic at its
    rate dtype's `flops_rates` FLOP/s or its bytes at `bytes_rate` B/s, whichever is slower."""
    return sum(count * max(flops / flops_rates[rate], nbytes / bytes_rate) for flops, nbytes, count, rate in ops)


def by_cost(ops: OpCosts) -> tuple[tuple[float, float, int, str], ...]:
    """`ops` as (FLOPs, bytes, count, rate dtype) groups, sorted: their kernels left out and the counts of equal
    costs added (what the roofline and FLOPs compute models charge, which do not look at a kernel's shape)."""
    counts = {}
    for flops, nbytes, count, rate, _ in ops:
        counts[flops, nbytes, rate] = counts.get((flops, nbytes, rate), 0) + count
    return tuple(sorted((flops, nbytes, count, rate) for (flops, nbytes, rate), count in counts.items()))
