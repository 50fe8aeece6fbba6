"""K-FAC: factors, damping conventions, KL clip, distributed factors and inversions, convergence.

References: per-sample gradients from autograd, explicit patch extraction,
torch.linalg.solve on the explicit (Kronecker) systems, brute-force
scheduling optimum, closed-form FLOP and byte counts, and plain SGD runs.
"""
import itertools
import math

import pytest
import simpy
import torch
import torch.nn.functional as F
from torch import nn

import simtrain
from simtrain.scenario import ModelSpec, OptimizerSpec
from simtrain.comm import ALL_REDUCE
from simtrain.comm.simulated import SimCommunicator
from simtrain.hw.catalog import CATALOG
from simtrain.hw.network import Network
from simtrain.hw.topology_builders import LinkClass, build_topology
from simtrain.scenario import validate_scenario
from simtrain.strategies.kfac_sync import assign_inverses
from simtrain.train.data import ShardLoader, load_dataset
from simtrain.train.kfac import Kfac
from simtrain.train.models import build_model


def generator(seed):
    return torch.Generator().manual_seed(seed)


def spd(n, seed):
    m = torch.randn(n, n, generator=generator(seed), dtype=torch.float64)
    return m @ m.t() / n + 0.1 * torch.eye(n, dtype=torch.float64)


def test_linear_factors_are_the_empirical_fisher_factors():
    batch, model = 16, nn.Sequential(nn.Linear(5, 3))
    x = torch.randn(batch, 5, generator=generator(0))
    y = torch.randint(0, 3, (batch,), generator=generator(1))
    kfac = Kfac(model, OptimizerSpec(name="kfac"))
    F.cross_entropy(model(x), y).backward()
    kfac.compute_batch_factors()
    # Reference: per-sample gradients of each sample's own loss w.r.t. the layer's output.
    out = model[0](x)
    per_sample = torch.autograd.grad(F.cross_entropy(out, y, reduction="sum"), out)[0]
    a = torch.cat([x, torch.ones(batch, 1)], dim=1)
    torch.testing.assert_close(kfac.batch_factor(0, "A"), a.t() @ a / batch)
    torch.testing.assert_close(kfac.batch_factor(0, "G"), per_sample.t() @ per_sample / batch)


def test_conv_factors_follow_kfc_and_reproduce_the_weight_gradient():
    batch, conv = 3, nn.Conv2d(2, 4, kernel_size=3, padding=1)
    model = nn.Sequential(conv, nn.Flatten(), nn.Linear(4 * 16, 5))
    x = torch.randn(batch, 2, 4, 4, generator=generator(2))
    y = torch.randint(0, 5, (batch,), generator=generator(3))
    kfac = Kfac(model, OptimizerSpec(name="kfac"))
    F.cross_entropy(model(x), y).backward()
    layer = kfac.layers[0]
    a, g = layer.a, layer.g
    # The captured patches and output gradients give back the real weight gradient: dW = sum_t g_t a_t^T.
    grad = torch.cat([conv.weight.grad.reshape(4, -1), conv.bias.grad.reshape(4, 1)], dim=1)
    torch.testing.assert_close(g.t() @ a, grad, rtol=1e-5, atol=1e-6)
    # Patches by explicit slicing (channel-major, then kernel row, kernel column), plus the bias 1.
    padded = F.pad(x, (1, 1, 1, 1))
    rows = [torch.cat([padded[i, :, r:r + 3, c:c + 3].reshape(-1), torch.ones(1)])
            for i in range(batch) for r in range(4) for c in range(4)]
    patches = torch.stack(rows)
    kfac.compute_batch_factors()
    positions = 16
    torch.testing.assert_close(kfac.batch_factor(0, "A"), patches.t() @ patches / batch)  # Omega
    torch.testing.assert_close(kfac.batch_factor(0, "G"), g.t() @ g * batch / positions)  # Gamma


def preconditioned(method, damping, a, g, grad, kl_clip=0.0, lr=0.1):
    """Run Kfac's decomposition and preconditioning on a Linear(5, 3) with known factors and gradient."""
    model = nn.Sequential(nn.Linear(5, 3))
    kfac = Kfac(model, OptimizerSpec(name="kfac", lr=lr, damping=damping, kl_clip=kl_clip, method=method))
    layer = kfac.layers[0]
    layer.running = {"A": a.float(), "G": g.float()}
    for j in range(len(kfac.factors)):
        kfac.decompose(j)
    model[0].weight.grad = grad[:, :5].float().clone()
    model[0].bias.grad = grad[:, 5].float().clone()
    kfac.precondition()
    return torch.cat([model[0].weight.grad, model[0].bias.grad.reshape(3, 1)], dim=1).double()


A, G = spd(6, 10), spd(3, 11)
GRAD = torch.randn(3, 6, generator=generator(12), dtype=torch.float64)


def test_inverse_method_is_factored_tikhonov_damping():
    damping = 0.01
    root = math.sqrt(damping)
    expected = torch.linalg.solve(G + root * torch.eye(3, dtype=torch.float64), GRAD)
    expected = torch.linalg.solve(A + root * torch.eye(6, dtype=torch.float64), expected.t()).t()
    torch.testing.assert_close(preconditioned("inverse", damping, A, G, GRAD), expected, rtol=1e-4, atol=1e-5)


def test_eigen_method_solves_the_damped_kronecker_system():
    damping = 0.01
    # vec (column-major) of G X A is (A kron G) vec(X); the eigen method solves (A kron G + lambda I) vec(X) = vec(dW).
    system = torch.kron(A, G) + damping * torch.eye(18, dtype=torch.float64)
    expected = torch.linalg.solve(system, GRAD.t().reshape(-1)).reshape(6, 3).t()
    torch.testing.assert_close(preconditioned("eigen", damping, A, G, GRAD), expected, rtol=1e-4, atol=1e-5)


def test_eigen_and_inverse_agree_as_damping_vanishes():
    expected = torch.linalg.solve(G, GRAD) @ torch.linalg.inv(A)
    for method in ("eigen", "inverse"):
        torch.testing.assert_close(preconditioned(method, 1e-12, A, G, GRAD), expected, rtol=1e-3, atol=1e-4)


def test_kl_clip_scales_the_update_to_the_trust_region():
    lr, clip = 0.5, 1e-4
    unclipped = preconditioned("inverse", 0.01, A, G, GRAD)
    nu = min(1.0, math.sqrt(clip / (lr * lr * float((unclipped * GRAD).sum()))))
    assert nu < 1
    clipped = preconditioned("inverse", 0.01, A, G, GRAD, kl_clip=clip, lr=lr)
    torch.testing.assert_close(clipped, unclipped * nu, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name,options", [("mlp", {"hidden": [16]}), ("cnn", {"channels": [4]})])
def test_factors_averaged_across_devices_equal_the_factors_of_the_concatenated_batch(name, options):
    world, batch, seed = 4, 8, 5
    data = load_dataset("digits", {}, seed)
    model = build_model(ModelSpec(name=name, **options), data.info, seed)
    batches = [ShardLoader(data.train, world, rank, batch, seed).next_batch() for rank in range(world)]
    kfacs = []
    for x, y in batches:
        replica = build_model(ModelSpec(name=name, **options), data.info, seed)
        kfac = Kfac(replica, OptimizerSpec(name="kfac"))
        F.cross_entropy(replica(x), y).backward()
        kfac.compute_batch_factors()
        kfacs.append(kfac)
    env = simpy.Environment()
    network = Network(env, build_topology("ring", world, LinkClass(bandwidth=1e10, latency=1e-6)))
    comm = SimCommunicator(network, [f"gpu{r}" for r in range(world)])
    for rank, kfac in enumerate(kfacs):
        comm.run(rank, ALL_REDUCE["ring"](rank, world, kfac.factor_buffer, average=True))
    env.run()
    whole = Kfac(model, OptimizerSpec(name="kfac"))
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    F.cross_entropy(model(x), y).backward()
    whole.compute_batch_factors()
    for kfac in kfacs:
        torch.testing.assert_close(kfac.factor_buffer, whole.factor_buffer, rtol=1e-4, atol=1e-6)


def brute_force_makespan(costs, world):
    return min(max(sum(c for c, d in zip(costs, owners) if d == r) for r in range(world))
               for owners in itertools.product(range(world), repeat=len(costs)))


def test_greedy_assignment_is_within_grahams_bound_and_balanced():
    for seed in range(5):
        sizes = torch.randint(8, 200, (7,), generator=generator(seed)).tolist()
        costs = [float(n) ** 3 for n in sizes]
        for world in (2, 3):
            owner = assign_inverses(costs, world)
            loads = [sum(c for c, d in zip(costs, owner) if d == r) for r in range(world)]
            # Graham 1969: longest-processing-time-first is within (4/3 - 1/(3m)) of the optimum.
            assert max(loads) <= (4 / 3 - 1 / (3 * world)) * brute_force_makespan(costs, world) + 1e-6
    # A 6-layer MLP's 12 factors (inputs with the bias column) on 4 devices.
    widths = [64, 256, 256, 128, 128, 64, 10]
    sizes = [n for i in range(6) for n in (widths[i] + 1, widths[i + 1])]
    costs = [float(n) ** 3 for n in sizes]
    owner = assign_inverses(costs, 4)
    loads = [sum(c for c, d in zip(costs, owner) if d == r) for r in range(4)]
    assert max(loads) <= 1.5 * sum(loads) / 4
    assert owner[sizes.index(257)] == 0  # the largest goes first, to rank 0 (ties by rank)


def kfac_scenario(devices=4, steps=6, **optimizer):
    return validate_scenario({
        "name": "kfac", "seed": 1,
        "cluster": {"topology": "ring", "devices": devices},
        "model": {"name": "mlp", "hidden": [32]},
        "data": {"name": "digits", "batch_size": 16},
        "train": {"steps": steps, "optimizer": {"name": "kfac", "lr": 0.1, "momentum": 0.9,
                                                "inv_update_steps": 3, **optimizer}},
        "report": {"trace": False},
    })


@pytest.fixture(scope="module")
def kfac_runs():
    return {distribute: simtrain.run(kfac_scenario(distribute_inverses=distribute)) for distribute in (True, False)}


def test_sharing_inversions_changes_time_not_numerics(kfac_runs):
    shared, replicated = kfac_runs[True], kfac_runs[False]
    for model in shared.final_models + replicated.final_models:
        for p, q in zip(model.parameters(), shared.final_model.parameters()):
            assert torch.equal(p, q)
    # Factors 65, 32 (layer 1) and 33, 10 (layer 3): eigendecompositions at steps 0 and 3 of 6.
    flops = 2 * 9 * (65 ** 3 + 32 ** 3 + 33 ** 3 + 10 ** 3)
    rate = CATALOG["a100-40gb"].flops_rate("fp32")
    inversions = replicated.data["kfac"]["time_per_step_s"]["inversions"]
    assert inversions == pytest.approx(flops / rate / 6, rel=1e-9)
    # Shared out, the devices together do the work once: the mean per device is a quarter.
    assert shared.data["kfac"]["time_per_step_s"]["inversions"] == pytest.approx(inversions / 4, rel=1e-9)
    # Largest first to the least-loaded device: 65 -> 0, 33 -> 1, 32 -> 2, 10 -> 3.
    assert [entry["device"] for entry in shared.data["kfac"]["assignment"]] == [0, 2, 1, 3]
    assert shared.data["kfac"]["time_per_step_s"]["communication"] > replicated.data["kfac"]["time_per_step_s"]["communication"]


def test_kfac_memory_holds_factors_and_decompositions(kfac_runs):
    sizes = [65, 32, 33, 10]
    factors = sum(n * n for n in sizes)
    eigen = sum(n * n + n for n in sizes)
    for device in kfac_runs[True].data["devices"]:
        assert device["peak_memory_bytes_by_category"]["kfac"] == 4 * (2 * factors + eigen)


def digits_run(optimizer, steps):
    return simtrain.run(validate_scenario({
        "name": "converge", "seed": 0,
        "cluster": {"topology": "ring", "devices": 2},
        "model": {"name": "mlp", "hidden": [64]},
        "data": {"name": "digits", "batch_size": 32},
        "train": {"steps": steps, "optimizer": optimizer},
        "report": {"trace": False},
    }))


def steps_to_target(report, target, window=10):
    losses = [loss for _, loss in report.data["loss_curve"]]
    for end in range(window, len(losses) + 1):
        if sum(losses[end - window:end]) / window <= target:
            return end
    return math.inf


def test_kfac_reaches_a_target_loss_in_fewer_steps_than_sgd_at_its_best_learning_rate():
    steps, target = 120, 0.15  # training loss, mean over the last 10 steps
    sgd = {lr: steps_to_target(digits_run({"name": "sgd", "lr": lr, "momentum": 0.9}, steps), target)
           for lr in (0.1, 0.3, 0.5, 1.0)}
    kfac = steps_to_target(digits_run({"name": "kfac", "lr": 0.1, "momentum": 0.9, "damping": 0.01}, steps), target)
    assert kfac < min(sgd.values()), (kfac, sgd)


def test_one_device_kfac_run_has_scaling_efficiency_one():
    # Nothing is sent on one device, so the step is what one device alone needs, K-FAC work included.
    report = simtrain.run(kfac_scenario(devices=1, steps=7))
    assert report.data["scaling_efficiency"] == pytest.approx(1.0, rel=1e-9)
    assert report.data["kfac"]["time_per_step_s"]["communication"] == 0.0
