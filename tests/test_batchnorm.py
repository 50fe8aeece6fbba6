"""BatchNorm models, SyncBN against BatchNorm over the concatenated batch, and weight decay.

References: torch's own BatchNorm on the concatenated batch (single process),
the ring all-reduce closed form for the statistics' traffic, and the
scale invariance BatchNorm gives the weights before it.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import simtrain
from simtrain.scenario import ModelSpec
from simtrain.errors import ScenarioError
from simtrain.scenario import validate_scenario
from simtrain.train.data import ShardLoader, load_dataset
from simtrain.train.models import build_model, layers_before_batchnorm
from simtrain.train.syncbn import sync_batchnorm_forward_backward

DIGITS = load_dataset("digits", {}, seed=0)


def test_batchnorm_follows_every_hidden_linear_and_conv():
    mlp = build_model(ModelSpec(name="mlp", hidden=[8, 6], batchnorm=True), DIGITS.info, seed=0)
    norms = [m.num_features for m in mlp if isinstance(m, nn.BatchNorm1d)]
    assert norms == [8, 6] and layers_before_batchnorm(mlp) == ["1", "4"]
    cnn = build_model(ModelSpec(name="cnn", channels=[4, 5], batchnorm=True), DIGITS.info, seed=0)
    assert [m.num_features for m in cnn if isinstance(m, nn.BatchNorm2d)] == [4, 5]
    plain = build_model(ModelSpec(name="mlp", hidden=[8, 6]), DIGITS.info, seed=0)
    assert layers_before_batchnorm(plain) == []


def lockstep(models, batches):
    """Drive each rank's SyncBN generator together, summing every request's buffers across ranks."""
    programs = [sync_batchnorm_forward_backward(m, x, y) for m, (x, y) in zip(models, batches)]
    requests = [next(p) for p in programs]
    while requests:
        total = torch.stack([r.buffer for r in requests]).sum(dim=0)
        for request in requests:
            request.buffer.copy_(total)
        requests = [request for request in map(resume, programs) if request is not None]


def resume(program):
    try:
        return program.send(None)
    except StopIteration:
        return None


@pytest.mark.parametrize("name,options", [("mlp", {"hidden": [16, 12]}), ("cnn", {"channels": [3]})])
def test_syncbn_on_n_devices_is_batchnorm_over_the_concatenated_batch(name, options):
    world, batch = 3, 8
    model = build_model(ModelSpec(name=name, **options, batchnorm=True), DIGITS.info, seed=1)
    batches = [ShardLoader(DIGITS.train, world, rank, batch, seed=1).next_batch() for rank in range(world)]
    replicas = [copy.deepcopy(model) for _ in range(world)]
    outputs = []
    head = lambda m: [layer for layer in m if isinstance(layer, nn.Linear)][-1]  # noqa: E731
    for replica in replicas:
        head(replica).register_forward_hook(lambda module, inputs, out: outputs.append(out.detach()))
    lockstep(replicas, batches)
    # Reference: one model, one BatchNorm over all ranks' samples, the mean loss.
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    logits = model(x)
    F.cross_entropy(logits, y).backward()
    torch.testing.assert_close(torch.cat(outputs), logits.detach(), rtol=1e-4, atol=1e-5)
    for (key, expected), *per_rank in zip(model.named_parameters(), *[r.parameters() for r in replicas]):
        mean_grad = torch.stack([p.grad for p in per_rank]).mean(dim=0)  # what the gradient all-reduce makes
        torch.testing.assert_close(mean_grad, expected.grad, rtol=1e-4, atol=1e-6, msg=key)
    for replica in replicas:
        for key, buffer in model.state_dict().items():
            torch.testing.assert_close(replica.state_dict()[key], buffer, rtol=1e-4, atol=1e-6, msg=key)
    # Local statistics (no sync) are not the concatenated batch's: the test can tell them apart.
    local = torch.cat([copy.deepcopy(model)(b[0]) for b in batches])
    assert not torch.allclose(local, logits, atol=1e-3)


HIDDEN, BATCH, STEPS, LR = [32], 8, 4, 0.1


def bn_scenario(sync, devices=4, **optimizer):
    return validate_scenario({
        "name": "syncbn", "seed": 2,
        "cluster": {"topology": "ring", "devices": devices},
        "model": {"name": "mlp", "hidden": HIDDEN, "batchnorm": True},
        "data": {"name": "digits", "batch_size": BATCH},
        "train": {"steps": STEPS, "optimizer": {"name": "sgd", "lr": LR, **optimizer}},
        "parallel": {"all_reduce": "ring", "sync_batchnorm": sync},
        "report": {"trace": False},
    })


@pytest.fixture(scope="module")
def bn_runs():
    return {sync: simtrain.run(bn_scenario(sync)) for sync in (True, False)}


def concatenated_batch_reference(world):
    """Plain torch: BatchNorm over the concatenation of the ranks' batches, SGD on the mean loss."""
    model = build_model(ModelSpec(name="mlp", hidden=HIDDEN, batchnorm=True), DIGITS.info, seed=2)
    data = load_dataset("digits", {}, seed=2)
    loaders = [ShardLoader(data.train, world, rank, BATCH, seed=2) for rank in range(world)]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    for _ in range(STEPS):
        batches = [loader.next_batch() for loader in loaders]
        optimizer.zero_grad()
        F.cross_entropy(model(torch.cat([b[0] for b in batches])), torch.cat([b[1] for b in batches])).backward()
        optimizer.step()
    return model.state_dict()


def test_sync_batchnorm_training_matches_batchnorm_on_the_global_batch(bn_runs):
    reference = concatenated_batch_reference(4)
    synced = bn_runs[True].final_model.state_dict()
    local = bn_runs[False].final_model.state_dict()
    for key, expected in reference.items():
        torch.testing.assert_close(synced[key], expected, rtol=1e-4, atol=1e-5, msg=key)
    assert any(not torch.allclose(local[key].float(), reference[key].float(), atol=1e-4) for key in reference)


def test_sync_batchnorm_traffic_is_charged_as_ring_all_reduces(bn_runs):
    # One BN layer of 32 channels: forward [sum, sum of squares, count] = 65 floats, backward 64 floats.
    # Ring on a 4-device ring of 50 GB/s, 5 us links: 2(N-1) steps of alpha + largest chunk / B.
    alpha, bandwidth, world = 5e-6, 50e9, 4
    per_step = sum(2 * (world - 1) * (alpha + -(-floats // world) * 4 / bandwidth) for floats in (65, 64))
    extra = (bn_runs[True].data["breakdown_s"]["communication"]
             - bn_runs[False].data["breakdown_s"]["communication"])
    assert extra == pytest.approx(per_step, rel=1e-6)


def test_sync_batchnorm_needs_a_sequential_model_with_direct_batchnorms():
    raw = bn_scenario(True).model_dump(mode="json", by_alias=True)
    raw["model"] = {"name": "test_batchnorm:nested_batchnorm_model"}
    with pytest.raises(ScenarioError, match="parallel.sync_batchnorm"):
        simtrain.run(validate_scenario(raw))


def nested_batchnorm_model():
    return nn.Sequential(nn.Flatten(), nn.Sequential(nn.Linear(64, 8), nn.BatchNorm1d(8)), nn.Linear(8, 10))


def weight_norm_run(weight_decay):
    return simtrain.run(validate_scenario({
        "name": "bn_wd", "seed": 0,
        "cluster": {"topology": "ring", "devices": 2},
        "model": {"name": "mlp", "hidden": [64], "batchnorm": True},
        "data": {"name": "digits", "batch_size": 32},
        "train": {"steps": 300, "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9,
                                              "weight_decay": weight_decay}},
        "report": {"trace": False, "every": 30},
    })).data["weight_norms"]


def test_weights_before_batchnorm_grow_without_weight_decay_and_stay_bounded_with_it():
    free, decayed = weight_norm_run(0.0), weight_norm_run(1e-2)
    assert free["before_batchnorm"] == ["1"] and free["steps"][:3] == [0, 30, 60]
    grows, bounded = free["layers"]["1"], decayed["layers"]["1"]
    # BN makes the loss invariant to the scale of w, so the gradient is orthogonal to w and a
    # plain SGD step only lengthens it: ||w + lr g||^2 = ||w||^2 + lr^2 ||g||^2.
    assert all(later >= earlier for earlier, later in zip(grows, grows[1:]))
    assert grows[-1] > 1.5 * grows[0]
    # With L2 the norm settles: the second half stays within 10% of its mean, below the start.
    second_half = bounded[len(bounded) // 2:]
    mean = sum(second_half) / len(second_half)
    assert max(second_half) < 1.1 * mean and min(second_half) > 0.9 * mean
    assert bounded[-1] < bounded[0] < grows[-1]
