"""Sharded data parallelism (the step engine with strategies/distributed_optimizer.py): ZeRO stages 1-3 (FSDP) and HSDP against their references.

- Numerics: every stage and HSDP trains the parameters one device trains on the same global batch
  (single-process torch through simtrain's one-device run), within 1e-5 in fp32; in bf16 and fp16 on two
  ranks, plain DDP's bit for bit (a sum of two is the same either way round).
- Memory: each category of a rank's ledger equals the ZeRO paper's closed form (Rajbhandari et al. 2020,
  mixed-precision Adam, K = 12) with simtrain's fp32 master gradient, exactly in bytes; `simtrain memory`
  plans what a run holds.
- Traffic: each rank sends (N - 1) / N of 2 Psi e bytes per step (stages 1, 2) and of 3 Psi e (stage 3), on
  the report's counters and on the links.
- Time: with free links an FSDP step is its compute; with slow links it is the closed form of the gathers
  that compute does not hide.
- A device lost under stage 3 restarts from the sharded checkpoint to the fault-free model, bit for bit.
"""
import pytest
import torch
from torch import nn

from simtrain import plan_memory, run
from simtrain.errors import ScenarioError
from simtrain.hw.cluster import build_cluster, run_to_end
from simtrain.job import Job
from simtrain.loss import cross_entropy
from simtrain.scenario import ModelSpec, validate_scenario
from simtrain.strategies.shard_layout import ShardLayout
from simtrain.train.data import ShardLoader, load_dataset
from simtrain.train.models import build_model
from simulated_steps import flat_parameters, microbatch_cost, one_step

MLP = {"name": "zero", "seed": 3, "cluster": {"devices": 1, "topology": "ring"},
       "model": {"name": "mlp", "hidden": [33, 32]},  # units of 2145, 1088 and 330 parameters: padded for N = 4
       "data": {"name": "digits", "batch_size": 16},
       "train": {"steps": 10, "optimizer": {"name": "adam", "lr": 0.01}}, "report": {"trace": False}}
GPT = {"name": "zero-gpt", "seed": 1, "cluster": {"devices": 1, "topology": "ring"},
       "model": {"name": "gpt", "hidden": 32, "layers": 2, "heads": 4},
       "data": {"name": "tokens", "batch_size": 8, "samples": 256, "seq_len": 8, "vocab": 16},
       # SGD: Adam turns the rounding noise of a gradient that is zero in exact arithmetic into a full step
       "train": {"steps": 10, "optimizer": {"lr": 0.1, "momentum": 0.9}}, "report": {"trace": False}}
WIDTH, BLOCKS = 64, 4
BLOCKS_MODEL = {"name": "zero-blocks", "seed": 0, "cluster": {"devices": 1, "topology": "ring"},
                "model": {"name": "test_sharded:blocks"},
                "data": {"name": "synthetic", "samples": 512, "features": WIDTH, "classes": WIDTH, "batch_size": 32},
                "train": {"steps": 1, "optimizer": {"name": "adam", "lr": 0.01}}, "report": {"trace": False}}
PSI = BLOCKS * (WIDTH * WIDTH + WIDTH)  # each unit (a Linear) divides by 4
FREE_LINKS = {"bandwidth": 1e18, "latency": 0}
ALPHA, BANDWIDTH = 5e-6, 1e8  # slow links: a gather takes far longer than a unit's compute


def blocks(width: int = WIDTH, count: int = BLOCKS) -> nn.Sequential:
    """Equal Linear (+ ReLU) units: the model whose step has a closed form."""
    layers = []
    for _ in range(count):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def scenario(base: dict, devices: int, batch_size: int | None = None, precision: str = "fp32", link=None,
             steps: int | None = None, **sharding):
    cluster = {**base["cluster"], "devices": devices, **({"link": link} if link else {})}
    data = {**base["data"], **({"batch_size": batch_size} if batch_size else {})}
    train = {**base["train"], "precision": precision, **({"steps": steps} if steps else {})}
    return validate_scenario({**base, "cluster": cluster, "data": data, "train": train,
                              "parallel": {"sharding": sharding}})




# ---------------------------------------------------------------- numerics

SHARDINGS = [{"stage": 1}, {"stage": 2}, {"stage": 3}, {"stage": 3, "reshard_after_forward": False},
             {"stage": 1, "degree": 2}, {"stage": 3, "degree": 2}]


@pytest.mark.parametrize("sharding", SHARDINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_every_stage_trains_what_one_device_trains(sharding):
    split = run(scenario(MLP, 4, **sharding))
    alone = run(scenario(MLP, 1, batch_size=4 * MLP["data"]["batch_size"]))
    assert split.data["status"] == "ok"
    torch.testing.assert_close(flat_parameters(split.final_model), flat_parameters(alone.final_model),
                               rtol=0, atol=1e-5)
    for model in split.final_models[1:]:  # every rank reports the same whole model
        assert torch.equal(flat_parameters(model), flat_parameters(split.final_model))
    assert split.data["final_loss"] == pytest.approx(alone.data["final_loss"], abs=1e-5)


@pytest.mark.parametrize("sharding", [{"stage": 3}, {"stage": 2, "degree": 2}], ids=["fsdp", "hsdp-stage2"])
def test_a_gpt_sharded_trains_what_one_device_trains(sharding):
    split = run(scenario(GPT, 4, **sharding))
    alone = run(scenario(GPT, 1, batch_size=4 * GPT["data"]["batch_size"]))
    assert split.data["sharding"]["units"] == 4  # the embedding, two blocks, the head
    torch.testing.assert_close(flat_parameters(split.final_model), flat_parameters(alone.final_model),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mixed_precision_trains_what_plain_ddp_trains(stage, precision):
    sharded = run(scenario(MLP, 2, precision=precision, stage=stage))
    ddp = run(scenario(MLP, 2, precision=precision))
    assert sharded.data["scheme"] == "sharded" and ddp.data["scheme"] == "data_parallel"
    assert torch.equal(flat_parameters(sharded.final_model), flat_parameters(ddp.final_model))
    assert sharded.data["amp"] == ddp.data["amp"]  # the same loss scale, the same skipped steps
    losses = [[loss for *_, loss in report.data["train_loss_curve"]] for report in (sharded, ddp)]
    assert losses[0] == losses[1] and len(losses[0]) >= 1  # stage 3: evaluated on the model assembled from shards


def fp32_main_gradients_reference(world: int, microbatches: int, steps: int) -> torch.Tensor:
    """Plain torch as Megatron-Core's distributed optimizer with --grad-reduce-in-fp32 runs it: each rank's bf16
    replica backpropagates its microbatches one by one, each one's bf16 gradient added into the rank's fp32 main
    gradient and dropped (the backward post-hook); the ranks' main gradients summed in fp32 and divided by the
    ranks; Adam steps the fp32 master weights, rounded into the bf16 model."""
    seed, hidden, batch = MLP["seed"], MLP["model"]["hidden"], MLP["data"]["batch_size"]
    data = load_dataset("digits", {}, seed)
    model = build_model(ModelSpec(name="mlp", hidden=hidden), data.info, seed)
    masters = [p.detach().clone().float().requires_grad_() for p in model.parameters()]
    model.to(torch.bfloat16)
    loaders = [ShardLoader(data.train, world, rank, batch, seed) for rank in range(world)]
    optimizer = torch.optim.Adam(masters, lr=MLP["train"]["optimizer"]["lr"], foreach=False)
    for _ in range(steps):
        mains = []
        for loader in loaders:
            main = [torch.zeros_like(master) for master in masters]
            x, y = loader.next_batch()
            for xs, ys in zip(x.to(torch.bfloat16).chunk(microbatches), y.chunk(microbatches)):
                model.zero_grad()
                (cross_entropy(model(xs), ys) * (1 / microbatches)).backward()
                for total, param in zip(main, model.parameters()):
                    total.add_(param.grad)
            mains.append(main)
        for master, *totals in zip(masters, *mains):
            master.grad = sum(totals[1:], totals[0]) / world
        optimizer.step()
        with torch.no_grad():
            for param, master in zip(model.parameters(), masters):
                param.copy_(master)
    return torch.cat([master.detach().flatten() for master in masters])


@pytest.mark.parametrize("stage", [1, 3])
def test_an_fp32_reduce_dtype_sums_bf16_gradients_in_fp32(stage):
    report = run(scenario(MLP, 2, precision="bf16", stage=stage, reduce_dtype="fp32"))
    section = report.data["sharding"]
    assert section["reduce_dtype"] == "fp32"
    # the sum of two is exact either way round: bit for bit (a bf16 reduce is 6e-3 away)
    assert torch.equal(flat_parameters(report.final_model), fp32_main_gradients_reference(2, 1, MLP["train"]["steps"]))
    # the reduce-scatter moves 4-byte elements, the gathers 2-byte ones
    gathers = 1 if stage == 1 else 2
    assert section["bytes_by_kind"]["reduce_scatter"] * gathers == 2 * section["bytes_by_kind"]["all_gather"]


@pytest.mark.parametrize("stage", [0, 1], ids=["ddp", "distributed-optimizer"])
def test_fp32_main_gradients_accumulate_microbatches_in_fp32(stage):
    """DDP and the distributed optimizer with an fp32 reduce dtype keep Megatron-Core's fp32 main gradients:
    microbatches accumulate in fp32, not in the bf16 gradient; two ranks' sum is exact either way round, so bit
    for bit."""
    report = run(validate_scenario({**MLP, "cluster": {**MLP["cluster"], "devices": 2},
                                    "train": {**MLP["train"], "precision": "bf16", "steps": 4},
                                    "parallel": {"sharding": {"stage": stage, "reduce_dtype": "fp32"},
                                                 "pipeline": {"microbatches": 4}}}))
    assert torch.equal(flat_parameters(report.final_model), fp32_main_gradients_reference(2, 4, 4))
    bf16_sums = fp32_main_gradients_reference(2, 1, 4)  # the same batches, one microbatch: a different model
    assert not torch.equal(flat_parameters(report.final_model), bf16_sums)


def test_ddp_main_gradients_are_all_reduced_in_fp32():
    """DDP's fp32 main gradients move twice the bytes of its bf16 bucket, every step."""
    moved = {}
    for sharding in ({"reduce_dtype": "fp32"}, {}):
        report = run(validate_scenario({**MLP, "cluster": {**MLP["cluster"], "devices": 2},
                                        "train": {**MLP["train"], "precision": "bf16", "steps": 2},
                                        "parallel": {"sharding": sharding}}))
        moved[bool(sharding)] = report.data["parallel"]["bytes_by_kind"]["dp_allreduce"]
    assert moved[True] == 2 * moved[False] > 0


MEGATRON_BYTES_PER_PARAMETER = {  # Megatron-LM's README, "Distributed Optimizer": d data-parallel ranks
    (0, "fp32"): lambda d: 18, (1, "fp32"): lambda d: 6 + 12 / d,  # bf16 parameters, fp32 gradients
    (0, None): lambda d: 20, (1, None): lambda d: 4 + 16 / d}  # 16-bit gradients (its fp16 row)


@pytest.mark.parametrize("stage, reduce_dtype", list(MEGATRON_BYTES_PER_PARAMETER))
def test_ddp_and_the_distributed_optimizer_hold_megatron_cores_bytes_per_parameter(stage, reduce_dtype):
    """bf16 parameters with fp32 main gradients keep 18 bytes a parameter under DDP, 6 + 12/d under the
    distributed optimizer; 16-bit gradients beside fp32 master gradients 20 and 4 + 16/d."""
    n = 4
    sharding = {"stage": stage, **({"reduce_dtype": reduce_dtype} if reduce_dtype else {})}
    job = one_step(scenario(BLOCKS_MODEL, n, precision="bf16", **sharding))
    per_parameter = MEGATRON_BYTES_PER_PARAMETER[stage, reduce_dtype]
    for device in job.devices:
        peak = device.memory.peak
        held = sum(peak[category] for category in ("weights", "master_weights", "gradients", "optimizer_state"))
        assert held == per_parameter(n) * PSI
        if reduce_dtype == "fp32":  # no 16-bit gradient, reduce-dtype copy or master gradient beside it
            assert peak["gradients"] == 4 * PSI


@pytest.mark.parametrize("settings, named", [({"parallel": {"mode": "async"}}, "parallel.mode async"),
                                             ({"parallel": {"sync_batchnorm": True}}, "parallel.sync_batchnorm"),
                                             ({"optimizer": {"name": "kfac", "lr": 0.01}}, "K-FAC")])
def test_ddp_main_gradients_where_not_built_are_one_line(settings, named):
    raw = {**MLP, "cluster": {**MLP["cluster"], "devices": 2}, "model": {**MLP["model"], "batchnorm": True},
           "train": {**MLP["train"], "precision": "bf16", **({"optimizer": settings["optimizer"]}
                                                               if "optimizer" in settings else {})}}
    raw["parallel"] = {**settings.get("parallel", {}), "sharding": {"reduce_dtype": "fp32"}}
    with pytest.raises(ScenarioError, match=f"parallel.sharding.reduce_dtype: .* not built with {named}") as error:
        validate_scenario(raw)
    assert "\n" not in str(error.value)


def test_a_missing_gather_would_show_a_stage_3_rank_holds_only_its_chunks_between_steps():
    scenario_ = scenario(BLOCKS_MODEL, 4, steps=2, stage=3)
    cluster = build_cluster(scenario_.cluster, record=True, seed=scenario_.seed)
    held = []  # after each step: which elements of each rank's parameter buffer are numbers
    job = Job(scenario_, cluster, range(4), on_step=lambda *_: held.append(
        [torch.isfinite(shard.param_flat.view(BLOCKS, 4, -1)) for shard in job.replicas]))
    job.start()
    run_to_end(cluster.env)
    assert len(held) == 2
    for finite in held:
        for shard, numbers in zip(job.replicas, finite):
            assert numbers[:, shard.owned[0]].all() and numbers.sum() == PSI // 4  # the rest is NaN


def test_a_shard_layout_pads_each_unit_to_the_degree_and_cuts_it_into_chunks():
    layout = ShardLayout([5, 3, 8], units=[[0, 1], [2]], shards=3)
    assert [layout.chunk_numel(unit) for unit in (0, 1)] == [3, 3]  # ceil(8 / 3) each
    assert (layout.padded_numel, layout.shard_numel) == (18, 6)
    assert [layout.param_slice(index) for index in range(3)] == [slice(0, 5), slice(5, 8), slice(9, 17)]
    flat = torch.arange(18)
    assert [chunk.tolist() for chunk in layout.chunks(flat, 1)] == [[9, 10, 11], [12, 13, 14], [15, 16, 17]]
    assert [layout.chunk(flat, unit, index).tolist() for unit in (0, 1) for index in range(3)] == [
        [0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14], [15, 16, 17]]
    assert [layout.owned(0, position) for position in range(3)] == [1, 2, 0]  # what a ring reduce-scatter leaves
    assert layout.shard_slice(1) == slice(3, 6)
    with pytest.raises(ValueError, match="units must cover"):
        ShardLayout([5, 3], units=[[1], [0]], shards=2)


# ---------------------------------------------------------------- memory

def expected_bytes(stage: int, precision: str, n: int) -> dict[str, int]:
    """Each category per rank: the ZeRO paper's terms (2 Psi fp16 parameters, 2 Psi fp16 gradients, K Psi = 4 Psi
    fp32 master + 8 Psi Adam moments), plus simtrain's fp32 master gradient: 4 Psi (DDP), 4 Psi / N (stages 1,
    2), where the paper keeps the 2 Psi / N fp16 gradient shard (stage 2). Stage 3 is FSDP2's: the fp32 shard is
    the parameter (no fp16 shard, no master), 4 + 4 + 8 Psi / N. fp32: 4 Psi parameters and gradients, 8 Psi
    moments, no master copy."""
    e = 2 if precision == "bf16" else 4
    whole, shard = PSI, PSI // n
    if stage == 0:
        held = {"weights": e * whole, "gradients": e * whole + (4 * whole if e == 2 else 0),
                "optimizer_state": 8 * whole}
        return {**held, **({"master_weights": 4 * whole} if e == 2 else {})}
    held = {"weights": 4 * shard if stage == 3 else e * whole,  # stage 3: FSDP2's fp32 shard is the parameter
            "gradients": (e * whole if stage == 1 else 0) + (4 * shard if stage > 1 or e == 2 else 0),
            "optimizer_state": 8 * shard}
    return {**held, **({"master_weights": 4 * shard} if e == 2 and stage < 3 else {})}


PAPER = {0: lambda psi, n: 16 * psi, 1: lambda psi, n: 4 * psi + 12 * psi // n,
         2: lambda psi, n: 2 * psi + 14 * psi // n, 3: lambda psi, n: 16 * psi // n}
MASTER_GRADIENT = {0: lambda psi, n: 4 * psi, 1: lambda psi, n: 4 * psi // n, 2: lambda psi, n: 2 * psi // n,
                   3: lambda psi, n: 0}  # stage 3: FSDP2's 4 + 4 + 8 (fp32 shard, gradient, moments) is 16 too


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_per_category_is_the_closed_form(stage, precision):
    n = 4
    job = one_step(scenario(BLOCKS_MODEL, n, precision=precision, stage=stage))
    expected = expected_bytes(stage, precision, n)
    if precision == "bf16":  # the paper's (2 + 2 + K) Psi split, K = 12, and simtrain's fp32 master gradient
        assert sum(expected.values()) == PAPER[stage](PSI, n) + MASTER_GRADIENT[stage](PSI, n)
    else:  # fp32 has no master copy: the paper's forms with 4 + 4 + 8 in place of 2 + 2 + 12
        assert sum(expected.values()) == {0: 16 * PSI, 1: 8 * PSI + 8 * PSI // n, 2: 4 * PSI + 12 * PSI // n,
                                          3: 16 * PSI // n}[stage]
    cost = microbatch_cost(job, 1)  # the whole model's, measured as one device runs it
    unit = PSI // BLOCKS * (2 if precision == "bf16" else 4)
    for device in job.devices:
        peak = device.memory.peak
        assert {category: peak[category] for category in expected} == expected
        assert peak["activations"] == cost.activation_bytes
        if stage == 3:  # in a unit's backward: it and the next one gathered, its unsharded gradient and the one
            # before it (reduce-scattering), and the chunk a reducing receive stages
            assert peak["comm_buffers"] == 4 * unit + unit // n


def test_padding_shards_each_unit_up_to_a_multiple_of_the_degree():
    job = one_step(scenario({**MLP, "train": {**MLP["train"], "steps": 1}}, 4, precision="bf16", stage=3))
    units = [64 * 33 + 33, 33 * 32 + 32, 32 * 10 + 10]
    shard = sum(-(-size // 4) for size in units)  # ceil(Psi_u / N), each unit
    assert job.scheme.replicas[0].layout.shard_numel == shard
    assert job.devices[0].memory.peak["weights"] == 4 * shard  # FSDP2's fp32 shard
    assert job.devices[0].memory.peak["optimizer_state"] == 8 * shard


@pytest.mark.parametrize("stage", [*(pytest.param(stage, marks=pytest.mark.slow) for stage in (0, 1, 2)), 3])
def test_the_memory_plan_is_what_a_run_holds(stage):  # each plan probes the largest batch too: seconds
    scenario_ = scenario(MLP, 4, precision="bf16", steps=2, stage=stage)
    report = run(scenario_)
    for device, plan in zip(report.data["devices"], plan_memory(scenario_)):
        assert plan.by_category == device["peak_memory_bytes_by_category"]
        assert plan.peak_bytes == device["peak_memory_bytes"]


# ---------------------------------------------------------------- traffic

@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("sharding,gathers", [({"stage": 1}, 1), ({"stage": 2}, 1), ({"stage": 3}, 2),
                                               ({"stage": 3, "reshard_after_forward": False}, 1)])
def test_bytes_per_step_are_the_papers_volumes(sharding, gathers, precision):
    n, steps = 4, 3
    report = run(scenario(BLOCKS_MODEL, n, precision=precision, steps=steps, **sharding))
    e = 2 if precision == "bf16" else 4
    per_rank = (n - 1) * PSI * e // n  # one ring pass over Psi: each rank sends (N - 1) / N of it
    moved = report.data["sharding"]["bytes_by_kind"]
    assert moved == {"all_gather": gathers * per_rank * n * steps, "reduce_scatter": per_rank * n * steps,
                     "all_reduce": 0}
    # stages 1, 2: 2 Psi per rank per step; stage 3: 3 Psi (2 Psi without resharding after the forward)
    assert sum(moved.values()) == (gathers + 1) * (n - 1) * PSI * e * steps
    assert sum(link["bytes"] for link in report.data["links"]) == sum(moved.values())  # ring neighbours: one hop


def test_hsdp_all_reduces_each_shard_across_the_replicas():
    n, degree, steps = 4, 2, 2
    report = run(scenario(BLOCKS_MODEL, n, steps=steps, stage=3, degree=degree))
    section = report.data["sharding"]
    assert (section["stage"], section["degree"], section["replicate"]) == (3, degree, n // degree)
    in_group = (degree - 1) * PSI * 4 // degree
    replicas = n // degree
    across = 2 * (replicas - 1) * (PSI // degree) * 4 // replicas  # ring all-reduce of the shard
    assert section["bytes_by_kind"] == {"all_gather": 2 * in_group * n * steps,
                                        "reduce_scatter": in_group * n * steps, "all_reduce": across * n * steps}


# ---------------------------------------------------------------- time

def test_with_free_links_an_fsdp_step_is_its_compute():
    report = run(scenario(BLOCKS_MODEL, 4, link=FREE_LINKS, steps=3, stage=3))
    breakdown = report.data["breakdown_s"]
    assert report.data["step_time_s"] == pytest.approx(breakdown["compute"] + breakdown["optimizer"], rel=1e-6)


@pytest.mark.parametrize("reshard", [True, False])
def test_with_slow_links_an_fsdp_step_is_the_closed_form_of_exposed_gathers(reshard):
    n = 4
    job = one_step(scenario(BLOCKS_MODEL, n, link={"bandwidth": BANDWIDTH, "latency": ALPHA}, stage=3,
                            reshard_after_forward=reshard))
    spans = [s for s in job.cluster.log.spans if s.rank == 0]
    computes = [s.end - s.start for s in spans if s.kind == "compute"]  # f_0 .. f_{U-1}, b_{U-1} .. b_0
    optimizer = next(s.end - s.start for s in spans if s.kind == "optimizer")
    g = (n - 1) * (ALPHA + PSI // BLOCKS * 4 / n / BANDWIDTH)  # one unit's ring all-gather (= its reduce-scatter)
    assert len(computes) == 2 * BLOCKS
    forward, backward = computes[:BLOCKS], computes[BLOCKS:]
    assert max(computes) < g  # slow links: every gather is exposed
    if reshard:  # 2U gathers back to back, the reduce-scatters lagging the backward by its longest unit, the last
        expected = (2 * BLOCKS + 1) * g + max(backward) + optimizer
    else:  # U gathers, then the last unit's forward and backward, then U reduce-scatters back to back
        expected = 2 * BLOCKS * g + forward[-1] + backward[0] + optimizer
    assert job.cluster.env.now == pytest.approx(expected, rel=1e-9)


# ---------------------------------------------------------------- faults and bad input

@pytest.mark.slow
def test_a_stage_3_restart_from_the_sharded_checkpoint_is_bit_identical():
    def raw(faults=()):
        return {"name": "t", "seed": 0,
                "cluster": {"topology": "switch", "devices": 5, "spares": 1, "faults": list(faults),
                            "link": {"bandwidth": 50e9, "latency": 5e-6}, "fault_detection": "100 us"},
                "model": {"name": "mlp", "hidden": [32]}, "data": {"name": "digits", "batch_size": 16},
                "train": {"steps": 40, "optimizer": {"name": "adam", "lr": 0.01},
                          "checkpoint": {"every": 10, "to": "storage", "bandwidth": "10 GB/s", "latency": "20 us"}},
                "parallel": {"sharding": {"stage": 3}}, "report": {"trace": False}}
    free = run(validate_scenario(raw()))
    faulty = run(validate_scenario(raw([{"at": 0.45 * free.data["sim_time_s"], "device": 1, "fail": True}])))
    assert faulty.data["status"] == "ok" and faulty.data["faults"]["restarts"] == 1
    for model in faulty.final_models:  # every rank, the spare's included
        assert torch.equal(flat_parameters(model), flat_parameters(free.final_model))
    assert [loss for _, loss in faulty.data["loss_curve"]] == [loss for _, loss in free.data["loss_curve"]]


@pytest.mark.parametrize("parallel,devices,message", [
    ({"dp": 4, "sharding": {"stage": 1, "degree": 3}}, 4, "parallel.sharding.degree: 3 does not divide parallel.dp 4"),
    ({"sharding": {"stage": 1, "degree": 3}}, 4, "parallel.sharding.degree: 3 does not divide the 4"),
    ({"mode": "async", "sharding": {"stage": 2}}, 4, "parallel.sharding.stage: 2 shards synchronous"),
])
def test_sharding_that_cannot_run_is_a_one_line_error(parallel, devices, message):
    with pytest.raises((ScenarioError, ValueError), match=message.replace(".", r"\.")):
        run(validate_scenario({**MLP, "cluster": {"devices": devices}, "parallel": parallel}))


def test_kfac_is_refused_with_sharding():
    raw = {**MLP, "cluster": {"devices": 2}, "train": {"steps": 1, "optimizer": {"name": "kfac"}},
           "parallel": {"sharding": {"stage": 1}}}
    with pytest.raises(ScenarioError, match="train.optimizer.name: kfac"):
        run(validate_scenario(raw))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_a_pbt_exploit_copies_each_ranks_shard_from_the_donors_same_rank(tmp_path, stage):
    from test_pbt import assert_the_recipient_trained_on_from_the_donors_state, run_population_and_replay, \
        two_switch_population
    scenario = two_switch_population(tmp_path, parallel={"sharding": {"stage": stage}},
                                     train={"optimizer": {"name": "adam", "lr": 0.01}, "precision": "bf16"})
    population, replay = run_population_and_replay(scenario)
    assert_the_recipient_trained_on_from_the_donors_state(population, replay)
    [event] = population.events
    donor = population.members[event["from"]]
    assert donor.checkpoint[0].layout == donor.checkpoint[1].layout  # each rank: its master shard and moments
    assert not torch.equal(donor.checkpoint[0].flat, donor.checkpoint[1].flat)  # ... of different chunks
    assert event["bytes"] == sum(state.nbytes for state in donor.checkpoint.values())
