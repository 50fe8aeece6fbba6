"""Group-limited (node-limited) routing, DeepSeek-V3's: the router against a direct per-token loop, the routing
models without numerics against their closed forms, and expert parallelism against one device.

References: a plain loop over the tokens that scores each group by the sum of its top_k / group_limit best
probabilities, keeps the group_limit best groups and takes the top_k experts among theirs (DeepSeek-V3,
arXiv 2412.19437, 2.1.2); the closed forms of train/moe_routing.py's docstring; single-process torch (the
whole model on every rank's batch at once) for expert parallelism.
"""
import pytest
import torch

import simtrain
from simtrain.scenario import validate_scenario
from simtrain.scenario.model import MoESpec
from simtrain.train.moe import MoE
from simtrain.train.moe_exchange import balanced_routing, rank_counts
from simtrain.train.moe_routing import (balanced_choices, balanced_counts, choice_counts, draw_choices, node_rows,
                                        routing_generator)

HIDDEN = 16


def reference_choices(probs: torch.Tensor, spec: MoESpec) -> list[int]:
    """One token's experts, highest probability first, by the rule as DeepSeek-V3 states it."""
    size, per_group = spec.experts // spec.groups, spec.top_k // spec.group_limit
    values = probs.tolist()
    scores = [sum(sorted(values[g * size:(g + 1) * size], reverse=True)[:per_group]) for g in range(spec.groups)]
    kept = sorted(range(spec.groups), key=lambda g: -scores[g])[:spec.group_limit]
    open_experts = [e for g in kept for e in range(g * size, (g + 1) * size)]
    return sorted(open_experts, key=lambda e: -values[e])[:spec.top_k]


def groups_of(experts, spec: MoESpec) -> set[int]:
    return {int(e) // (spec.experts // spec.groups) for e in experts}


@pytest.mark.parametrize("spec", [
    dict(experts=8, top_k=3, groups=4, group_limit=2), dict(experts=16, top_k=4, groups=8, group_limit=2,
                                                            shared_experts=1),
    dict(experts=8, top_k=2, groups=2, group_limit=1), dict(experts=12, top_k=6, groups=6, group_limit=3),
    dict(experts=16, top_k=4, groups=8, group_limit=2, score="sigmoid"), dict(experts=8, top_k=2, score="sigmoid")])
def test_group_limited_layer_equals_the_per_token_loop(spec):
    """Output, tokens per expert, the balancing loss and the limit against the loop (softmax scores, or sigmoid
    ones whose shares the balancing loss reads); the limit binds for some token (its plain top_k would have
    reached more groups)."""
    spec = MoESpec(**spec)
    torch.manual_seed(0)
    layer = MoE(HIDDEN, spec)
    h = torch.randn(4, 16, HIDDEN, generator=torch.Generator().manual_seed(1))
    tokens = h.reshape(-1, HIDDEN)
    expected, taken, bound, shares = [], [0] * spec.experts, 0, []
    for token in tokens:
        logits = layer.router.weight @ token
        scores = torch.softmax(logits, dim=0) if spec.score == "softmax" else torch.sigmoid(logits)
        shares.append(scores / scores.sum())
        if spec.groups is None:
            chosen = sorted(range(spec.experts), key=lambda e: -float(scores[e].detach()))[:spec.top_k]
        else:
            chosen = reference_choices(scores.detach(), spec)
            assert len(groups_of(chosen, spec)) <= spec.group_limit
            bound += len(groups_of(scores.topk(spec.top_k).indices, spec)) > spec.group_limit
        total = sum(scores[e] for e in chosen)
        out = sum(scores[e] / total * layer.experts[e](token) for e in chosen)
        for e in chosen:
            taken[e] += 1
        expected.append(out + sum(shared(token) for shared in layer.shared))
    torch.testing.assert_close(layer(h), torch.stack(expected).view_as(h), rtol=1e-5, atol=1e-6)
    assert layer.routing.tokens_per_expert == tuple(taken)
    fraction = torch.tensor(taken, dtype=torch.float32) / (len(tokens) * spec.top_k)
    aux = spec.aux_loss_coeff * spec.experts * (fraction * torch.stack(shares).mean(dim=0)).sum()
    assert layer.routing.aux_loss == pytest.approx(float(aux.detach()), rel=1e-5)
    assert bound > 0 or spec.groups is None


def test_meta_tokens_route_to_shapes():
    """Numerics off: the group-limited choice runs on meta tensors (shapes only)."""
    layer = MoE(HIDDEN, MoESpec(experts=8, top_k=4, groups=4, group_limit=2)).to("meta")
    assert layer(torch.empty(2, 5, HIDDEN, device="meta")).shape == (2, 5, HIDDEN)
    assert sum(layer.routing.tokens_per_expert) == 10 * 4


DEEPSEEK_V3 = MoESpec(experts=256, top_k=8, groups=8, group_limit=4)


@pytest.mark.parametrize("spec,tokens", [
    (MoESpec(experts=8, top_k=3, groups=4, group_limit=2), 13), (MoESpec(experts=8, top_k=3, groups=4,
                                                                         group_limit=2), 8),
    (MoESpec(experts=12, top_k=5, groups=6, group_limit=3), 7), (DEEPSEEK_V3, 4096), (DEEPSEEK_V3, 1)])
def test_balanced_group_limited_routing_is_its_closed_form(spec, tokens):
    """Each token's choices are distinct experts in exactly group_limit groups; the counts per expert are those
    choices' and the closed form's: group g takes n_g = sum_m k_m (T // G + [(g - floor(m G / M)) mod G < T mod G]),
    its P experts n_g // P each and the remainder one more each to its first."""
    choices = balanced_choices(spec, tokens)
    assert choices.shape == (tokens, spec.top_k)
    for row in choices.tolist():
        assert len(set(row)) == spec.top_k and len(groups_of(row, spec)) == spec.group_limit
    G, M, P, k = spec.groups, spec.group_limit, spec.experts // spec.groups, spec.top_k
    totals = [sum((k // M + (m < k % M)) * (tokens // G + ((g - m * G // M) % G < tokens % G)) for m in range(M))
              for g in range(G)]
    closed = [totals[e // P] // P + (e % P < totals[e // P] % P) for e in range(spec.experts)]
    assert balanced_counts(spec, tokens) == choice_counts(choices, spec.experts) == closed


def test_balanced_deepseek_v3_routing_over_ep_64():
    """DeepSeek-V3's 256 experts, top 8 in 4 of 8 groups, over ep 64 on 8 nodes of 8 GPUs (4 experts a GPU, a
    group a node), T = 4096 tokens a rank: every expert takes T k / E = 128 of a rank's assignments, every ep-rank
    pair of the all-to-all T k / ep = 512 rows, and every token reaches 4 nodes: T 4 / 8 = 2048 a node."""
    tokens, ep = 4096, 64
    layer = MoE(8, DEEPSEEK_V3, lambda: torch.nn.Identity())
    layer.ep = ep
    assigned, kept = balanced_routing(layer, tokens)
    assert assigned == kept and all(row == [128] * 256 for row in assigned)
    assert rank_counts(kept) == [[512] * ep] * ep
    assert node_rows(balanced_choices(DEEPSEEK_V3, tokens), tuple(e // 32 for e in range(256)), 8) == [2048] * 8


@pytest.mark.parametrize("routing", [{"model": "zipf", "zipf_exponent": 1.2},
                                     {"model": "histogram", "histogram": [1, 0, 0, 0, 2, 3, 0, 0]},
                                     {"model": "zipf", "zipf_exponent": 0.0}])
def test_drawn_group_limited_routing_keeps_the_limit(routing):
    """zipf and histogram draws keep each token in group_limit groups (fewer where fewer groups have a share),
    seeded; uniform shares (zipf exponent 0) give every expert its share within 1% over 10^5 tokens."""
    spec = MoESpec(experts=8, top_k=3, groups=4, group_limit=2, routing=routing)
    tokens = 100_000
    choices = draw_choices(spec, tokens, routing_generator(0, 1, 2, 3))
    assert torch.equal(choices, draw_choices(spec, tokens, routing_generator(0, 1, 2, 3)))
    spread = (torch.nn.functional.one_hot(choices // 2, 4).amax(dim=1)).sum(dim=1)
    assert int(spread.max()) <= 2
    counts = choice_counts(choices, 8)
    if routing.get("histogram"):
        assert [counts[e] for e in (1, 2, 3, 6, 7)] == [0] * 5
    if routing.get("zipf_exponent") == 0.0:
        assert all(count / (tokens * 3) == pytest.approx(1 / 8, abs=0.01) for count in counts)


def scenario(devices, ep, numerics=True, steps=2, routing=None, cluster=None, parallel=None, score="softmax"):
    moe = {"experts": 8, "top_k": 3, "groups": 4, "group_limit": 2, "aux_loss_coeff": 0.0, "score": score}
    if routing is not None:
        moe["routing"] = routing
    return validate_scenario({
        "name": "t", "seed": 1, "numerics": numerics,
        "cluster": {"topology": "switch", "devices": devices, **(cluster or {})},
        "model": {"name": "gpt", "hidden": HIDDEN, "layers": 2, "heads": 2, "moe": moe},
        "data": {"name": "tokens", "batch_size": 4, "seq_len": 8, "vocab": 32},
        "train": {"steps": steps, "optimizer": {"name": "sgd", "lr": 0.1}},
        "parallel": {"ep": ep, **(parallel or {})},
        "report": {"trace": False},
    })


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_expert_parallel_group_limited_routing_trains_to_the_parameters_of_one_device(score):
    """ep 4: each rank routes its tokens group-limited (route_tokens) and the parameters are one device's."""
    from test_expert_parallel import assert_same_parameters, one_device
    spec = scenario(4, 4, score=score)
    report = simtrain.run(spec)
    reference, _ = one_device(spec, 4)
    assert_same_parameters(report.final_model, reference)


def test_without_numerics_each_rank_draws_group_limited_routing():
    """Numerics off, histogram shares on experts 0 and 4 to 7 only, ep 2: a rank's assignments go only there."""
    report = simtrain.run(scenario(2, 2, numerics=False, routing={"model": "histogram",
                                                                  "histogram": [1, 0, 0, 0, 1, 1, 1, 1]}))
    share = report.data["moe"]["expert_share"]
    assert share[1:4] == [0.0, 0.0, 0.0] and sum(share) == pytest.approx(1.0)


@pytest.mark.parametrize("moe,line", [
    ({"groups": 3, "group_limit": 1}, "model.moe.groups: 3 does not divide model.moe.experts 8"),
    ({"groups": 4}, "model.moe.group_limit: group-limited routing needs it beside model.moe.groups"),
    ({"group_limit": 2}, "model.moe.groups: group-limited routing needs it beside model.moe.group_limit"),
    ({"groups": 4, "group_limit": 5}, "model.moe.group_limit: 5 is more than the 4 model.moe.groups"),
    ({"top_k": 5, "groups": 4, "group_limit": 2}, "model.moe.top_k: 5 is more than the 2 x 2 experts of "
                                                  "model.moe.group_limit groups"),
    ({"top_k": 2, "groups": 4, "group_limit": 3}, "model.moe.group_limit: 3 is more than top_k 2"),
])
def test_bad_group_fields_are_one_line_naming_the_field(capsys, moe, line):
    from test_moe import GPT_SMALL, cli
    flow = ", ".join(f"{key}: {value}" for key, value in {"experts": 8, **moe}.items())
    assert cli("validate", str(GPT_SMALL), "--set", f"model.moe={{{flow}}}") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and line in err
