"""Gradient accumulation without pp/tp: `parallel.pipeline.microbatches` m under DDP, ZeRO 1/2/3 and HSDP.

- Numerics: every layout trains what single-process torch trains with the same accumulation (each replica's
  batch cut into the same m micro-batches, each loss weighted 1/m, the gradients averaged over replicas),
  within 1e-5 in fp32; numerics off runs the same program.
- Memory: the activation peak is one micro-batch's, as measured on that micro-batch (cost.py), ~1/m of the
  whole batch's.
- Time: with free links a step is m micro-batches' compute and the update; with slow links, DDP without
  overlap adds one ring all-reduce after the last micro-batch (no_sync before it), and FSDP repeats each
  micro-batch's exposed gathers and last reduce-scatter (FSDP2's default: gradients reduced every micro-batch).
- Refusals: a count that does not divide the batch, and what accumulation does not combine with.
"""
import pytest
import torch
import torch.nn.functional as F

from simtrain import run
from simtrain.errors import ScenarioError
from simtrain.scenario import ModelSpec, validate_scenario
from simtrain.train.data import ShardLoader, load_dataset
from simtrain.train.models import build_model
from simulated_steps import flat_parameters, microbatch_cost, one_step
from test_sharded import ALPHA, BANDWIDTH, BLOCKS, BLOCKS_MODEL, FREE_LINKS, PSI

HIDDEN, BATCH, LR, MOMENTUM, SEED = [32], 16, 0.1, 0.9, 3


def scenario(devices: int, microbatches: int, steps: int = 4, model: dict | None = None, link=None,
             numerics: bool = True, **parallel) -> object:
    base = BLOCKS_MODEL if model is not None else {
        "cluster": {"devices": devices, "topology": "ring"}, "model": {"name": "mlp", "hidden": HIDDEN},
        "data": {"name": "digits", "batch_size": BATCH},
        "train": {"optimizer": {"name": "sgd", "lr": LR, "momentum": MOMENTUM}}}
    return validate_scenario({
        "name": "accumulation", "seed": SEED, "numerics": numerics,
        "cluster": {**base["cluster"], "devices": devices, **({"link": link} if link else {})},
        "model": base["model"], "data": base["data"], "train": {**base["train"], "steps": steps},
        "parallel": {"pipeline": {"microbatches": microbatches}, **parallel}, "report": {"trace": False}})


def torch_accumulation(world: int, microbatches: int, steps: int) -> torch.Tensor:
    """Single-process torch: one model; per step each replica's batch cut into `microbatches`, each loss / m
    backward into .grad in turn, the replicas' accumulated gradients averaged; SGD with momentum."""
    data = load_dataset("digits", {}, SEED)
    model = build_model(ModelSpec(name="mlp", hidden=HIDDEN), data.info, SEED)
    loaders = [ShardLoader(data.train, world, rank, BATCH, SEED) for rank in range(world)]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, foreach=False)
    for _ in range(steps):
        grads = []
        for loader in loaders:
            x, y = loader.next_batch()
            model.zero_grad()
            for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
                (F.cross_entropy(model(xs), ys) / microbatches).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *per_rank in zip(model.parameters(), *grads):
            p.grad = torch.stack(per_rank).mean(dim=0)
        optimizer.step()
    return flat_parameters(model)


LAYOUTS = {"ddp": ({}, 2), "ddp-no-overlap": ({"overlap": False}, 2), "zero1": ({"sharding": {"stage": 1}}, 2),
           "zero2": ({"sharding": {"stage": 2}}, 2), "zero3": ({"sharding": {"stage": 3}}, 2),
           "hsdp": ({"sharding": {"stage": 3, "degree": 2}}, 4),
           "hsdp-zero1": ({"sharding": {"stage": 1, "degree": 2}}, 4),
           # GPipe: every micro-batch's forward before the first backward; zero bubble: each backward in I and W
           # (until 2026-12-07 zero3 ended in a traceback under either, or in NaNs where GPipe ran)
           "zero2-gpipe": ({"sharding": {"stage": 2}, "pipeline": {"microbatches": 4, "schedule": "gpipe"}}, 2),
           "zero3-gpipe": ({"sharding": {"stage": 3}, "pipeline": {"microbatches": 4, "schedule": "gpipe"}}, 2),
           "zero3-zero-bubble": ({"sharding": {"stage": 3}, "pipeline": {"microbatches": 4, "schedule": "zero_bubble"}},
                                 2)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_accumulation_trains_what_single_process_torch_accumulation_trains(layout):
    parallel, devices = LAYOUTS[layout]
    report = run(scenario(devices, 4, **parallel))
    torch.testing.assert_close(flat_parameters(report.final_model), torch_accumulation(devices, 4, 4),
                               rtol=0, atol=1e-5)
    assert report.data["parallel"]["microbatches"] == 4


def test_the_reported_loss_is_the_mean_of_the_micro_batches():
    """The losses a run reports are the micro-batches', whose mean is the batch's (to rounding)."""
    whole, cut = (run(scenario(2, m, steps=1)) for m in (1, 4))
    assert cut.data["final_loss"] == pytest.approx(whole.data["final_loss"], rel=1e-5)


# ---------------------------------------------------------------- memory

@pytest.mark.parametrize("parallel", [{}, {"sharding": {"stage": 3}}], ids=["ddp", "zero3"])
@pytest.mark.parametrize("numerics", [True, False], ids=["numerics", "meta"])
def test_the_activation_peak_is_one_micro_batchs(parallel, numerics):
    peaks = {}
    for m in (1, 4):
        job = one_step(scenario(2, m, steps=1, model=BLOCKS_MODEL, numerics=numerics, **parallel))
        measured = microbatch_cost(job, m).activation_bytes  # a micro-batch's, measured
        peaks[m] = job.devices[0].memory.peak["activations"]
        assert peaks[m] == measured
    assert peaks[4] * 4 == pytest.approx(peaks[1], rel=0.05)


# ---------------------------------------------------------------- time

def _spans(job, kind):
    return [s.end - s.start for s in job.cluster.log.spans if s.rank == 0 and s.kind == kind]


@pytest.mark.parametrize("parallel", [{}, {"overlap": False}, {"sharding": {"stage": 1}},
                                      {"sharding": {"stage": 3}}], ids=["ddp", "no-overlap", "zero1", "zero3"])
def test_with_free_links_a_step_is_m_micro_batches_compute_and_the_update(parallel):
    m = 4
    job = one_step(scenario(4, m, steps=1, model=BLOCKS_MODEL, link=FREE_LINKS, **parallel))
    device, cost = job.devices[0], microbatch_cost(job, m)  # one micro-batch's FLOPs, measured
    computes = _spans(job, "compute")
    micro = device.compute_time(cost.forward_flops, "fp32", cost.forward_ops) + device.compute_time(
        cost.backward_flops, "fp32", cost.backward_ops)
    assert sum(computes) == pytest.approx(m * micro, rel=1e-9)
    assert job.cluster.env.now == pytest.approx(m * micro + sum(_spans(job, "optimizer")), rel=1e-9)


def test_ddp_without_overlap_reduces_once_after_the_last_micro_batch():
    n, m = 4, 4
    job = one_step(scenario(n, m, steps=1, model=BLOCKS_MODEL, link={"bandwidth": BANDWIDTH, "latency": ALPHA},
                            overlap=False))
    ring = 2 * (n - 1) * (ALPHA + PSI * 4 / n / BANDWIDTH)  # one ring all-reduce of the fp32 gradient
    assert len(_spans(job, "compute")) == 2 * m
    expected = sum(_spans(job, "compute")) + ring + sum(_spans(job, "optimizer"))
    assert job.cluster.env.now == pytest.approx(expected, rel=1e-9)


def test_an_fsdp_step_repeats_each_micro_batchs_exposed_gathers_and_reduce_scatter():
    n, m = 4, 2
    job = one_step(scenario(n, m, steps=1, model=BLOCKS_MODEL, link={"bandwidth": BANDWIDTH, "latency": ALPHA},
                            sharding={"stage": 3}))
    computes = _spans(job, "compute")
    g = (n - 1) * (ALPHA + PSI // BLOCKS * 4 / n / BANDWIDTH)  # one unit's ring all-gather (= its reduce-scatter)
    assert len(computes) == 2 * BLOCKS * m
    backward = computes[BLOCKS:2 * BLOCKS]
    # each micro-batch: 2U gathers back to back, the reduce-scatters lagging by the longest unit, the last one
    expected = m * ((2 * BLOCKS + 1) * g + max(backward)) + sum(_spans(job, "optimizer"))
    assert job.cluster.env.now == pytest.approx(expected, rel=1e-9)
    moved = job.scheme.report_sections()["sharding"]["bytes_by_kind"]
    assert moved["reduce_scatter"] == m * (n - 1) * PSI * 4  # every micro-batch's gradient reduce-scattered


def test_zero1_reduce_scatters_once_per_step():
    n, m = 4, 4
    job = one_step(scenario(n, m, steps=1, model=BLOCKS_MODEL, sharding={"stage": 1}))
    moved = job.scheme.report_sections()["sharding"]["bytes_by_kind"]
    assert moved["reduce_scatter"] == (n - 1) * PSI * 4  # the accumulated gradient, once


# ---------------------------------------------------------------- refusals

@pytest.mark.parametrize("parallel,message", [
    ({"pipeline": {"microbatches": 3}}, "parallel.pipeline.microbatches: 3 does not divide data.batch_size 16"),
    ({"pipeline": {"microbatches": 2}, "mode": "async"}, "parallel.mode: async"),
    ({"pipeline": {"microbatches": 2}, "sync_batchnorm": True}, "parallel.sync_batchnorm"),
])
def test_what_accumulation_cannot_do_is_a_one_line_error(parallel, message):
    raw = {"name": "t", "cluster": {"devices": 2, "topology": "ring"}, "model": {"name": "mlp"},
           "data": {"name": "digits", "batch_size": BATCH}, "parallel": parallel}
    with pytest.raises(ScenarioError, match=message) as error:
        validate_scenario(raw)
    assert "\n" not in str(error.value)


def test_a_micro_batchs_balancing_loss_joins_the_gradient_as_its_share():
    """MoE: each micro-batch's balancing-loss gradient is weighted 1/m like its loss (as under pp/tp), not added
    m times whole."""
    from simtrain.train.moe import MoE
    spec = validate_scenario({
        "name": "moe-accumulation", "seed": SEED, "numerics": False, "cluster": {"devices": 2, "topology": "ring"},
        "model": {"name": "gpt", "hidden": 32, "layers": 2, "heads": 4, "moe": {"experts": 4}},
        "data": {"name": "tokens", "batch_size": 8, "samples": 64, "seq_len": 8, "vocab": 16},
        "train": {"steps": 1}, "parallel": {"pipeline": {"microbatches": 4}}, "report": {"trace": False}})
    job = one_step(spec)
    scales = {layer.aux_loss_scale for layer in job.scheme.replicas[0].model.modules() if isinstance(layer, MoE)}
    assert scales == {0.25}
