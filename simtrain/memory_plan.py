"""Peak device memory of a training step, without training, and the largest batch that fits.

`plan_memory(scenario)` replays one step of the scenario's own step programs
(backend/interpreter.py) with numerics off: the job is built on the meta device
(shapes and dtypes, no storage, no arithmetic: a model far larger than the
host's RAM is fine), its batches are meta tensors of the data's shapes, and
the scheme's programs run through the same interpreter as a real run, on a
cluster whose ledgers record past capacity instead of stopping. What a device
holds is therefore exactly what a run holds, technique by technique: the
replica's persistent bytes, activations measured from the tensors autograd
saves, the collective's staging buffers, K-FAC's factors and broadcast
buffers, SyncBN's statistics exchanges. The replay runs until every rank has
stepped once (one step for the synchronous schemes, one update per worker for
async).

The result per device is the ledger's peak and its split by category at the
moment of the peak, what report.json's `devices` shows after a run.
`plan_host_memory` replays the same step for the ledger of the cluster's
shared memory (the host's DRAM: what ZeRO-Offload keeps there,
strategies/offload.py), report.json's `shared_memory`.

`DeviceMemory.largest_batch` finds the largest per-device batch size whose
step fits a device. A step's peak usually grows linearly with the batch (activations
scale with it; weights, gradients and optimizer state do not), so the line
through the last two replays predicts the boundary, and replays at the
prediction and one size above it confirm it (two or three rounds of that
secant at most); where they do not, doubling until a batch does not fit and
bisection between the last that fits and the first that does not finish the
search. Every answer is confirmed by replays, never extrapolated: the
activation peak is not linear in the batch size for every model. The smallest batch tried is 2 for a model with BatchNorm (torch's
BatchNorm cannot train on one sample per channel), else 1; under model
parallelism every size tried is a multiple of its microbatches.

    plans = plan_memory(load_scenario("scenarios/quickstart.yaml"))
    plans[0].peak_bytes, plans[0].by_category, plans[0].largest_batch   # the search runs when asked for
    host = plan_host_memory(scenario)        # None without cluster.shared_memory
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Callable

from torch import nn

from .errors import PastLimit, ScenarioError
from .hw.cluster import Cluster, run_to_end
from .hw.resolved_cluster import ResolvedCluster, resolve_cluster
from .job import Job
from .scenario import Scenario, validate_scenario
from .schemes import scheme_class
from .user_code import user_code_errors

_LARGEST_PROBE = 1 << 40  # no batch beyond this is tried
_SECANT_ROUNDS = 3  # predictions from the peaks' line before doubling and bisection take over


@dataclass(frozen=True)
class DeviceMemory:
    """One device's peak over a training step."""

    rank: int
    device: str
    capacity_bytes: int
    peak_bytes: int
    by_category: dict[str, int]  # at the moment of the peak; adds up to peak_bytes
    search_largest: Callable[[], int] = field(repr=False, compare=False)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes

    @cached_property
    def largest_batch(self) -> int:
        """The largest per-device batch size whose step fits (0: none), searched when first asked for: each
        probe is a replay, and a caller that wants the peaks alone pays none."""
        return self.search_largest()


@dataclass(frozen=True)
class HostMemory:
    """The shared memory's (the host's) peak over a training step."""

    location: str
    capacity_bytes: int | None  # None: unbounded
    peak_bytes: int
    by_category: dict[str, int]  # at the moment of the peak; adds up to peak_bytes


def replay_step(scenario: Scenario, resolved: ResolvedCluster, batch_size: int) -> Job:
    """The scenario's job (its cluster section resolved as `resolved`) after one step of its programs at
    `batch_size`, numerics off: its devices' ledgers hold that step's peaks (past capacity too)."""
    scheme = scheme_class(scenario.parallel)
    cluster = Cluster.from_resolved(resolved, record=False, seed=scenario.seed, enforce_capacity=False)
    world = cluster.size - scenario.cluster.spares  # the job's devices; spares stay idle
    steps = scheme.steps_until_every_rank_stepped(world)
    replayed = scenario.model_copy(update={
        "data": scenario.data.model_copy(update={"batch_size": batch_size}),
        "train": scenario.train.model_copy(update={"steps": steps}),
    })
    # Alone on the network as the run is (runner.py): a ring all-reduce is timed for its group at once, not as
    # 2N(N-1) transfers, each rank's N chunk views held meanwhile (100,000 ring devices: 10^10 views).
    job = Job(replayed, cluster, range(world), numerics=False, alone=not scenario.has_faults)
    job.start()
    with user_code_errors(scenario):
        run_to_end(cluster.env)
    return job


def _mirrored(scenario: Scenario) -> Scenario:
    """The scenario with parallel.representatives where its checks allow them (scenario/root.py) and the ranks
    a representative stands for hold what it holds: one rank per pipeline stage replayed, the others reading its
    ledger (_ledgers), the same peaks at a fraction of the replay (Llama 3 8B on 64 GPUs: docs/guides/memory.md;
    tested equal to the full run's by every memory-plan test). Not where ranks hold different buffers: a tree's
    or a naive all-reduce's ranks, cp ranks (their chunks' exchanges), overlapped sharded buckets (each rank's
    own bucket order), the host's ledger of cluster.shared_memory (every rank's offloaded state), experts routed
    by a drawn model (each rank draws its own)."""
    parallel, moe = scenario.parallel, scenario.model.moe
    if (parallel.representatives or parallel.all_reduce != "ring" or parallel.cp > 1
            or parallel.sharding.overlap_grad_reduce or parallel.sharding.overlap_param_gather
            or scenario.cluster.shared_memory is not None or moe is not None and moe.routing.model != "balanced"):
        return scenario
    raw = scenario.model_dump(mode="json")
    raw["numerics"], raw["parallel"]["representatives"] = False, True
    try:
        return validate_scenario(raw, base_dir=scenario.base_dir)
    except ScenarioError:  # a scenario whose ranks cannot be mirrored replays every rank
        return scenario


class _Probe:
    """Replays of one scenario at several batch sizes, each replayed once."""

    def __init__(self, scenario: Scenario):
        self.scenario = _mirrored(scenario)
        self.resolved = resolve_cluster(scenario.cluster, scenario.base_dir)  # for every replay
        self._peaks: dict[int, list[int]] = {}
        self._given = scenario

    def replay(self, batch_size: int) -> Job:
        try:
            job = replay_step(self.scenario, self.resolved, batch_size)
        except ScenarioError as error:  # representatives refused once the layout is known (HSDP): every rank replayed
            if self.scenario is self._given or isinstance(error, PastLimit):  # (a limit holds for every rank's too)
                raise
            self.scenario = self._given
            job = replay_step(self.scenario, self.resolved, batch_size)
        self._peaks[batch_size] = [ledger.peak_total for ledger in _ledgers(job)]
        return job

    def peak(self, rank: int, batch_size: int) -> int:
        if batch_size not in self._peaks:
            self.replay(batch_size)
        return self._peaks[batch_size][rank]

    def fits(self, rank: int, batch_size: int, capacity_bytes: float) -> bool:
        return self.peak(rank, batch_size) <= capacity_bytes


def plan_memory(scenario: Scenario, batch_size: int | None = None) -> list[DeviceMemory]:
    """Per device: the peak of one training step at `batch_size` (default the scenario's), by category."""
    probe = _Probe(scenario)
    job = probe.replay(scenario.data.batch_size if batch_size is None else batch_size)
    sizes = _batch_sizes(job)
    return [DeviceMemory(rank=rank, device=device.spec.name, capacity_bytes=int(device.spec.memory_bytes),
                         peak_bytes=ledger.peak_total, by_category=dict(ledger.peak_breakdown),
                         search_largest=partial(_largest, probe, rank, device.spec.memory_bytes, sizes))
            for rank, (device, ledger) in enumerate(zip(job.devices, _ledgers(job)))]


def _ledgers(job: Job) -> list:
    """Each job rank's memory ledger: a rank that representatives mirror (strategies/representatives.py) holds
    what its representative holds, as the run's report says."""
    mirror_of, devices = job.scheme.mirror_of, job.cluster.devices
    return [devices[mirror_of.get(device.rank, device.rank)].memory for device in job.devices]


def plan_host_memory(scenario: Scenario, batch_size: int | None = None) -> HostMemory | None:
    """The peak of the cluster's shared memory over one training step, by category; None without one."""
    if scenario.cluster.shared_memory is None:
        return None
    job = _Probe(scenario).replay(scenario.data.batch_size if batch_size is None else batch_size)
    store = job.cluster.shared_memory
    return HostMemory(location=store.location,
                      capacity_bytes=None if store.capacity_bytes is None else int(store.capacity_bytes),
                      peak_bytes=store.memory.peak_total, by_category=dict(store.memory.peak_breakdown))


def _batch_sizes(job: Job) -> tuple[int, int]:
    """(smallest, step) of the batch sizes the job can run: a pipeline cuts its batch into
    `microbatches` equal parts (step), and a model with BatchNorm cannot train on one sample
    per channel (smallest 2)."""
    parallel = job.scenario.parallel
    step = parallel.microbatches
    batchnorm = any(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in job.model.modules())
    return (step * 2 if batchnorm and step == 1 else step), step


def _largest(probe: _Probe, rank: int, capacity_bytes: float, sizes: tuple[int, int]) -> int:
    """The largest batch size (a multiple of step, from smallest) whose step fits; 0 if none does.
    Secant predictions confirmed by replays, then doubling and bisection between the sizes known to fit and not."""
    smallest, step = sizes
    if not probe.fits(rank, smallest, capacity_bytes):
        return 0
    fits, too_big = smallest, None
    line = [smallest, min(2 * smallest, _LARGEST_PROBE)]
    for _ in range(_SECANT_ROUNDS):
        guess = _on_the_line(probe, rank, capacity_bytes, line, step)
        if guess is None:
            break
        for candidate in (guess, min(guess + step, _LARGEST_PROBE)):
            if probe.fits(rank, candidate, capacity_bytes):
                fits = max(fits, candidate)
            else:
                too_big = candidate if too_big is None else min(too_big, candidate)
        if too_big is not None and too_big - fits <= step:
            return fits
        line = [line[-1], guess]
    while too_big is None:
        candidate = fits * 2
        if candidate > _LARGEST_PROBE:
            return fits
        if probe.fits(rank, candidate, capacity_bytes):
            fits = candidate
        else:
            too_big = candidate
    while too_big - fits > step:
        middle = (fits + too_big) // 2 // step * step
        if probe.fits(rank, middle, capacity_bytes):
            fits = middle
        else:
            too_big = middle
    return fits


def _on_the_line(probe: _Probe, rank: int, capacity_bytes: float, line: list[int], step: int) -> int | None:
    """The batch size (a multiple of step) where the line through the peaks replayed at `line`'s two sizes meets
    the capacity; None where the peak does not grow between them or the line meets it outside the sizes tried."""
    (a, b) = line
    if a == b:
        return None
    peak_a, peak_b = (probe.peak(rank, size) for size in line)
    if peak_b <= peak_a:
        return None
    guess = int(a + (capacity_bytes - peak_a) * (b - a) // (peak_b - peak_a)) // step * step
    return guess if step <= guess < _LARGEST_PROBE else None
