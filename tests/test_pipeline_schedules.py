"""Pipeline schedules as data (simtrain/parallel/schedules) against their papers, torch, and the simulator.

- Every schedule's lists are valid: each (microbatch, part) forwarded once and backed once (B, or I then W), a
  backward after its forward and after the next part's input backward (the timeline runs them, or names the rank
  that waits forever), W after I.
- GPipe, 1F1B and interleaved are today's lists, action for action (the shipped scenarios' figures rest on them).
- Bubbles, on the pure lists with fixed action times (timeline.py), against each paper's closed form:
  GPipe and 1F1B (p - 1)(F + B) (Narayanan et al. 2021, eq. 1); interleaved (p - 1)(F + B) / v (eq. 2, F and B
  of a whole stage); ZB-H1 (p - 1)(F + I - W) (Qi et al. 2024, section 3.1, where their B is our I);
  DualPipeV (PP/2 - 1)(F&B + B - 3W) for PP = 2p parts (the DualPipe README), with F = I = W and F&B between
  max(F, B) and F + B, as the README's pairs run once both their inputs are there.
- DualPipeV's lists are torch.distributed.pipelining's ScheduleDualPipeV's, action for action.
- The same bubbles through a simulated run (equal blocks, free links): 1F1B's and ZB-H1's closed forms; DualPipeV's
  engine against the timeline of the same lists with the measured action times, a pair starting once both its
  inputs are in and, with nothing to communicate inside it, taking F + B.
- A pair runs as DualPipe's F&B: each pass until it waits on a communication, then the other (the order of its
  operations, checked op by op); under expert parallelism its all-to-alls hide behind the other pass's compute.
- A CSV schedule equal to 1F1B's gives 1F1B's report; bad files are one-line errors naming the field.
- Numerics: zero_bubble and dualpipev train the parameters 1F1B trains, under ZeRO-3, Megatron-Core's buckets
  and expert parallelism too.
- The weight-gradient split is measured: a Linear's W is its weight GEMM, 2 x batch x in x out FLOPs.
- Under sequence parallelism the split schedules train what 1F1B trains (with tp_comm_overlap too); an I pass
  charges its column-parallel Linears' input-gradient GEMMs beside the gather of their kept shards, and keeps the
  gathered inputs for W: a stage's peak activations exceed 1F1B's by their closed-form bytes.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from simtrain import run
from simtrain.errors import ScenarioError
from simtrain.parallel.schedules import REGISTRY, build_schedule
from simtrain.parallel.schedules.actions import Action, Overlapped, check_schedule, computations
from simtrain.parallel.schedules.timeline import timeline
from simtrain.schemes.weight_grads import input_gradient_part
from simulated_steps import bytes_by_label, flat_parameters, one_step
from test_model_parallel import EQUAL, GPT, MLP, scenario

ROOT = Path(__file__).resolve().parents[1]
GRID = [(p, m) for p in (2, 3, 4, 8) for m in (1, 2, 3, 4, 6, 8, 12, 16, 17, 24)]
CHUNKS = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zero_bubble": 1, "dualpipev": 2}


def buildable(name: str, p: int, m: int) -> bool:
    return not (name == "interleaved" and m % p or name == "dualpipev" and m < 2 * p)


# ---------------------------------------------------------------- the lists

@pytest.mark.parametrize("name", list(CHUNKS))
def test_every_schedule_runs_each_microbatch_of_each_part_once_each_way_in_order(name):
    for p, m in GRID:
        if not buildable(name, p, m):
            continue
        schedule = build_schedule(name, p, m, CHUNKS[name])
        check_schedule(schedule, m)  # forward once, backward once (B or I + W), after its forward; W after I
        line = timeline(schedule, m, {"F": 1.0, "I": 1.0, "W": 1.0})  # no rank waits on itself
        for rank, steps in enumerate(schedule.actions):
            for action in (a for step in steps for a in computations(step)):
                if action.kind in ("I", "B") and action.part < schedule.parts - 1:  # after the next part's I
                    assert line.ends["I", action.part + 1, action.microbatch] <= line.ends[tuple(action)] - 1.0


def test_the_placements_are_looped_or_the_v():
    assert build_schedule("interleaved", 4, 8, 2).placement == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert build_schedule("dualpipev", 4, 8, 2).placement == ((0, 7), (1, 6), (2, 5), (3, 4))
    assert build_schedule("1f1b", 4, 8, 1).placement == ((0,), (1,), (2,), (3,))


def test_gpipe_1f1b_and_interleaved_are_the_lists_simtrain_ran_before():
    """Today's lists (schemes/pipeline_schedule.py at a6eb7f2), as torch's action strings."""
    def strings(name, p, m, v, rank):
        return [str(a) for a in build_schedule(name, p, m, v).actions[rank]]
    assert strings("gpipe", 2, 3, 1, 1) == ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]
    assert strings("1f1b", 4, 6, 1, 0) == ["0F0", "0F1", "0F2", "0F3", "0B0", "0F4", "0B1", "0F5", "0B2", "0B3",
                                           "0B4", "0B5"]
    assert strings("1f1b", 4, 6, 1, 3) == ["3F0", "3B0", "3F1", "3B1", "3F2", "3B2", "3F3", "3B3", "3F4", "3B4",
                                           "3F5", "3B5"]
    assert strings("interleaved", 2, 4, 2, 0) == ["0F0", "0F1", "2F0", "2F1", "0F2", "2B0", "0F3", "2B1", "2F2",
                                                  "0B0", "2F3", "0B1", "2B2", "2B3", "0B2", "0B3"]
    assert strings("interleaved", 2, 2, 2, 1) == ["1F0", "1F1", "3F0", "3F1", "3B0", "3B1", "1B0", "1B1"]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zero_bubble"])
def test_a_rank_holds_the_forwards_its_schedule_keeps_in_flight(name):
    p, m = 4, 8
    for rank, steps in enumerate(build_schedule(name, p, m, 1).actions):
        in_flight = peak = 0
        for action in steps:
            in_flight += {"F": 1, "B": -1, "I": -1, "W": 0}[action.kind]
            peak = max(peak, in_flight)
        assert peak == (m if name == "gpipe" else min(p - rank, m))


def test_dualpipev_is_torch_pipelinings_schedule_dualpipev():
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(schedules, "ScheduleDualPipeV"):
        pytest.skip("this torch has no ScheduleDualPipeV")
    for p in (2, 3, 4, 8):
        for m in range(2 * p, 2 * p + 5):
            ours = build_schedule("dualpipev", p, m, 2)
            for rank in range(p):
                plan = type("Plan", (), {"pp_group_size": p, "_n_microbatches": m})()
                theirs = schedules.ScheduleDualPipeV._calculate_single_rank_operations(plan, rank)
                assert [str(step) for step in ours.actions[rank]] == [str(action) for action in theirs]


# ---------------------------------------------------------------- closed forms on the lists

COSTS = [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 1.0, 1.0), (1.0, 1.0, 0.5), (3.0, 2.0, 1.5)]  # F, I, W


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubbles_are_p_minus_1_times_f_plus_b(name):
    for p, m in GRID:
        for f, i, w in COSTS:
            line = timeline(build_schedule(name, p, m, 1), m, {"F": f, "I": i, "W": w})
            assert line.bubble_s == pytest.approx([(p - 1) * (f + i + w)] * p)


def test_interleaved_bubble_is_divided_by_the_chunks():
    for p, m, v in [(2, 4, 2), (4, 8, 2), (4, 16, 4), (8, 16, 2), (3, 9, 3)]:
        f, b = 1.0, 2.0  # one chunk's
        line = timeline(build_schedule("interleaved", p, m, v), m, {"F": f, "I": b, "W": 0.0})
        assert max(line.bubble_s) == pytest.approx((p - 1) * (v * f + v * b) / v)


def test_zero_bubble_h1_bubble_is_p_minus_1_times_f_plus_i_minus_w():
    for p, m in GRID:
        if m < p:  # the paper's closed form is for a full pipeline
            continue
        for f, i, w in COSTS:
            line = timeline(build_schedule("zero_bubble", p, m, 1), m, {"F": f, "I": i, "W": w})
            assert line.bubble_s == pytest.approx([(p - 1) * (f + i - w)] * p)


def test_dualpipev_bubble_is_the_dualpipe_readmes_with_pairs_run_as_one():
    for p, m in [(2, 4), (4, 8), (4, 11), (8, 16), (8, 20)]:
        for t in (1.0, 2.0):
            for pair in (2 * t, 2.5 * t, 3 * t):  # F&B between max(F, B) and F + B, B = I + W = 2t
                line = timeline(build_schedule("dualpipev", p, m, 2), m, {"F": t, "I": t, "W": t, "FB": pair})
                assert max(line.bubble_s) == pytest.approx((2 * p / 2 - 1) * (pair + 2 * t - 3 * t))


# ---------------------------------------------------------------- through the simulator

def measured(job):
    spans = job.cluster.log.spans
    return {name: next(s.end - s.start for s in spans if s.name == name)
            for name in ("forward", "backward", "backward_weight") if any(s.name == name for s in spans)}


def rank_bubbles(job, p):
    return [sum(s.end - s.start for s in job.cluster.log.spans if s.kind == "bubble" and s.rank == r)
            for r in range(p)]


def test_simulated_zero_bubble_has_the_closed_form_bubble_and_1f1b_its_own():
    p, m = 4, 8
    zb = one_step(scenario(EQUAL, p, pp=p, schedule="zero_bubble", microbatches=m))
    t = measured(zb)  # an I pass is named backward, its W backward_weight
    t_f, t_i, t_w = t["forward"], t["backward"], t["backward_weight"]
    assert t_w == pytest.approx(t_i, rel=1e-6)  # a Linear's weight GEMM costs its input-gradient GEMM
    assert rank_bubbles(zb, p)[0] == pytest.approx((p - 1) * (t_f + t_i - t_w), rel=0.01)
    one = one_step(scenario(EQUAL, p, pp=p, schedule="1f1b", microbatches=m))
    assert rank_bubbles(one, p)[0] == pytest.approx((p - 1) * (t_f + t_i + t_w), rel=0.01)
    step = max(s.end for s in zb.cluster.log.spans if s.name.startswith("backward"))
    assert step == pytest.approx(m * (t_f + t_i + t_w) + (p - 1) * (t_f + t_i - t_w), rel=0.01)


def test_simulated_dualpipev_bubble_is_its_timeline_with_the_measured_times():
    p, m = 4, 8
    job = one_step(scenario(EQUAL, p, pp=p, schedule="dualpipev", microbatches=m, virtual_stages=2))
    t = measured(job)
    f, i, w = t["forward"], t["backward"], t["backward_weight"]
    # a pair starts once both its inputs are in, as DualPipe's; with nothing to communicate inside it, F + B
    line = timeline(job.scheme.schedule, m, {"F": f, "I": i, "W": w, "FB": f + i + w})
    assert rank_bubbles(job, p) == pytest.approx(list(line.bubble_s), rel=0.01)
    step = max(s.end for s in job.cluster.log.spans if s.name.startswith("backward"))
    assert step == pytest.approx(line.step_s, rel=0.01)


def test_zero_bubble_keeps_what_w_reads_from_i_to_w():
    """Equal blocks: what a chunk's W reads is every Linear's input, less what the chunk's first takes (the
    received activation, which its I still holds); the peak counts them while held."""
    job = one_step(scenario(EQUAL, 4, pp=4, schedule="zero_bubble", microbatches=8))
    costs = [cost for cost in job.scheme._costs.values() if not isinstance(cost, list)]
    assert all(0 < cost.weight_held_bytes <= cost.activation_bytes for cost in costs)
    for cost in costs:  # W's FLOPs: each Linear's weight GEMM, 2 x batch x 32 x 32, and half the backward
        assert sum(flops for flops, _, _ in cost.weight_grads) == pytest.approx(sum(cost.backward_flops) / 2)


def write_csv(path: Path, schedule) -> Path:
    path.write_text("\n".join(",".join(str(step) for step in steps) for steps in schedule.actions) + "\n")
    return path


def test_a_csv_schedule_equal_to_1f1b_gives_1f1bs_report(tmp_path):
    p, m = 4, 8
    path = write_csv(tmp_path / "one_f_one_b.csv", build_schedule("1f1b", p, m, 1))
    base = {**EQUAL, "cluster": {**EQUAL["cluster"], "devices": p}, "train": {"steps": 2}}
    from_file = run(scenario_of({**base, "parallel": {"pp": p, "pipeline": {
        "schedule": "file", "schedule_file": str(path), "microbatches": m}}}))
    one = run(scenario_of({**base, "parallel": {"pp": p, "pipeline": {"schedule": "1f1b", "microbatches": m}}}))
    ours, theirs = dict(from_file.data), dict(one.data)
    assert (ours["parallel"].pop("schedule"), theirs["parallel"].pop("schedule")) == ("file", "1f1b")
    del ours["wall_time_s"], theirs["wall_time_s"]  # the host's, not a simulated figure
    assert ours == theirs


def test_dualpipev_read_from_a_file_runs_as_dualpipev_the_engine_knows_no_schedule(tmp_path):
    """What DualPipeV costs: its file and a registry line. Its actions as a CSV (the V, overlapped pairs, I and W)
    run through the same engine, with no schedule-specific code, to the same report."""
    p, m = 2, 4
    path = write_csv(tmp_path / "v.csv", build_schedule("dualpipev", p, m, 2))
    base = {**EQUAL, "cluster": {**EQUAL["cluster"], "devices": p}, "train": {"steps": 2}}
    pipeline = {"microbatches": m, "virtual_stages": 2}
    from_file = run(scenario_of({**base, "parallel": {"pp": p, "pipeline": {
        **pipeline, "schedule": "file", "schedule_file": str(path)}}})).data
    built = run(scenario_of({**base, "parallel": {"pp": p, "pipeline": {**pipeline, "schedule": "dualpipev"}}})).data
    for report in (from_file, built):
        del report["wall_time_s"], report["parallel"]["schedule"]
    assert from_file == built


def test_a_csv_reads_overlapped_pairs_and_drops_sends(tmp_path):
    schedule = build_schedule("dualpipev", 2, 4, 2)
    rows = [",".join([*(str(step) for step in steps), "0SEND_F1"]) for steps in schedule.actions]
    (tmp_path / "v.csv").write_text("\n".join(rows) + "\n")
    read = build_schedule("file", 2, 4, 2, tmp_path / "v.csv")
    assert read.actions == schedule.actions and read.placement == schedule.placement
    assert any(type(step) is Overlapped for step in read.actions[0])


def test_a_csv_may_order_a_ranks_microbatches_its_own_way(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("0F0,0F1,0B0,0B1\n1F1,1F0,1B1,1B0\n")
    assert [str(a) for a in build_schedule("file", 2, 2, 1, path).actions[1]] == ["1F1", "1F0", "1B1", "1B0"]


@pytest.mark.parametrize("rows,message", [
    (["0F0,0X0,0B0", "1F0,1B0"], "'0X0' is not an action"),
    (["0F0,0B0"], "has 1 rows of actions; parallel.pp is 2"),
    (["0B0,0F0", "1F0,1B0"], "0B0 runs before its F"),
    (["0F0,0I0,0F1,0B1", "1F0,1B0,1F1,1B1"], "part 0 microbatch 0 is not run forward and backward"),
    (["0F0,0B0,0F1,0B1", "1F1,1B1,1F0,1B0"], "rank 0 waits forever at 0B0"),
    (["0F0,0UNSHARD,0B0", "1F0,1B0"], "'0UNSHARD' is not an action"),
])
def test_bad_schedule_files_are_one_line_errors(tmp_path, rows, message):
    path = tmp_path / "s.csv"
    path.write_text("\n".join(rows) + "\n")
    microbatches = 2 if len(rows[0].split(",")) > 3 else 1
    with pytest.raises(ValueError) as error:
        build_schedule("file", 2, microbatches, 1, path)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert str(error.value).startswith("parallel.pipeline.schedule_file: ")


# ---------------------------------------------------------------- numerics

@pytest.mark.parametrize("layout", [
    {"pp": 2, "schedule": "zero_bubble", "microbatches": 4},
    {"pp": 2, "schedule": "dualpipev", "microbatches": 4, "virtual_stages": 2},
    {"pp": 2, "dp": 2, "schedule": "zero_bubble", "microbatches": 4, "sharding": {"stage": 3}},
    {"pp": 2, "dp": 2, "schedule": "dualpipev", "microbatches": 4, "virtual_stages": 2,
     "sharding": {"stage": 1, "overlap_grad_reduce": True}},
], ids=["zb", "dualpipev", "zb-zero3", "dualpipev-zero1-overlap"])
def test_split_backward_schedules_train_what_1f1b_trains(layout):
    layout = dict(layout)
    devices = layout.get("dp", 1) * layout["pp"]
    ours = run(scenario(MLP, devices, **layout))
    reference = dict(layout, schedule="1f1b")
    reference.pop("virtual_stages", None)
    theirs = run(scenario(MLP, devices, **reference))
    assert ours.data["status"] == "ok"
    torch.testing.assert_close(flat_parameters(ours.final_models[0]), flat_parameters(theirs.final_models[0]),
                               rtol=1e-5, atol=1e-5)
    assert ours.data["final_loss"] == pytest.approx(theirs.data["final_loss"], abs=1e-5)


def test_a_pair_runs_each_pass_until_it_waits_then_the_other():
    """interleaved: the forward posts its all-to-all and parks at its wait; the backward computes, its blocking
    collective is posted and parked; the forward's wait is taken first, then the backward's, whose collective's
    answer is its handle's communication seconds."""
    from simtrain.schemes.pipeline import interleaved
    from simtrain.step_ops import Await, Collective, Compute, Post

    class Handle:
        def __init__(self, label):
            self.label, self.charged_s = label, 0.25

    def forward():
        handle = yield Post("dispatch", "moe dispatch")
        yield Compute(1.0, "bf16", "attention")
        yield Await(handle)
        yield Compute(1.0, "bf16", "experts")

    answers = []

    def backward():
        yield Compute(2.0, "bf16", "experts backward")
        answers.append((yield Collective("combine", "moe combine backward")))
        yield Compute(2.0, "bf16", "attention backward")

    program, trace, value = interleaved(forward(), backward()), [], None
    while True:
        try:
            op = program.send(value)
        except StopIteration:
            break
        trace.append((type(op).__name__, op.label if type(op) is Post else getattr(op, "name", None)))
        value = Handle(op.label) if type(op) is Post else None
        if type(op) is Await:
            trace[-1] = ("Await", op.handle.label)
    assert trace == [("Post", "moe dispatch"), ("Compute", "attention"), ("Compute", "experts backward"),
                     ("Post", "moe combine backward"), ("Await", "moe dispatch"), ("Compute", "experts"),
                     ("Await", "moe combine backward"), ("Compute", "attention backward")]
    assert answers == [0.25]


def test_dualpipev_pairs_hide_all_to_all_behind_compute():
    """The same layers, exchanges and micro-batches: DualPipeV's pairs leave less all-to-all exposed than the
    interleaved schedule's passes, each of which waits on its own exchanges."""
    from test_expert_model_parallel import scenario as moe_scenario
    exposed = {}
    for schedule in ("dualpipev", "interleaved"):
        report = run(moe_scenario(4, ep=2, pp=2, microbatches=4, schedule=schedule, virtual_stages=2, steps=1,
                                  numerics=False))
        exposed[schedule] = report.data["moe"]["all_to_all_time_s"][0]
    assert 0 < exposed["dualpipev"] < 0.9 * exposed["interleaved"]


def test_dualpipev_under_expert_parallelism_trains_what_interleaved_trains():
    """The V's turn (parts p - 1 and p on one rank) hands tensors over on the rank; the ep exchanges of an I pass
    run in its backward."""
    from test_expert_model_parallel import scenario as moe_scenario
    ours = run(moe_scenario(4, ep=2, pp=2, microbatches=4, schedule="dualpipev", virtual_stages=2, steps=2))
    theirs = run(moe_scenario(4, ep=2, pp=2, microbatches=4, schedule="interleaved", virtual_stages=2, steps=2))
    torch.testing.assert_close(flat_parameters(ours.final_models[0]), flat_parameters(theirs.final_models[0]),
                               rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the scenario's field

@pytest.mark.parametrize("pipeline,message", [
    ({"schedule": "dualpipev", "microbatches": 8}, "parallel.pipeline.virtual_stages: dualpipev holds exactly 2"),
    ({"schedule": "dualpipev", "microbatches": 2, "virtual_stages": 2},
     "parallel.pipeline.microbatches: dualpipev needs at least 4"),
    ({"schedule": "zero_bubble", "virtual_stages": 2}, "parallel.pipeline.virtual_stages: 2 chunks per device"),
    ({"schedule": "pipedream"}, "parallel.pipeline.schedule: unknown schedule 'pipedream'"),
    ({"schedule": "file"}, "parallel.pipeline.schedule_file: goes with schedule file"),
    ({"schedule": "file", "schedule_file": "no/such.csv"}, "parallel.pipeline.schedule_file: cannot read"),
])
def test_schedules_a_layout_cannot_run_are_one_line_errors(pipeline, message):
    raw = {"train": {"steps": 1}, "cluster": {"devices": 2}, "model": {"hidden": [32, 32, 32]},
           "parallel": {"pp": 2, "pipeline": pipeline}}
    with pytest.raises(ScenarioError) as error:
        one_step(scenario_of(raw))
    assert message in str(error.value) and "\n" not in str(error.value)


def scenario_of(raw):
    from simtrain.scenario import validate_scenario
    return validate_scenario(raw)


def test_validate_checks_a_dualpipev_scenario_without_torch(tmp_path):
    good = tmp_path / "v.yaml"
    good.write_text("name: v\ncluster: {devices: 4}\nmodel: {name: gpt, hidden: 32, layers: 4, heads: 4}\n"
                    "data: {name: tokens, batch_size: 8, samples: 64, seq_len: 8, vocab: 16}\n"
                    "parallel: {pp: 2, pipeline: {schedule: dualpipev, microbatches: 4, virtual_stages: 2}}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("microbatches: 4", "microbatches: 2"))
    script = (f"import sys\nfrom simtrain.cli import main\n"
              f"for path, code in (({str(good)!r}, 0), ({str(bad)!r}, 2)):\n"
              f"    try:\n        main(['validate', path])\n    except SystemExit as exit:\n"
              f"        assert (exit.code or 0) == code, (path, exit.code)\n"
              f"assert 'torch' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "parallel.pipeline.microbatches: dualpipev needs at least 4" in done.stdout + done.stderr


def test_the_registry_names_each_schedule_file():
    folder = ROOT / "simtrain" / "parallel" / "schedules"
    assert all((folder / f"{module}.py").is_file() for module in REGISTRY.values())
    assert set(CHUNKS) | {"file"} == set(REGISTRY)
    assert Action("I", 3, 1).__str__() == "3I1"


# ---------------------------------------------------------------- under sequence parallelism

GPT_SP = {**GPT, "train": {**GPT["train"], "steps": 3}}


@pytest.mark.parametrize("layout", [
    {"schedule": "zero_bubble", "microbatches": 4},
    {"schedule": "dualpipev", "microbatches": 4, "virtual_stages": 2},
    {"schedule": "zero_bubble", "microbatches": 4, "tp_comm_overlap": True},
], ids=["zb", "dualpipev", "zb-tp-comm-overlap"])
def test_split_backwards_under_sequence_parallelism_train_what_1f1b_trains(layout):
    """A gpt over pp 2 x tp 2 with sequence parallelism (and with Transformer Engine's overlaps): the I pass
    gathers each column-parallel Linear's kept shard again for its input gradient and keeps it for W."""
    ours = run(scenario(GPT_SP, 4, pp=2, tp=2, sequence_parallel=True, **layout))
    reference = dict(layout, schedule="1f1b")
    reference.pop("virtual_stages", None)
    theirs = run(scenario(GPT_SP, 4, pp=2, tp=2, sequence_parallel=True, **reference))
    torch.testing.assert_close(flat_parameters(ours.final_models[0]), flat_parameters(theirs.final_models[0]),
                               rtol=1e-5, atol=1e-5)
    assert ours.data["final_loss"] == pytest.approx(theirs.data["final_loss"], abs=1e-5)


def test_under_sequence_parallelism_i_gathers_the_shards_again_and_keeps_them_for_w():
    """pp 2 x tp 2, one microbatch of 8 sequences of 8 tokens, width 32. Stage 0 holds the embedding and a block
    (two all-gathered inputs: the attention's, the MLP's), stage 1 a block and the head (three). Closed forms:
    - an I pass charges, beside each gather, its column-parallel Linears' input-gradient GEMMs alone, 2 x tokens
      x in x out FLOPs (q, k, v: 32 to 16 each on a tp rank; the MLP's first Linear 32 to 64), nothing after it;
    - it keeps each gathered input, tokens x 32 fp32 values, for its W: a stage's peak activations exceed 1F1B's
      by those, the shards gathered as often (tp_regather's bytes the same)."""
    tokens, gathered = 8 * 8, 8 * 8 * 32 * 4
    jobs = {schedule: one_step(scenario({**GPT, "train": {**GPT["train"], "steps": 1}}, 4, pp=2, tp=2,
                                        sequence_parallel=True, schedule=schedule, microbatches=1))
            for schedule in ("1f1b", "zero_bubble")}
    zb = jobs["zero_bubble"]
    peaks = {schedule: [device.memory.peak["activations"] for device in job.devices] for schedule, job in jobs.items()}
    assert [ours - theirs for ours, theirs in zip(peaks["zero_bubble"], peaks["1f1b"])] == \
        [2 * gathered] * 2 + [3 * gathered] * 2
    assert bytes_by_label(zb)["tp_regather"] == bytes_by_label(jobs["1f1b"])["tp_regather"] > 0
    stage0 = next(cost for cost in zb.scheme._costs.values()
                  if not isinstance(cost, list) and cost.weight_regathered_bytes == 2 * gathered)
    splits = [split for split in input_gradient_part(stage0).backward_regather if split is not None]
    assert [(split.after_flops, split.behind) for split in splits] == [(2 * tokens * 32 * 64, 0.0),
                                                                        (3 * 2 * tokens * 32 * 16, 0.0)]


@pytest.mark.parametrize("name, stages, microbatches, follows", [
    ("1f1b", 1, 4, True), ("interleaved", 1, 4, True), ("gpipe", 1, 1, True), ("gpipe", 1, 4, False),
    ("zero_bubble", 1, 4, False), ("1f1b", 2, 4, False)])
def test_whether_each_forwards_whole_backward_follows_it(name, stages, microbatches, follows):
    """F0 B0 F1 B1 ... on every rank: what FSDP's unit-by-unit overlap needs (strategies/unit_overlap.py); GPipe's
    forwards run first, zero bubble splits its backwards, and 1F1B on two stages warms up with two forwards."""
    schedule = build_schedule(name, stages, microbatches, chunks=1)
    assert schedule.backwards_follow_forwards() is follows, [str(action) for action in schedule.actions[0]]
