"""Heterogeneous and noisy devices: stragglers, per-rank device overrides, compute jitter.

References: closed-form step times from the catalog's FLOP rates and the
ring all-reduce formula, the share of updates a straggler can make, and the
moments of the lognormal distribution.
"""
import math

import numpy as np
import pytest
import simpy

import simtrain
from simtrain.scenario import ModelSpec, OptimizerSpec
from simtrain.cost import measure_step_cost
from simtrain.hw.catalog import CATALOG
from simtrain.hw.device import Device, span_sigma
from simtrain.hw.eventlog import EventLog
from simtrain.real.fit import ComputeJitter, modelled_wait
from simtrain.scenario import validate_scenario
from simtrain.train.data import ShardLoader, load_dataset
from simtrain.train.models import build_model
from simtrain.train.optim import optimizer_step_bytes

HIDDEN, BATCH, SEED = [32], 16, 2
EFFICIENCY = 0.001  # slow devices: compute dominates, as for a big model
STORE = {"location": "host", "bandwidth": "100 GB/s", "latency": "100 ns",
         "host_link": {"bandwidth": "32 GB/s", "latency": "1 us"}}


def scenario(devices, steps, mode, trace=False, **cluster):
    return validate_scenario({
        "name": "t", "seed": SEED,
        "cluster": {"topology": "ring", "devices": devices, "device": {"base": "a100-40gb", "efficiency": EFFICIENCY},
                    "shared_memory": STORE, **cluster},
        "model": {"name": "mlp", "hidden": HIDDEN},
        "data": {"name": "digits", "batch_size": BATCH},
        "train": {"steps": steps, "optimizer": {"name": "sgd", "lr": 0.1}},
        "parallel": {"mode": mode},
        "report": {"trace": trace},
    })


def step_costs():
    """Forward and backward FLOPs of one batch, and the parameters' bytes."""
    data = load_dataset("digits", {}, SEED)
    model = build_model(ModelSpec(name="mlp", hidden=HIDDEN), data.info, SEED)
    x, y = ShardLoader(data.train, 1, 0, BATCH, SEED).next_batch()
    cost = measure_step_cost(model, x, y)
    return cost.forward_flops, cost.backward_flops, sum(p.numel() * 4 for p in model.parameters())


def test_sync_step_time_follows_the_straggler():
    world, slowdown, steps = 4, 4.0, 6
    data = simtrain.run(scenario(world, steps, "sync", overrides={2: {"slowdown": slowdown}})).data
    forward, backward, param_bytes = step_costs()
    spec = CATALOG["a100-40gb"]
    compute = (forward + backward) / (spec.peak_flops["fp32"] * EFFICIENCY)
    optimizer = optimizer_step_bytes(OptimizerSpec(name="sgd", lr=0.1), param_bytes) / (spec.memory_bandwidth * EFFICIENCY)
    ring = 2 * (world - 1) * (5e-6 + param_bytes / world / 50e9)  # 2(N-1)(alpha + S/(N B))
    # The straggler is on the critical path every step; everyone else waits for it at the all-reduce.
    assert data["step_time_s"] == pytest.approx(slowdown * (compute + optimizer) + ring, rel=1e-4)
    for device in data["devices"]:
        spent = device["breakdown_s"]
        if device["rank"] == 2:
            assert spent["idle"] / steps < 1e-3 * data["step_time_s"]
        else:  # a fast rank: its own work, then the straggler's extra work and the ring, waiting or sending
            waiting = (spent["idle"] + spent["communication"]) / steps
            assert waiting == pytest.approx((slowdown - 1) * (compute + optimizer) + ring, rel=1e-4)
            assert spent["idle"] / steps > (slowdown - 1) * (compute + optimizer) - ring


def test_async_throughput_loses_only_the_stragglers_share():
    world, slowdown, steps = 4, 4.0, 240
    equal = simtrain.run(scenario(world, steps, "async")).data
    straggler = simtrain.run(scenario(world, steps, "async", overrides={0: {"slowdown": slowdown}})).data
    # A worker's cycle: pull and push (host link and store latencies, host-link bandwidth),
    # forward+backward on its device (slowed), the store's optimizer step (not slowed).
    forward, backward, param_bytes = step_costs()
    compute = (forward + backward) / (CATALOG["a100-40gb"].peak_flops["fp32"] * EFFICIENCY)
    transfers = 2 * (1.1e-6 + param_bytes / 32e9)
    apply = optimizer_step_bytes(OptimizerSpec(name="sgd", lr=0.1), param_bytes) / 100e9
    fast_cycle, slow_cycle = compute + transfers + apply, slowdown * compute + transfers + apply
    # Workers never wait for each other: the group's rate is the sum of its members' rates.
    share = ((world - 1) / fast_cycle + 1 / slow_cycle) / (world / fast_cycle)
    assert straggler["throughput_samples_per_s"] / equal["throughput_samples_per_s"] == pytest.approx(share, rel=0.03)
    per_rank = straggler["async"]["updates_per_rank"]
    assert per_rank[0] / np.mean(per_rank[1:]) == pytest.approx(fast_cycle / slow_cycle, rel=0.1)
    # The same straggler stalls a sync group: every step waits for its whole compute and optimizer step.
    sync_equal = simtrain.run(scenario(world, steps // world, "sync")).data
    sync_straggler = simtrain.run(scenario(world, steps // world, "sync", overrides={0: {"slowdown": slowdown}})).data
    optimizer = optimizer_step_bytes(OptimizerSpec(name="sgd", lr=0.1), param_bytes) / (
        CATALOG["a100-40gb"].memory_bandwidth * EFFICIENCY)
    ring = 2 * (world - 1) * (5e-6 + param_bytes / world / 50e9)
    ratio = sync_straggler["throughput_samples_per_s"] / sync_equal["throughput_samples_per_s"]
    assert ratio == pytest.approx((compute + optimizer + ring) / (slowdown * (compute + optimizer) + ring), rel=1e-3)
    assert ratio < share


def test_a_rank_can_be_another_device():
    data = simtrain.run(scenario(2, 2, "sync", trace=True, overrides={1: {"device": "v100-16gb"}})).data
    assert [d["device"] for d in data["devices"]] == ["a100-40gb", "v100-16gb"]
    assert data["devices"][1]["capacity_bytes"] == 16 * 2**30
    # The V100 runs at its own (full catalog) efficiency: the override replaces the whole device.
    forward, backward, _ = step_costs()
    v100 = CATALOG["v100-16gb"]
    assert data["devices"][1]["breakdown_s"]["compute"] == pytest.approx(
        2 * (forward + backward) / (v100.peak_flops["fp32"] * v100.efficiency), rel=1e-9)


def test_a_device_field_can_be_overridden_per_rank():
    data = simtrain.run(scenario(2, 3, "sync", overrides={0: {"efficiency": 4 * EFFICIENCY}})).data
    fast, slow = (d["breakdown_s"]["compute"] for d in data["devices"])
    assert slow / fast == pytest.approx(4.0, rel=1e-9)


def test_compute_jitter_is_lognormal_with_mean_one_per_rank_and_seeded():
    sigma, steps = 0.2, 150
    report = simtrain.run(scenario(2, steps, "sync", trace=True, compute_jitter=sigma))
    forward, backward, _ = step_costs()
    rate = CATALOG["a100-40gb"].peak_flops["fp32"] * EFFICIENCY
    nominal = {"forward": forward / rate, "backward": backward / rate}
    factors = {0: [], 1: []}
    for event in report.trace["traceEvents"]:
        if event["ph"] == "X" and event["pid"] == 0 and event.get("cat") == "compute":
            factors[event["tid"]].append(event["dur"] / 1e6 / nominal[event["name"]])
    for rank in (0, 1):
        logs = np.log(factors[rank])
        assert len(logs) == 2 * steps
        # log(factor) ~ N(-sigma^2 / 2, sigma^2): mean factor 1. Tolerances: ~4 standard errors.
        assert logs.std() == pytest.approx(sigma, rel=0.12)
        assert logs.mean() == pytest.approx(-sigma**2 / 2, abs=4 * sigma / math.sqrt(len(logs)))
    assert factors[0] != factors[1]  # each rank has its own stream
    again = simtrain.run(scenario(2, steps, "sync", trace=True, compute_jitter=sigma))
    assert again.data["sim_time_s"] == report.data["sim_time_s"]


def test_fixed_compute_jitter_adds_a_variance_that_does_not_grow_with_the_span():
    """Reference: the closed form of the noise. A span of mean t is lognormal with mean t and variance
    v = t² (e^σ² - 1) + s², so log(time) is normal with variance log(1 + v / t²) and mean log t less half of
    it. Drawn 20,000 times by a device, for a span shorter than s and one longer, within 4 standard errors."""
    sigma, fixed, draws = 0.1, 1e-3, 20_000
    env, log = simpy.Environment(), EventLog()
    spec = CATALOG["a100-40gb"]
    device = Device(env, 0, "gpu0", spec, log, jitter=sigma, jitter_fixed=fixed, rng=np.random.default_rng(7))
    rate = spec.peak_flops["fp32"] * spec.efficiency
    for nominal in (0.5e-3, 8e-3):
        start = len(log.spans)
        for _ in range(draws):
            device.compute(nominal * rate, "fp32", "span")
        logs = np.log([span.end - span.start for span in log.spans[start:]])
        log_variance = math.log1p((nominal**2 * math.expm1(sigma**2) + fixed**2) / nominal**2)
        error = math.sqrt(log_variance / draws)
        assert logs.mean() == pytest.approx(math.log(nominal) - log_variance / 2, abs=4 * error)
        assert logs.std() == pytest.approx(math.sqrt(log_variance), abs=4 * error / math.sqrt(2))
    assert span_sigma(0.5e-3, sigma, 0.0) == sigma  # without the fixed part, σ itself: the draws of before


def test_ranks_wait_for_each_other_as_calibration_models_it():
    """Reference: the wait calibration fits the noise to (real/fit.py modelled_wait, its own draws of the
    model). Two ranks of a sync run without overlap (a forward and a backward span a step), 400 steps: each
    waits at the all-reduce for the other, on average, what the model gives for their nominal spans (within
    8%: the standard error of 800 heavy-tailed waits is about 3%)."""
    steps, jitter = 400, ComputeJitter(0.2, 8e-6)  # spans of about 4 us: the fixed part twice them
    report = simtrain.run(validate_scenario({
        "name": "t", "seed": SEED,
        "cluster": {"topology": "ring", "devices": 2, "device": {"base": "a100-40gb", "efficiency": EFFICIENCY},
                    "compute_jitter": jitter.sigma, "compute_jitter_fixed": jitter.fixed_s},
        "model": {"name": "mlp", "hidden": HIDDEN}, "data": {"name": "digits", "batch_size": BATCH},
        "train": {"steps": steps, "optimizer": {"name": "sgd", "lr": 0.1}},
        "parallel": {"mode": "sync", "overlap": False}}))
    forward, backward, _ = step_costs()
    rate = CATALOG["a100-40gb"].peak_flops["fp32"] * EFFICIENCY
    waits = [device["breakdown_s"]["idle"] / steps for device in report.data["devices"]]
    modelled = modelled_wait(jitter, [forward / rate], [backward / rate])[0]
    assert np.mean(waits) == pytest.approx(modelled, rel=0.08)
