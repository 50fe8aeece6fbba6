"""Kineto traces (report/kineto.py) read by Holistic Trace Analysis 0.5.0, unmodified: HTA's figures against ours.

A data-parallel MLP 64 -> 256 -> 256 -> 256 -> 10 on four slow devices (1e9 FLOP/s, 1e9 B/s of memory) over a
ring of 1e9 B/s links, its gradients all-reduced in a bucket per layer during the backward (DDP's overlap). Rank
3 is a straggler (slowdown 1.25): the others wait for it inside every all-reduce, idle time that report.json
counts as idle, and so must HTA.

References:
- report.json, per rank: HTA's compute time is our compute + optimizer; its non-compute time (GPU busy with no
  compute kernel) our exposed communication; its idle time our idle time, less the parts of the run before the
  rank's first kernel and after its last (HTA measures a rank from its first kernel to its last: the window is
  read from trace.json, the Chrome trace of the same run);
- closed forms: where no rank waits for a peer (rank 3, the straggler; every rank of the run with
  representatives), an all-reduce of F floats takes 2(N-1)(alpha + ceil(F/N) * 4 B / bandwidth); every bucket
  but the first layer's hides behind the backward of the layer below (tests/test_overlap.py's premise, ten times
  slower), so HTA's overlap is 1 - that bucket's all-reduce over all of them;
- users' code under simtrain.dist.spawn: the DistReport's compute and communication seconds per rank.

Tolerance: the traces are in whole microseconds, each span's ends rounded to the nearest, so a union of n
kernels' intervals moves by at most n us; HTA's idle and non-compute times are differences of two such unions
and a window: at most 2n + 1 us for a rank of n kernels (about 0.05 % of its 0.2 s here).
"""
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hta import trace_analysis as hta_trace_analysis

import simtrain
import simtrain.dist
from simtrain.dist import Representatives
from simtrain.scenario import validate_scenario

# HTA 0.5.0 calls pandas in ways pandas 3 deprecates (inplace=, lsuffix=): its warnings, not ours
pytestmark = [pytest.mark.filterwarnings("ignore::pandas.errors.Pandas4Warning"), pytest.mark.slow]

WIDTHS, BATCH, WORLD, STEPS = [64, 256, 256, 256, 10], 64, 4, 3
RATE, ALPHA, BANDWIDTH, STRAGGLER = 1e9, 1e-5, 1e9, 3


def scenario(representatives: bool) -> dict:
    cluster = {"topology": "ring", "devices": WORLD, "link": {"bandwidth": BANDWIDTH, "latency": ALPHA},
               "device": {"base": "a100-40gb", "efficiency": 1.0, "memory_bandwidth": 1e9,
                          "peak_flops": {dtype: RATE for dtype in ("fp32", "tf32", "fp16", "bf16")}}}
    if not representatives:
        cluster["overrides"] = {STRAGGLER: {"slowdown": 1.25}}
    return validate_scenario({
        "name": "kineto", "seed": 1, "numerics": False, "cluster": cluster,
        "model": {"name": "mlp", "hidden": WIDTHS[1:-1]},
        "data": {"name": "digits", "batch_size": BATCH},
        "train": {"steps": STEPS, "optimizer": {"name": "sgd", "lr": 0.1}},
        "parallel": {"all_reduce": "ring", "overlap": True, "bucket_cap_mb": 0.005,
                     "representatives": representatives},
        "report": {"trace": True, "kineto": True},
    })


def ring_all_reduce_us(floats: int) -> float:
    return 2 * (WORLD - 1) * (ALPHA + math.ceil(floats / WORLD) * 4 / BANDWIDTH) * 1e6


LAYER_FLOATS = [WIDTHS[i] * WIDTHS[i + 1] + WIDTHS[i + 1] for i in range(len(WIDTHS) - 1)]
ALL_REDUCES_US = STEPS * sum(ring_all_reduce_us(floats) for floats in LAYER_FLOATS)
EXPOSED_US = STEPS * ring_all_reduce_us(LAYER_FLOATS[0])  # the first layer's bucket, completed last


class Run:
    """A scenario run written to a directory, and HTA's analysis of its kineto/ traces."""

    def __init__(self, out: Path, representatives: bool):
        simtrain.run(scenario(representatives)).write(out)
        self.data = json.loads((out / "report.json").read_text())
        self.traces = {int(path.stem.removeprefix("rank")): json.loads(path.read_text())
                       for path in sorted((out / "kineto").iterdir())}
        self.chrome = json.loads((out / "trace.json").read_text())
        self.analysis = hta_trace_analysis.TraceAnalysis(trace_dir=str(out / "kineto"))

    def kernels(self, rank: int) -> int:
        return sum(event.get("cat") in ("kernel", "gpu_memcpy") for event in self.traces[rank]["traceEvents"])

    def window_us(self, rank: int) -> tuple[float, float]:
        """The rank's first and last instants of work, from the Chrome trace."""
        spans = [event for event in self.chrome["traceEvents"]
                 if event["ph"] == "X" and event.get("pid") == 0 and event["tid"] in (rank, WORLD + rank)
                 and event["cat"] != "idle"]
        return min(event["ts"] for event in spans), max(event["ts"] + event["dur"] for event in spans)


@pytest.fixture(scope="module")
def straggler(tmp_path_factory):
    return Run(tmp_path_factory.mktemp("straggler"), representatives=False)


@pytest.fixture(scope="module")
def represented(tmp_path_factory):
    return Run(tmp_path_factory.mktemp("represented"), representatives=True)


def breakdown_by_rank(analysis) -> dict:
    """HTA's temporal breakdown, a row per rank."""
    return {row["rank"]: row for row in analysis.get_temporal_breakdown(visualize=False).to_dict("records")}


def test_temporal_breakdown_is_report_json_per_rank(straggler):
    hta = breakdown_by_rank(straggler.analysis)
    assert sorted(hta) == list(range(WORLD))
    waited = 0.0
    for device in straggler.data["devices"]:
        rank, ours = device["rank"], {kind: seconds * 1e6 for kind, seconds in device["breakdown_s"].items()}
        first_us, last_us = straggler.window_us(rank)
        outside_us = first_us + straggler.data["sim_time_s"] * 1e6 - last_us
        tolerance_us = 2 * straggler.kernels(rank) + 1
        assert hta[rank]["compute_time(us)"] == pytest.approx(ours["compute"] + ours["optimizer"], abs=tolerance_us)
        assert hta[rank]["non_compute_time(us)"] == pytest.approx(ours["communication"], abs=tolerance_us)
        assert hta[rank]["idle_time(us)"] == pytest.approx(ours["idle"] - outside_us, abs=tolerance_us)
        assert hta[rank]["kernel_time(us)"] == pytest.approx(last_us - first_us, abs=1)
        waited += ours["idle"]
    assert waited > 3 * 10_000  # the premise: the others waited for the straggler, 10+ ms each


def test_overlap_and_kernel_breakdown_of_a_rank_that_never_waits_are_the_closed_forms(straggler):
    overlap = straggler.analysis.get_comm_comp_overlap(visualize=False).set_index("rank")["comp_comm_overlap_pctg"]
    events = straggler.traces[STRAGGLER]["traceEvents"]
    communication_kernels = sum(event["name"].startswith("nccl") for event in events)
    # HTA rounds the percentage to 0.01; the hidden and the whole communication time move by n us at most each
    tolerance_pct = 0.005 + 100 * 2 * communication_kernels / ALL_REDUCES_US
    assert overlap[STRAGGLER] == pytest.approx(100 * (1 - EXPOSED_US / ALL_REDUCES_US), abs=tolerance_pct)
    by_type, by_kernel = straggler.analysis.get_gpu_kernel_breakdown(visualize=False)
    assert set(by_type["kernel_type"]) == {"COMPUTATION", "COMMUNICATION", "COMPUTATION overlapping COMMUNICATION"}
    kernels = by_kernel[by_kernel["rank"] == STRAGGLER].set_index("name")
    assert {"forward", "backward", "optimizer step", "ncclDevKernel_dp_allreduce"} <= set(kernels.index)
    assert kernels.loc["ncclDevKernel_dp_allreduce", "kernel_type"] == "COMMUNICATION"
    assert kernels.loc["ncclDevKernel_dp_allreduce", "sum (us)"] == pytest.approx(ALL_REDUCES_US,
                                                                                  abs=communication_kernels)


def test_idle_time_breakdown_finds_no_host_wait(straggler):
    """The simulator models no host: every gap on the compute stream is a wait on other kernels, and its sum is
    the rank's idle and exposed communication time within its window."""
    idle, _ = straggler.analysis.get_idle_time_breakdown(ranks=[0], visualize=False)
    assert "host_wait" not in set(idle[idle["idle_time"] > 0]["idle_category"])
    device = straggler.data["devices"][0]["breakdown_s"]
    first_us, last_us = straggler.window_us(0)
    outside_us = first_us + straggler.data["sim_time_s"] * 1e6 - last_us
    compute_stream = idle[idle["stream"] == 7]["idle_time"].sum()
    assert compute_stream == pytest.approx((device["idle"] + device["communication"]) * 1e6 - outside_us,
                                           abs=2 * straggler.kernels(0) + 1)


def test_a_representative_writes_the_trace_of_its_class(represented):
    """With representatives, rank 0 runs for all four: one trace, standing for ranks 0-3, whose figures are
    each rank's in report.json and the closed forms (no rank waits)."""
    assert represented.data["parallel"]["representatives"]
    assert list(represented.traces) == [0]
    assert represented.traces[0]["simtrain"]["stands_for"] == [0, 1, 2, 3]
    assert represented.traces[0]["distributedInfo"] == {"backend": "nccl", "rank": 0, "world_size": WORLD}
    hta = breakdown_by_rank(represented.analysis)[0]
    tolerance_us = 2 * represented.kernels(0) + 1
    for device in represented.data["devices"]:
        ours = {kind: seconds * 1e6 for kind, seconds in device["breakdown_s"].items()}
        assert hta["compute_time(us)"] == pytest.approx(ours["compute"] + ours["optimizer"], abs=tolerance_us)
        assert hta["non_compute_time(us)"] == pytest.approx(ours["communication"], abs=tolerance_us)
    assert hta["non_compute_time(us)"] == pytest.approx(EXPOSED_US, abs=tolerance_us)


def all_reduce_steps(rank, world):
    """Three steps of a matmul's worth of compute, then a blocking all-reduce of 1 MB."""
    dist.init_process_group("simtrain")
    grads = torch.ones(262_144)
    for _ in range(STEPS):
        simtrain.dist.compute(2e10, name="matmul")
        dist.all_reduce(grads)
    return rank


@pytest.mark.parametrize("options, written", [
    (dict(numerics=True), [0, 1, 2, 3]),
    (dict(numerics=False, representatives=Representatives((WORLD,), alike_dims=(0,))), [0]),
])
def test_users_code_writes_traces_whose_figures_are_the_dist_report(tmp_path, options, written):
    results = simtrain.dist.spawn(all_reduce_steps, world=WORLD, topology="ring", bandwidth=BANDWIDTH,
                                  latency=ALPHA, device="a100-40gb", **options)
    paths = results.report.write_kineto(tmp_path)
    assert [path.name for path in paths] == [f"rank{rank}.json" for rank in written]
    hta = breakdown_by_rank(hta_trace_analysis.TraceAnalysis(trace_dir=str(tmp_path / "kineto")))
    for rank in written:
        ours = results.report.data["devices"][rank]
        kernels = sum(event.get("cat") == "kernel" for event in json.loads(paths[written.index(rank)].read_text())
                      ["traceEvents"])
        # blocking collectives: every second of communication is exposed
        assert hta[rank]["compute_time(us)"] == pytest.approx(ours["compute_s"] * 1e6, abs=2 * kernels + 1)
        assert hta[rank]["non_compute_time(us)"] == pytest.approx(ours["communication_s"] * 1e6, abs=2 * kernels + 1)
        assert hta[rank]["non_compute_time(us)"] > 1000  # the premise: 1 MB all-reduced three times at 1 GB/s
