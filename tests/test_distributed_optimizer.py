"""ZeRO stages 1, 2 and 3 (FSDP) and HSDP under pipeline and tensor parallelism (strategies/distributed_optimizer.py:
Megatron-Core's distributed optimizer, torchtitan's FSDP x TP) against their references.

- Numerics: ZeRO-1 x pp x tp, stage 2 x tp, FSDP x TP, FSDP x TP x PP (interleaved, parameters kept from forward
  to backward) and HSDP x TP train the parameters one device trains on the same global batch (single-process
  torch through simtrain's one-device run) within 1e-5 in fp32, and plain DDP's (stage 0 on the same dp x pp x tp
  layout) within the same bound; in bf16 on two replicas, plain DDP's bit for bit (a sum of two is the same
  either way round).
- Memory: each category of a rank's ledger is the ZeRO paper's closed form (Rajbhandari et al. 2020,
  mixed-precision Adam, K = 12) with Psi the rank's share of the model and N = dp, plus simtrain's fp32 master
  gradient, exactly in bytes; `simtrain memory` plans what a run holds.
- Traffic: each rank's reduce-scatter and all-gather each send (N - 1) / N of Psi e per step (the paper's 2 Psi),
  the bytes plain DDP's ring all-reduce sends, on the report's counters and on the links; under stage 3 the
  gather runs before the forward and again before the backward (3 Psi), once with `reshard_after_forward:
  false` (2 Psi); under HSDP each rank's chunk is all-reduced across the replicas besides.
- Checkpoints: every rank's shard saved after some steps and loaded into a new job goes on to the uninterrupted
  run's parameters, bit for bit.
- Representatives (one rank per stage, its reduce-scatter and all-gather timed with their mirrors') against the
  full simulation: the same bytes and peaks, the step time within 1%; so too with Megatron-Core's overlap
  (bucket_overlap.py), each bucket's posted collective timed with its mirrors', and sequence parallelism.
- Bad input: one line naming the key.
"""
import pytest
import torch

from simtrain import plan_memory, run, runner
from simtrain.errors import ScenarioError
from simtrain.hw.cluster import build_cluster, run_to_end
from simtrain.job import Job
from simtrain.scenario import validate_scenario
from simulated_steps import flat_parameters, one_step

GPT = {"name": "zero-mp", "seed": 1, "cluster": {"devices": 1},
       "model": {"name": "gpt", "hidden": 32, "layers": 2, "heads": 4},
       "data": {"name": "tokens", "batch_size": 8, "samples": 256, "seq_len": 8, "vocab": 16},
       # SGD: Adam turns the rounding noise of a gradient that is zero in exact arithmetic into a full step
       "train": {"steps": 6, "optimizer": {"lr": 0.1, "momentum": 0.9}}, "report": {"trace": False}}
ADAM = {"name": "adam", "lr": 1e-3}


def scenario(dp: int = 1, pp: int = 1, tp: int = 1, stage: int = 0, precision: str = "fp32", batch_size: int = 8,
             steps: int | None = None, optimizer: dict | None = None, numerics: bool = True,
             sharding: dict | None = None, **parallel):
    train = {**GPT["train"], "precision": precision, **({"steps": steps} if steps else {}),
             **({"optimizer": optimizer} if optimizer else {})}
    pipeline = {"microbatches": 2} if pp > 1 else {}
    return validate_scenario({**GPT, "numerics": numerics, "cluster": {"devices": dp * pp * tp},
                              "data": {**GPT["data"], "batch_size": batch_size}, "train": train,
                              "parallel": {"dp": dp, "pp": pp, "tp": tp, "pipeline": pipeline,
                                           "sharding": {"stage": stage, **(sharding or {})}, **parallel}})




# ---------------------------------------------------------------- numerics

INTERLEAVED = {"schedule": "interleaved", "virtual_stages": 2, "microbatches": 2}
LAYOUTS = {"zero1-pp-tp": dict(dp=2, pp=2, tp=2, stage=1), "zero2-tp": dict(dp=2, tp=2, stage=2),
           "zero1-pp": dict(dp=4, pp=2, stage=1), "zero2-pp": dict(dp=2, pp=2, stage=2),
           "fsdp-tp": dict(dp=2, tp=2, stage=3),
           "fsdp-tp-pp": dict(dp=2, pp=2, tp=2, stage=3, pipeline=INTERLEAVED,
                              sharding={"reshard_after_forward": False}),
           "hsdp-tp": dict(dp=4, tp=2, stage=3, sharding={"degree": 2})}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_zero_under_pp_and_tp_trains_what_one_device_and_plain_ddp_train(layout):
    dp = layout["dp"]
    sharded = run(scenario(**layout))
    ddp = run(scenario(**{**layout, "stage": 0, "sharding": None}))
    alone = run(scenario(batch_size=dp * GPT["data"]["batch_size"]))
    assert sharded.data["scheme"] == "model_parallel" and sharded.data["sharding"]["stage"] == layout["stage"]
    assert sharded.data["sharding"]["replicate"] == dp // layout.get("sharding", {}).get("degree", dp)
    trained = flat_parameters(sharded.final_model)
    torch.testing.assert_close(trained, flat_parameters(alone.final_model), rtol=0, atol=1e-5)
    torch.testing.assert_close(trained, flat_parameters(ddp.final_model), rtol=0, atol=1e-5)
    assert sharded.data["final_loss"] == pytest.approx(alone.data["final_loss"], abs=1e-5)


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_on_two_replicas_trains_what_plain_ddp_trains_bit_for_bit(stage):
    sharded = run(scenario(dp=2, pp=2, tp=2, stage=stage, precision="bf16", optimizer=ADAM))
    ddp = run(scenario(dp=2, pp=2, tp=2, precision="bf16", optimizer=ADAM))
    assert torch.equal(flat_parameters(sharded.final_model), flat_parameters(ddp.final_model))
    losses = [[loss for *_, loss in report.data["train_loss_curve"]] for report in (sharded, ddp)]
    assert losses[0] == losses[1] and len(losses[0]) >= 1


# ---------------------------------------------------------------- memory

def share(job: Job, rank: int) -> int:
    """Psi of job rank `rank`: the parameters of its share of the model (its pipeline stage, its tp slice)."""
    return sum(p.numel() for p in job.replicas[rank].params)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_per_category_is_the_papers_closed_form_of_the_ranks_share(stage, precision):
    n, e = 2, 2 if precision == "bf16" else 4
    settings = dict(dp=n, pp=2, tp=2, precision=precision, steps=1, optimizer=ADAM)
    sharded, ddp = one_step(scenario(stage=stage, **settings)), one_step(scenario(**settings))
    for rank, device in enumerate(sharded.devices):
        psi = share(ddp, rank)
        assert psi % n == 0 and psi > 0  # no padding: the closed forms exactly
        # stage 3: FSDP2's fp32 shard is the parameter, no 16-bit shard and no master beside it
        held = {"weights": 4 * psi // n if stage == 3 else e * psi,
                "gradients": (e * psi if stage == 1 else 0) + (4 * psi // n if stage >= 2 or e == 2 else 0),
                "optimizer_state": 8 * psi // n, **({"master_weights": 4 * psi // n} if e == 2 and stage < 3 else {})}
        if precision == "bf16":  # (2 + 2 + K) Psi / N terms, K = 12, and simtrain's fp32 master gradient 4 Psi / N
            assert sum(held.values()) == {1: 4 * psi + 12 * psi // n + 4 * psi // n,
                                          2: 2 * psi + 14 * psi // n + 2 * psi // n,
                                          3: 16 * psi // n}[stage]  # FSDP2: 4 + 4 + 8, the paper's total
        peak = device.memory.peak
        assert {category: peak[category] for category in held} == held
        if stage >= 2:  # the whole gradient the microbatches accumulate into, held until its reduce-scatter
            assert peak["comm_buffers"] >= e * psi * (2 if stage == 3 else 1)  # stage 3: and the gathered share
        # activations as plain DDP's: the step's compute is the same
        assert peak["activations"] == ddp.devices[rank].memory.peak["activations"]


@pytest.mark.parametrize("stage, sharding", [(1, {}), (2, {}), (3, {}), (3, {"degree": 2}),
                                             (2, {"overlap_grad_reduce": True, "overlap_param_gather": True,
                                                  "bucket_size": 300, "reduce_dtype": "fp32"})],
                         ids=["zero1", "zero2", "fsdp", "hsdp", "zero2-overlapped-buckets"])
def test_the_memory_plan_is_what_a_run_holds(stage, sharding):
    dp = 4 if "degree" in sharding else 2
    scenario_ = scenario(dp=dp, pp=2, tp=2 if dp == 2 else 1, stage=stage, precision="bf16", steps=2,
                         optimizer=ADAM, sharding=sharding)
    report = run(scenario_)
    for device, plan in zip(report.data["devices"], plan_memory(scenario_)):
        assert plan.by_category == device["peak_memory_bytes_by_category"]
        assert plan.peak_bytes == device["peak_memory_bytes"]


# ---------------------------------------------------------------- traffic

@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("stage", [1, 2])
def test_bytes_per_step_are_the_papers_volumes_and_plain_ddps(stage, precision):
    n, steps, e = 2, 2, 2 if precision == "bf16" else 4
    settings = dict(dp=n, pp=2, tp=2, precision=precision, steps=steps)
    sharded, ddp = run(scenario(stage=stage, **settings)), run(scenario(**settings))
    shares = one_step(scenario(**{**settings, "steps": 1}))
    per_pass = sum((n - 1) * share(shares, rank) * e // n for rank in range(shares.world))  # every rank's
    moved = sharded.data["sharding"]["bytes_by_kind"]
    assert moved == {"all_gather": per_pass * steps, "reduce_scatter": per_pass * steps, "all_reduce": 0}
    # the paper's 2 Psi per rank per step: what plain DDP's ring all-reduce sends, on the same links
    assert ddp.data["parallel"]["bytes_by_kind"]["dp_allreduce"] == 2 * per_pass * steps
    assert sharded.data["parallel"]["bytes_by_kind"]["dp_allreduce"] == 0
    assert (sum(link["bytes"] for link in sharded.data["links"])
            == sum(link["bytes"] for link in ddp.data["links"]))


def test_fsdp_under_tp_moves_3_psi_kept_parameters_2_psi_and_hsdp_all_reduces_each_chunk():
    """Stage 3 on dp x tp, one microbatch: the share gathered before the forward and again before the backward,
    its gradient reduce-scattered: (N - 1) / N of Psi e three times per rank per step; with the parameters kept
    from forward to backward, twice. HSDP (N = 2 of dp 4): a ring all-reduce of each rank's reduced chunk
    Psi e / N across the R = 2 replicas sends 2 (R - 1) / R of it."""
    steps, e = 2, 4
    shares = one_step(scenario(dp=2, tp=2, steps=1))
    psi = [share(shares, rank) for rank in range(shares.world)]
    per_pass = sum(p * e // 2 for p in psi)  # every rank's (N - 1) / N of Psi e, N = 2
    for reshard, gathers in ((True, 2), (False, 1)):
        moved = run(scenario(dp=2, tp=2, stage=3, steps=steps, sharding={"reshard_after_forward": reshard}))
        assert moved.data["sharding"]["bytes_by_kind"] == {
            "all_gather": gathers * per_pass * steps, "reduce_scatter": per_pass * steps, "all_reduce": 0}
    # kept parameters: on the links, the bytes of plain DDP's ring all-reduce (2 Psi)
    ddp = run(scenario(dp=2, tp=2, steps=steps))
    assert sum(link["bytes"] for link in moved.data["links"]) == sum(link["bytes"] for link in ddp.data["links"])
    hsdp = run(scenario(dp=4, tp=2, stage=3, steps=steps, sharding={"degree": 2}))
    per_pass = sum(p * e // 2 for p in psi) * 2  # twice the replicas
    assert hsdp.data["sharding"]["bytes_by_kind"] == {
        "all_gather": 2 * per_pass * steps, "reduce_scatter": per_pass * steps, "all_reduce": per_pass * steps}


# ---------------------------------------------------------------- checkpoints

@pytest.mark.parametrize("stage", [1, 3])
def test_a_restart_from_every_ranks_shard_goes_on_bit_for_bit(stage):
    """Each rank's training state is its shard (fp32 master chunk, Adam's moments of it): saved after 2 steps,
    loaded into a new job of 2 steps, it trains the uninterrupted 4-step run's parameters bit for bit."""
    settings = dict(dp=2, pp=2, tp=2, stage=stage, precision="bf16", optimizer=ADAM)
    whole = run(scenario(steps=4, **settings))
    first = one_step(scenario(steps=2, **settings))
    saved = [(replica.training_state(), replica.loader.position()) for replica in first.replicas]
    assert [state.layout[0] for state, _ in saved] == [("master", torch.float32, (share(first, rank) // 2,))
                                                       for rank in range(first.world)]
    cluster = build_cluster(scenario(steps=2, **settings).cluster, record=True, seed=GPT["seed"])
    second = Job(scenario(steps=2, **settings), cluster, range(cluster.size))
    for replica, (state, position) in zip(second.replicas, saved):
        replica.load_training_state(state, state.flat.clone())
        replica.loader.seek(position)
    second.start()
    run_to_end(cluster.env)
    second.finish()
    assert torch.equal(flat_parameters(second.scheme.trained_model()), flat_parameters(whole.final_model))


# ---------------------------------------------------------------- representatives

def at_scale(representatives: bool, stage: int, overlap: bool = False) -> dict:
    return validate_scenario({
        "name": "zero-representatives", "seed": 2, "numerics": False,
        "cluster": {"topology": "fat_tree", "devices": 16, "gpus_per_node": 4, "nodes_per_leaf": 2,
                    "device": "h100-80gb", "link": {"bandwidth": "450 GB/s", "latency": "0.25 us"},
                    "inter_node_link": {"bandwidth": "50 GB/s", "latency": "1.35 us"}},
        "model": {"name": "gpt", "hidden": 64, "layers": 4, "heads": 4},
        "data": {"name": "tokens", "batch_size": 4, "samples": 64, "seq_len": 16, "vocab": 64},
        "train": {"steps": 2, "precision": "bf16", "optimizer": ADAM},
        "parallel": {"tp": 4, "pp": 2, "dp": 2, "pipeline": {"schedule": "1f1b", "microbatches": 4},
                     "sharding": {"stage": stage, "overlap_grad_reduce": overlap, "overlap_param_gather": overlap},
                     # as Megatron-Core's H100 runs: with the overlap, sequence parallelism (microbatches of one
                     # sequence, fewer than tp: the mirrored rings cut the flat buffer)
                     "sequence_parallel": overlap, "representatives": representatives},
        "report": {"trace": False},
    })


@pytest.mark.parametrize("stage, overlap", [(1, False), (2, False), (3, False), (1, True)])
def test_representatives_give_the_full_simulations_figures(stage, overlap):
    full, represented = run(at_scale(False, stage, overlap)).data, run(at_scale(True, stage, overlap)).data
    assert represented["parallel"]["representatives"]
    assert represented["sharding"]["bytes_by_kind"] == full["sharding"]["bytes_by_kind"]
    assert represented["parallel"]["bytes_by_kind"] == full["parallel"]["bytes_by_kind"]
    # each category at the device's peak: with the overlap, the buckets the end of the backward completes are
    # posted once its activations are let go, so that whether a ring step's staged receive lands beside them does
    # not hang on which of two ring partners posts first at the same instant
    assert ([device["peak_memory_bytes_by_category"] for device in represented["devices"]]
            == [device["peak_memory_bytes_by_category"] for device in full["devices"]])
    # with the overlap (sequence parallelism's rings timed on the flat buffer) no contention is left out here
    assert represented["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-9 if overlap else 0.01)


@pytest.mark.parametrize("stage", [1, 3])
def test_the_memory_plan_under_representatives_is_the_full_simulations(stage):
    """A mirrored rank holds what its representative holds (the run's report says so too), not nothing."""
    full, represented = plan_memory(at_scale(False, stage)), plan_memory(at_scale(True, stage))
    assert [(device.peak_bytes, device.by_category) for device in represented] == [
        (device.peak_bytes, device.by_category) for device in full]


@pytest.mark.parametrize("layout", [dict(dp=2, stage=3), dict(dp=2, pp=2, stage=1), dict(dp=2, pp=2, stage=3)],
                         ids=["fsdp", "zero1-pp", "fsdp-pp"])
def test_a_sharded_run_out_of_memory_reports_the_model_its_shards_hold(layout, monkeypatch):
    """Out of memory in the first step, before any update: the trained model is the initial one, put together
    from the fp32 master shards as the end of the run would have (the same loss as plain DDP's stopped run). The
    layouts that would fit are not searched for (tests/test_layout_search.py checks them)."""
    monkeypatch.setattr(runner, "layouts_that_fit", lambda scenario: [])

    def stopped(**layout):
        raw = scenario(precision="bf16", **layout).model_dump(mode="json")
        raw["cluster"]["device"] = {"base": "a100-40gb", "memory": "200 KiB"}
        return run(validate_scenario(raw)).data

    sharded, plain = stopped(**layout), stopped(dp=layout["dp"] * layout.get("pp", 1))
    assert (sharded["status"], sharded["steps"]) == (plain["status"], plain["steps"]) == ("out_of_memory", 0)
    assert sharded["final_loss"] == plain["final_loss"]


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("parallel, message", [
    ({"tp": 2, "dp": 4, "sharding": {"stage": 3, "degree": 3}}, "parallel.sharding.degree: 3 does not divide "
                                                                "parallel.dp 4"),
    ({"tp": 2, "dp": 2, "sharding": {"stage": 1, "degree": 0}}, "parallel.sharding.degree"),
])
def test_bad_input_is_one_line_naming_the_key(parallel, message):
    with pytest.raises(ScenarioError, match=message):
        validate_scenario({**GPT, "cluster": {"devices": 2 * parallel["dp"]}, "parallel": parallel})


@pytest.mark.parametrize("parallel, message", [
    ({"tp": 2, "sharding": {"stage": 1, "degree": 3}}, "parallel.sharding.degree: 3 does not divide the 4"),
    ({"tp": 2, "pp": 2, "numerics": False, "representatives": True, "sharding": {"stage": 3, "degree": 2}},
     "parallel.representatives: .* HSDP"),
])
def test_what_the_job_cannot_run_is_refused_when_it_is_built(parallel, message):
    numerics = parallel.pop("numerics", True)
    with pytest.raises(ScenarioError, match=message):
        run(validate_scenario({**GPT, "numerics": numerics, "cluster": {"devices": 8 * parallel.get("pp", 1)},
                               "parallel": parallel}))
