"""A lost device under pipeline, tensor, context and sharded data parallelism: the whole job restarts from its
last checkpoint on a spare, every rank reloading its own part (recovery.py).

References: the fault-free run itself. The restarted run ends with its model and loss curve bit for bit, and
its time is the fault-free time plus the parts of the restart, each checked against the fault-free run's own
trace: detection (cluster.fault_detection), the checkpoint read (a rank reads its part in the time its write
took: the same bytes through the same storage), the work redone (from the checkpoint's commit, its last rank's
write, to the fault), and the resume (a sharded rank's shard leaves out the parameters it does not own: one
all-gather of them, as each of the fault-free run's steps ends with).
"""
import pytest
import torch

import simtrain
from simtrain.scenario import validate_scenario

MLP = {"name": "mlp", "hidden": [32, 32, 32]}
GPT = {"name": "gpt", "hidden": 16, "layers": 1, "heads": 2}
LAYOUTS = {  # name: (model, data, parallel, optimizer)
    "pp2_tp2": (MLP, {"name": "digits", "batch_size": 16}, {"pp": 2, "tp": 2}, "sgd"),
    "zero2": (MLP, {"name": "digits", "batch_size": 16}, {"sharding": {"stage": 2}}, "sgd"),
    "pp2_zero1_adam": (MLP, {"name": "digits", "batch_size": 16}, {"pp": 2, "sharding": {"stage": 1}}, "adam"),
    "cp2_adam": (GPT, {"name": "tokens", "seq_len": 8, "batch_size": 4, "samples": 256}, {"cp": 2}, "adam"),
    # FSDP x TP as HSDP (shard groups of one, two replicas): the step cut short leaves no gathered unit behind
    "tp2_fsdp_hsdp": (GPT, {"name": "tokens", "seq_len": 8, "batch_size": 4, "samples": 256},
                      {"tp": 2, "sharding": {"stage": 3, "degree": 1}}, "adam"),
}


def scenario(layout: str, faults=()):
    model, data, parallel, optimizer = LAYOUTS[layout]
    return validate_scenario({
        "name": layout, "seed": 0,
        "cluster": {"topology": "switch", "devices": 5, "spares": 1, "faults": list(faults),
                    "link": {"bandwidth": 50e9, "latency": 5e-6}, "fault_detection": "100 us"},
        "model": model, "data": data, "parallel": parallel, "report": {"trace": True},
        "train": {"steps": 12, "optimizer": {"name": optimizer, "lr": 0.01},
                  "checkpoint": {"every": 5, "to": "storage", "bandwidth": "10 GB/s", "latency": "20 us"}}})


def spans(report, name: str) -> list[dict]:
    return [e for e in report.trace["traceEvents"] if e["ph"] == "X" and e["name"] == name]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_lost_device_restarts_bit_identical_in_the_sum_of_its_parts(layout):
    free = simtrain.run(scenario(layout))
    curve = free.data["loss_curve"]
    at = (curve[7][0] + curve[8][0]) / 2  # during step 8: steps 5, 6 and 7 are done since the checkpoint
    faulty = simtrain.run(scenario(layout, [{"at": at, "device": 2, "fail": True}]))

    assert faulty.data["status"] == "ok"
    for name, tensor in faulty.final_model.state_dict().items():
        assert torch.equal(tensor, free.final_model.state_dict()[name]), name
    assert [loss for _, loss in faulty.data["loss_curve"]] == [loss for _, loss in curve]

    (event,) = faulty.data["faults"]["events"]
    assert event["effect"] == "restarted on a spare" and event["spare"] == 4
    assert event["checkpoint_step"] == 5 and event["steps_redone"] == 3
    assert event["detection_s"] == pytest.approx(100e-6, rel=1e-9)
    writes = spans(free, "checkpoint (step 5)")
    assert len(writes) == 4
    assert event["reload_s"] == pytest.approx(max(e["dur"] for e in writes) * 1e-6, rel=1e-9)
    assert event["redone_s"] == pytest.approx(at - max(e["ts"] + e["dur"] for e in writes) * 1e-6, rel=1e-9)
    gathers = [e["dur"] for e in spans(free, "all_gather")]
    if "zero" in layout:  # each dp group gathers its share, the groups side by side; the largest share last
        assert event["resume_s"] == pytest.approx(max(gathers) * 1e-6, rel=1e-9)
    else:
        assert event["resume_s"] == 0.0
    parts = event["detection_s"] + event["reload_s"] + event["resume_s"] + event["redone_s"]
    assert faulty.data["faults"]["time_lost_s"] == pytest.approx(parts, rel=1e-12)
    assert faulty.data["sim_time_s"] == pytest.approx(free.data["sim_time_s"] + parts, rel=1e-12)


@pytest.mark.parametrize("layout", ["zero2", "pp2_zero1_adam", "cp2_adam"])
def test_numerics_off_restarts_in_the_time_numerics_on_takes(layout):
    """With numerics off the checkpoint packs meta bytes (adam's step count, which torch keeps on the host,
    among them: a RuntimeError before); the restarted run's times are the numerics-on run's."""
    curve = simtrain.run(scenario(layout)).data["loss_curve"]
    faults = [{"at": (curve[7][0] + curve[8][0]) / 2, "device": 2, "fail": True}]  # during step 8
    on = simtrain.run(scenario(layout, faults))
    raw = scenario(layout, faults).model_dump(mode="json", by_alias=True)
    off = simtrain.run(validate_scenario({**raw, "numerics": False}))
    assert off.data["status"] == on.data["status"] == "ok"
    assert off.data["faults"]["events"][0]["effect"] == "restarted on a spare"
    assert off.data["sim_time_s"] == pytest.approx(on.data["sim_time_s"], rel=1e-9)
    assert off.data["faults"]["time_lost_s"] == pytest.approx(on.data["faults"]["time_lost_s"], rel=1e-9)
