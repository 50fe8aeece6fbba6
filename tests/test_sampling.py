"""Prioritized and Metropolis-Hastings batch sampling (simtrain/train/sampling.py).

References: scipy's chi-square test, the closed-form target p^alpha / sum p^alpha
computed here with numpy, the full-data mean gradient from plain torch, an
independent argsort ranking, and the stated host cost model's closed form.
"""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.stats import chisquare
from torch.utils.data import TensorDataset

import simtrain
from simtrain.errors import ScenarioError
from simtrain.scenario import validate_scenario
from simtrain.train.sampling import (HOST_ACCESS_S, MetropolisSampler, PrioritizedSampler, PriorityTable,
                                     effective_sample_size)


def dataset(n, features=5, classes=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, features, generator=generator),
                         torch.randint(0, classes, (n,), generator=generator))


def sampler(kind, data, batch_size, seed=0, alpha=0.7, beta=0.4, mh_steps=1):
    common = dict(dataset=data, num_replicas=1, rank=0, batch_size=batch_size, seed=seed, every=10,
                  alpha=alpha, eps=0.01, beta0=beta, beta_end=beta, beta_steps=100)
    if kind == "prioritized":
        return PrioritizedSampler(**common)
    return MetropolisSampler(**common, steps=mh_steps)


def set_losses(table, losses):
    table.refresh(np.arange(len(table)), torch.as_tensor(losses, dtype=torch.float64))


def target_distribution(losses, alpha, eps=0.01):
    scaled = (np.asarray(losses, dtype=np.float64) + eps) ** alpha
    return scaled / scaled.sum()


def draw_counts(s, batches):
    counts = np.zeros(len(s.table), dtype=np.int64)
    for _ in range(batches):
        s.next_batch()
        np.add.at(counts, s._positions, 1)
    return counts


@pytest.mark.parametrize("kind", ["prioritized", "mh"])
def test_equal_priorities_draw_uniformly(kind):
    s = sampler(kind, dataset(50), batch_size=10)  # nothing seen yet: every priority is the maximum
    counts = draw_counts(s, 2000)
    assert chisquare(counts).pvalue > 0.01
    # The same test rejects a sampler whose priorities differ: it has the power to fail.
    skewed = sampler(kind, dataset(50), batch_size=10)
    set_losses(skewed.table, np.linspace(0.1, 3.0, 50))
    assert chisquare(draw_counts(skewed, 2000)).pvalue < 1e-6


def test_mh_long_run_frequencies_match_the_target():
    losses = np.linspace(0.05, 3.0, 12) ** 2
    s = sampler("mh", dataset(12), batch_size=8, alpha=0.7, mh_steps=1)
    set_losses(s.table, losses)
    draw_counts(s, 50)  # burn-in
    frequencies = draw_counts(s, 6000) / (6000 * 8)
    target = target_distribution(losses, 0.7)
    assert 0.5 * np.abs(frequencies - target).sum() < 0.05
    assert 0.5 * np.abs(np.full(12, 1 / 12) - target).sum() > 0.15  # far from uniform: a real check
    assert 0 < s.accepted < s.proposed


def weighted_gradients(kind, beta, draws, losses, model, burn_in=0):
    """The batch-loss gradient of `draws` independently seeded samplers with the same priorities."""
    data = dataset(len(losses), seed=1)
    gradients = []
    for seed in range(draws):
        s = sampler(kind, data, batch_size=4, seed=seed, alpha=0.8, beta=beta, mh_steps=2)
        set_losses(s.table, losses)
        for _ in range(burn_in):  # mh: run the chains (priorities fixed) before taking a batch
            s.draw(s.target())
        x, y = s.next_batch()
        loss = s.batch_loss(model(x), y)
        gradients.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))]))
    return torch.stack(gradients).double()


@pytest.mark.slow
@pytest.mark.parametrize("kind, burn_in", [("prioritized", 0), ("mh", 10)])
def test_is_weighted_gradient_is_unbiased_with_beta_one(kind, burn_in):
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    losses = np.linspace(0.02, 2.5, 24)
    x, y = dataset(24, seed=1).tensors
    full = torch.cat([g.flatten() for g in torch.autograd.grad(F.cross_entropy(model(x), y),
                                                              list(model.parameters()))]).double()
    # w_i = (N P(i))^-1 / max w: the weighted mean estimates the mean gradient times 1 / max w.
    max_weight = 1 / (24 * target_distribution(losses, 0.8).min())
    draws = 2000
    unbiased = weighted_gradients(kind, 1.0, draws, losses, model, burn_in) * max_weight
    error = (unbiased.mean(0) - full).abs()
    standard_error = unbiased.std(0) / math.sqrt(draws)
    assert (error < 4 * standard_error + 1e-6).all()
    # Without the correction the same average is biased toward high-loss samples, far outside the noise.
    biased = weighted_gradients(kind, 0.0, draws, losses, model, burn_in)
    assert ((biased.mean(0) - full).abs() > 8 * biased.std(0) / math.sqrt(draws)).any()


def test_beta_anneals_linearly_then_stays():
    s = PrioritizedSampler(dataset(40), 1, 0, 4, 0, every=10, alpha=0.6, eps=0.01, beta0=0.4, beta_steps=10)
    model = torch.nn.Linear(5, 3)
    betas = []
    for _ in range(12):
        betas.append(s.beta)
        x, y = s.next_batch()
        s.batch_loss(model(x), y)
    assert betas == pytest.approx([0.4 + 0.06 * step for step in range(11)] + [1.0])


def test_top_decile_matches_an_independent_ranking():
    table = PriorityTable(torch.arange(37), eps=0.01)
    losses = np.round(np.random.default_rng(0).uniform(0, 2, 37), 1)  # many ties
    set_losses(table, losses)
    order = torch.argsort(torch.as_tensor(table.priorities()), descending=True, stable=True)
    expected = np.zeros(37, dtype=bool)
    expected[order[:4].numpy()] = True  # ceil(0.1 * 37) = 4
    assert (table.in_top_decile(np.arange(37)) == expected).all()


def test_effective_sample_size_closed_forms():
    assert effective_sample_size(np.ones(8)) == pytest.approx(8)
    assert effective_sample_size(np.array([1.0, 0, 0, 0])) == pytest.approx(1)
    assert effective_sample_size(np.array([1.0, 0.5])) == pytest.approx(1.5 ** 2 / 1.25)


def test_each_rank_keeps_its_own_distributed_sampler_shard():
    from torch.utils.data import DistributedSampler
    data = dataset(40)
    tables = [PrioritizedSampler(data, 4, rank, 4, 0, every=10, alpha=0.6, eps=0.01, beta0=0.4,
                                 beta_steps=10).table for rank in range(4)]
    for rank, table in enumerate(tables):
        reference = DistributedSampler(data, num_replicas=4, rank=rank, shuffle=True, seed=0, drop_last=True)
        reference.set_epoch(0)
        assert sorted(table.indices.tolist()) == sorted(reference)
    assert sorted(i for t in tables for i in t.indices.tolist()) == list(range(40))


def digits(sampling, steps=20, seed=0, devices=2, every=10, train=None, **data):
    return validate_scenario({
        "name": "t", "seed": seed, "cluster": {"topology": "ring", "devices": devices},
        "model": {"name": "mlp", "hidden": [64]},
        "data": {"name": "digits", "batch_size": 64, "sampling": sampling, **data},
        "train": {"steps": steps, "optimizer": {"name": "sgd", "lr": 0.2}, **(train or {})},
        "report": {"trace": True, "every": every},
    })


def steps_to(curve, target):
    return next(step for step, _, loss in curve if loss <= target)


def test_digits_prioritized_reaches_target_loss_in_no_more_steps():
    # Without the importance correction (beta = 0). README: with beta annealed to 1 it takes more.
    runs = {kind: simtrain.run(digits(kind, steps=300, devices=1, every=5, beta0=0.0, beta_end=0.0)).data
            for kind in ("uniform", "prioritized")}
    uniform, prioritized = (runs[k]["train_loss_curve"] for k in ("uniform", "prioritized"))
    assert steps_to(prioritized, 0.15) <= steps_to(uniform, 0.15)
    for data in runs.values():  # the curve's last point is the report's final training loss
        assert data["train_loss_curve"][-1][2] == data["final_loss"]


@pytest.mark.parametrize("kind", ["prioritized", "mh"])
def test_sampling_is_charged_as_host_work_by_the_cost_model(kind):
    data = simtrain.run(digits(kind, steps=25, mh={"steps": 3})).data
    shard = 1437 // 2
    depth = math.ceil(math.log2(shard))
    draws = 64 * depth if kind == "prioritized" else 64 * 3
    assert data["breakdown_s"]["sampling"] == pytest.approx((draws + 2 * 64 * depth) * HOST_ACCESS_S, rel=1e-9)
    # Host work on top of the uniform run's step: every other part of the step is the uniform run's.
    uniform = simtrain.run(digits("uniform", steps=25)).data
    assert data["step_time_s"] == pytest.approx(uniform["step_time_s"] + data["breakdown_s"]["sampling"], rel=1e-12)
    for part in ("compute", "communication", "optimizer"):
        assert data["breakdown_s"][part] == pytest.approx(uniform["breakdown_s"][part], rel=1e-12), part
    section = data["sampling"]
    assert section["kind"] == kind
    assert [step for step, _ in section["effective_sample_size"]] == [10, 20, 25]
    assert all(0 < ess <= 64 for _, ess in section["effective_sample_size"])
    assert 0 <= section["top_decile_share"] <= 1
    assert ("acceptance_rate" in section) == (kind == "mh")


@pytest.mark.parametrize("kind", ["prioritized", "mh"])
def test_a_forward_recomputed_for_the_backward_refreshes_the_priorities_once(kind):
    # train.checkpointing full runs the last layer's forward, and the loss with it, again in the backward: the
    # sampler counts each batch once, so the run trains and reports as the one that keeps its activations.
    kept, recomputed = (simtrain.run(digits(kind, steps=12, every=5, train={"checkpointing": checkpointing})).data
                        for checkpointing in ("none", "full"))
    assert [loss for _, loss in recomputed["loss_curve"]] == [loss for _, loss in kept["loss_curve"]]
    assert recomputed["sampling"] == kept["sampling"]
    assert [batches for batches, _ in recomputed["sampling"]["effective_sample_size"]] == [5, 10, 12]


def test_uniform_is_the_plain_shard_loader_with_no_bookkeeping():
    report = simtrain.run(digits("uniform"))
    assert report.data["breakdown_s"]["sampling"] == 0 and "sampling" not in report.data


@pytest.mark.parametrize("kind", ["prioritized", "mh"])
def test_same_scenario_same_batches_same_report(kind):
    first, second = (simtrain.run(digits(kind)) for _ in range(2))
    strip = lambda report: {k: v for k, v in report.data.items() if k != "wall_time_s"}
    assert strip(first) == strip(second)
    for a, b in zip(first.final_models, second.final_models):
        assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    other = simtrain.run(digits(kind, seed=1))
    assert other.data["loss_curve"] != first.data["loss_curve"]


@pytest.mark.parametrize("override, field", [({"sampling": "greedy"}, "data.sampling"),
                                             ({"mh": {"steps": 0}}, "data.mh.steps"),
                                             ({"beta0": 1.5}, "data.beta0"),
                                             ({"eps": 0}, "data.eps")])
def test_bad_sampling_fields_name_the_field(override, field):
    with pytest.raises(ScenarioError, match=field):
        validate_scenario({"data": override})
