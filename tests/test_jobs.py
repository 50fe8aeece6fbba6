"""Jobs on one cluster, the scheme registry, and the memory plan as a replay of the step programs.

References: closed-form transfer times of the flow model (two flows on one
link get half of it each); a job trained alone (its numbers do not depend on
its neighbours); the memory ledgers of real runs; real runs at the planned
largest batch and one sample more.
"""
import re
from pathlib import Path

import pytest
import torch

import simtrain
from simtrain import schemes
from simtrain.errors import ScenarioError
from simtrain.hw.cluster import build_cluster, run_to_end
from simtrain.hw.resolved_cluster import resolve_cluster
from simtrain.job import Job
from simtrain.memory_plan import plan_memory, replay_step
from simtrain.report import build_trace
from simtrain.scenario import SharedMemorySpec, validate_scenario
from simtrain.schemes import scheme_name
from simtrain.schemes.asynchronous import AsynchronousSGD
from simtrain.schemes.model_parallel import ModelParallel
from simtrain.units import format_seconds

BANDWIDTH, LATENCY, STEPS = 10e9, 2e-6, 3
# Two switches joined by one uplink, two GPUs on each; every link 10 GB/s per direction, 2 us.
TWO_SWITCHES = f"""
gpus: [gpu0, gpu1, gpu2, gpu3]
switches: [sw0, sw1]
links:
  - {{between: [gpu0, sw0], bandwidth: {BANDWIDTH}, latency: {LATENCY}}}
  - {{between: [gpu1, sw0], bandwidth: {BANDWIDTH}, latency: {LATENCY}}}
  - {{between: [gpu2, sw1], bandwidth: {BANDWIDTH}, latency: {LATENCY}}}
  - {{between: [gpu3, sw1], bandwidth: {BANDWIDTH}, latency: {LATENCY}}}
  - {{between: [sw0, sw1], bandwidth: {BANDWIDTH}, latency: {LATENCY}}}
"""


def job_scenario(tmp_path, name: str, devices=None):
    topology = tmp_path / "two-switches.yaml"
    topology.write_text(TWO_SWITCHES)
    cluster = {"topology": str(topology)} if devices is None else {"topology": "switch", "devices": devices}
    return validate_scenario({
        "name": name, "seed": 3, "cluster": cluster,
        "model": {"name": "mlp", "hidden": [16]},  # 1,210 parameters: two equal ring chunks of 605
        "data": {"name": "digits", "batch_size": 16},
        "train": {"steps": STEPS, "optimizer": {"name": "sgd", "lr": 0.1}},
        "parallel": {"all_reduce": "ring"},
    })


def run_two_jobs(tmp_path, ranks_a, ranks_b):
    scenario_a, scenario_b = job_scenario(tmp_path, "a"), job_scenario(tmp_path, "b")
    cluster = build_cluster(scenario_a.cluster, scenario_a.base_dir)
    jobs = [Job(scenario_a, cluster, ranks_a), Job(scenario_b, cluster, ranks_b)]
    for job in jobs:
        job.start()
    run_to_end(cluster.env)
    assert not any(job.scheme.stuck() for job in jobs)
    return cluster, jobs


def communication_per_step(cluster, rank):
    return cluster.log.total(rank, "communication") / STEPS


@pytest.mark.parametrize("ranks_a, ranks_b, hops, sharers", [
    ([0, 2], [1, 3], 3, 2),  # both jobs cross the uplink sw0 - sw1: each gets half of it
    ([0, 1], [2, 3], 2, 1),  # each job stays on its own switch: neither slows the other
])
def test_two_jobs_share_the_links_their_routes_have_in_common(tmp_path, ranks_a, ranks_b, hops, sharers):
    cluster, jobs = run_two_jobs(tmp_path, ranks_a, ranks_b)
    chunk_bytes = 605 * 4
    # Ring all-reduce of 2 ranks: one reduce-scatter and one all-gather transfer per step.
    expected = 2 * (hops * LATENCY + chunk_bytes / (BANDWIDTH / sharers))
    for rank in range(4):
        assert communication_per_step(cluster, rank) == pytest.approx(expected, rel=1e-9)


def test_a_job_trains_on_a_shared_cluster_exactly_as_alone(tmp_path):
    cluster, jobs = run_two_jobs(tmp_path, [0, 2], [1, 3])
    alone = simtrain.run(job_scenario(tmp_path, "alone", devices=2))
    for job in jobs:
        for mine, reference in zip(job.scheme.final_models(), alone.final_models):
            for (name, a), (_, b) in zip(mine.state_dict().items(), reference.state_dict().items()):
                assert torch.equal(a, b), name


def test_jobs_are_told_apart_in_the_event_log_and_the_trace(tmp_path):
    cluster, jobs = run_two_jobs(tmp_path, [0, 2], [1, 3])
    assert {(span.rank, span.job) for span in cluster.log.spans} == {(0, 0), (2, 0), (1, 1), (3, 1)}
    trace = build_trace(cluster)["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "process_name"}
    assert processes == {0: "job a", 1: "job b", 2: "links"}
    tracks = {(e["pid"], e["tid"]) for e in trace if e["ph"] == "X" and e["pid"] < 2}
    streams = {(job, 4 + rank) for job, rank in ((0, 0), (0, 2), (1, 1), (1, 3))}  # overlapped all-reduces
    assert tracks == {(0, 0), (0, 2), (1, 1), (1, 3)} | streams
    with pytest.raises(ValueError, match="belong to another job"):
        Job(job_scenario(tmp_path, "c"), cluster, [3])


@pytest.mark.parametrize("parallel, devices, name, scheme", [
    ({}, 4, "data_parallel", ModelParallel),  # data parallelism alone: the step engine's pp = tp = cp = 1 case
    ({"all_reduce": "tree"}, 4, "data_parallel", ModelParallel),
    ({"mode": "async"}, 4, "async", AsynchronousSGD),
    ({"pp": 2}, 4, "model_parallel", ModelParallel),
    ({"tp": 2, "all_reduce": "naive"}, 4, "model_parallel", ModelParallel),
])
def test_the_scheme_follows_from_the_layout_and_the_mode(parallel, devices, name, scheme):
    spec = validate_scenario({"cluster": {"devices": devices}, "model": {"hidden": [32, 32, 32]},
                              "data": {"batch_size": 8}, "train": {"steps": 1}, "parallel": parallel,
                              "report": {"trace": False}})
    assert scheme_name(spec.parallel) == name
    cluster = build_cluster(spec.cluster, record=False)
    job = Job(spec, cluster, range(devices))
    assert type(job.scheme) is scheme
    # the memory plan replays the same scheme's programs (before, it looked up the all-reduce algorithm)
    assert type(replay_step(spec, resolve_cluster(spec.cluster), 8).scheme) is scheme
    assert simtrain.run(spec).data["scheme"] == name


def test_the_old_parallel_scheme_key_is_one_line_naming_the_new_keys():
    for old in ("ring", "async"):
        with pytest.raises(ScenarioError, match=r"^scenario: parallel.scheme: replaced by parallel.all_reduce "
                                                r"\(naive \| ring \| tree \| hierarchical \| dbtree\) and "
                                                r"parallel.mode \(sync \| async\)"):
            validate_scenario({"parallel": {"scheme": old}})


# ---------------------------------------------------------------- the memory plan replays the programs

TECHNIQUES = {
    "sync sgd momentum": {"train": {"optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}}},
    "async": {"parallel": {"mode": "async"}},
    "kfac": {"train": {"optimizer": {"name": "kfac", "lr": 0.1}}},
    "sync batchnorm": {"model": {"batchnorm": True}, "parallel": {"sync_batchnorm": True}},
    "fp16 + checkpointing": {"train": {"precision": "fp16", "checkpointing": "sqrt"}},
    "bf16 adam, tree": {"train": {"precision": "bf16", "optimizer": {"name": "adam", "lr": 1e-3}},
                        "parallel": {"all_reduce": "tree"}},
}


def technique(name, batch=32, steps=2, memory=None):
    extra = TECHNIQUES[name]
    device = {"base": "a100-40gb", **({"memory": memory} if memory is not None else {})}
    return validate_scenario({
        "name": "memory", "seed": 2,
        "cluster": {"topology": "ring", "devices": 3, "device": device},
        "model": {"name": "mlp", "hidden": [48, 48, 48], **extra.get("model", {})},
        "data": {"name": "digits", "batch_size": batch},
        "train": {"steps": steps, **extra.get("train", {})},
        "parallel": extra.get("parallel", {}),
        "report": {"trace": False},
    })


@pytest.mark.slow
@pytest.mark.parametrize("name", TECHNIQUES)
def test_the_memory_plan_holds_what_a_run_holds(name):
    spec = technique(name, steps=6)  # async: two updates per worker
    report = simtrain.run(spec)
    assert report.data["status"] == "ok"
    for plan, device in zip(plan_memory(spec), report.data["devices"]):
        assert plan.peak_bytes == device["peak_memory_bytes"]
        assert plan.by_category == device["peak_memory_bytes_by_category"]


@pytest.mark.slow
@pytest.mark.parametrize("name", TECHNIQUES)
def test_the_largest_batch_that_fits_fits_and_one_more_sample_does_not(name):
    capacity = plan_memory(technique(name), batch_size=100)[0].peak_bytes  # so that about 100 fit
    largest = plan_memory(technique(name, memory=capacity))[0].largest_batch
    assert 100 <= largest < 200
    fits = simtrain.run(technique(name, batch=largest, steps=3, memory=capacity))
    assert fits.data["status"] == "ok"
    too_big = simtrain.run(technique(name, batch=largest + 1, steps=3, memory=capacity))
    assert too_big.data["status"] == "out_of_memory"
    assert too_big.data["out_of_memory"]["largest_batch_size_that_fits"] == largest


@pytest.mark.slow
def test_batchnorm_models_are_planned_from_two_samples():
    # torch's BatchNorm cannot train on one sample: the search starts at 2 (and never crashes on 1).
    capacity = plan_memory(technique("sync batchnorm"), batch_size=2)[0].peak_bytes
    spec = technique("sync batchnorm", memory=capacity)
    largest = plan_memory(spec)[0].largest_batch
    assert largest >= 2
    assert plan_memory(spec, batch_size=largest)[0].peak_bytes <= capacity
    assert plan_memory(spec, batch_size=largest + 1)[0].peak_bytes > capacity


# ---------------------------------------------------------------- friction a new user met

def test_async_gets_a_default_store_in_host_memory():
    spec = validate_scenario({"parallel": {"mode": "async"}})
    assert spec.cluster.shared_memory == SharedMemorySpec()
    assert spec.cluster.shared_memory.host_link.bandwidth == 31.5e9
    report = simtrain.run(technique("async", steps=4))
    assert report.data["status"] == "ok" and report.data["shared_memory"]["bandwidth_Bps"] == 204.8e9


@pytest.mark.parametrize("seconds, text", [
    (0.00679869, "6.80 ms"), (3.4e-5, "34.0 µs"), (1.2e-10, "0.120 ns"), (12.3456, "12.3 s"), (0.0, "0 s"),
    (0.99996, "1.00 s"), (7261.4, "7,260 s"),
])
def test_durations_print_with_a_fitting_unit(seconds, text):
    assert format_seconds(seconds) == text


def test_a_run_ends_with_its_last_span_not_with_a_stale_network_timeout():
    # Naive all-reduce on a 4x4 torus: flows re-share links as others end, and each rate change
    # leaves a finish timeout behind that fires later and does nothing. The run ends before it.
    spec = validate_scenario({"cluster": {"topology": "torus2d", "devices": 16}, "parallel": {"all_reduce": "naive"},
                              "train": {"steps": 3}})
    cluster = build_cluster(spec.cluster, spec.base_dir)
    job = Job(spec, cluster, range(cluster.size))
    job.start()
    run_to_end(cluster.env)
    last_span_end = max(span.end for span in cluster.log.spans)
    assert cluster.env.now > last_span_end * (1 + 1e-3)  # the stale tail exists
    report = simtrain.run(spec)
    assert report.data["sim_time_s"] == last_span_end
    assert report.data["step_time_s"] == last_span_end / 3


def test_a_new_scheme_is_one_file_and_one_registry_line(monkeypatch):
    """The worked example of docs/concepts/schemes.md, run as written: registered with one line, the runner
    finds and runs it. Its replicas never communicate: on one device it trains what data parallelism trains
    (whose all-reduce of one rank averages over one), and on two nothing crosses a link."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "concepts" / "schemes.md").read_text()
    example = next(block for block in re.findall(r"```python\n(.*?)```", page, re.S) if "class Independent" in block)
    namespace = {}
    exec(compile(example, "schemes.md", "exec"), namespace)
    independent = namespace["Independent"]
    monkeypatch.setattr(schemes, "SCHEMES", {"independent": independent, **schemes.SCHEMES})
    monkeypatch.setattr(independent, "applies", classmethod(lambda cls, parallel: parallel.all_reduce == "naive"))

    def scenario(devices, all_reduce):
        return validate_scenario({"cluster": {"devices": devices}, "model": {"hidden": [32]},
                                  "data": {"batch_size": 16}, "train": {"steps": 4},
                                  "parallel": {"all_reduce": all_reduce}, "report": {"trace": False}})

    alone, reference = simtrain.run(scenario(1, "naive")), simtrain.run(scenario(1, "ring"))
    assert alone.data["scheme"] == "independent" and reference.data["scheme"] == "data_parallel"
    for mine, theirs in zip(alone.final_model.parameters(), reference.final_model.parameters()):
        assert torch.equal(mine, theirs)
    pair = simtrain.run(scenario(2, "naive"))
    assert pair.data["scheme"] == "independent" and all(link["bytes"] == 0 for link in pair.data["links"])
    first, second = pair.final_models
    assert not torch.equal(next(first.parameters()), next(second.parameters()))  # each trained on its own shard
