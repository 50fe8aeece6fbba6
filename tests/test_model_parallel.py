"""Pipeline and tensor parallelism (schemes/model_parallel.py) against their references.

- Equivalence: every layout trains the same parameters as one device on the same
  global batch (single-process torch through simtrain's one-device run), within 1e-5.
- Bubbles: with equal stages and free links, GPipe and 1F1B take (m + p - 1)(t_f + t_b)
  per step and interleaved (m + (p - 1)/v)(t_f + t_b) (Narayanan et al. 2021, eq. 1 and 2).
- Memory: a stage holds m microbatches' activations under GPipe, min(p - s, m) under 1F1B.
- Traffic: the bytes on the links are those the layout must move, counted by hand.
- Layouts as pure logic (schedules: tests/test_pipeline_schedules.py); bad layouts as one-line errors.
"""
import pytest
import torch
from torch import nn

from simtrain import load_scenario, plan_memory, run
from simtrain.errors import ScenarioError
from simtrain.parallel import Layout
from simtrain.scenario import validate_scenario
from simulated_steps import flat_parameters, one_step

MLP = {"name": "mp", "seed": 3, "cluster": {"devices": 1}, "model": {"hidden": [32, 32, 32]},
       "data": {"name": "digits", "batch_size": 24}, "train": {"steps": 20, "optimizer": {"momentum": 0.9}},
       "report": {"trace": False, "every": 20}}
GPT = {"name": "gpt", "seed": 1, "cluster": {"devices": 1}, "model": {"name": "gpt", "hidden": 32, "layers": 2,
                                                                       "heads": 4},
       "data": {"name": "tokens", "batch_size": 8, "samples": 256, "seq_len": 8, "vocab": 16},
       # SGD: Adam divides a gradient by its own magnitude, so the rounding noise in a gradient that is zero in
       # exact arithmetic (attention's key bias: softmax ignores a shift) becomes a full-size step
       "train": {"steps": 20, "optimizer": {"lr": 0.1, "momentum": 0.9}}, "report": {"trace": False, "every": 20}}
FREE_LINKS = {"bandwidth": 1e18, "latency": 0}


def scenario(base: dict, devices: int = 1, **parallel):
    pipeline = {key: parallel.pop(key) for key in ("schedule", "microbatches", "virtual_stages") if key in parallel}
    raw = {**base, "cluster": {**base["cluster"], "devices": devices},
           "parallel": {**parallel, **({"pipeline": pipeline} if pipeline else {})}}
    return validate_scenario(raw)



LAYOUTS = [
    *({"pp": p, "schedule": s, "microbatches": m} for p in (2, 4) for s in ("gpipe", "1f1b") for m in (1, 3, 8)),
    {"pp": 2, "schedule": "interleaved", "microbatches": 4, "virtual_stages": 2},
    {"pp": 2, "schedule": "interleaved", "microbatches": 2, "virtual_stages": 2},
    {"tp": 2}, {"tp": 4},
    {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2},
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "-".join(f"{k}{v}" for k, v in layout.items()))
def test_every_mlp_layout_trains_what_one_device_trains(layout):
    layout = dict(layout)
    devices = layout.get("dp", 1) * layout.get("pp", 1) * layout.get("tp", 1)
    base = {**MLP, "data": {**MLP["data"], "batch_size": 24 if layout.get("microbatches", 1) != 8 else 32}}
    split = run(scenario(base, devices, **layout))
    global_batch = base["data"]["batch_size"] * layout.get("dp", 1)
    alone = run(scenario({**base, "data": {**base["data"], "batch_size": global_batch}}))
    assert split.data["status"] == "ok"
    torch.testing.assert_close(flat_parameters(split.final_models[0]), flat_parameters(alone.final_models[0]),
                               rtol=0, atol=1e-5)
    assert split.data["final_loss"] == pytest.approx(alone.data["final_loss"], abs=1e-5)


@pytest.mark.parametrize("layout", [
    {"pp": 2, "schedule": "1f1b", "microbatches": 4},
    {"pp": 4, "schedule": "gpipe", "microbatches": 2},
    {"pp": 2, "schedule": "interleaved", "microbatches": 2, "virtual_stages": 2},
    {"tp": 2}, {"tp": 4}, {"tp": 2, "microbatches": 4},  # the last: gradient accumulation without a pipeline
    {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2},
], ids=lambda layout: "-".join(f"{k}{v}" for k, v in layout.items()))
def test_every_gpt_layout_trains_what_one_device_trains(layout):
    layout = dict(layout)
    devices = layout.get("dp", 1) * layout.get("pp", 1) * layout.get("tp", 1)
    split = run(scenario(GPT, devices, **layout))
    global_batch = GPT["data"]["batch_size"] * layout.get("dp", 1)
    alone = run(scenario({**GPT, "data": {**GPT["data"], "batch_size": global_batch}}))
    torch.testing.assert_close(flat_parameters(split.final_models[0]), flat_parameters(alone.final_models[0]),
                               rtol=0, atol=1e-5)


# ---------------------------------------------------------------- bubbles, memory, traffic

class Scale(nn.Module):
    """x * s: makes the first Linear's input need a gradient, so the first stage's backward is a
    stage like the others (the FLOP counter counts element-wise work as 0)."""

    def __init__(self, width: int):
        super().__init__()
        self.s = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * self.s


def equal_blocks(width: int = 32, blocks: int = 8) -> nn.Sequential:
    """Identical Linear + ReLU blocks: equal pipeline stages (the head is a block too)."""
    layers = [Scale(width)]
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


EQUAL = {"name": "equal", "cluster": {"devices": 1, "link": FREE_LINKS},
         "model": {"name": "test_model_parallel:equal_blocks"},
         "data": {"name": "synthetic", "samples": 512, "features": 32, "classes": 32, "batch_size": 32},
         "train": {"steps": 1}, "report": {"every": 1}}



@pytest.mark.parametrize("schedule,p,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 2, 4, 1),
                                            ("gpipe", 2, 1, 1), ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2)])
def test_pipeline_step_time_is_the_closed_form(schedule, p, m, v):
    job = one_step(scenario(EQUAL, p, pp=p, schedule=schedule, microbatches=m, virtual_stages=v))
    spans = job.cluster.log.spans
    chunk_forward = next(s.end - s.start for s in spans if s.name == "forward")
    chunk_backward = next(s.end - s.start for s in spans if s.name == "backward")
    t_f, t_b = v * chunk_forward, v * chunk_backward  # one microbatch through one whole stage
    pipeline_end = max(s.end for s in spans if s.name == "backward")
    expected = (m + (p - 1) / v) * (t_f + t_b)
    assert pipeline_end == pytest.approx(expected, rel=0.01)
    bubble = sum(s.end - s.start for s in spans if s.kind == "bubble" and s.rank == 0)
    assert bubble == pytest.approx((p - 1) / v * (t_f + t_b), rel=0.01)  # stage 0 waits out the whole bubble


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stage_holds_the_activations_its_schedule_keeps(schedule):
    p, m = 4, 8
    job = one_step(scenario(EQUAL, p, pp=p, schedule=schedule, microbatches=m))
    for rank, device in enumerate(job.devices):
        chunk = job.scheme._signature(job.replicas[rank], 0, rank)  # rank s holds model part s
        per_microbatch = next(cost.activation_bytes for key, cost in job.scheme._costs.items() if key[0] == chunk)
        held = m if schedule == "gpipe" else min(p - rank, m)
        assert device.memory.peak_breakdown["activations"] == held * per_microbatch


def test_pipeline_sends_one_activation_and_one_gradient_per_boundary_and_microbatch():
    p, m, batch, width = 4, 8, 32, 32
    report = run(scenario({**EQUAL, "cluster": {"devices": 1, "topology": "ring",
                                                "link": {"bandwidth": "50 GB/s", "latency": "5 us"}},
                           "train": {"steps": 2}}, p, pp=p, microbatches=m))
    per_message = batch // m * width * 4  # fp32 activations of one microbatch
    expected = 2 * (p - 1) * m * per_message * 2  # both directions, every boundary, every microbatch, 2 steps
    assert report.data["parallel"]["bytes_by_kind"] == {"dp_allreduce": 0, "pp_p2p": expected, "tp_allreduce": 0,
                                                        "overflow_vote": 0, "cp_ring": 0}
    assert sum(link["bytes"] for link in report.data["links"]) == expected  # neighbours on the ring: one hop


def test_tensor_parallel_all_reduces_each_pairs_activation_forward_and_its_gradient_backward():
    batch, steps = 24, 2
    report = run(scenario({**MLP, "model": {"hidden": [64, 64, 64]}, "train": {"steps": steps},
                           "data": {"name": "digits", "batch_size": batch}}, 2, tp=2))
    # pairs (Linear 64-64, Linear 64-64) and (Linear 64-64, Linear 64-10): forward sums of the outputs
    # (64 and 10 features), backward sums of the inputs' gradients (none for the data, 64 for the second)
    values = batch * (64 + 10 + 64)
    ring_bytes = 2 * 4 * values  # a 2-rank ring: each rank sends its half of the buffer twice
    assert report.data["parallel"]["bytes_by_kind"]["tp_allreduce"] == steps * ring_bytes
    assert sum(link["bytes"] for link in report.data["links"]) == steps * ring_bytes


# ---------------------------------------------------------------- pure logic

def test_layout_places_tp_innermost_then_pp_then_dp():
    layout = Layout(dp=2, pp=2, tp=2)
    assert layout.coordinates(5) == {"tp": 1, "cp": 0, "pp": 0, "dp": 1}
    groups = layout.rank_groups(5)
    assert groups.tp == (4, 5) and groups.pp == (5, 7) and groups.dp == (1, 5)
    assert layout.groups("pp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    other = Layout(dp=2, pp=2, tp=2, placement=("dp", "tp", "pp"))
    assert other.rank_groups(0).dp == (0, 1) and other.rank_groups(0).pp == (0, 4)


@pytest.mark.parametrize("raw,message", [
    ({"cluster": {"devices": 8}, "parallel": {"pp": 3}}, "parallel.dp: dp (default) x pp 3 x cp 1 x tp 1 must equal"),
    ({"cluster": {"devices": 4}, "parallel": {"pp": 4}, "model": {"hidden": [8]}},
     "parallel.pp: 4 model parts (pp x virtual_stages) but the model has only 2 splittable layers"),
    ({"cluster": {"devices": 2}, "parallel": {"tp": 2}, "model": {"hidden": [9, 9]}},
     "parallel.tp: the model cannot be split 2 ways"),
    ({"cluster": {"devices": 2}, "parallel": {"tp": 2}, "model": {"name": "cnn"}}, "parallel.tp: the model has no"),
    ({"cluster": {"devices": 2}, "parallel": {"pp": 2, "pipeline": {"microbatches": 5}}},
     "parallel.pipeline.microbatches: 5 does not divide data.batch_size 32"),
    ({"cluster": {"devices": 2}, "parallel": {"pp": 2, "pipeline": {"virtual_stages": 2}}},
     "parallel.pipeline.virtual_stages: 2 chunks per device need schedule interleaved"),
    ({"cluster": {"devices": 2}, "parallel": {"pp": 2, "mode": "async"}}, "parallel.mode: async does not"),
    ({"cluster": {"devices": 2}, "parallel": {"pp": 2, "pipeline": {"split": [1, 1]}}},
     "parallel.pipeline.split: needs 2 counts"),
])
def test_layouts_that_do_not_fit_are_one_line_errors(raw, message):
    with pytest.raises(ScenarioError) as error:
        scenario_ = validate_scenario({"train": {"steps": 1}, **raw})
        one_step(scenario_)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_units_built_alike_are_measured_once_and_as_each_alone():
    """unit_flops runs a block like one before it once; every unit's FLOPs and output equal running it alone."""
    import copy

    from simtrain.op_cost import OperatorRecorder
    from simtrain.train.data import load_dataset
    from simtrain.train.models import build_model
    from simtrain.train.partition import model_units, unit_passes

    spec = scenario({**GPT, "model": {**GPT["model"], "layers": 4, "moe": {"experts": 2, "top_k": 1, "every": 2}}})
    data = load_dataset("tokens", spec.data.loader_options(), 0)
    model = build_model(spec.model, data.info, 0)
    units = model_units(model, tensor_parallel=False)
    x = torch.stack([data.train[i][0] for i in range(4)])
    meta, h, alone = copy.deepcopy(model).to("meta"), torch.empty(x.shape, dtype=x.dtype, device="meta"), []
    with torch.no_grad():
        for unit in units:
            with OperatorRecorder() as recorder:
                for index in unit:
                    h = meta[index](h)
            alone.append((float(recorder.flops), tuple(h.shape)))
    passes = unit_passes(model, units, x)
    assert [(flops, tuple(out.shape)) for flops, out in passes] == alone
    assert len({id(out) for _, out in passes}) < len(units)  # the dense blocks were run once, the MoE blocks once
    assert len({flops for flops, _ in passes[1:5]}) == 2  # a dense and an MoE block differ


@pytest.mark.slow
def test_the_shipped_scenarios_run():
    """scenarios/pipeline.yaml, two steps on 256 samples (the loss curve's evaluation of the default 2048 was most
    of the run): pp 4 with a bubble."""
    report = run(load_scenario("scenarios/pipeline.yaml", ["train.steps=2", "data.samples=256"]))
    assert report.data["parallel"]["pp"] == 4 and report.data["parallel"]["bubble_fraction"] > 0


@pytest.mark.slow
def test_the_memory_plan_of_a_pipeline_tries_whole_microbatches():
    """pp 4 (dp 2, 4 microbatches): every stage's largest batch is a multiple of 4, found by the secant's
    predictions and, for a stage whose peaks are not on a line, doubling and bisection. One block per stage on
    1 GB devices keeps each replay short and the search to a few hundred samples."""
    scenario_ = load_scenario("scenarios/data_vs_model_parallel.yaml",
                              ["parallel.pp=4", "model.hidden=1024", "model.heads=8", "data.seq_len=128",
                               "model.layers=4", "cluster.device={base: v100-16gb, memory: 1 GB}"])
    for plan in plan_memory(scenario_):
        assert plan.peak_bytes <= plan.capacity_bytes
        assert plan.largest_batch > scenario_.data.batch_size and plan.largest_batch % 4 == 0


# --- the one mailbox: a pipeline message is a Send posted without blocking and a Recv awaited ---

def _two_ranks(latency_s=5e-6, bandwidth_Bps=1e9):
    import simpy

    from simtrain.comm.simulated import SimCommunicator
    from simtrain.hw.eventlog import EventLog
    from simtrain.hw.network import Network
    from simtrain.hw.topology_builders import LinkClass, build_topology

    env = simpy.Environment()
    network = Network(env, build_topology("ring", 2, LinkClass(bandwidth=bandwidth_Bps, latency=latency_s)))
    log = EventLog()
    return env, log, SimCommunicator(network, ["gpu0", "gpu1"], log=log)


@pytest.mark.parametrize("send_at, await_at", [(3e-3, 1e-3), (1e-3, 1.002e-3), (1e-3, 5e-3)])
def test_an_awaited_receive_is_bubble_until_its_send_then_communication_until_it_lands(send_at, await_at):
    """Closed form: the transfer takes latency + bytes / bandwidth from the send's post (the receive was
    posted at 0); the receiver is charged, from its await, bubble until the send and communication until
    the data lands; the sender, which never awaits, nothing."""
    from simtrain.comm.ops import Recv, Send

    env, log, comm = _two_ranks()
    payload, out = torch.arange(250, dtype=torch.float32), torch.zeros(250)
    lands_at = send_at + 5e-6 + payload.nbytes / 1e9
    handle = comm.post(1, (lambda: (yield Recv(0, out)))(), "pp_p2p")
    got = {}

    def sender():
        yield env.timeout(send_at)
        comm.post(0, (lambda: (yield Send(1, payload)))(), "pp_p2p")

    def receiver():
        yield env.timeout(await_at)
        got["value"] = yield comm.wait(handle, idle="bubble")
        got["at"] = env.now

    env.process(sender())
    env.process(receiver())
    env.run()
    assert torch.equal(got["value"], payload) and got["at"] == pytest.approx(max(lands_at, await_at))
    assert log.total(1, "bubble") == pytest.approx(max(0.0, send_at - await_at))
    assert log.total(1, "communication") == pytest.approx(max(0.0, lands_at - max(send_at, await_at)))
    assert log.total(0, "communication") == 0 and log.total(0, "bubble") == 0
    assert comm.bytes_by_label == {"pp_p2p": payload.nbytes} and comm.stuck() == []


def test_a_receive_awaited_with_no_send_is_stuck():
    from simtrain.comm.ops import Recv

    env, _, comm = _two_ranks()
    handle = comm.post(1, (lambda: (yield Recv(0, torch.zeros(4))))(), "pp_p2p")
    assert comm.stuck() == []  # posted, not awaited: the rank is not waiting on it
    comm.wait(handle)
    env.run()
    assert comm.stuck() == [1]
