"""Expert parallelism computes what one device computes on the same global batch.

References: single-process torch (the whole MoE gpt on the concatenation of
every rank's batch, rank order, SGD) for the parameters and the dropped
tokens; the routed token counts times the token's bytes for what the
all-to-alls move, read back from the network's event log.
"""
from pathlib import Path

import pytest
import torch

import simtrain
from simtrain.cli import main
from simtrain.hw.cluster import build_cluster, run_to_end
from simtrain.job import Job
from simtrain.scenario import validate_scenario
from simtrain.train.data import hold_out_validation, load_dataset
from simtrain.train.models import build_model
from simtrain.scenario.model import MoESpec, RoutingSpec
from simtrain.train.moe import MoE
from simtrain.train.moe_routing import balanced_counts, choice_counts, draw_choices, routing_generator
from simtrain.train.sampling import build_loader

STEPS, BATCH, HIDDEN, LR = 3, 4, 16, 0.1
ROOT = Path(__file__).resolve().parents[1]
GPT_SMALL = ROOT / "scenarios" / "gpt_small.yaml"


def scenario(devices, ep, capacity_factor=None, numerics=True, routing=None, experts=4, steps=STEPS,
             cluster=None, parallel=None, precision="fp32"):
    moe = {"experts": experts, "top_k": 2, "capacity_factor": capacity_factor, "aux_loss_coeff": 0.0}
    if routing is not None:
        moe["routing"] = routing
    return validate_scenario({
        "name": "t", "seed": 1, "numerics": numerics,
        "cluster": {"topology": "switch", "devices": devices, **(cluster or {})},
        "model": {"name": "gpt", "hidden": HIDDEN, "layers": 2, "heads": 2, "moe": moe},
        "data": {"name": "tokens", "batch_size": BATCH, "seq_len": 8, "vocab": 32},
        "train": {"steps": steps, "optimizer": {"name": "sgd", "lr": LR}, "precision": precision},
        "parallel": {"ep": ep, **(parallel or {})},
        "report": {"trace": False},
    })


def one_device(spec, world, losses: list | None = None):
    """Plain torch: the whole model on every rank's batch at once; the router's drops per step (and each step's
    loss appended to `losses`, if given)."""
    data = hold_out_validation(load_dataset(spec.data.name, spec.data.loader_options(), spec.seed),
                               spec.data.validation_fraction, spec.seed)
    model = build_model(spec.model, data.info, spec.seed)
    loaders = [build_loader(spec, data.train, world, rank) for rank in range(world)]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    dropped = []
    for _ in range(spec.train.steps):
        batches = [loader.next_batch() for loader in loaders]
        x, y = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
        model.zero_grad()
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        if losses is not None:
            losses.append(loss.item())
        dropped.append(sum(layer.routing.dropped for layer in model.modules() if isinstance(layer, MoE)))
    return model, dropped


def assert_same_parameters(model, reference):
    expected = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter, expected[name], rtol=0, atol=1e-5)


@pytest.mark.parametrize("ep", [2, 4])
def test_trains_to_the_parameters_of_one_device(ep):
    spec = scenario(ep, ep)
    report = simtrain.run(spec)
    reference, _ = one_device(spec, ep)
    assert_same_parameters(report.final_model, reference)


@pytest.mark.parametrize("devices, parallel", [
    (4, {"sharding": {"stage": 1}}), (4, {"sharding": {"stage": 2}}), (2, {"pipeline": {"microbatches": 2}}),
    (4, {"sharding": {"stage": 2}, "pipeline": {"microbatches": 2}}), (4, {"sharding": {"stage": 1, "degree": 2}}),
    (8, {"pp": 2, "sharding": {"stage": 1, "degree": 2}}), (4, {"sharding": {"stage": 3}}),
    (8, {"pp": 2, "sharding": {"stage": 3}})],
    ids=["zero 1", "zero 2", "2 micro-batches", "zero 2, 2 micro-batches", "HSDP", "HSDP x pp 2", "zero 3",
         "zero 3 x pp 2"])
def test_sharded_and_accumulated_experts_train_to_the_parameters_of_one_device(devices, parallel):
    """The distributed optimizer shards the dense parameters over the shard group and each expert's over all its
    holders (under HSDP the dense chunks alone are then all-reduced across the replicas; under stage 3 each
    chunk's dense and expert parameters are gathered apart, each over its own group), and micro-batches
    accumulate: still one device's training on the dp ranks' batches."""
    spec = scenario(devices, 2, parallel=parallel)
    report = simtrain.run(spec)
    reference, _ = one_device(spec, devices // parallel.get("pp", 1))
    assert_same_parameters(report.final_model, reference)


TWO_HOSTS = {"topology": "hierarchical", "gpus_per_node": 2, "device": "a100-40gb",
             "link": {"bandwidth": 1e9, "latency": 1e-6}, "inter_node_link": {"bandwidth": 2.5e8, "latency": 5e-6}}


def test_hierarchical_dispatch_trains_to_the_parameters_of_one_device():
    """ep 4 on two hosts of two GPUs: the tokens go through the host peer on their rail, and land as pairwise."""
    spec = scenario(4, 4, cluster=TWO_HOSTS, parallel={"moe_dispatch": "hierarchical"}, steps=1)
    report = simtrain.run(spec)
    reference, _ = one_device(spec, 4)
    assert_same_parameters(report.final_model, reference)


def test_hierarchical_dispatch_costs_its_closed_form_more_than_pairwise():
    """Numerics off, balanced top-1 routing over 4 experts, ep 4 on n = 2 hosts of g = 2 GPUs (N = 4): each of
    the four exchanges is a balanced all-to-all of S = T (4 H) bytes a rank (T its tokens), every rank starting
    at once. Pairwise overlaps the node switch and the NICs, T_p = max(2 a_in + (g-1)/N S/B_in,
    2 a_out + (N-g)/N S/B_out); hierarchical runs them one after the other, T_h = 2 a_in + (g-1)/g S/B_in
    + 2 a_out + (n-1)/n S/B_out. The step differs by exactly 4 (T_h - T_p)."""
    def moe_section(dispatch):
        spec = scenario(4, 4, numerics=False, routing={"model": "balanced"}, steps=1, cluster=TWO_HOSTS,
                        parallel={"moe_dispatch": dispatch})
        spec = spec.model_copy(update={"model": spec.model.model_copy(update={
            "layers": 1, "moe": spec.model.moe.model_copy(update={"top_k": 1})})})
        return one_step(spec).scheme.report_sections()["moe"]

    pairwise, hierarchical = moe_section("pairwise"), moe_section("hierarchical")
    size = BATCH * 8 * HIDDEN * 4
    b_in, a_in, b_out, a_out, g, n = 1e9, 1e-6, 2.5e8, 5e-6, 2, 2
    t_p = max(2 * a_in + (g - 1) / (g * n) * size / b_in, 2 * a_out + (g * n - g) / (g * n) * size / b_out)
    t_h = 2 * a_in + (g - 1) / g * size / b_in + 2 * a_out + (n - 1) / n * size / b_out
    assert hierarchical["all_to_all_bytes"] == pairwise["all_to_all_bytes"]
    assert hierarchical["step_time_s"][0] - pairwise["step_time_s"][0] == pytest.approx(4 * (t_h - t_p), rel=1e-6)


def test_experts_are_data_parallel_over_the_groups():
    """dp 4, ep 2: two groups; each expert all-reduced over the two ranks that hold it."""
    spec = scenario(4, 2)
    report = simtrain.run(spec)
    reference, _ = one_device(spec, 4)
    for model in report.final_models:
        assert_same_parameters(model, reference)


def test_bf16_equals_plain_ddp_but_for_the_experts_one_rounding():
    """dp = ep = 2, one SGD step in bf16, against plain DDP's bf16 run (ep 1) on the same two ranks. The replicated
    gradients are the same two bf16 gradients all-reduced (a sum of two does not depend on its order): their
    parameters are bit-identical. An expert's gradient differs: DDP rounds each rank's to bf16 and adds the two,
    where its ep holder computes the sum over both ranks' tokens in one bf16 GEMM (fp32 accumulation, rounded
    once): within two bf16 ulps (2 * 2^-7 relative) of the largest gradient element, taken from one fp32 device.
    (With dp > 2 the replicated sums are also ordered differently: ep's all-reduce cuts a shorter buffer, the
    experts left out, into its ring's chunks, so the replicated parameters differ by bf16 ulps too.)"""
    expert_parallel = simtrain.run(scenario(2, 2, precision="bf16", steps=1)).final_model
    data_parallel = simtrain.run(scenario(2, 1, precision="bf16", steps=1)).final_model
    spec = scenario(2, 2, steps=1)
    reference, _ = one_device(spec, 2)
    data = hold_out_validation(load_dataset(spec.data.name, spec.data.loader_options(), spec.seed),
                               spec.data.validation_fraction, spec.seed)
    initial, after = dict(build_model(spec.model, data.info, spec.seed).named_parameters()), \
        dict(reference.named_parameters())
    ddp = dict(data_parallel.named_parameters())
    experts = 0
    for name, parameter in expert_parallel.named_parameters():
        if ".experts." not in name:
            assert torch.equal(parameter, ddp[name]), name
            continue
        experts += 1
        largest_gradient = ((initial[name] - after[name]) / LR).abs().max()
        assert (parameter - ddp[name]).abs().max() <= LR * 2 * 2**-7 * largest_gradient, name
    assert experts == 2 * 4 * 4  # two MoE layers of four experts of four tensors


def test_a_capacity_drops_the_tokens_one_device_drops():
    spec = scenario(2, 2, capacity_factor=0.75)
    report = simtrain.run(spec)
    reference, dropped = one_device(spec, 2)
    assert report.data["moe"]["dropped_tokens"] == dropped
    assert sum(dropped) > 0
    assert_same_parameters(report.final_model, reference)


def one_step(spec):
    cluster = build_cluster(spec.cluster, record=True, seed=spec.seed)
    job = Job(spec, cluster, range(cluster.size), numerics=spec.numerics)
    job.start()
    run_to_end(cluster.env)
    return job


def test_all_to_all_bytes_are_the_routed_tokens_times_the_token_size():
    """ep 4: each rank's batch routed by the initial model (one device, rank by rank); every assignment to an
    expert on another rank crosses the network once in each of the four exchanges, a token's hidden vector."""
    ep = 4
    spec = scenario(ep, ep, steps=1)
    job = one_step(spec)
    data = hold_out_validation(load_dataset(spec.data.name, spec.data.loader_options(), spec.seed),
                               spec.data.validation_fraction, spec.seed)
    reference = build_model(spec.model, data.info, spec.seed)
    leaving = 0
    for rank in range(ep):
        x, _ = build_loader(spec, data.train, ep, rank).next_batch()
        reference(x)
        for layer in (layer for layer in reference.modules() if isinstance(layer, MoE)):
            leaving += sum(count for expert, count in enumerate(layer.routing.tokens_per_expert)
                           if expert // (4 // ep) != rank)
    token_bytes = HIDDEN * 4
    moved = {}
    for rank in range(ep):
        for label, nbytes in job.cluster.log.bytes_by_label(rank, "communication").items():
            moved[label] = moved.get(label, 0) + nbytes
    assert leaving > 0
    for label in ("moe dispatch", "moe combine", "moe dispatch backward", "moe combine backward"):
        assert moved[label] == leaving * token_bytes
    assert job.scheme.report_sections()["moe"]["all_to_all_bytes"] == [4 * leaving * token_bytes]


def cli(*args):
    try:
        main(list(args))
    except SystemExit as exit_:
        return exit_.code
    return 0


@pytest.mark.parametrize("command,overrides,expected", [
    ("validate", ["model.moe={experts: 6}", "parallel.ep=4"], "parallel.ep: 4 does not divide model.moe.experts 6"),
    ("validate", ["parallel.ep=2"], "parallel.ep: 2 shards the experts of model.moe; the model has none"),
    ("validate", ["model.moe={}", "parallel.ep=2", "train.optimizer={name: kfac, lr: 0.1}"],
     "parallel.ep: runs with a first-order optimizer"),
    ("validate", ["model.moe={}", "parallel.moe_dispatch=hierarchical"], "parallel.moe_dispatch: hierarchical "
                                                                         "moves tokens between the ranks of "
                                                                         "parallel.ep, which is 1"),
    ("run", ["model.moe={experts: 6}", "parallel.ep=3", "parallel.moe_dispatch=hierarchical", "cluster.devices=6",
             "cluster.topology=hierarchical", "cluster.gpus_per_node=2",
             "cluster.inter_node_link={bandwidth: 1e9, latency: 1e-5}", "train.steps=1"],
     "parallel.moe_dispatch: hierarchical needs the ep group's ranks [0, 1, 2] spread evenly over hosts"),
    ("validate", ["model.moe={routing: {model: histogram, histogram: [1, 2]}}"], "model.moe.routing.histogram"),
    ("run", ["model.moe={experts: 8}", "parallel.ep=8", "train.steps=1"],
     "parallel.ep: 8 does not divide the 4 "
                                                                          "data-parallel ranks"),
    ("validate", ["model.moe={experts: 4, top_k: 5}", "parallel.ep=2"], "model.moe.top_k: 5 is more than the 4"),
    ("validate", ["model.moe={capacity_factor: 0}", "parallel.ep=2"], "model.moe.capacity_factor"),
])
def test_bad_input_is_one_line_naming_the_key(capsys, tmp_path, command, overrides, expected):
    args = [arg for override in overrides for arg in ("--set", override)]
    extra = ["--out", str(tmp_path)] if command == "run" else []
    assert cli(command, str(GPT_SMALL), *args, *extra) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and expected in err


def test_moe_on_the_mlp_model_is_refused(capsys):
    assert cli("validate", str(ROOT / "scenarios" / "quickstart.yaml"), "--set", "model.moe={}", "--set",
               "parallel.ep=2") == 2
    assert "model.moe: mixture-of-experts layers are for the gpt model, not mlp" in capsys.readouterr().err


def test_one_overloaded_expert_makes_its_rank_the_step():
    """Numerics off, top-1, every token routed to expert 0 (on rank 0) against balanced routing, 2 ranks on a
    switch: the other rank waits for rank 0 at every exchange, so the step takes longer by rank 0's extra expert
    work, T more tokens through an MLP of 16 H^2 FLOPs per token forward and 32 H^2 backward, and by the four
    exchanges carrying T tokens one way instead of T/2 each way: 4 (T/2) (4 H bytes) / B."""
    bandwidth = 1e9

    def step_s(routing):
        spec = validate_scenario({
            "name": "t", "seed": 1, "numerics": False,
            "cluster": {"topology": "switch", "devices": 2, "device": "a100-40gb",
                        "link": {"bandwidth": bandwidth, "latency": 1e-6}},
            "model": {"name": "gpt", "hidden": HIDDEN, "layers": 1, "heads": 2,
                      "moe": {"experts": 2, "top_k": 1, "aux_loss_coeff": 0.0, "routing": routing}},
            "data": {"name": "tokens", "batch_size": BATCH, "seq_len": 8, "vocab": 32},
            "train": {"steps": 1, "optimizer": {"name": "sgd", "lr": LR}},
            "parallel": {"ep": 2}, "report": {"trace": False}})
        job = one_step(spec)
        return job.scheme.report_sections()["moe"]["step_time_s"][0], job.devices[0]

    balanced, device = step_s({"model": "balanced"})
    forced, _ = step_s({"model": "histogram", "histogram": [1, 0]})
    tokens = BATCH * 8  # T, one rank's tokens
    extra_experts = device.compute_time(48 * HIDDEN ** 2 * tokens, "fp32")
    extra_exchanges = 4 * (tokens / 2) * HIDDEN * 4 / bandwidth
    assert forced - balanced == pytest.approx(extra_experts + extra_exchanges, rel=1e-9)


def test_routing_models_draw_their_shares():
    """balanced: the even split; zipf and histogram: 10^6 seeded draws within 1% of their shares."""
    assert balanced_counts(MoESpec(experts=4, top_k=2), 5) == [3, 3, 2, 2]
    draws = 1_000_000
    for routing, shares in [(RoutingSpec(model="zipf", zipf_exponent=1.5), [1 / (e + 1) ** 1.5 for e in range(4)]),
                            (RoutingSpec(model="histogram", histogram=[1, 3, 0, 4]), [1, 3, 0, 4])]:
        spec = MoESpec(experts=4, top_k=1, routing=routing)
        counts = choice_counts(draw_choices(spec, draws, routing_generator(0, 1, 2, 3)), 4)
        assert sum(counts) == draws
        assert counts == choice_counts(draw_choices(spec, draws, routing_generator(0, 1, 2, 3)), 4)  # seeded
        for count, share in zip(counts, shares):
            assert count / draws == pytest.approx(share / sum(shares), abs=0.01)


def test_balanced_routing_without_numerics_moves_the_closed_form_bytes():
    """Numerics off, balanced: each rank's T top_k assignments split evenly over E experts, of which E - E/ep are
    on other ranks: dp T top_k (1 - 1/ep) tokens of 4 H bytes per exchange and MoE block, four exchanges."""
    ep, devices, experts = 2, 4, 4
    report = simtrain.run(scenario(devices, ep, numerics=False, experts=experts, steps=1))
    tokens = BATCH * 8
    assert report.data["moe"]["all_to_all_bytes"] == [4 * 2 * devices * tokens * 2 * (1 - 1 / ep) * HIDDEN * 4]
    assert report.data["moe"]["imbalance"] == [1.0]
