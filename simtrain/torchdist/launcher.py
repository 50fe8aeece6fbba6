"""`spawn` runs a function as N ranks of torch.distributed on a simulated cluster; `distributed` makes it a test.

    def train(rank, world):
        dist.init_process_group("simtrain")       # rank and world come from the launcher
        ...
    results = spawn(train, world=8, scenario="scenarios/quickstart.yaml")
    results[3]                  # rank 3's return value
    results.report.data         # simulated time per rank, bytes per link, memory and time per device
    results.report.trace        # Chrome trace (Perfetto)
    results.report.write_kineto("runs/mine")   # runs/mine/kineto/rank<N>.json: PyTorch profiler traces (HTA)
    results.report.write_chakra("runs/mine")   # runs/mine/chakra/et.<rank>.et: Chakra execution traces

The cluster is a scenario's `cluster` section (with `cluster.devices` set to
`world`), or, without a scenario, the fields given here, validated the same
way (a mistake is one line naming the field); a keyword not given keeps the
scenario spec's default (simtrain/scenario/: cluster.topology, cluster.link,
cluster.device, parallel.all_reduce, parallel.channels), the one home of
each. Collectives that sum run the scenario's `parallel.all_reduce` algorithm
over its `parallel.channels`, or the `collective` given.

    @distributed(world=4, topology="ring", bandwidth="50 GB/s", latency="5 us")
    def test_my_allreduce(rank, world, cluster):
        ...
        assert cluster.bytes_sent(rank) <= 2 * (world - 1) / world * nbytes

`numerics=False` runs the ranks on fake tensors (numerics_off.py): the same
simulated time, bytes and memory as with numerics on, without the arithmetic,
so hundreds of ranks of a large model run in one process. The report gives each
rank's memory by category (memory_categories.py): `weights`, `gradients`,
`optimizer_state`, `activations`, `tensors` (the rest), `comm_buffers`, at the
peak (`peak_memory_bytes_by_category`) and each at its own peak
(`peak_memory_bytes_per_category`). A rank that blocks outside the scheduler (a
lock, `time.sleep`) for `timeout_s` seconds of wall time is `RankBlocked`.
With numerics off, `representatives=Representatives(mesh_shape, alike_dims)`
runs one rank per class of ranks alike along those mesh dimensions; the others
post their parts of its collectives (representatives.py).

`now_s()` in a rank reads the simulated clock, after the rank's counted ops.

`distributed` turns the function into a test without arguments, which pytest
collects like any other: nothing to register. The third argument is the run
(`bytes_sent`, `bytes_received`, `now_s`, `cluster`).
"""
import inspect
import numbers
from contextlib import nullcontext
from functools import cached_property
from pathlib import Path

from ..errors import ScenarioError
from ..hw.cluster import build_cluster
from ..report import build_kineto, build_trace, kineto_files, write_atomic
from ..report.chakra_files import chakra_files
from ..scenario import ClusterSpec, Scenario, apply_override, load_scenario, validate_scenario
from .memory_categories import categorized
from .numerics_off import initialisers_of_fakes
from .op_meter import sharding_propagation_unmetered, storage_resizes_metered
from .representatives import Representatives
from .run import SimRun

DEFAULT_TIMEOUT_S = 5.0  # the watchdog: wall time a rank may block outside the scheduler (scheduler.py)
from .world import ranks_as_threads


class DistReport:
    """What a spawn measured: `data` (JSON-ready figures) and `trace` (Chrome trace event format, built from the
    cluster's event log when first read: for hundreds of ranks it takes seconds); `write_kineto` and
    `write_chakra` write the PyTorch profiler and the Chakra execution traces."""

    def __init__(self, data: dict, cluster, mirror_of: dict[int, int]):
        self.data = data
        self._cluster = cluster
        self._mirror_of = mirror_of  # a represented rank -> its representative

    @cached_property
    def trace(self) -> dict:
        return build_trace(self._cluster)

    def write_kineto(self, out_dir) -> list[Path]:
        """Write out_dir/kineto/rank<N>.json, a PyTorch profiler (Kineto) trace per rank that ran (with
        representatives, each lists the ranks it stands for), which Holistic Trace Analysis reads
        (report/kineto.py); the paths written."""
        out_dir = Path(out_dir)
        (out_dir / "kineto").mkdir(parents=True, exist_ok=True)
        traces = build_kineto(self._cluster, range(self._cluster.size), self._mirror_of)
        return [write_atomic(out_dir / name, lambda f, p=payload: f.write(p))
                for name, payload in kineto_files(traces).items()]

    def chakra(self, steps: int = 1) -> dict[str, bytes]:
        """Each rank's Chakra execution trace, `et.<rank>.et`, and `comm_group.json` (report/chakra.py), by file
        name; `steps`, the training steps the ranks ran, for a replay's step time."""
        return chakra_files(self._cluster, list(range(self._cluster.size)), steps, self._mirror_of)

    def write_chakra(self, out_dir, steps: int = 1) -> Path:
        """Write `chakra()`'s files into out_dir/chakra/ (made if need be); that folder."""
        folder = Path(out_dir) / "chakra"
        folder.mkdir(parents=True, exist_ok=True)
        for name, payload in self.chakra(steps).items():
            write_atomic(folder / name, lambda f, p=payload: f.write(p))
        return folder


class SpawnResult(list):
    """The ranks' return values in rank order, with the run's `report`."""

    def __init__(self, values: list, report: DistReport):
        super().__init__(values)
        self.report = report


def spawn(fn, world: int | None = None, scenario=None, *, topology: str | None = None, bandwidth=None,
          latency=None, device=None, collective: str | None = None, channels: int | None = None,
          numerics: bool = True, timeout_s: float | None = DEFAULT_TIMEOUT_S,
          representatives: Representatives | None = None) -> SpawnResult:
    """Run `fn(rank, world)` as each rank of a simulated cluster; their values and the report. A keyword left
    None keeps the scenario's value (the spec's default without a scenario). `numerics=False`: the ranks'
    floating-point tensors are fake (numerics_off.py). `timeout_s`: the watchdog's seconds of wall time for a rank
    blocked outside the scheduler (scheduler.py; None: no watchdog). `representatives` (numerics off): the ranks
    that run alike along a mesh dimension run once (representatives.py)."""
    if not callable(fn):
        raise ScenarioError(f"simtrain.dist.spawn: fn: {fn!r} is not callable; give a function of (rank, world)")
    if not isinstance(numerics, bool):
        raise ScenarioError(f"simtrain.dist.spawn: numerics: expected True or False, got {numerics!r}")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real)
                                  or not timeout_s > 0):
        raise ScenarioError(f"simtrain.dist.spawn: timeout_s: expected a positive number of seconds or None, "
                            f"got {timeout_s!r}")
    if representatives is not None and numerics:
        raise ScenarioError("simtrain.dist.spawn: representatives: needs numerics=False (ranks alike run alike only "
                            "without values)")
    spec = spawn_scenario(world, scenario, topology, bandwidth, latency, device, collective, channels)
    cluster = build_cluster(spec.cluster, base_dir=spec.base_dir, seed=spec.seed)
    world = cluster.size
    cluster.add_job("spawn", list(range(world)))
    cluster.log.keep_messages()  # isend and irecv, for the report's Chakra traces (report/chakra.py)
    cluster.log.keep_communication_parts()  # for its Kineto traces (report/kineto.py), written after the run
    run = SimRun(cluster, world, spec.parallel.all_reduce, spec.parallel.channels, numerics, timeout_s,
                 representatives)
    with ranks_as_threads(world), categorized(run), sharding_propagation_unmetered(), \
            storage_resizes_metered(lambda rank: run.meters[rank]), \
            (nullcontext() if numerics else initialisers_of_fakes()):
        for rank in filter(run.runs, range(world)):
            run.start(rank, lambda rank=rank: fn(rank, world))
        values = run.finish()
    return SpawnResult(values, _report(run))


def distributed(world: int, scenario=None, **options):
    """Decorator: the test `fn(rank, world, run)` runs on `world` simulated ranks (`spawn`'s options)."""
    def decorate(fn):
        def test():
            spawn(lambda rank, size: fn(rank, size, SimRun.active("distributed")), world, scenario, **options)

        test.__name__, test.__qualname__, test.__doc__, test.__module__ = \
            fn.__name__, fn.__qualname__, fn.__doc__, fn.__module__
        test.__signature__ = inspect.Signature()
        return test

    return decorate


def compute(flops: float, dtype: str = "fp32", name: str = "compute") -> None:
    """In a rank: `flops` of `dtype` arithmetic on its device, after its counted torch ops."""
    SimRun.active("simtrain.dist.compute").compute(flops, dtype, name)


def now_s() -> float:
    """In a rank: the simulated time once its counted torch ops have run (as `torch.cuda.synchronize()` then a
    clock: a step's time is the difference of two readings)."""
    run = SimRun.active("simtrain.dist.now_s")
    run.flush()
    return run.now_s


def spawn_scenario(world, scenario, topology, bandwidth, latency, device, collective, channels) -> Scenario:
    """The scenario a spawn runs: the file's with `world`, `collective` and `channels` set, a Scenario given as it
    is, or the keywords given as a scenario's fields (every one left None keeps its spec's default)."""
    if world is not None and (isinstance(world, bool) or not isinstance(world, numbers.Integral)):
        raise ScenarioError(f"simtrain.dist.spawn: world: expected an integer, got {world!r}")
    overrides = [f"cluster.devices={world}"] if world is not None else []
    if collective is not None:
        overrides.append(f"parallel.all_reduce={collective}")
    if channels is not None:
        overrides.append(f"parallel.channels={channels}")
    if isinstance(scenario, Scenario):
        if overrides:
            raise ScenarioError("simtrain.dist.spawn: world, collective and channels: set them in the scenario given "
                                "(a Scenario is run as it is)")
        return scenario
    if scenario is not None:
        return load_scenario(scenario, overrides)
    if world is None:
        raise ScenarioError("simtrain.dist.spawn: world: needed without a scenario")
    raw = {}
    for override in overrides:
        apply_override(raw, override)
    cluster = raw["cluster"]
    for key, value in (("topology", topology), ("device", device)):
        if value is not None:
            cluster[key] = value
    link = {key: value for key, value in (("bandwidth", bandwidth), ("latency", latency)) if value is not None}
    if link:  # the other of the two keeps cluster.link's default
        cluster["link"] = {**ClusterSpec().link.model_dump(), **link}
    return validate_scenario(raw, source="simtrain.dist.spawn")


def _report(run: SimRun) -> DistReport:
    cluster = run.cluster
    log = cluster.log
    devices, bytes_sent = [], run.bytes_sent_by_rank()
    for device in cluster.devices:
        source = cluster.devices[run.reported_as(device.rank)]  # a represented rank: its representative
        devices.append({
            "rank": device.rank,
            "node": device.node,
            "end_s": run.rank_end_s(device.rank),
            "compute_s": log.total(source.rank, "compute"),
            "communication_s": log.total(device.rank, "communication"),
            "bytes_sent": bytes_sent[device.rank],
            "peak_memory_bytes": source.memory.peak_total,
            "peak_memory_bytes_by_category": dict(source.memory.peak_breakdown),
            "peak_memory_bytes_per_category": dict(source.memory.peak),
        })
    data = {"sim_time_s": log.last_end_s, "devices": devices, "links": cluster.network.link_stats()}
    mirror_of = {rank: run.reported_as(rank) for rank in range(run.world) if run.reported_as(rank) != rank}
    return DistReport(data, cluster, mirror_of)
