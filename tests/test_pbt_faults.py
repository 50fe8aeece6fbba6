"""A lost device in a population (studies/pbt_faults.py): only its member restarts, on a spare, from the latest
round it went on from.

Reference: the fault-free population itself. Synchronous rounds decide in member order once every member is
ready, so the restart changes no decision: every member's final parameters and the whole decision history are
the fault-free run's, bit for bit. Member 0 loses a device after it copied member 1 at round 8: it restarts from
the donor's checkpoint with the explored learning rate, skips round 8 (it took part in it) and meets round 12.
Every member runs at the same speed (only the learning rate differs), so the population ends later by the
restart's time lost, whose parts are checked against closed forms: detection (cluster.fault_detection), the read
(latency + bytes / bandwidth of pbt.checkpoint) and the work redone (from the moment member 0 went on from
round 8, after its copy, to the fault).
"""
import pytest
import torch
import yaml

from simtrain.cli import main
from simtrain.errors import ScenarioError
from simtrain.scenario import validate_scenario
from simtrain.studies.pbt import run_population

DETECTION, LATENCY, BANDWIDTH = 100e-6, 1e-3, 1e9


def population(faults=(), **cluster):
    return validate_scenario({
        "name": "pbt-faults", "seed": 5,
        "cluster": {"topology": "switch", "devices": 5, "spares": 1, "faults": list(faults),
                    "link": {"bandwidth": 50e9, "latency": 5e-6}, "fault_detection": DETECTION, **cluster},
        "model": {"name": "mlp", "hidden": [16]},
        "data": {"name": "digits", "batch_size": 16, "validation_fraction": 0.2},
        "train": {"steps": 14, "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}},
        "report": {"every": 2},
        "pbt": {"population": 2, "perturbation_interval": 4, "synch": True, "quantile_fraction": 0.5,
                "checkpoint": {"bandwidth": BANDWIDTH, "latency": LATENCY},
                "hyperparam_mutations": {"train.optimizer.lr": {"log_uniform": [0.001, 1.0]}}}})


def decisions(report) -> list[dict]:
    """Every exploit without its timing."""
    return [{key: value for key, value in event.items() if key not in ("sim_time_s", "transfer_s")}
            for event in report.data["pbt"]["events"]]


def test_a_lost_device_restarts_its_member_from_its_round_and_the_population_ends_bit_identical():
    free = run_population(population())
    exploit = free.data["pbt"]["events"][1]
    assert (exploit["step"], exploit["to"], exploit["from"]) == (8, 0, 1)
    went_on = exploit["sim_time_s"] + exploit["transfer_s"]  # member 0 goes on from round 8 with the donor's state
    at = went_on + 3e-5  # during step 9 of member 0
    faulty = run_population(population([{"at": at, "device": 0, "fail": True}]))

    assert decisions(faulty) == decisions(free) and len(decisions(free)) == 3  # rounds 4, 8 and 12
    for fault_free, restarted in zip(free.data["pbt"]["members"], faulty.data["pbt"]["members"]):
        assert [[step, metric] for step, _, metric in restarted["metrics"]] == \
               [[step, metric] for step, _, metric in fault_free["metrics"]]
        assert restarted["steps"] == 14 and [values for _, _, values in restarted["schedule"]] == \
               [values for _, _, values in fault_free["schedule"]]
    assert free.data["pbt"]["best"] == faulty.data["pbt"]["best"]
    for name, tensor in faulty.final_model.state_dict().items():
        assert torch.equal(tensor, free.final_model.state_dict()[name]), name
    assert faulty.data["pbt"]["members"][0]["ranks"] == [4, 1]  # the spare took rank 0's place

    faults = faulty.data["faults"]
    (event,) = faults["events"]
    assert event["member"] == 0 and event["effect"] == "restarted on a spare" and event["spare"] == 4
    assert event["checkpoint_step"] == 8 and event["steps_redone"] == 1  # step 8 was done, 9 was under way
    assert event["detection_s"] == pytest.approx(DETECTION, rel=1e-9)
    assert event["reload_s"] == pytest.approx(LATENCY + exploit["bytes"] / BANDWIDTH, rel=1e-12)
    assert event["redone_s"] == pytest.approx(at - went_on, rel=1e-9)
    assert event["resume_s"] == 0.0
    assert event["time_lost_s"] == pytest.approx(
        event["detection_s"] + event["reload_s"] + event["redone_s"], rel=1e-12)
    assert faults["fault_free_time_s"] == free.data["sim_time_s"]
    assert faulty.data["sim_time_s"] == pytest.approx(free.data["sim_time_s"] + faults["time_lost_s"], rel=1e-12)
    assert faults["restarts"] == 1 and faults["spares_left"] == []


def test_a_device_lost_while_its_member_is_in_a_round_fails_the_run_with_one_line():
    at = 1.5e-3  # member 0 reads member 1's round-4 checkpoint from storage (1.09 ms to 2.10 ms)
    with pytest.raises(ScenarioError) as error:
        run_population(population([{"at": at, "device": 1, "fail": True}]))
    assert str(error.value) == ("cluster.faults: device 1 lost at 0.0015 s while member 0 was in its round at step "
                                "4: a restart would take part in it again (not modelled) (a population does not "
                                "go on without a member)")


@pytest.mark.parametrize("args,expected", [
    (["--set", "cluster.random_faults={device_mtbf: 1.0}"], "cluster.random_faults: not with a population"),
    (["--set", "cluster.faults=[{at: 0.001, device: 0, fail: true}]", "--set", "pbt.checkpoint=null"],
     "cluster.faults: a lost device's member restarts from its round's checkpoint in storage; give pbt.checkpoint"),
    (["--set", "train.checkpoint={every: 4}"], "train.checkpoint: not with a population"),
    (["--set", "cluster.faults=[{at: 0.001, device: 0, fail: true}]", "--set", "parallel.mode=async"],
     "cluster.faults: a lost device in an async population"),
    (["--set", "pbt.population=3"], "pbt.population: 3 members do not split the cluster's 4 devices besides its "
                                    "spares"),
])
def test_what_a_population_still_refuses_is_one_line_naming_the_key_exit_2(tmp_path, capsys, args, expected):
    scenario_file = tmp_path / "pbt.yaml"
    scenario_file.write_text(yaml.safe_dump(population().model_dump(mode="json", by_alias=True)))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(scenario_file), *args, "--out", str(tmp_path / "out"), "-q"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and expected in err
    assert not (tmp_path / "out").exists()
