"""Representatives (strategies/representatives.py) and full recomputation against the full simulation.

- With one replica, simulating one rank per stage gives the full simulation's
  step time, breakdown, memory peaks and bytes (relative 1e-9): the tp ranks
  of a stage run in lockstep, and a collective timed with its mirrors on an
  idle network is the one the full simulation runs.
  Also with parallel.tp_comm_overlap (its ring steps and pipelined splits).
- With several replicas the dp all-reduce meets pipeline sends on the NICs
  in the full simulation and not in the representatives': within 1%.
- Full activation recomputation (train.checkpointing: full) under tp: the
  same parameters as without it; one more forward per chunk (FLOPs by the
  closed form); fewer activation bytes held, only the chunks' inputs between forward and backward.
- A tp all-reduce of an activation is cut flat: every ring link carries the same bytes.
- Experts (ep with the distributed optimizer, numerics off): within 1%, the same exchanges and peaks.
  Under data parallelism alone too (ep 4 of dp 8): one rank for all, the all-to-all time within 1%.
- Data parallelism alone (DDP): one rank for all, the full simulation's figures (relative 1e-9).
- Where representatives do not apply: one-line errors.
"""
import pytest
import torch

import simtrain
from simtrain import memory_plan
from simtrain.scenario import validate_scenario
from simulated_steps import one_step

GPT = {"name": "gpt", "hidden": 64, "layers": 6, "heads": 4}


def scenario(devices: int, gpus_per_node: int, numerics: bool = False, checkpointing: str = "none", model=GPT,
             **parallel):
    pipeline = parallel.pop("pipeline", {"schedule": "interleaved", "microbatches": 4, "virtual_stages": 2})
    return validate_scenario({
        "name": "representatives", "seed": 2, "numerics": numerics,
        "cluster": {"topology": "fat_tree", "devices": devices, "gpus_per_node": gpus_per_node, "nodes_per_leaf": 2,
                    "device": "a100-80gb", "link": {"bandwidth": "240 GB/s", "latency": "0.25 us"},
                    "inter_node_link": {"bandwidth": "24 GB/s", "latency": "1.35 us"}},
        "model": model,
        "data": {"name": "tokens", "batch_size": 4, "samples": 64, "seq_len": 16, "vocab": 64},
        "train": {"steps": 2, "precision": "bf16", "checkpointing": checkpointing,
                  "optimizer": {"name": "adam", "lr": 1e-3}},
        "parallel": {"all_reduce": "ring", "pipeline": pipeline, **parallel},
        "report": {"trace": False},
    })


def compared(data: dict) -> dict:
    return {"step_time_s": data["step_time_s"], "breakdown_s": data["breakdown_s"],
            "peaks": [device["peak_memory_bytes"] for device in data["devices"]],
            "bytes": data["parallel"]["bytes_by_kind"], "bubble": data["parallel"]["bubble_fraction"]}


def assert_close(a, b, rel: float):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_close(a[key], b[key], rel)
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_close(x, y, rel)
    else:
        assert a == pytest.approx(b, rel=rel, abs=1e-15)


@pytest.mark.parametrize("devices, layout", [(8, dict(tp=4, pp=2)), (4, dict(tp=4, pp=1, pipeline={})),
                                             (8, dict(tp=4, pp=2, sequence_parallel=True, tp_comm_overlap=True))])
def test_one_replica_with_a_node_per_stage_equals_the_full_simulation(devices, layout):
    full = simtrain.run(scenario(devices, 4, checkpointing="full", **layout)).data
    represented = simtrain.run(scenario(devices, 4, checkpointing="full", representatives=True, **layout)).data
    assert represented["parallel"]["representatives"] and not full["parallel"]["representatives"]
    assert_close(compared(represented), compared(full), rel=1e-9)


def test_stages_sharing_a_node_come_within_one_percent():
    """Two stages per node: a pipeline send crosses the NVSwitch port a tp all-reduce uses, in the full
    simulation only."""
    full = simtrain.run(scenario(8, 4, tp=2, pp=4)).data
    represented = simtrain.run(scenario(8, 4, tp=2, pp=4, representatives=True)).data
    assert_close(compared(represented)["peaks"], compared(full)["peaks"], rel=1e-9)
    assert represented["parallel"]["bytes_by_kind"] == full["parallel"]["bytes_by_kind"]
    assert represented["step_time_s"] == pytest.approx(full["step_time_s"], rel=0.01)


def test_replicas_come_within_one_percent_of_the_full_simulation():
    full = simtrain.run(scenario(16, 4, tp=2, pp=2, dp=4)).data
    represented = simtrain.run(scenario(16, 4, tp=2, pp=2, dp=4, representatives=True)).data
    assert represented["parallel"]["bytes_by_kind"] == full["parallel"]["bytes_by_kind"]
    assert [d["peak_memory_bytes"] for d in represented["devices"]] == [d["peak_memory_bytes"] for d in full["devices"]]
    assert represented["step_time_s"] == pytest.approx(full["step_time_s"], rel=0.01)


def test_buckets_reduced_on_the_stream_beside_the_backward_come_within_one_percent():
    """ZeRO-1 with overlap_grad_reduce over dp 4 x pp 2 x tp 2: each bucket's reduce-scatter, posted on the
    rank's stream of its dp group, runs beside the rest of the backward under representatives as in the full
    simulation (it held the compute after it back once: a mirrored collective ran on the device's compute
    stream), one after another (no two of a rank's overlap)."""
    layout = dict(tp=2, pp=2, dp=4, sharding={"stage": 1, "overlap_grad_reduce": True, "bucket_size": 20000},
                  pipeline={"microbatches": 4})
    full, represented = (simtrain.run(scenario(16, 4, representatives=flag, **dict(layout))).data
                         for flag in (False, True))
    assert represented["parallel"]["bytes_by_kind"] == full["parallel"]["bytes_by_kind"]
    assert represented["step_time_s"] == pytest.approx(full["step_time_s"], rel=0.01)
    assert represented["breakdown_s"]["compute"] == pytest.approx(full["breakdown_s"]["compute"], rel=1e-9)
    job = one_step(scenario(16, 4, **dict(layout)))
    spans = sorted((s.start, s.end) for s in job.cluster.log.spans
                   if s.rank == 0 and s.kind == "communication" and s.name == "reduce_scatter")
    assert len(spans) > 2 and all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


@pytest.mark.parametrize("ep", [1, 2])
def test_experts_with_representatives_come_within_one_percent_with_the_same_exchanges(ep):
    """An MoE gpt (4 experts, top 2, balanced routing) over dp 4 x pp 2 x tp 2 with ep 2 (or 1) and ZeRO-1, 16 devices on
    4-GPU nodes: each MoE layer's exchanges are timed with every ep group of its stage on an idle network, the
    experts' reduce-scatters with every experts' data-parallel group of it. Step time within 1% of the full
    simulation's, the same all-to-all bytes and memory peaks."""
    moe = {**GPT, "moe": {"experts": 4, "top_k": 2}}
    layout = dict(tp=2, pp=2, ep=ep, sequence_parallel=True, sharding={"stage": 1}, pipeline={"microbatches": 4})
    full, represented = (simtrain.run(scenario(16, 4, model=moe, representatives=flag, **dict(layout))).data
                         for flag in (False, True))
    moved = full["moe"]["all_to_all_bytes"]
    assert represented["moe"]["all_to_all_bytes"] == moved and (moved[0] > 0) == (ep > 1)  # ep 1: experts local
    assert_close(compared(represented)["peaks"], compared(full)["peaks"], rel=1e-9)
    assert represented["step_time_s"] == pytest.approx(full["step_time_s"], rel=0.01)


def test_experts_under_data_parallelism_alone_come_within_one_percent_with_the_same_exchanges():
    """The same MoE gpt with ep 4 and data parallelism alone (dp 8 on two 4-GPU nodes, one micro-batch): one rank
    runs for all, each MoE layer's exchanges timed with every ep group's, the replicated gradient's all-reduce
    with the experts' over their holders. The same all-to-all bytes and memory peaks as the full simulation, step
    time and all-to-all time within 1%."""
    moe = {**GPT, "moe": {"experts": 4, "top_k": 2}}
    full, represented = (simtrain.run(scenario(8, 4, model=moe, representatives=flag, ep=4,
                                               pipeline={"microbatches": 1})).data for flag in (False, True))
    assert represented["scheme"] == full["scheme"] == "expert_parallel"
    moved = full["moe"]["all_to_all_bytes"]
    assert represented["moe"]["all_to_all_bytes"] == moved and moved[0] > 0
    assert_close(compared(represented)["peaks"], compared(full)["peaks"], rel=1e-9)
    assert represented["step_time_s"] == pytest.approx(full["step_time_s"], rel=0.01)
    assert_close(represented["moe"]["all_to_all_time_s"], full["moe"]["all_to_all_time_s"], rel=0.01)


def test_full_recomputation_trains_the_same_and_runs_one_more_forward():
    plain = simtrain.run(scenario(8, 4, numerics=True, tp=2, pp=2, dp=2))
    recomputed = simtrain.run(scenario(8, 4, numerics=True, checkpointing="full", tp=2, pp=2, dp=2))
    for a, b in zip(plain.final_model.state_dict().values(), recomputed.final_model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # compute: forward F and backward 2F per chunk without recomputation (flop_counter's definitions);
    # with it the forward runs twice: (F + F + 2F) / (F + 2F) = 4/3 on every rank
    for before, after in zip(plain.data["devices"], recomputed.data["devices"]):
        assert after["breakdown_s"]["compute"] == pytest.approx(before["breakdown_s"]["compute"] * 4 / 3, rel=1e-9)
        held = after["peak_memory_bytes_by_category"]["activations"]
        assert held < before["peak_memory_bytes_by_category"]["activations"]


def test_data_parallelism_alone_is_one_rank_for_all():
    """DDP over two nodes: one rank runs, its buckets' all-reduces timed with their mirrors, as the full
    simulation's 8 ranks."""
    full = simtrain.run(scenario(8, 4, tp=1, pp=1, pipeline={})).data
    represented = simtrain.run(scenario(8, 4, tp=1, pp=1, pipeline={}, representatives=True)).data
    assert_close(compared(represented), compared(full), rel=1e-9)


def test_a_tp_all_reduce_of_an_activation_loads_every_ring_link_alike():
    data = simtrain.run(scenario(4, 4, tp=4, pp=1, pipeline={})).data
    ring_links = [link for link in data["links"] if link["bytes"] and "switch" in (link["src"] + link["dst"])]
    into_switch = sorted({link["bytes"] for link in ring_links if link["dst"].endswith("switch")})
    assert len(ring_links) == 8 and len(into_switch) == 1


@pytest.mark.parametrize("change, message", [
    ({"numerics": True}, "parallel.representatives: needs numerics false"),
    ({"parallel": {"representatives": True, "tp": 1, "pp": 1, "pipeline": {}, "sharding": {"stage": 3}}},
     "parallel.representatives: with sharding under data parallelism alone is not built"),
    ({"cluster": {"compute_jitter": 0.1}}, "parallel.representatives: needs identical devices"),
    ({"cluster": {"compute_jitter_fixed": "1 ms"}}, "parallel.representatives: needs identical devices"),
    ({"parallel": {"representatives": True, "tp": 1, "pp": 1, "pipeline": {}},
      "train": {"optimizer": {"name": "kfac", "lr": 0.1}}}, "parallel.representatives: not built with K-FAC"),
])
def test_where_representatives_do_not_apply(change, message):
    raw = scenario(8, 4, tp=4, pp=2, representatives=True).model_dump(mode="json", by_alias=True)
    for section, values in change.items():
        if isinstance(values, dict):
            raw[section] = {**raw[section], **values}
        else:
            raw[section] = values
    with pytest.raises(Exception) as info:
        validate_scenario(raw)
    assert message in str(info.value) and "\n" not in str(info.value).strip()


@pytest.mark.parametrize("layout", [dict(tp=2, pp=2, dp=4), dict(tp=2, pp=2, dp=4, sharding={"stage": 1}),
                                    dict(dp=16, pipeline={})],
                         ids=["tp-pp-dp", "zero1-tp-pp-dp", "ddp"])
def test_the_memory_plan_replays_representatives_and_gives_the_full_runs_peaks(layout):
    """plan_memory replays one rank per stage where the scenario allows representatives (memory_plan._mirrored):
    every rank's peak and its split are the full simulation's (a one-step run without representatives)."""
    two_steps = scenario(16, 4, **layout)
    full_scenario = two_steps.model_copy(update={"train": two_steps.train.model_copy(update={"steps": 1})})
    assert memory_plan._mirrored(full_scenario).parallel.representatives
    full = simtrain.run(full_scenario).data["devices"]
    plans = simtrain.plan_memory(full_scenario)
    assert [plan.peak_bytes for plan in plans] == [device["peak_memory_bytes"] for device in full]
    assert [plan.by_category for plan in plans] == [device["peak_memory_bytes_by_category"] for device in full]
