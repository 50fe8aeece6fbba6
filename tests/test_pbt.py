"""Population-based training: exploit copies, selection and explore rules, schedules, replay.

References: a single run of an exploit's recipient's lineage (bit for bit), the flow model's closed form
for the copy's time and the bytes on the links between two groups, direct
computation with the same seeded random.Random for Ray's selection and
explore rules, a single run of a member's scenario (bit for bit), and a run
given the replayed schedule.
"""
import json
import math
import random

import pytest
import torch
import yaml

import simtrain
from simtrain.cli import main
from simtrain.errors import ScenarioError
from simtrain.evaluation import evaluate
from simtrain.limits import MAX_SCHEDULE_ENTRIES
from simtrain.scenario import RangeSpec, validate_scenario
from simtrain.studies.pbt import Population, run_population
from simtrain.studies.pbt_replay import lineage, replay_scenario
from simtrain.studies.pbt_strategy import choose_donors, explore, initial_hyperparameters, quantiles
from simtrain.train.data import ShardLoader, hold_out_validation, load_dataset
# Two switches joined by one uplink, two GPUs on each: member 0 on sw0, member 1 on sw1, so only an exploit
# crosses the uplink.
from test_jobs import BANDWIDTH, LATENCY, TWO_SWITCHES


def population_scenario(population=4, devices=8, steps=30, interval=10, pbt=None, **sections):
    return validate_scenario({
        "name": "pbt-test", "seed": 5,
        "cluster": sections.get("cluster", {"topology": "ring", "devices": devices}),
        "model": {"name": "mlp", "hidden": [16]},
        "data": {"name": "digits", "batch_size": 16, "validation_fraction": 0.2},
        "train": {"steps": steps, "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
                  **sections.get("train", {})},
        "parallel": sections.get("parallel", {"all_reduce": "ring"}),
        "report": sections.get("report", {"trace": False, "every": 10}),
        "pbt": {"population": population, "perturbation_interval": interval, "synch": True,
                "hyperparam_mutations": {"train.optimizer.lr": {"log_uniform": [0.001, 1.0]},
                                         "data.batch_size": [8, 16, 32]},
                **(pbt or {})},
    })


# ---------------------------------------------------------------- exploit: a real copy, bit for bit

def two_switch_population(tmp_path, checkpoint=None, **sections):
    """Two members of two GPUs that start with different learning rates (so their states differ when one
    copies the other); member 0's devices are slowed so that its next all-reduce starts after the copy has
    ended."""
    topology = tmp_path / "two-switches.yaml"
    topology.write_text(TWO_SWITCHES)
    cluster = {"topology": str(topology), "overrides": {0: {"slowdown": 1e4}, 1: {"slowdown": 1e4}},
               **sections.pop("cluster", {})}
    return population_scenario(population=2, steps=12, interval=10, cluster=cluster,
                               pbt={"quantile_fraction": 0.5, "checkpoint": checkpoint, "hyperparam_mutations": {
                                   "train.optimizer.lr": [0.1, 0.02]}}, **sections)


def run_population_and_replay(scenario):
    """Run the population; return it and the single run its exploit's recipient's lineage describes
    (pbt_replay.py: the donor's hyperparameters up to its checkpoint, then the recipient's), on a ring of
    one member's two devices."""
    population = Population(scenario)
    population.run()
    [event] = population.events
    donor, recipient = (population.members[event[key]] for key in ("from", "to"))
    assert donor.schedule[0][2] != recipient.schedule[0][2]  # the recipient's own state differed from the donor's
    replay = replay_scenario(scenario.model_dump(mode="json"), population.section(), recipient.id)
    return population, simtrain.run(validate_scenario({**replay, "cluster": {"topology": "ring", "devices": 2}}))


def assert_the_recipient_trained_on_from_the_donors_state(population, replay) -> None:
    """Every rank of the recipient ends bit for bit where its replay ends: it took the donor's whole training
    state (weights, optimizer state, fp32 masters and loss scale under mixed precision) at the exploit."""
    [event] = population.events
    mine = population.members[event["to"]].job.scheme.final_models()
    assert len(mine) == len(replay.final_models)
    for model, reference in zip(mine, replay.final_models):
        for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("train", [
    {"optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}},
    {"optimizer": {"name": "adam", "lr": 0.01}, "precision": "fp16"},  # fp32 masters, Adam moments, loss scale
])
def test_after_an_exploit_the_recipient_trains_on_from_the_donors_state_bit_for_bit(tmp_path, train):
    population, replay = run_population_and_replay(two_switch_population(tmp_path, train=train))
    [event] = population.events
    assert (event["step"], event["from_step"]) == (10, 10)
    assert_the_recipient_trained_on_from_the_donors_state(population, replay)
    [checkpoint] = population.members[event["from"]].checkpoint.values()
    pieces = [name.split(".")[0] for name, _, _ in checkpoint.layout]
    assert "optimizer" in pieces and ("master" in pieces) == ("precision" in train)
    assert checkpoint.nbytes == event["bytes"]
    # The checkpoint is the donor's state at the round: its model as a single run of 10 steps leaves it.
    donor = population.members[event["from"]]
    ten_steps = donor.job.scenario.model_copy(update={"train": donor.job.scenario.train.model_copy(
        update={"steps": 10}), "cluster": population_scenario().cluster.model_copy(update={"devices": 2})})
    alone = simtrain.run(ten_steps).final_model
    if "precision" not in train:
        model_bytes = torch.cat([t.reshape(-1).view(torch.uint8) for t in alone.state_dict().values()])
        assert torch.equal(checkpoint.flat[:len(model_bytes)], model_bytes)


def test_an_exploit_moves_the_state_once_between_the_groups_in_the_closed_form_time(tmp_path):
    population = Population(two_switch_population(tmp_path, report={"trace": True}))
    population.run()
    [event] = population.events
    nbytes = event["bytes"]
    across = {(link["src"], link["dst"]): link["bytes"] for link in population.cluster.network.link_stats()}
    uplink = ("sw0", "sw1") if event["from"] == 0 else ("sw1", "sw0")
    assert across[uplink] == nbytes and across[uplink[::-1]] == 0
    # Each recipient rank pulls half over 3 hops, the two halves sharing the uplink (B/2 each), then the
    # two ranks swap halves over 2 hops: 3L + (S/2)/(B/2) + 2L + (S/2)/B.
    expected = 5 * LATENCY + nbytes / BANDWIDTH + nbytes / 2 / BANDWIDTH
    assert event["transfer_s"] == pytest.approx(expected, rel=1e-9)
    spans = [span for span in population.cluster.log.spans if span.name.startswith("exploit")]
    assert {(span.rank, span.name) for span in spans} == {
        (rank, name) for rank in population.members[event["to"]].job.ranks
        for name in ("exploit", "exploit all-gather")}


def test_pipeline_members_copy_each_stage_from_the_donors_same_stage(tmp_path):
    scenario = two_switch_population(tmp_path, parallel={"all_reduce": "ring", "pp": 2, "pipeline": {"microbatches": 2}})
    population, replay = run_population_and_replay(scenario)
    assert_the_recipient_trained_on_from_the_donors_state(population, replay)
    [event] = population.events
    donor = population.members[event["from"]]
    assert donor.checkpoint[0].layout != donor.checkpoint[1].layout  # the two stages hold different layers
    across = {(link["src"], link["dst"]): link["bytes"] for link in population.cluster.network.link_stats()}
    uplink = ("sw0", "sw1") if event["from"] == 0 else ("sw1", "sw0")
    assert across[uplink] == event["bytes"] == sum(state.nbytes for state in donor.checkpoint.values())


def test_through_checkpoint_storage_every_member_writes_each_round_and_a_recipient_reads(tmp_path):
    storage_bandwidth, storage_latency = 1e9, 1e-3
    scenario = two_switch_population(tmp_path, checkpoint={"bandwidth": storage_bandwidth, "latency": storage_latency},
                                     report={"trace": True})
    population, replay = run_population_and_replay(scenario)
    assert_the_recipient_trained_on_from_the_donors_state(population, replay)
    [event] = population.events
    access = storage_latency + event["bytes"] / storage_bandwidth
    assert event["transfer_s"] == pytest.approx(access, rel=1e-12)  # each recipient rank reads the state
    section = population.section()
    assert section["checkpoint_write_s"] == pytest.approx(2 * access, rel=1e-12)  # one round, two members
    assert section["copy_time_s"] == pytest.approx(3 * access, rel=1e-12)
    across = {(link["src"], link["dst"]): link["bytes"] for link in population.cluster.network.link_stats()}
    assert across[("sw0", "sw1")] == across[("sw1", "sw0")] == 0  # nothing goes device to device
    spans = {(span.rank, span.name) for span in population.cluster.log.spans if span.name.startswith("checkpoint")}
    recipient = population.members[event["to"]].job.ranks
    assert spans == {(0, "checkpoint write"), (2, "checkpoint write"),
                     *((rank, "checkpoint read") for rank in recipient)}


def test_async_members_copy_the_store_at_its_bandwidth(tmp_path):
    scenario = two_switch_population(tmp_path, parallel={"mode": "async"})
    population, replay = run_population_and_replay(scenario)
    assert_the_recipient_trained_on_from_the_donors_state(population, replay)
    [event] = population.events
    store = scenario.cluster.shared_memory.bandwidth
    assert event["transfer_s"] == pytest.approx(2 * event["bytes"] / store, rel=1e-12)


# ---------------------------------------------------------------- selection and explore: pure rules

def test_truncation_the_two_worst_of_eight_copy_the_two_best():
    scores = {member: score for member, score in enumerate([0.5, 0.1, 0.9, 0.3, 0.8, 0.2, 0.4, 0.7])}
    bottom, top = quantiles(scores, "min", 0.25)
    assert (bottom, top) == ([2, 4], [5, 1])
    assert quantiles(scores, "max", 0.25) == ([1, 5], [4, 2])
    assert quantiles({**scores, 3: math.nan}, "min", 0.25)[0] == [3, 2]  # a diverged member is the worst
    assert quantiles(scores, "min", 0.5) == ([2, 4, 7, 0], [6, 3, 5, 1])
    assert quantiles(scores, "min", 0.0) == ([], [])
    donors = choose_donors(scores, list(range(8)), "truncation", "min", 0.25, random.Random(3))
    reference = random.Random(3)
    assert donors == {2: reference.choice([5, 1]), 4: reference.choice([5, 1])}


def test_binary_tournament_copies_a_random_other_member_when_it_is_better():
    scores = {0: 0.5, 1: 0.1, 2: 0.9}
    donors = choose_donors(scores, [0, 1, 2], "binary_tournament", "min", 0.25, random.Random(7))
    reference, expected = random.Random(7), {}
    for member in (0, 1, 2):
        other = reference.choice([m for m in (0, 1, 2) if m != member])
        if scores[other] < scores[member]:
            expected[member] = other
    assert donors == expected and 1 not in donors


def test_every_synchronous_round_of_eight_has_exactly_the_two_worst_copy_the_two_best():
    report = run_population(population_scenario(population=8, devices=8, steps=31, interval=10))
    section = report.data["pbt"]
    for step in (10, 20, 30):
        scores = {m["id"]: next(metric for s, _, metric in m["metrics"] if s == step) for m in section["members"]}
        bottom, top = quantiles(scores, "min", 0.25)
        events = [event for event in section["events"] if event["step"] == step]
        assert sorted(event["to"] for event in events) == sorted(bottom)
        assert all(event["from"] in top for event in events)


def test_without_synch_a_ready_member_is_compared_with_every_members_latest_metric():
    # Batch sizes 8 to 64 make members' steps take different times: rounds fall at different instants.
    report = run_population(population_scenario(population=4, devices=4, steps=41, interval=10, pbt={
        "synch": False, "quantile_fraction": 0.5}))
    section = report.data["pbt"]
    checked = 0
    for event in section["events"]:
        rounds_then = [m["id"] for m in section["members"] for _, t, _ in m["metrics"] if t == event["sim_time_s"]]
        if rounds_then != [event["to"]]:
            continue  # members ready at the same instant decide in the order they got there
        checked += 1
        latest = {m["id"]: [point for point in m["metrics"][:-1] if point[1] <= event["sim_time_s"]][-1]
                  for m in section["members"] if m["metrics"][0][1] <= event["sim_time_s"]}
        bottom, top = quantiles({member: point[2] for member, point in latest.items()}, "min", 0.5)
        assert event["to"] in bottom and event["from"] in top
        assert event["from_step"] == latest[event["from"]][0] and event["step"] == latest[event["to"]][0]
    assert checked >= 2


def test_members_stop_at_the_round_a_member_reaches_the_stop_metric():
    report = run_population(population_scenario(population=4, devices=4, steps=40, interval=10, pbt={
        "stop": {"metric": 2.3}}))
    first_round = [m["metrics"][0][2] for m in report.data["pbt"]["members"]]
    assert min(first_round) <= 2.3 < max(first_round)
    assert [m["steps"] for m in report.data["pbt"]["members"]] == [10] * 4


MUTATIONS = {"lr": RangeSpec(log_uniform=(0.001, 1.0)), "momentum": RangeSpec(uniform=(0.0, 0.99)),
             "batch": [16, 32, 64]}


def test_explore_perturbs_by_a_factor_and_moves_lists_to_a_neighbour():
    values = {"lr": 0.1, "momentum": 0.5, "batch": 32}
    new = explore(values, MUTATIONS, 0.0, (1.2, 0.8), random.Random(11))
    reference = random.Random(11)
    expected = {}
    for name in ("lr", "momentum"):
        assert reference.random() >= 0.0
        expected[name] = values[name] * reference.choice((1.2, 0.8))
    reference.random()
    expected["batch"] = [16, 32, 64][1 + reference.choice((-1, 1))]
    assert new == expected
    # Clipped to the range, clamped at a list's ends.
    edge = explore({"lr": 1.0, "momentum": 0.99, "batch": 64}, MUTATIONS, 0.0, (1.2, 1.2), random.Random(0))
    assert edge["lr"] == 1.0 and edge["momentum"] == 0.99 and edge["batch"] in (32, 64)
    assert explore(values, MUTATIONS, 0.0, (1.0, 1.0), random.Random(2))["lr"] == 0.1


def test_explore_resamples_with_its_probability():
    values = {"lr": 0.1, "momentum": 0.5, "batch": 32}
    new = explore(values, MUTATIONS, 1.0, (1.2, 0.8), random.Random(4))
    reference = random.Random(4)
    reference.random()
    lr = math.exp(reference.uniform(math.log(0.001), math.log(1.0)))
    reference.random()
    momentum = reference.uniform(0.0, 0.99)
    reference.random()
    assert new == {"lr": lr, "momentum": momentum, "batch": reference.choice([16, 32, 64])}
    # Over many draws, the share of resampled values is resample_probability.
    rng = random.Random(0)
    draws = [explore({"lr": 0.1}, {"lr": MUTATIONS["lr"]}, 0.25, (1.2, 0.8), rng)["lr"] for _ in range(4000)]
    perturbed = sum(1 for lr in draws if math.isclose(lr, 0.12) or math.isclose(lr, 0.08))
    assert perturbed / 4000 == pytest.approx(0.75, abs=0.03)


def test_initial_hyperparameters_are_drawn_with_the_seed():
    drawn = initial_hyperparameters(MUTATIONS, random.Random(9))
    reference = random.Random(9)
    assert drawn == {"lr": math.exp(reference.uniform(math.log(0.001), 0.0)),
                     "momentum": reference.uniform(0.0, 0.99), "batch": reference.choice([16, 32, 64])}


# ---------------------------------------------------------------- members are single runs

def test_without_exploit_or_explore_a_member_is_the_single_run_of_its_hyperparameters():
    scenario = population_scenario(population=4, devices=8, steps=25, pbt={
        "quantile_fraction": 0, "resample_probability": 0, "perturbation_factors": [1, 1]})
    population = Population(scenario)
    population.run()
    assert population.events == []
    for member in population.members[:2]:
        single = scenario.with_hyperparameters(member.values).model_copy(
            update={"cluster": scenario.cluster.model_copy(update={"devices": 2})})
        alone = simtrain.run(single)
        for mine, reference in zip(member.job.scheme.final_models(), alone.final_models):
            for (name, a), (_, b) in zip(mine.state_dict().items(), reference.state_dict().items()):
                assert torch.equal(a, b), name
        assert [loss for _, loss in member.job.scheme.loss_curve] == [loss for _, loss in alone.data["loss_curve"]]
        assert member.metric == evaluate(alone.final_model, member.job.data.validation)[0]


def test_validation_is_held_out_of_the_training_split_never_the_test_set():
    splits = load_dataset("digits", {}, seed=0)
    held = hold_out_validation(splits, 0.2, seed=3)
    rows = lambda dataset: {tuple(x.tolist()) + (int(y),) for x, y in zip(*dataset.tensors)}  # noqa: E731
    assert len(held.validation) == round(0.2 * 1437) and len(held.train) == 1437 - len(held.validation)
    assert rows(held.train) | rows(held.validation) == rows(splits.train)
    assert not rows(held.train) & rows(held.validation)
    assert held.test is splits.test
    assert hold_out_validation(splits, 0.0, seed=3) is splits


# ---------------------------------------------------------------- train.schedule and replay

def single(schedule=(), steps=12, **train):
    return validate_scenario({
        "name": "schedule", "seed": 1, "cluster": {"topology": "ring", "devices": 2},
        "model": {"name": "mlp", "hidden": [16]}, "data": {"name": "digits", "batch_size": 16},
        "train": {"steps": steps, "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
                  "schedule": list(schedule), **train},
        "report": {"trace": False},
    })


def same_models(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.final_model.state_dict().values(),
                                                  b.final_model.state_dict().values()))


def test_a_schedule_from_step_0_is_the_scenario_with_those_values():
    scheduled = simtrain.run(single([{"step": 0, "train.optimizer.lr": 0.3, "data.batch_size": 8}]))
    plain = simtrain.run(single(optimizer={"name": "sgd", "lr": 0.3, "momentum": 0.9}).model_copy(
        update={"data": single().data.model_copy(update={"batch_size": 8})}))
    assert same_models(scheduled, plain)
    assert scheduled.data["loss_curve"] == plain.data["loss_curve"]


def test_a_schedule_applies_from_its_step_and_the_stream_goes_on_from_the_same_sample():
    changed = simtrain.run(single([{"step": 6, "train.optimizer.lr": 0.0001}]))
    unchanged = simtrain.run(single())
    assert changed.data["loss_curve"][:7] == unchanged.data["loss_curve"][:7]  # step 6's loss precedes its update
    assert not same_models(changed, unchanged)
    splits = load_dataset("digits", {}, seed=0)
    loader, reference = ShardLoader(splits.train, 2, 1, 16, seed=1), ShardLoader(splits.train, 2, 1, 8, seed=1)
    loader.next_batch()
    loader.set_batch_size(8)
    first = torch.cat([reference.next_batch()[1] for _ in range(3)])
    assert torch.equal(torch.cat([first[:16], loader.next_batch()[1]]), first)


def test_lineage_follows_the_copies_back_to_step_0():
    section = {"members": [
        {"id": 0, "steps": 30, "schedule": [[0, 0.0, {"lr": 0.1}], [20, 2.0, {"lr": 0.05}]]},
        {"id": 1, "steps": 30, "schedule": [[0, 0.0, {"lr": 0.3}], [10, 1.0, {"lr": 0.2}]]},
    ], "events": [
        {"step": 10, "from": 0, "to": 1, "from_step": 10},
        {"step": 20, "from": 1, "to": 0, "from_step": 20},
    ]}
    assert lineage(section, 0) == ([{"step": 0, "lr": 0.1}, {"step": 10, "lr": 0.2}, {"step": 20, "lr": 0.05}],
                                   30)
    assert lineage(section, 1) == ([{"step": 0, "lr": 0.1}, {"step": 10, "lr": 0.2}], 30)
    # synch false: member 1 copied member 0's checkpoint of step 10 at its own step 20.
    section["events"] = [{"step": 20, "from": 0, "to": 1, "from_step": 10}]
    section["members"][1]["schedule"] = [[0, 0.0, {"lr": 0.3}], [20, 1.0, {"lr": 0.2}]]
    assert lineage(section, 1) == ([{"step": 0, "lr": 0.1}, {"step": 10, "lr": 0.2}], 20)


def cli(*args):
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    return exit_info.value.code


def test_pbt_run_and_replay_from_the_command_line(tmp_path, capsys):
    scenario_file = tmp_path / "pbt.yaml"
    scenario_file.write_text(yaml.safe_dump(population_scenario(steps=21).model_dump(mode="json", by_alias=True)))
    outputs = []
    for run in ("a", "b"):
        assert cli("run", str(scenario_file), "--out", str(tmp_path / run)) == 0
        report = json.loads((tmp_path / run / "report.json").read_text())
        report.pop("wall_time_s")
        outputs.append((report, (tmp_path / run / "final_model.pt").read_bytes()))
    assert outputs[0] == outputs[1]  # same scenario and seed: the same report and model, byte for byte
    report = outputs[0][0]
    assert "population" in capsys.readouterr().out and (tmp_path / "a" / "pbt.png").stat().st_size > 10_000
    section = report["pbt"]
    assert section["events"] and section["copy_time_s"] == sum(e["transfer_s"] for e in section["events"])
    best = section["best"]
    assert section["members"][best]["final_metric"] == min(m["final_metric"] for m in section["members"])
    assert cli("pbt", "replay", str(tmp_path / "a" / "report.json"), "--member", "best",
               "--out", str(tmp_path / "replay.yaml")) == 0
    replay = yaml.safe_load((tmp_path / "replay.yaml").read_text())
    assert replay["train"]["schedule"] == lineage(section, best)[0] and "pbt" not in replay
    assert replay["cluster"]["devices"] == 2
    # A replayed schedule run equals a fresh run given that schedule.
    replayed = simtrain.run(simtrain.load_scenario(tmp_path / "replay.yaml"))
    fresh = simtrain.run(single(replay["train"]["schedule"], steps=replay["train"]["steps"]).model_copy(
        update={"data": replayed_data(replay), "model": population_scenario().model, "seed": 5}))
    assert same_models(replayed, fresh) and replayed.data["loss_curve"] == fresh.data["loss_curve"]


def replayed_data(replay):
    return validate_scenario({"data": replay["data"]}).data


@pytest.mark.parametrize("args,expected", [
    (["--set", "pbt.population=3"], "pbt.population: 3 members do not split the cluster's 8 devices"),
    (["--set", "pbt.hyperparam_mutations={train.steps: [1, 2]}"], "train.steps is not a hyperparameter"),
    (["--set", "data.validation_fraction=0"], "pbt.metric.name: val_loss needs data.validation_fraction"),
    (["--set", "train.schedule=[{step: 0, train.optimizer.lr: 0.1}]"], "train.schedule: a population"),
])
def test_pbt_mistakes_are_one_line_errors(tmp_path, capsys, args, expected):
    scenario_file = tmp_path / "pbt.yaml"
    scenario_file.write_text(yaml.safe_dump(population_scenario().model_dump(mode="json", by_alias=True)))
    assert cli("run", str(scenario_file), *args, "--out", str(tmp_path / "out"), "-q") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and expected in err


def test_replay_of_a_report_without_a_population_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "report.json").write_text('{"name": "x"}')
    assert cli("pbt", "replay", str(tmp_path / "report.json"), "--out", str(tmp_path / "r.yaml")) == 2
    assert "no pbt section" in capsys.readouterr().err


def test_replay_of_a_report_edited_by_hand_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "report.json").write_text('{"pbt": {"members": [], "events": []}}')
    (tmp_path / "scenario.resolved.yaml").write_text("name: x\n")
    assert cli("pbt", "replay", str(tmp_path / "report.json"), "--out", str(tmp_path / "r.yaml")) == 2
    err = capsys.readouterr().err.strip()
    assert "not as simtrain wrote it" in err and "\n" not in err


def test_a_schedule_past_its_limit_is_refused_in_one_line():
    entries = [{"step": step, "train.optimizer.lr": 0.1} for step in range(MAX_SCHEDULE_ENTRIES + 1)]
    with pytest.raises(ScenarioError, match="train.schedule") as error:
        validate_scenario({"train": {"schedule": entries}})
    assert "\n" not in str(error.value)
