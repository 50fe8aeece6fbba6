"""ZeRO-Offload (strategies/offload.py): sharded data parallelism with the optimizer, and optionally the parameters, in
host memory, against its references.

- Numerics: the host steps the same fp32 shard with the same optimizer, so every offloaded run trains the
  unoffloaded sharded run's parameters bit for bit (fp32 and bf16), hence one device's within 1e-5 (fp32).
- Memory: each category of a device's ledger and of the host's equals ZeRO-Offload's closed form (Ren et al.
  2021: the device keeps the 16-bit parameters, 2 Psi, and under stage 1 the 16-bit gradient, 2 Psi; the host the
  fp32 master 4 Psi, the fp32 gradient 4 Psi and Adam's moments 8 Psi, Psi / N a rank), exactly in bytes;
  `simtrain memory`'s plans are what a run holds, on the devices and on the host.
- Time: with a slow host link a step is the closed form of the exposed copies and the host step; with a free
  host link it is the unoffloaded step less the device's update plus the host's step.
- Bad input: one line naming the key, exit 2.
"""
import pytest
import torch

from simtrain import plan_memory, run
from simtrain.scenario import validate_scenario
from simtrain.hw.host_compute import host_step_s
from simtrain.memory_plan import plan_host_memory
from simtrain.strategies.sharded_replica import chunk_update_bytes

from refusals import refusal
from test_sharded import BLOCKS, BLOCKS_MODEL, FREE_LINKS, MLP, PSI, flat_parameters, one_step, scenario

HOST = {"shared_memory": {}}  # a DGX A100 socket's DRAM behind each GPU's PCIe 4.0 x16 link


def on_host(base: dict, host: dict | None = None) -> dict:
    return {**base, "cluster": {**base["cluster"], "shared_memory": HOST["shared_memory"] if host is None else host}}


# ---------------------------------------------------------------- numerics

@pytest.mark.parametrize("stage,offload,precision", [(1, "optimizer", "fp32"), (2, "optimizer", "bf16"),
                                                     (3, "optimizer", "fp32"), (3, "optimizer_and_parameters",
                                                                                "bf16")])
def test_an_offloaded_run_trains_the_unoffloaded_runs_parameters(stage, offload, precision):
    offloaded = run(scenario(on_host(MLP), 4, precision=precision, steps=4, stage=stage, offload=offload))
    sharded = run(scenario(on_host(MLP), 4, precision=precision, steps=4, stage=stage))
    assert offloaded.data["sharding"]["offload"]["what"] == offload
    assert torch.equal(flat_parameters(offloaded.final_model), flat_parameters(sharded.final_model))
    if precision == "fp32":
        alone = run(scenario(MLP, 1, batch_size=4 * MLP["data"]["batch_size"], steps=4))
        torch.testing.assert_close(flat_parameters(offloaded.final_model), flat_parameters(alone.final_model),
                                   rtol=0, atol=1e-5)


LAYOUTS = {"pp 2": {"pp": 2}, "tp 2": {"tp": 2}, "HSDP": {"sharding": {"degree": 2}}}


def beside(layout: str, stage: int, offload: str = "none"):
    """BLOCKS_MODEL on 4 ranks in bf16 with Adam, sharded at `stage` under `layout` (with 2 data-parallel ranks
    beside pp or tp; HSDP: 2 replicas of shard groups of 2)."""
    parallel = {**LAYOUTS[layout], "sharding": {"stage": stage, "offload": offload,
                                                **LAYOUTS[layout].get("sharding", {})}}
    base = on_host(BLOCKS_MODEL)
    return validate_scenario({**base, "cluster": {**base["cluster"], "devices": 4}, "parallel": parallel,
                              "train": {**base["train"], "precision": "bf16", "steps": 3}})


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("stage", [1, 3])
def test_offload_beside_model_parallelism_and_hsdp_trains_the_same_parameters_holding_its_closed_form(layout, stage):
    """Offloaded under pp, tp or HSDP, every rank's shard steps on the host: the unoffloaded run's parameters bit
    for bit, each device holding ZeRO-Offload's share of its own (P e of weights: its share's padded parameters
    in bf16; S e under stage 3 with the parameters on the device), the host 16 bytes of bf16 Adam's state per
    element of every rank's shard (the HSDP replicas each their own)."""
    offloaded = run(beside(layout, stage, "optimizer"))
    assert torch.equal(flat_parameters(offloaded.final_model), flat_parameters(run(beside(layout, stage)).final_model))
    job = one_step(beside(layout, stage, "optimizer"))
    layouts = [job.scheme.replicas[rank].layout for rank in range(4)]
    for device, shards in zip(job.devices, layouts):
        held = shards.shard_numel if stage == 3 else shards.padded_numel
        assert device.memory.peak["weights"] == 2 * held
        assert device.memory.peak.get("optimizer_state", 0) == 0
    store = job.cluster.shared_memory.memory.peak
    assert store["master_weights"] + store["gradients"] + store["optimizer_state"] == sum(
        16 * shards.shard_numel for shards in layouts)


# ---------------------------------------------------------------- memory

def offload_bytes(stage: int, offload: str, n: int) -> tuple[dict, dict]:
    """ZeRO-Offload's closed forms under bf16 Adam (each unit divides by N): a device's persistent bytes, and the
    host's (every rank's together), by category."""
    device = {"weights": 0 if offload == "optimizer_and_parameters" else 2 * PSI // (n if stage == 3 else 1),
              "gradients": 2 * PSI if stage == 1 else 0, "master_weights": 0, "optimizer_state": 0}
    host = {"master_weights": 4 * PSI, "gradients": 4 * PSI, "optimizer_state": 8 * PSI,
            "weights": 2 * PSI if offload == "optimizer_and_parameters" else 0}
    return device, host


@pytest.mark.parametrize("stage,offload", [(1, "optimizer"), (2, "optimizer"), (3, "optimizer"),
                                           (3, "optimizer_and_parameters")])
def test_device_and_host_memory_are_zero_offloads_closed_forms(stage, offload):
    n = 4
    job = one_step(scenario(on_host(BLOCKS_MODEL), n, precision="bf16", stage=stage, offload=offload))
    device, host = offload_bytes(stage, offload, n)
    for rank in job.devices:
        peak = rank.memory.peak
        assert {category: peak.get(category, 0) for category in device} == device
    assert sum(device.values()) == {1: 4 * PSI, 2: 2 * PSI, 3: 2 * PSI // n}[stage] * (offload == "optimizer")
    store = job.cluster.shared_memory.memory.peak
    assert {category: store.get(category, 0) for category in host} == host
    assert sum(host.values()) == 16 * PSI + (2 * PSI if offload == "optimizer_and_parameters" else 0)


def test_the_memory_plan_is_what_an_offloaded_run_holds():
    scenario_ = scenario(on_host(MLP), 4, precision="bf16", steps=2, stage=3, offload="optimizer_and_parameters")
    report = run(scenario_)
    for device, plan in zip(report.data["devices"], plan_memory(scenario_)):
        assert plan.by_category == device["peak_memory_bytes_by_category"]
        assert plan.peak_bytes == device["peak_memory_bytes"]
    host = plan_host_memory(scenario_)
    assert host.by_category == report.data["shared_memory"]["peak_memory_bytes_by_category"]
    assert host.peak_bytes == report.data["shared_memory"]["peak_memory_bytes"]


# ---------------------------------------------------------------- time

HOST_LINK, DRAM = 1e8, 1e10  # bytes/s: a slow host link; the host's DRAM, faster than the two host links together


def offloaded_step(host_link: float, offload: str = "optimizer", dram: float = DRAM, **host):
    n = 2
    host = {"bandwidth": dram, "host_link": {"bandwidth": host_link, "latency": 0}, **host}
    sharding = {"offload": offload} if offload != "none" else {}
    return one_step(scenario(on_host(BLOCKS_MODEL, host), n, link=FREE_LINKS, stage=2, **sharding))


def test_with_a_slow_host_link_a_step_is_the_closed_form_of_the_exposed_copies_and_the_host_step():
    job = offloaded_step(HOST_LINK)
    spans = [s for s in job.cluster.log.spans if s.rank == 0]
    computes = [s.end - s.start for s in spans if s.kind == "compute"]  # f_0 .. f_{U-1}, b_{U-1} .. b_0
    forward, backward = computes[:BLOCKS], computes[BLOCKS:]
    chunk = PSI // BLOCKS // 2  # a unit's chunk: the same for every unit
    copy = chunk * 4 / HOST_LINK  # c: one chunk (fp32) over the host link, either way
    step = host_step_s(chunk_update_bytes(chunk, "fp32", job.scenario.train.optimizer), 2, DRAM)  # h, a unit's
    assert [s.end - s.start for s in spans if s.kind == "optimizer"] == pytest.approx([step] * BLOCKS, rel=1e-12)
    assert max(computes) < step < copy  # the copies are the bottleneck: the host link is busy once they start
    # The last unit's reduced chunk is copied once the next unit's backward has ended, each later one before the
    # link drains: U copies back to back; then the host steps unit 0, and the U parameter copies run back to back
    # beside the later units' steps.
    expected = sum(forward) + backward[0] + backward[1] + BLOCKS * copy + step + BLOCKS * copy
    assert job.cluster.log.last_end_s == pytest.approx(expected, rel=1e-9)


def test_with_a_free_host_link_a_step_is_the_unoffloaded_step_with_the_hosts_update():
    # free copies (host links and the store's own link), the host step at a DGX A100's DRAM bandwidth
    offloaded = offloaded_step(1e18, dram=1e18, host="dgx-a100")
    sharded = offloaded_step(1e18, offload="none", dram=1e18)
    device_update = [s.end - s.start for s in sharded.cluster.log.spans if s.rank == 0 and s.kind == "optimizer"]
    host_steps = [s.end - s.start for s in offloaded.cluster.log.spans if s.rank == 0 and s.kind == "optimizer"]
    assert len(device_update) == 1 and len(host_steps) == BLOCKS
    chunk = PSI // BLOCKS // 2
    assert sum(host_steps) == pytest.approx(BLOCKS * 2 * 28 * chunk / 409.6e9, rel=1e-12)  # Adam: 28 B a parameter
    expected = sharded.cluster.log.last_end_s - device_update[0] + sum(host_steps)
    assert offloaded.cluster.log.last_end_s == pytest.approx(expected, rel=1e-9)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("cluster,parallel,expected", [
    ({}, {"sharding": {"stage": 2, "offload": "optimizer"}},
     "parallel.sharding.offload: optimizer keeps the state in host memory; give cluster.shared_memory"),
    ({"shared_memory": {"location": "gpu0"}}, {"sharding": {"stage": 2, "offload": "optimizer"}},
     "cluster.shared_memory.location: offload keeps the state in the host's memory"),
    ({"shared_memory": {"host": "dgx-z"}}, {"sharding": {"stage": 2, "offload": "optimizer"}},
     "cluster.shared_memory.host: unknown host 'dgx-z'; known: dgx-a100, dgx-h100"),
    ({"shared_memory": {"location": "gpu0", "host": "dgx-a100"}}, {"sharding": {"stage": 2, "offload": "optimizer"}},
     "cluster.shared_memory.host: only for location host, not 'gpu0'"),
    (HOST, {"sharding": {"stage": 0, "offload": "optimizer"}},
     "parallel.sharding.offload: optimizer offloads a rank's shard of the training state; needs sharding.stage"),
    (HOST, {"sharding": {"stage": 2, "offload": "optimizer_and_parameters"}},
     "parallel.sharding.offload: optimizer_and_parameters offloads the parameters' shards"),
])
def test_offload_that_cannot_run_is_one_line_and_exit_2(tmp_path, capsys, cluster, parallel, expected):
    raw = {**MLP, "cluster": {"devices": 4, **cluster}, "parallel": parallel}
    assert expected in refusal(tmp_path, capsys, raw)
