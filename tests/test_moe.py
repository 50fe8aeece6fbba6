"""Mixture-of-experts layers: the layer against a direct per-token loop (routing, renormalized top-k
weights, capacity drops, shared experts), the balancing loss and its gradient against the loss added by
hand, FLOPs against the activated-weights closed form, a gpt with MoE training, and bad input."""
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import simtrain
from simtrain.cli import main
from simtrain.cost import measure_step_cost
from simtrain.scenario import load_scenario
from simtrain.scenario.model import MoESpec
from simtrain.train.gpt import build_gpt
from simtrain.train.model_flops import gpt_flops_per_sequence
from simtrain.train.moe import MoE, moe_block

HIDDEN = 16
ROOT = Path(__file__).resolve().parents[1]
GPT_SMALL = ROOT / "scenarios" / "gpt_small.yaml"


def layer_and_input(seed=0, batch=3, positions=10, **spec):
    torch.manual_seed(seed)
    layer = MoE(HIDDEN, MoESpec(**spec))
    h = torch.randn(batch, positions, HIDDEN, generator=torch.Generator().manual_seed(seed + 1))
    return layer, h


def per_token_reference(layer, h):
    """Token by token, in order: softmax router, top-k renormalized, each expert taking assignments until it
    has `capacity`; returns the output, the kept counts, the dropped count and the balancing loss."""
    spec = layer.spec
    tokens = h.reshape(-1, HIDDEN)
    capacity = math.inf if spec.capacity_factor is None else math.ceil(
        spec.capacity_factor * len(tokens) * spec.top_k / spec.experts)
    taken, dropped, outputs, all_probs, chosen_counts = [0] * spec.experts, 0, [], [], [0] * spec.experts
    for token in tokens:
        probs = torch.softmax(layer.router.weight @ token, dim=0)
        all_probs.append(probs)
        order = sorted(range(spec.experts), key=lambda e: -float(probs[e].detach()))[:spec.top_k]
        total = sum(probs[e] for e in order)
        out = torch.zeros(HIDDEN)
        for e in order:
            chosen_counts[e] += 1
            if taken[e] < capacity:
                taken[e] += 1
                out = out + probs[e] / total * layer.experts[e](token)
            else:
                dropped += 1
        for shared in layer.shared:
            out = out + shared(token)
        outputs.append(out)
    mean_probs = torch.stack(all_probs).mean(dim=0)
    share = torch.tensor(chosen_counts, dtype=torch.float32) / (len(tokens) * spec.top_k)
    aux = spec.aux_loss_coeff * spec.experts * (share * mean_probs).sum()
    return torch.stack(outputs).view_as(h), taken, dropped, aux


@pytest.mark.parametrize("spec", [
    dict(experts=4, top_k=1), dict(experts=4, top_k=2), dict(experts=8, top_k=3, shared_experts=2),
    dict(experts=3, top_k=3),
])
def test_dropless_layer_equals_the_per_token_loop(spec):
    layer, h = layer_and_input(**spec)
    expected, taken, dropped, aux = per_token_reference(layer, h)
    torch.testing.assert_close(layer(h), expected, rtol=1e-5, atol=1e-6)
    assert layer.routing.tokens_per_expert == tuple(taken) and sum(taken) == 30 * spec["top_k"]
    assert layer.routing.dropped == dropped == 0
    assert layer.routing.aux_loss == pytest.approx(float(aux.detach()), rel=1e-5)


@pytest.mark.parametrize("factor,top_k", [(0.5, 1), (1.0, 2), (0.3, 2), (1.25, 2)])
def test_capacity_drops_the_same_assignments_as_the_per_token_loop(factor, top_k):
    layer, h = layer_and_input(seed=3, experts=4, top_k=top_k, capacity_factor=factor, shared_experts=1)
    expected, taken, dropped, _ = per_token_reference(layer, h)
    torch.testing.assert_close(layer(h), expected, rtol=1e-5, atol=1e-6)
    assert layer.routing.tokens_per_expert == tuple(taken)
    assert layer.routing.dropped == dropped
    assert max(taken) <= math.ceil(factor * 30 * top_k / 4)
    if factor < 1:
        assert dropped > 0


def test_balancing_loss_reaches_the_gradients_as_if_added_to_the_loss():
    layer, h = layer_and_input(seed=5, experts=4, top_k=2, aux_loss_coeff=0.5)
    weights = torch.randn(h.shape, generator=torch.Generator().manual_seed(9))
    (layer(h) * weights).sum().backward()
    got = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    expected, _, _, aux = per_token_reference(layer, h)
    ((expected * weights).sum() + aux).backward()
    for name, p in layer.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert got["router.weight"].abs().sum() > 0


def test_balanced_routing_gives_the_coefficient_as_loss():
    layer, h = layer_and_input(experts=4, top_k=1, aux_loss_coeff=0.25)
    with torch.no_grad():
        layer.router.weight.zero_()  # every probability 1/4; top-1 ties go one way, share unbalanced ...
    layer(h)
    # ... so E * sum f_e P_e = 4 * (1 * 1/4) = 1: the coefficient, as for any routing with uniform probabilities
    assert layer.routing.aux_loss == pytest.approx(0.25)


def test_meta_flops_are_the_activated_weights_closed_form():
    """Numerics off: balanced routing; forward + backward FLOPs equal 6N + 12LHQT per token with N the router
    and the top_k + shared experts of each MoE block (every 2nd of 4 blocks here)."""
    layers, width, heads, vocab, seq_len, batch = 4, 32, 4, 64, 16, 2
    spec = MoESpec(experts=4, top_k=2, shared_experts=1, every=2)
    with torch.device("meta"):
        model = build_gpt(vocab, seq_len, width, layers, heads, moe_block(spec))
    tokens = torch.empty((batch, seq_len), dtype=torch.long, device="meta")
    cost = measure_step_cost(model, tokens, tokens)
    assert cost.forward_flops + cost.backward_flops == batch * gpt_flops_per_sequence(layers, width, vocab,
                                                                                      seq_len, spec)


def test_every_nth_block_is_moe():
    model = build_gpt(64, 8, 16, 6, 2, moe_block(MoESpec(every=3)))
    assert [hasattr(block, "moe") for block in list(model)[1:-1]] == [False, False, True, False, False, True]
    assert not any(hasattr(block, "expand") for block in list(model)[1:-1] if hasattr(block, "moe"))


def moe_scenario(**moe):
    """gpt_small with MoE blocks, small: 10 steps, 2 layers, 256 samples (the loss curve evaluates them all)."""
    return load_scenario(GPT_SMALL, [f"model.moe={moe}", "train.steps=10", "model.layers=2", "cluster.devices=2",
                                     "report.every=10", "data.samples=256"])


def test_a_gpt_with_moe_learns_and_runs_the_same_twice():
    """The same batch losses twice, and 0.2 nats lower after 10 steps (they fall by about 0.5)."""
    first = simtrain.run(moe_scenario(experts=4, top_k=2, capacity_factor=1.25, shared_experts=1)).data
    second = simtrain.run(moe_scenario(experts=4, top_k=2, capacity_factor=1.25, shared_experts=1)).data
    losses = [loss for _, loss in first["loss_curve"]]
    assert first["loss_curve"] == second["loss_curve"]
    assert losses[-1] < losses[0] - 0.2


def cli(*args):
    try:
        main(list(args))
    except SystemExit as exit_:
        return exit_.code
    return 0


@pytest.mark.parametrize("scenario,overrides,expected", [
    (GPT_SMALL, ["model.moe={experts: 4, top_k: 5}"], "model.moe.top_k: 5 is more than the 4 experts"),
    (GPT_SMALL, ["model.moe={capacity_factor: 0}"], "model.moe.capacity_factor"),
    (GPT_SMALL, ["model.moe={capacity_factor: -1}"], "model.moe.capacity_factor"),
    (GPT_SMALL, ["model.moe={every: 5}"], "model.moe.every"),
    (ROOT / "scenarios" / "quickstart.yaml", ["model.moe={}"], "model.moe: mixture-of-experts layers are for the "
                                                                 "gpt model, not mlp"),
    (GPT_SMALL, ["model.moe={}", "parallel.tp=2", "data.seq_len=31"], "model.moe: under parallel.tp each tp rank "
                                                                      "routes its part of the sequence; data.seq_len "
                                                                      "31 does not divide into cp x tp = 2"),
])
def test_bad_moe_input_is_one_line_naming_the_key(capsys, scenario, overrides, expected):
    args = [arg for override in overrides for arg in ("--set", override)]
    assert cli("validate", str(scenario), *args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and expected in err


def test_router_softmax_is_over_fp32_logits():
    layer, h = layer_and_input(experts=4, top_k=2)
    layer = layer.to(torch.bfloat16)
    out = layer(h.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert F.softmax(layer.router(h.to(torch.bfloat16).reshape(-1, HIDDEN)).float(), -1).dtype == torch.float32


def test_recomputation_trains_the_same_with_the_balancing_loss_counted_once():
    """Checkpointed blocks run their forward again in the backward; the auxiliary gradient still joins once: the
    same losses to fp32 rounding (the step engine recomputes unit by unit, its sums in another order; a balancing
    gradient counted twice, at coefficient 0.5, would move them by far more)."""
    moe = "model.moe={experts: 4, top_k: 2, capacity_factor: 1.0, aux_loss_coeff: 0.5}"
    runs = [simtrain.run(load_scenario(GPT_SMALL, [moe, "train.steps=8", "cluster.devices=2", "data.samples=256",
                                                   f"train.checkpointing={mode}"])).data for mode in ("none", "full")]
    assert [loss for _, loss in runs[1]["loss_curve"]] == pytest.approx(
        [loss for _, loss in runs[0]["loss_curve"]], rel=1e-6)
    assert runs[1]["final_loss"] == pytest.approx(runs[0]["final_loss"], rel=1e-6)
    assert runs[1]["flops"]["device_flops_utilization"] > runs[1]["flops"]["mfu"]  # the recomputed forwards
