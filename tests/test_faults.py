"""Faults and recovery: degraded, healed and failed links, lost devices, checkpoints, restarts.

References: closed forms of a transfer on a degraded link (alpha + S/(fB), and
its phases when the link changes mid-transfer); the fault-free run itself
(bit-identical results and models: a rerouted collective, a sync job restarted
on a spare); the time of a restarted run rebuilt from its parts, each from its
own model (fault-free time, detection, checkpoint read, the work redone); the
checkpoint cost's closed form; the async store's count of updates against the
fault-free run's trace.
"""
import copy
import json

import pytest
import simpy
import torch

import simtrain
from simtrain.cli import main
from simtrain.comm import build_all_reduce
from simtrain.comm.simulated import SimCommunicator
from simtrain.errors import NoRoute, ScenarioError
from simtrain.hw.cluster import build_cluster, run_to_end
from simtrain.hw.faults import FaultInjector
from simtrain.hw.network import Network
from simtrain.hw.topology_builders import LinkClass, build_topology
from simtrain.scenario import validate_scenario

B, ALPHA = 50e9, 5e-6  # the scenarios' links: 50 GB/s per direction, 5 us per hop


def two_devices(faults, **cluster):
    return validate_scenario({"cluster": {"topology": "ring", "devices": 2, "faults": faults,
                                          "link": {"bandwidth": B, "latency": ALPHA}, **cluster}})


def transfer_time(faults, nbytes):
    """One transfer gpu0 -> gpu1 of `nbytes` at time 0 on a one-link cluster with `faults` applied."""
    scenario = two_devices(faults)
    cluster = build_cluster(scenario.cluster)
    injector = FaultInjector(cluster, scenario, [0, 1], on_device_lost=None)
    injector.start(cluster.env.event())
    flow = cluster.network.start_flow("gpu0", "gpu1", nbytes)
    run_to_end(cluster.env)
    return flow.end, injector.events


def test_degraded_link_takes_alpha_plus_s_over_fb():
    nbytes, f = 10**6, 0.25
    end, events = transfer_time([{"at": 0, "link": ["gpu0", "gpu1"], "bandwidth_factor": f}], nbytes)
    assert end == pytest.approx(ALPHA + nbytes / (f * B), rel=1e-12)
    assert events[0]["kind"] == "link_degraded" and events[0]["source"] == "scenario"


def test_healed_link_two_phases():
    nbytes, f, until = 10**6, 0.25, 10e-6
    end, events = transfer_time([{"at": 0, "link": ["gpu0", "gpu1"], "bandwidth_factor": f, "until": until}],
                                nbytes)
    left = nbytes - f * B * (until - ALPHA)  # degraded from the end of the latency to `until`
    assert end == pytest.approx(until + left / B, rel=1e-12)
    assert [event["kind"] for event in events] == ["link_degraded", "link_healed"]
    assert events[1]["flows_crossing"] == 1  # the transfer was crossing it when it healed


def test_degraded_mid_transfer_three_phases():
    nbytes, f, at, until = 10**6, 0.5, 8e-6, 12e-6
    end, events = transfer_time([{"at": at, "link": ["gpu1", "gpu0"], "bandwidth_factor": f, "until": until}],
                                nbytes)
    left = nbytes - B * (at - ALPHA) - f * B * (until - at)
    assert end == pytest.approx(until + left / B, rel=1e-12)
    assert events[0]["flows_crossing"] == 1


def test_degraded_link_is_shared_max_min_with_other_flows():
    # Two flows share the degraded link: each gets half of f*B.
    scenario = two_devices([{"at": 0, "link": ["gpu0", "gpu1"], "bandwidth_factor": 0.5}])
    cluster = build_cluster(scenario.cluster)
    FaultInjector(cluster, scenario, [0, 1], on_device_lost=None).start(cluster.env.event())
    flows = [cluster.network.start_flow("gpu0", "gpu1", 10**6) for _ in range(2)]
    run_to_end(cluster.env)
    assert [flow.end for flow in flows] == pytest.approx([ALPHA + 2 * 10**6 / (0.5 * B)] * 2, rel=1e-12)


def all_reduce_with_failure(topology, fail=None, at=None):
    """A ring all-reduce (numerics on, the topology's default channels) on every device; `fail` (u, v) fails
    at `at`. Returns (buffers, network, moved flows)."""
    nodes, world = topology.devices, topology.num_devices
    generators = [torch.Generator().manual_seed(rank) for rank in range(world)]
    buffers = [torch.randn(1 << 16, generator=g) for g in generators]
    env = simpy.Environment()
    network = Network(env, topology)
    comm = SimCommunicator(network, nodes)
    program = build_all_reduce("ring", topology, nodes, None, "algo", "channels")
    moved = []
    if fail is not None:
        env.timeout(at).callbacks.append(lambda _event: moved.extend(network.fail_link(*fail)))
    for rank in range(world):
        comm.run(rank, program(rank, world, buffers[rank]))
    run_to_end(env)
    assert not comm.stuck()
    return buffers, network, moved


def mid_transfer(network, src, dst, latency):
    """A time at which a fault-free transfer src -> dst is moving bytes."""
    record = next(r for r in network.records if (r.src, r.dst) == (src, dst) and r.end - r.start > latency)
    return (record.start + latency + record.end) / 2


def bytes_by_link(network):
    return {(stat["src"], stat["dst"]): stat["bytes"] for stat in network.link_stats()}


@pytest.mark.parametrize("build,link", [
    (lambda: build_topology("torus2d", 9, LinkClass(50e9, 5e-6)), ("gpu0", "gpu1")),
    (lambda: build_topology("topologies/dgx-a100-2node.yaml", None, None), ("n0g0", "ib-spine")),
])
def test_failed_link_reroutes_flows_in_flight(build, link):
    topology = build()
    free_buffers, free_net, _ = all_reduce_with_failure(topology)
    crossing = next(r for r in free_net.records if r.path[:2] == link)
    latency = sum(topology.link(a, b)["latency"] for a, b in zip(crossing.path, crossing.path[1:]))
    at = mid_transfer(free_net, crossing.src, crossing.dst, latency)
    buffers, network, moved = all_reduce_with_failure(build(), link, at)
    # The collective completed with the fault-free numbers, bit for bit.
    for got, expected in zip(buffers, free_buffers):
        assert torch.equal(got, expected)
    assert moved, "a flow was crossing the link when it failed"
    before, after = bytes_by_link(free_net), bytes_by_link(network)
    u, v = link
    assert after[u, v] < before[u, v]  # the failed link carried only what crossed it before the failure
    for flow_ in moved:
        assert (u, v) not in zip(flow_.path, flow_.path[1:]) and (v, u) not in zip(flow_.path, flow_.path[1:])
    # What no longer crossed the failed link crossed every link of the detour instead: the bytes over all
    # links grow by exactly that much per extra hop.
    diverted = before[u, v] - after[u, v] + before[v, u] - after[v, u]  # both directions failed
    detour = moved[0].path
    assert diverted > 0
    for hop in zip(detour, detour[1:]):
        if before[hop] == 0:  # a link only the detour uses (the failed link's one direction was busy)
            assert after[hop] == before[u, v] - after[u, v]
    assert sum(after.values()) - sum(before.values()) == diverted * (len(detour) - len(crossing.path))


def test_no_route_left_is_a_job_failure_reported(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text("name: noroute\ncluster: {topology: switch, devices: 4, faults: [{at: 0.1 ms, "
                    "link: [gpu1, switch], fail: true}]}\nmodel: {name: mlp, hidden: [16]}\ntrain: {steps: 20}\n"
                    "report: {trace: false}\n")
    with pytest.raises(SystemExit) as exit_:
        main(["run", str(path), "--out", str(tmp_path / "out"), "-q"])
    assert exit_.value.code == 3
    err = capsys.readouterr().err.strip()
    assert err.startswith("job failed: no route left") and "\n" not in err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["status"] == "failed" and "no route left from" in report["failure"]
    assert 0 < report["steps"] < 20 and report["faults"]["events"][0]["kind"] == "link_failed"


def test_network_reports_no_route():
    topology = build_topology("switch", 2, LinkClass(1e9, 0.0))
    network = Network(simpy.Environment(), topology)
    network.fail_link("gpu0", "switch")
    with pytest.raises(NoRoute, match="no route left from gpu0 to gpu1"):
        network.start_flow("gpu0", "gpu1", 10)


# ---- lost devices: sync restart from a checkpoint on a spare ------------------------------------

def sync_scenario(faults=(), checkpoint=None, spares=1, steps=60, trace=False, **cluster):
    train = {"steps": steps, **({"checkpoint": checkpoint} if checkpoint else {})}
    return {"name": "t", "seed": 0,
            "cluster": {"topology": "switch", "devices": 4 + spares, "spares": spares, "faults": list(faults),
                        "link": {"bandwidth": B, "latency": ALPHA}, "fault_detection": "100 us", **cluster},
            "model": {"name": "mlp", "hidden": [32]}, "data": {"name": "digits", "batch_size": 16},
            "train": train, "parallel": {"all_reduce": "ring"}, "report": {"trace": trace}}


def spans(report, name_prefix):
    return [event for event in report.trace["traceEvents"]
            if event["ph"] == "X" and event["name"].startswith(name_prefix)]


@pytest.fixture(scope="module")
def restart_runs():
    checkpoint = {"every": 10, "to": "storage", "bandwidth": "10 GB/s", "latency": "20 us"}
    free = simtrain.run(validate_scenario(sync_scenario(checkpoint=checkpoint, trace=True)))
    at = 2.2e-3
    faulty = simtrain.run(validate_scenario(sync_scenario([{"at": at, "device": 1, "fail": True}], checkpoint,
                                                          trace=True)))
    return free, faulty, at


def test_restart_on_spare_is_bit_identical(restart_runs):
    free, faulty, _ = restart_runs
    assert faulty.data["status"] == "ok"
    for model in faulty.final_models[1:]:  # every rank, the spare's replica included
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, free.final_models[0].state_dict()[name])
    assert [loss for _, loss in faulty.data["loss_curve"]] == [loss for _, loss in free.data["loss_curve"]]
    assert faulty.data["final_loss"] == free.data["final_loss"]


def test_restart_time_is_fault_free_plus_detection_reload_and_redone(restart_runs):
    free, faulty, at = restart_runs
    (event,) = faulty.data["faults"]["events"]
    step = event["checkpoint_step"]
    # detection: cluster.fault_detection
    assert event["detection_s"] == pytest.approx(100e-6, rel=1e-9)
    # reload: each of the 4 ranks reads its state (weights and biases, fp32; plain SGD keeps no state) from
    # storage shared by all: latency + 4 S / B
    state_bytes = sum(p.numel() * 4 for p in free.final_model.parameters())
    assert event["reload_s"] == pytest.approx(20e-6 + 4 * state_bytes / 10e9, rel=1e-12)
    # redone: from the moment the fault-free run's checkpoint of that step had been written by every rank
    written = max(e["ts"] + e["dur"] for e in spans(free, f"checkpoint (step {step})")) * 1e-6
    assert event["redone_s"] == pytest.approx(at - written, rel=1e-9)
    assert event["steps_redone"] == sum(1 for t, _ in free.data["loss_curve"] if written < t <= at)
    expected = free.data["sim_time_s"] + event["detection_s"] + event["reload_s"] + event["redone_s"]
    assert faulty.data["sim_time_s"] == pytest.approx(expected, rel=1e-12)
    assert faulty.data["faults"]["time_lost_s"] == pytest.approx(expected - free.data["sim_time_s"], rel=1e-9)


def test_restart_shows_in_trace_and_report(restart_runs):
    free, faulty, at = restart_runs
    section = faulty.data["faults"]
    assert section["restarts"] == 1 and section["spares_left"] == []
    (event,) = section["events"]
    assert event["effect"] == "restarted on a spare" and event["spare"] == 4 and event["job_rank"] == 1
    restart = spans(faulty, "restart")
    assert len(restart) == 4 and all(e["ts"] == pytest.approx((at + 100e-6) * 1e6) for e in restart)
    assert {e["tid"] for e in restart} == {0, 2, 3, 4}  # the spare took rank 1's place
    assert spans(faulty, "lost")[0]["tid"] == 1
    # Checkpoints: before steps 10, 20, ..., 50, by every rank; the restarted job writes the same ones (those
    # after the checkpoint it went back to had not been written when the device was lost).
    assert len(spans(free, "checkpoint")) == len(spans(faulty, "checkpoint")) == 5 * 4
    assert section["checkpoint_time_s"] == pytest.approx(free.data["faults"]["checkpoint_time_s"], rel=1e-12)
    # Goodput: the fault-free run without checkpoints over this run.
    assert section["goodput"] == pytest.approx(section["fault_free_time_s"] / faulty.data["sim_time_s"])
    assert section["fault_free_time_s"] < free.data["sim_time_s"]
    # The all-reduce bytes of the steps done twice count twice, and part of the step the loss cut short.
    per_step = free.data["parallel"]["bytes_by_kind"]["dp_allreduce"] // 60
    sent = faulty.data["parallel"]["bytes_by_kind"]["dp_allreduce"]
    assert per_step * (60 + event["steps_redone"]) <= sent < per_step * (61 + event["steps_redone"])


@pytest.mark.parametrize("to,writers", [("host", 1), ("storage", 4)])
def test_checkpoint_cost_closed_form(to, writers):
    steps, every, latency, bandwidth = 30, 10, 20e-6, 10e9
    plain = simtrain.run(validate_scenario(sync_scenario(spares=0, steps=steps)))
    saved = simtrain.run(validate_scenario(sync_scenario(
        spares=0, steps=steps, checkpoint={"every": every, "to": to, "bandwidth": bandwidth, "latency": latency})))
    state_bytes = sum(p.numel() * 4 for p in plain.final_model.parameters())
    write_s = latency + writers * state_bytes / bandwidth
    assert saved.data["faults"]["checkpoints_committed"] == 2  # before steps 10 and 20
    assert saved.data["sim_time_s"] - plain.data["sim_time_s"] == pytest.approx(2 * write_s, rel=1e-9)
    assert saved.data["faults"]["checkpoint_time_s"] == pytest.approx(2 * write_s, rel=1e-12)
    assert saved.data["faults"]["goodput"] == pytest.approx(plain.data["sim_time_s"] / saved.data["sim_time_s"])
    assert saved.data["breakdown_s"]["checkpoint"] == pytest.approx(2 * write_s / steps, rel=1e-12)


@pytest.mark.parametrize("checkpoint,spares,reason", [
    (None, 1, "no train.checkpoint to restart from"),
    ({"every": 10}, 0, "no spare left"),
])
def test_sync_job_without_a_way_back_fails_at_detection(checkpoint, spares, reason):
    at = 1e-3
    report = simtrain.run(validate_scenario(sync_scenario([{"at": at, "device": 2, "fail": True}], checkpoint,
                                                          spares=spares)))
    assert report.data["status"] == "failed" and reason in report.data["failure"]
    assert report.data["sim_time_s"] == pytest.approx(at + 100e-6)  # ends when the loss is detected
    assert report.data["faults"]["events"][0]["effect"].startswith("the job failed")


def test_lost_spare_is_no_longer_available():
    report = simtrain.run(validate_scenario(sync_scenario(
        [{"at": 1e-4, "device": 4, "fail": True}, {"at": 1e-3, "device": 0, "fail": True}], {"every": 10})))
    first, second = report.data["faults"]["events"]
    assert first["effect"] == "an idle spare: no longer available"
    assert report.data["status"] == "failed" and "no spare left" in second["effect"]


def test_lost_device_takes_its_links_on_a_ring():
    # On a ring GPUs route: once gpu2 is lost, traffic between its neighbours goes the long way round; the
    # spare gpu4 (between gpu3 and gpu0) takes rank 2. The model is still the fault-free one.
    raw = sync_scenario(checkpoint={"every": 10}, topology="ring", steps=30)
    free = simtrain.run(validate_scenario(raw))
    raw["cluster"]["faults"] = [{"at": 5e-4, "device": 2, "fail": True}]
    faulty = simtrain.run(validate_scenario(raw))
    (event,) = faulty.data["faults"]["events"]
    assert event["links_failed"] == 2 and event["effect"] == "restarted on a spare" and event["spare"] == 4
    for name, tensor in faulty.final_model.state_dict().items():
        assert torch.equal(tensor, free.final_model.state_dict()[name])
    # The ring 0-1-4-3 now takes longer routes (1 -> 4 over gpu0, 4 -> 3 direct, 3 -> 0 over gpu4).
    assert faulty.data["sim_time_s"] > free.data["sim_time_s"] + event["time_lost_s"]


# ---- lost devices: async goes on ------------------------------------------------------------------

ASYNC = {"name": "a", "seed": 0,
         "cluster": {"topology": "switch", "devices": 4, "link": {"bandwidth": B, "latency": ALPHA},
                     "compute_jitter": 0.3},
         "model": {"name": "mlp", "hidden": [32]}, "data": {"name": "digits", "batch_size": 16},
         "train": {"steps": 80}, "parallel": {"mode": "async"}}


def async_run(faults=(), consistency="hogwild"):
    raw = copy.deepcopy(ASYNC)
    raw["cluster"]["faults"] = list(faults)
    raw["parallel"]["async"] = {"consistency": consistency}
    return simtrain.run(validate_scenario(raw))


@pytest.mark.parametrize("consistency", ["hogwild", "locked"])
@pytest.mark.parametrize("phase", ["push", "shared optimizer step"])
def test_async_lost_worker_updates(consistency, phase):
    free = async_run(consistency=consistency)
    worker = 2
    phases = [e for e in spans(free, phase) if e["tid"] == worker]
    target = phases[len(phases) // 2]
    at = (target["ts"] + target["dur"] / 2) * 1e-6  # in the middle of that phase of one of its updates
    faulty = async_run([{"at": at, "device": worker, "fail": True}], consistency)
    section, (event,) = faulty.data["async"], faulty.data["faults"]["events"]
    landed_before = sum(1 for e in spans(free, "shared optimizer step") if e["tid"] == worker
                        and (e["ts"] + e["dur"]) * 1e-6 <= at)
    push_lost = phase == "push"  # its bytes had not all reached the store; in the apply, they had
    assert event["push_lost"] == push_lost and faulty.data["faults"]["pushes_lost"] == int(push_lost)
    assert section["updates_per_rank"][worker] == event["updates_applied"] == landed_before + (not push_lost)
    # Every update claimed was applied once: the lost one went back to the others.
    assert section["updates"] == sum(section["updates_per_rank"]) == len(faulty.data["loss_curve"]) == 80
    assert faulty.data["status"] == "ok"


def test_async_losing_every_worker_fails():
    report = async_run([{"at": 1e-5, "device": rank, "fail": True} for rank in range(4)])
    assert report.data["status"] == "failed" and "every async worker is lost" in report.data["failure"]


# ---- random faults ------------------------------------------------------------------------------

def random_run(**random_faults):
    raw = sync_scenario(checkpoint={"every": 10}, spares=6, steps=100)
    raw["cluster"]["random_faults"] = {"device_mtbf": "4 ms", **random_faults}
    return simtrain.run(validate_scenario(raw))


def test_random_faults_are_drawn_from_the_seed():
    first, again = random_run(), random_run(seed=0)  # seed: the scenario's by default
    events = first.data["faults"]["events"]
    assert events and all(event["source"] == "random" for event in events)
    assert events == again.data["faults"]["events"]
    assert first.data["sim_time_s"] == again.data["sim_time_s"]
    other = random_run(seed=1)
    assert other.data["faults"]["events"] != events
    # Each restart replays the same batches: still the fault-free model.
    reference = simtrain.run(validate_scenario(sync_scenario(spares=6, steps=100)))
    for name, tensor in first.final_model.state_dict().items():
        assert torch.equal(tensor, reference.final_model.state_dict()[name])


# ---- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("cluster,train,parallel,expected", [
    ({"faults": [{"at": "5 ms", "link": ["gpu0", "gpu9"], "fail": True}]}, {}, {},
     "cluster.faults.0.link: no link gpu0-gpu9"),
    ({"faults": [{"at": "5 ms", "device": 7, "fail": True}]}, {}, {}, "cluster.faults.0.device: no device 7"),
    ({"faults": [{"at": "5 ms", "link": ["gpu0", "gpu1"], "bandwidth_factor": 0.5, "until": "5 ms"}]}, {}, {},
     "cluster.faults.0: until: must be after at"),
    ({"faults": [{"at": "soon", "device": 1, "fail": True}]}, {}, {}, "cluster.faults.0.at: cannot read 'soon'"),
    ({"faults": [{"at": "1 ms", "device": 1}]}, {}, {}, "a device fault is {at, device: N, fail: true}"),
    ({"faults": [{"at": "1 ms", "link": ["gpu0", "gpu1"]}]}, {}, {}, "gives either bandwidth_factor or fail"),
    ({"faults": [{"at": "1 ms", "link": ["gpu0", "gpu1"], "bandwidth_factor": 1.5}]}, {}, {},
     "cluster.faults.0.bandwidth_factor"),
    ({"random_faults": {"seed": 3}}, {}, {}, "give device_mtbf, link_mtbf or both"),
    ({"spares": 4}, {}, {}, "cluster.spares: 4 leaves no device"),
    ({}, {"checkpoint": {"every": 5, "to": "storage"}}, {}, "train.checkpoint.bandwidth: give the storage's"),
    ({}, {"checkpoint": {"every": 5}}, {"mode": "async"}, "train.checkpoint: for synchronous schemes"),
])
def test_fault_mistakes_are_one_line_errors(cluster, train, parallel, expected):
    raw = {"cluster": {"topology": "ring", "devices": 4, **cluster}, "train": {"steps": 2, **train},
           "parallel": parallel}
    with pytest.raises(ScenarioError) as error:
        simtrain.run(validate_scenario(raw))
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_link_faults_run_under_model_parallelism():
    raw = {"cluster": {"topology": "switch", "devices": 4, "link": {"bandwidth": B, "latency": ALPHA}},
           "model": {"name": "mlp", "hidden": [32, 32]}, "data": {"batch_size": 16}, "train": {"steps": 10},
           "parallel": {"pp": 2}, "report": {"trace": False}}
    free = simtrain.run(validate_scenario(raw))
    raw["cluster"]["faults"] = [{"at": 0, "link": ["gpu1", "switch"], "bandwidth_factor": 0.01}]
    slow = simtrain.run(validate_scenario(raw))
    assert slow.data["sim_time_s"] > free.data["sim_time_s"]
    for name, tensor in slow.final_model.state_dict().items():
        assert torch.equal(tensor, free.final_model.state_dict()[name])


def test_a_loss_after_the_last_all_reduce_changes_nothing():
    # Lost while its last optimizer step runs: the others finish; the run ends when they do.
    free = simtrain.run(validate_scenario(sync_scenario(checkpoint={"every": 10}, steps=20, trace=True)))
    last = max((e for e in spans(free, "optimizer step") if e["tid"] == 2), key=lambda e: e["ts"])
    at = (last["ts"] + last["dur"] / 2) * 1e-6
    faulty = simtrain.run(validate_scenario(sync_scenario([{"at": at, "device": 2, "fail": True}], {"every": 10},
                                                          steps=20)))
    (event,) = faulty.data["faults"]["events"]
    assert faulty.data["status"] == "ok" and event["effect"] == "none: the job had finished"
    assert faulty.data["sim_time_s"] == free.data["sim_time_s"]
    for name, tensor in faulty.final_model.state_dict().items():
        assert torch.equal(tensor, free.final_model.state_dict()[name])


@pytest.mark.parametrize("precision, stage", [("fp32", 0), ("fp16", 1)], ids=["ddp", "fp16 sharded"])
def test_a_job_whose_every_rank_is_lost_restarts_on_its_spare(precision, stage):
    """A job of one rank lost in its first step holds its training state nowhere: it has not finished when its
    one program stops, so it restarts from its checkpoint on the spare and trains as if nothing was lost (until
    2026-12-07 it counted as finished, and a sharded fp16 run ended in a traceback publishing no master weights)."""
    raw = sync_scenario(checkpoint={"every": 10}, steps=20)
    raw["cluster"]["devices"] = 2
    raw["train"]["precision"] = precision
    raw["parallel"]["sharding"] = {"stage": stage}
    free = simtrain.run(validate_scenario(raw))
    raw["cluster"]["faults"] = [{"at": "1 us", "device": 0, "fail": True}]
    faulty = simtrain.run(validate_scenario(raw))
    (event,) = faulty.data["faults"]["events"]
    assert event["effect"] == "restarted on a spare" and event["checkpoint_step"] == 0
    assert faulty.data["status"] == "ok" and faulty.data["steps"] == 20
    for name, tensor in faulty.final_model.state_dict().items():
        assert torch.equal(tensor, free.final_model.state_dict()[name])


@pytest.mark.parametrize("step", [0, 2], ids=["before the first checkpoint", "after two"])
def test_a_restart_under_megatron_cores_overlapped_distributed_optimizer_trains_the_fault_free_model(step):
    """pp 2 x dp 2, ZeRO-2 with the reduce-scatters beside the backward and the all-gathers deferred to the next
    forward (overlap_grad_reduce, overlap_param_gather), a device lost in the middle of step `step` + 1: the
    collectives the cut step had posted go with it, the load gathers every bucket, and the restarted job trains
    the fault-free model bit for bit (until 2026-12-07 it freed buffers the lost step's device had already
    dropped, or deadlocked on the deferred gathers each rank had got to)."""
    raw = {"name": "t", "seed": 0,
           "cluster": {"topology": "ring", "devices": 5, "spares": 1, "link": {"bandwidth": B, "latency": ALPHA}},
           "model": {"name": "gpt", "hidden": 32, "layers": 4, "heads": 4},
           "data": {"name": "tokens", "batch_size": 8, "seq_len": 16, "vocab": 32, "samples": 256},
           "train": {"steps": 4, "optimizer": {"name": "adam", "lr": 0.01}, "checkpoint": {"every": 1}},
           "parallel": {"pp": 2, "pipeline": {"microbatches": 2},
                        "sharding": {"stage": 2, "overlap_grad_reduce": True, "overlap_param_gather": True}}}
    free = simtrain.run(validate_scenario(raw))
    ends = [0.0] + [end for end, _ in free.data["loss_curve"]]
    raw["cluster"]["faults"] = [{"at": (ends[step] + ends[step + 1]) / 2, "device": 1, "fail": True}]
    faulty = simtrain.run(validate_scenario(raw))
    (event,) = faulty.data["faults"]["events"]
    assert event["effect"] == "restarted on a spare" and event["checkpoint_step"] == step
    for name, tensor in faulty.final_model.state_dict().items():
        assert torch.equal(tensor, free.final_model.state_dict()[name])


def test_restart_goes_back_to_the_hyperparameters_of_its_checkpoint():
    # train.schedule lowers lr before step 15; lost after step 18, the job goes back to step 10, where lr
    # was still the scenario's: the restarted run must use it again until step 15 (bit-identical model).
    raw = sync_scenario(checkpoint={"every": 10}, steps=30)
    raw["train"]["schedule"] = [{"step": 15, "train.optimizer.lr": 0.02}]
    free = simtrain.run(validate_scenario(raw))
    after_18, after_19 = free.data["loss_curve"][17][0], free.data["loss_curve"][18][0]  # [sim_time_s, loss]
    raw["cluster"]["faults"] = [{"at": (after_18 + after_19) / 2, "device": 3, "fail": True}]
    faulty = simtrain.run(validate_scenario(raw))
    (event,) = faulty.data["faults"]["events"]
    assert event["checkpoint_step"] == 10 and event["steps_redone"] == 8
    for name, tensor in faulty.final_model.state_dict().items():
        assert torch.equal(tensor, free.final_model.state_dict()[name])
