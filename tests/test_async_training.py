"""Asynchronous SGD through shared memory, against plain torch and closed forms.

References: a single-process torch loop (one worker, lockstep workers), the
sum of every gradient the workers computed (locked mode), the order statistics
of lockstep workers, and the transfer closed forms of the store's links.
"""
import json

import pytest
import torch

import simtrain
from simtrain.scenario import ModelSpec
from simtrain.errors import ScenarioError
from simtrain.scenario import validate_scenario
from simtrain.train.data import ShardLoader, load_dataset
from simtrain.train.models import build_model
from simtrain.train.replica import Replica

HIDDEN, BATCH, LR, SEED = [32], 16, 0.1, 5
STORE = {"location": "host", "bandwidth": "100 GB/s", "latency": "100 ns",
         "host_link": {"bandwidth": "32 GB/s", "latency": "1 us"}}
# A slow device makes compute dominate the store's transfers, as for a big model.
SLOW = {"base": "a100-40gb", "efficiency": 0.001}


def scenario(devices, steps, mode="async", consistency="hogwild", staleness_lr="none", momentum=0.0,
             trace=False, **cluster):
    return validate_scenario({
        "name": "t", "seed": SEED,
        "cluster": {"topology": "ring", "devices": devices, "shared_memory": STORE, **cluster},
        "model": {"name": "mlp", "hidden": HIDDEN},
        "data": {"name": "digits", "batch_size": BATCH},
        "train": {"steps": steps, "optimizer": {"name": "sgd", "lr": LR, "momentum": momentum}},
        "parallel": {"mode": mode, "async": {"consistency": consistency, "staleness_lr": staleness_lr}},
        "report": {"trace": trace},
    })


def params(model):
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def initial_model():
    data = load_dataset("digits", {}, SEED)
    return data, build_model(ModelSpec(name="mlp", hidden=HIDDEN), data.info, SEED)


@pytest.mark.parametrize("consistency", ["hogwild", "locked"])
def test_one_worker_is_exactly_plain_sgd(consistency):
    report = simtrain.run(scenario(1, 15, consistency=consistency, momentum=0.9))
    sync = simtrain.run(scenario(1, 15, mode="sync", momentum=0.9))
    data, model = initial_model()
    loader = ShardLoader(data.train, 1, 0, BATCH, SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, foreach=False)
    for _ in range(15):
        x, y = loader.next_batch()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    reference = params(model)
    for name, tensor in params(report.final_model).items():
        assert torch.equal(tensor, reference[name])
        assert torch.equal(tensor, params(sync.final_model)[name])
    section = report.data["async"]
    assert section["staleness_histogram"] == [15] and section["staleness_max"] == 0
    assert section["lock_wait_s"] == 0


@pytest.mark.parametrize("staleness_lr", ["none", "inverse"])
def test_lockstep_workers_match_a_round_by_round_torch_loop(staleness_lr):
    # Two identical workers without jitter move in lockstep: both read the same parameters,
    # both updates land at the same instant and are applied in rank order, so rank 1's
    # update is one update stale every round.
    rounds = 8
    report = simtrain.run(scenario(2, 2 * rounds, staleness_lr=staleness_lr))
    data, model = initial_model()
    loaders = [ShardLoader(data.train, 2, rank, BATCH, SEED) for rank in range(2)]
    with torch.no_grad():
        for _ in range(rounds):
            grads = []
            for loader in loaders:
                x, y = loader.next_batch()
                with torch.enable_grad():
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    grads.append(torch.autograd.grad(loss, list(model.parameters())))
            for rank, grad in enumerate(grads):
                lr = LR / (1 + rank) if staleness_lr == "inverse" else LR
                for p, g in zip(model.parameters(), grad):
                    p.add_(g, alpha=-lr)
    for name, tensor in params(report.final_model).items():
        torch.testing.assert_close(tensor, params(model)[name], rtol=0, atol=1e-6)
    assert report.data["async"]["staleness_histogram"] == [rounds, rounds]


def test_identical_workers_in_lockstep_have_staleness_equal_to_their_rank():
    section = simtrain.run(scenario(4, 40)).data["async"]
    assert section["staleness_histogram"] == [10, 10, 10, 10]
    assert section["updates_per_rank"] == [10, 10, 10, 10]


def test_equal_speed_workers_reach_staleness_n_minus_one():
    world, steps = 4, 240
    section = simtrain.run(scenario(world, steps, device=SLOW, compute_jitter=0.2)).data["async"]
    histogram = section["staleness_histogram"]
    assert sum(histogram) == section["updates"] == steps
    assert len(histogram) == section["staleness_max"] + 1 and histogram[-1] > 0
    mean = sum(s * count for s, count in enumerate(histogram)) / steps
    assert section["staleness_mean"] == pytest.approx(mean, rel=1e-12)
    assert mean == pytest.approx(world - 1, abs=0.15)


def test_locked_mode_never_loses_an_update(monkeypatch):
    # Independent accounting: every gradient a worker computes is recorded as it is
    # computed; with plain SGD the shared parameters must end at initial - lr * their sum.
    computed = []
    original = Replica.backward

    def recording(self, loss, share=1.0):
        loss = original(self, loss, share)
        computed.append(self.grad_buffer.clone())
        return loss

    monkeypatch.setattr(Replica, "backward", recording)
    steps = 30
    report = simtrain.run(scenario(4, steps, consistency="locked", device=SLOW, compute_jitter=0.3, trace=True))
    assert len(computed) == steps == report.data["async"]["updates"]
    _, model = initial_model()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    expected = flat - LR * torch.stack(computed).sum(dim=0)
    final = torch.cat([p.detach().reshape(-1) for p in report.final_model.parameters()])
    torch.testing.assert_close(final, expected, rtol=0, atol=1e-5)
    # Lock waits, accounted from the trace: the time from a worker's backward to its push.
    waited = 0.0
    for rank in range(4):
        spans = sorted((e for e in report.trace["traceEvents"]
                        if e["ph"] == "X" and e["pid"] == 0 and e["tid"] == rank and e["cat"] != "idle"),
                       key=lambda e: e["ts"])
        for before, after in zip(spans, spans[1:]):
            if after["name"] == "push":
                assert before["name"] == "backward"
                waited += (after["ts"] - before["ts"] - before["dur"]) / 1e6
    section = report.data["async"]
    assert waited > 0
    assert section["lock_wait_s"] == pytest.approx(waited, rel=1e-6)
    assert sum(section["lock_wait_s_per_rank"]) == pytest.approx(section["lock_wait_s"], rel=1e-12)


def test_pull_and_push_cost_the_store_links_closed_form():
    report = simtrain.run(scenario(1, 3, trace=True))
    param_bytes = sum(p.numel() * 4 for p in report.final_model.parameters())
    latency = 1e-6 + 100e-9  # host link, then the store's link
    expected = latency + param_bytes / 32e9  # the host link is the bottleneck
    transfers = [e for e in report.trace["traceEvents"] if e["ph"] == "X" and e["name"] in ("pull", "push")]
    assert len(transfers) == 6
    for event in transfers:
        assert event["dur"] / 1e6 == pytest.approx(expected, rel=1e-9)
    memory = report.data["shared_memory"]
    by_category = memory["peak_memory_bytes_by_category"]
    assert by_category["weights"] == by_category["gradients"] == param_bytes
    assert by_category["comm_buffers"] == param_bytes  # one push staged at a time
    assert memory["peak_memory_bytes"] == sum(by_category.values())


def test_concurrent_readers_share_the_store_bandwidth():
    # Two lockstep workers pull at once through one 1 GB/s store link: each pull takes twice as long.
    store = {**STORE, "bandwidth": "1 GB/s"}
    report = simtrain.run(validate_scenario({
        **scenario(2, 2, trace=True).model_dump(), "cluster": {"devices": 2, "shared_memory": store},
        "report": {"trace": True}}))
    param_bytes = sum(p.numel() * 4 for p in report.final_model.parameters())
    pulls = [e for e in report.trace["traceEvents"] if e["ph"] == "X" and e["name"] == "pull"]
    assert len(pulls) == 2
    for event in pulls:
        assert event["dur"] / 1e6 == pytest.approx(1.1e-6 + 2 * param_bytes / 1e9, rel=1e-9)


def test_adding_a_store_does_not_change_a_collective():
    with_store = simtrain.run(scenario(4, 5, mode="sync")).data
    without = simtrain.run(validate_scenario({**scenario(4, 5, mode="sync").model_dump(),
                                              "cluster": {"topology": "ring", "devices": 4}})).data
    assert with_store["sim_time_s"] == without["sim_time_s"]
    assert with_store["final_loss"] == without["final_loss"]


def test_a_parameter_server_node_of_the_topology():
    store = {"location": "switch", "bandwidth": "25 GB/s", "latency": "2 us"}
    report = simtrain.run(validate_scenario({
        **scenario(1, 2, trace=True).model_dump(),
        "cluster": {"topology": "switch", "devices": 1, "link": {"bandwidth": "50 GB/s", "latency": "5 us"},
                    "shared_memory": store}}))
    param_bytes = sum(p.numel() * 4 for p in report.final_model.parameters())
    pulls = [e for e in report.trace["traceEvents"] if e["ph"] == "X" and e["name"] == "pull"]
    for event in pulls:  # gpu0 - switch - shared_memory: two latencies, the 25 GB/s link bottlenecks
        assert event["dur"] / 1e6 == pytest.approx(7e-6 + param_bytes / 25e9, rel=1e-9)
    assert report.data["shared_memory"]["location"] == "switch"


def test_same_scenario_same_report():
    runs = [simtrain.run(scenario(3, 30, device=SLOW, compute_jitter=0.2, overrides={1: {"slowdown": 2.0}}))
            for _ in range(2)]
    first, second = ({k: v for k, v in r.data.items() if k != "wall_time_s"} for r in runs)
    assert json.dumps(first) == json.dumps(second)
    assert first["async"]["updates_per_rank"][1] < first["async"]["updates_per_rank"][0]


@pytest.mark.parametrize("cluster, message", [
    ({"shared_memory": {"location": "gpu0", "bandwidth": "1 GB/s", "host_link": {"bandwidth": "1 GB/s"}}},
     "cluster.shared_memory.host_link: only for location host"),
    ({"shared_memory": {"location": "nowhere", "bandwidth": "1 GB/s"}}, "cluster.shared_memory.location: unknown node"),
    ({"overrides": {4: {"slowdown": 2}}}, "cluster.overrides.4: no such rank"),
    ({"overrides": {1: {"device": "a200"}}}, "cluster.overrides.1.device: unknown device"),
])
def test_mistakes_name_the_field(cluster, message):
    raw = scenario(2, 2).model_dump(by_alias=True)
    raw["cluster"] = {"devices": 2, "shared_memory": STORE, **cluster}
    with pytest.raises(ScenarioError, match=message):
        simtrain.run(validate_scenario(raw))
