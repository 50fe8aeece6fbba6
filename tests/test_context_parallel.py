"""Context parallelism (parallel.cp, ring attention) against its references.

- Ring attention's numerics: each rank's queries against every rank's key/value block, merged by
  log-sum-exp over the load-balanced chunks, equal causal attention on the whole sequence
  (single-process torch, train/gpt.py's attention_core).
- Equivalence: cp = 2 and 4 alone, and with tp (and sequence parallelism), pp, dp and full
  recomputation, gpt and llama, train the same parameters as one device on the same global batch
  (single-process torch through simtrain's one-device run), within 1e-5 (fp32).
- The distributed optimizer (sharding stages 1, 2) shards over the dp-cp group, as Megatron-Core's does:
  one device's parameters, and the ring reduce-scatter's and all-gather's closed-form bytes.
- Bytes: per layer and microbatch each rank sends its key/value block cp - 1 times forward and
  the blocks' gradients cp - 1 times backward: 2 x (cp - 1) x 2·b·(s/cp)·h_kv x bytes (closed form).
- Time: with links that cost nothing the step is the compute alone; the ring's forward steps run
  beside the attention's compute.
- Representatives (one rank per stage standing for its tp and cp groups and replicas) give the full
  simulation's bytes and step time.
- The memory plan (`simtrain memory`) holds what a run holds.
- The 4D layout: cp ranks adjacent after tp by default; with cp = 1 the 3D ranks are unchanged.
- Bad input: a sequence that 2·cp does not divide or a model without attention:
  one line naming the field, exit 2.
"""
import functools

import pytest
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from simtrain import plan_memory, run
from simtrain.cli import main
from simtrain.parallel import Layout
from simtrain.scenario import validate_scenario
from simtrain.train.fused_attention import flash_attention
from simtrain.train.gpt import attention_core
from simtrain.train.ring_attention import ContextShard, attend, block_of, merge, shard_sequence
from simulated_steps import bytes_by_label, flat_parameters, one_step

GPT = {"name": "gpt", "seed": 1, "cluster": {"devices": 1}, "model": {"name": "gpt", "hidden": 32, "layers": 2,
                                                                       "heads": 4},
       "data": {"name": "tokens", "batch_size": 8, "samples": 256, "seq_len": 16, "vocab": 16},
       # SGD: see tests/test_model_parallel.py (Adam magnifies the rounding noise of a zero gradient)
       "train": {"steps": 6, "optimizer": {"lr": 0.1, "momentum": 0.9}}, "report": {"trace": False, "every": 6}}
LLAMA = {**GPT, "name": "llama", "model": {"name": "llama", "hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2,
                                           "ffn_hidden": 48}}


GPT_FUSED = {**GPT, "name": "gpt-fused", "model": {**GPT["model"], "attention": "fused"}}
LLAMA_FUSED = {**LLAMA, "name": "llama-fused", "model": {**LLAMA["model"], "attention": "fused"}}


def scenario(base: dict = GPT, checkpointing: str = "none", batch: int | None = None, devices=None, **parallel):
    if devices is None:
        devices = 1
        for degree in ("dp", "pp", "tp", "cp"):
            devices *= parallel.get(degree, 1)
    if "microbatches" in parallel:
        parallel["pipeline"] = {"microbatches": parallel.pop("microbatches")}
    data = {**base["data"], **({"batch_size": batch} if batch else {})}
    return validate_scenario({**base, "cluster": {**base["cluster"], "devices": devices}, "data": data,
                              "train": {**base["train"], "checkpointing": checkpointing}, "parallel": parallel})



ids = lambda layout: "-".join(f"{k}{v}" for k, v in layout.items())  # noqa: E731


@pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_is_causal_attention_on_the_whole_sequence(cp, fused):
    """Eager or as FlashAttention kernels (model.attention: fused): the ring's blocks merged are the whole
    sequence's causal attention, and the fused blocks' FLOPs add up to one causal kernel's on the whole."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 8) for _ in range(3))
    whole = attention_core(q, k, v)
    blocks = [block_of(*(shard_sequence(t, ContextShard(r, cp), dim=2) for t in (k, v))) for r in range(cp)]
    with FlopCounterMode(display=False) as ring_flops:
        for rank in range(cp):
            queries = shard_sequence(q, ContextShard(rank, cp), dim=2)
            out, lse, _ = attend(queries, blocks[rank], rank, rank, fused)
            for step in range(1, cp):  # the blocks in the order the ring brings them
                origin = (rank - step) % cp
                out, lse = merge(out, lse, attend(queries, blocks[origin], rank, origin, fused))
            torch.testing.assert_close(out, shard_sequence(whole, ContextShard(rank, cp), dim=2), rtol=0,
                                       atol=1e-6)
    if fused:
        with FlopCounterMode(display=False) as one_kernel:
            flash_attention(q, k, v)
        assert ring_flops.get_total_flops() == one_kernel.get_total_flops()


@pytest.mark.parametrize("base,checkpointing,layout", [
    (GPT, "none", {"cp": 2}), (GPT, "none", {"cp": 4}), (GPT, "none", {"cp": 2, "tp": 2}),
    (GPT, "none", {"cp": 2, "tp": 2, "sequence_parallel": True}), (GPT, "none", {"cp": 2, "pp": 2}),
    (GPT, "none", {"dp": 2, "pp": 2, "cp": 2, "tp": 2, "microbatches": 2}),
    (GPT, "full", {"cp": 2, "tp": 2}), (GPT, "selective", {"cp": 2, "tp": 2}),
    (LLAMA, "none", {"cp": 4}), (LLAMA, "selective", {"pp": 2, "cp": 2, "microbatches": 2}),
    (LLAMA, "none", {"dp": 2, "cp": 2, "tp": 2}),
    (LLAMA, "none", {"pp": 2, "cp": 2, "tp": 2, "sequence_parallel": True, "microbatches": 2}),
    (GPT_FUSED, "none", {"cp": 2, "tp": 2}), (LLAMA_FUSED, "none", {"cp": 4}),
], ids=lambda value: value["name"] if isinstance(value, dict) and "seed" in value
    else value if isinstance(value, str) else ids(value))
def test_context_parallelism_trains_what_one_device_trains(base, checkpointing, layout):
    layout = dict(layout)
    split = run(scenario(base, checkpointing, **layout))
    alone = run(scenario(base, batch=base["data"]["batch_size"] * layout.get("dp", 1)))
    assert split.data["status"] == "ok"
    assert split.data["parallel"]["cp"] == layout["cp"]
    torch.testing.assert_close(flat_parameters(split.final_models[0]), flat_parameters(alone.final_models[0]),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("base,stage,layout", [
    (GPT, 1, {"dp": 2, "cp": 2}), (LLAMA, 2, {"cp": 2, "tp": 2, "pp": 2, "microbatches": 2}),
], ids=lambda value: value["name"] if isinstance(value, dict) and "seed" in value
    else f"stage{value}" if isinstance(value, int) else ids(value))
def test_the_distributed_optimizer_shards_over_dp_x_cp_and_trains_what_one_device_trains(base, stage, layout):
    """Megatron-Core's distributed optimizer shards the gradient and the optimizer state over the dp-cp group
    (its DistributedDataParallel reduce-scatters over get_data_parallel_group(with_context_parallel=True)): each
    rank of N = dp x cp sends (N - 1)/N of its share's padded gradient in the reduce-scatter, as much of the
    parameters in the all-gather (the ring's closed form), and the model is one device's."""
    base = {**base, "train": {**base["train"], "steps": 2}}
    split = run(scenario(base, sharding={"stage": stage}, **dict(layout)))
    alone = run(scenario(base, batch=base["data"]["batch_size"] * layout.get("dp", 1)))
    torch.testing.assert_close(flat_parameters(split.final_models[0]), flat_parameters(alone.final_models[0]),
                               rtol=0, atol=1e-5)
    sharding, n = split.data["sharding"], layout.get("dp", 1) * layout["cp"]
    assert sharding["degree"] == n and sharding["stage"] == stage
    shares = one_step(scenario({**base, "train": {**base["train"], "steps": 1}}, sharding={"stage": stage},
                               **dict(layout)))
    padded = [shares.replicas[rank].layout.padded_numel for rank in range(shares.world)]
    per_step = sum((n - 1) * elements // n * 4 for elements in padded)  # fp32
    assert sharding["bytes_by_kind"] == {"reduce_scatter": 2 * per_step, "all_gather": 2 * per_step,
                                         "all_reduce": 0}


# ---------------------------------------------------------------- bytes and time

@pytest.mark.parametrize("base,cp,tp", [(GPT, 2, 1), (GPT, 4, 1), (GPT, 2, 2), (LLAMA, 4, 1), (LLAMA, 2, 2)])
def test_the_ring_moves_each_block_cp_minus_1_times_each_way(base, cp, tp):
    microbatches = 2
    spec = scenario({**base, "train": {**base["train"], "steps": 1}}, cp=cp, tp=tp, microbatches=microbatches)
    moved = bytes_by_label(one_step(spec))
    model, data = base["model"], base["data"]
    width = model["hidden"] // model["heads"] * model.get("kv_heads", model["heads"])  # keys' (and values') width
    block = 2 * (data["batch_size"] // microbatches) * (data["seq_len"] // cp) * width // tp * 4  # K and V, fp32
    per_rank = (cp - 1) * block * model["layers"] * microbatches
    assert moved["cp_kv"] == moved["cp_kv_grad"] == cp * tp * per_rank


def test_with_free_links_the_step_is_the_compute():
    free = {"bandwidth": 1e18, "latency": 0}
    spec = scenario({**GPT, "numerics": False, "train": {**GPT["train"], "steps": 1},
                     "cluster": {"devices": 1, "link": free}}, cp=4)
    data = run(spec).data
    breakdown = data["breakdown_s"]
    assert data["parallel"]["bytes_by_kind"]["cp_ring"] > 0
    assert breakdown["communication"] < 1e-6 * data["step_time_s"]
    assert data["step_time_s"] == pytest.approx(breakdown["compute"] + breakdown["optimizer"], rel=1e-6)


@pytest.mark.parametrize("numerics", [False, True])
def test_the_ring_runs_beside_the_attention_both_ways(numerics):
    """With links slow enough that each ring step outlasts the compute beside it (closed form: K and V of 8 x 8
    tokens x 32 features in fp32 over the link, T = bytes / bandwidth), each forward step is posted when the
    projection has made the block and ends T later, the own block's attention computed meanwhile; each
    backward step is posted when the ring step's backward has made the block's gradient and ends T later, the
    own block's attention differentiated meanwhile. The step is its compute plus, per ring step, T less the
    compute beside it. Numerics on and off give the same times."""
    rate, bandwidth = 1e9, 2e6
    device = {"base": "a100-40gb", "efficiency": 1.0, "peak_flops": {"fp32": rate, "tf32": rate}}
    spec = scenario({**GPT, "numerics": numerics, "train": {**GPT["train"], "steps": 1},
                     "cluster": {"devices": 1, "device": device, "link": {"bandwidth": bandwidth, "latency": 0}}},
                    cp=2)
    spans = [span for span in one_step(spec).cluster.log.spans if span.rank == 0]
    transfer_s = 2 * 8 * 8 * 32 * 4 / bandwidth
    ring = [i for i, span in enumerate(spans) if span.name in ("cp_kv", "cp_kv_grad")]
    assert [spans[i].name for i in ring] == ["cp_kv"] * 2 + ["cp_kv_grad"] * 2  # 2 layers, each way
    exposed = 0.0
    for i in ring:
        made, beside, waited = spans[i - 2], spans[i - 1], spans[i]
        assert made.kind == beside.kind == "compute" and beside.name == made.name
        assert beside.start == made.end and waited.start == beside.end
        assert waited.end == pytest.approx(made.end + transfer_s, rel=1e-12)
        exposed += transfer_s - (beside.end - beside.start)
    compute = sum(span.end - span.start for span in spans if span.kind == "compute")
    others = sum(span.end - span.start for span in spans if span.kind != "compute" and span.name not in
                 ("cp_kv", "cp_kv_grad"))
    assert max(span.end for span in spans) == pytest.approx(compute + exposed + others, rel=1e-12)
    if numerics:
        off = [span for span in one_step(spec.model_copy(update={"numerics": False})).cluster.log.spans
               if span.rank == 0]
        assert [(span.name, span.start, span.end) for span in off] == \
            [(span.name, span.start, span.end) for span in spans]


@functools.cache
def layer_bytes(checkpointing: str, seq_len: int, cp: int = 2) -> int:
    """Activation bytes one more gpt layer holds on a cp rank (numerics off, bf16): the peak with 3 layers less
    that with 2."""
    def peak(layers: int) -> int:
        spec = scenario({**GPT, "numerics": False, "model": {**GPT["model"], "layers": layers},
                         "data": {**GPT["data"], "seq_len": seq_len, "batch_size": 2},
                         "train": {**GPT["train"], "steps": 1, "precision": "bf16"}}, checkpointing, cp=cp)
        return plan_memory(spec)[0].by_category.get("activations", 0)
    return peak(3) - peak(2)


def test_selective_recomputation_keeps_no_ring_steps_scores():
    """Selective recomputation under cp recomputes each ring step's attention in its backward: what a layer
    keeps is then linear in the sequence (doubling it doubles the bytes exactly); without it each step's
    (s/cp)-square scores make it grow faster."""
    assert layer_bytes("selective", 64) * 2 == layer_bytes("selective", 128)
    assert layer_bytes("none", 64) * 2 < layer_bytes("none", 128)
    assert layer_bytes("selective", 128) < layer_bytes("none", 128)


def at_scale(representatives: bool) -> dict:
    return validate_scenario({
        "name": "cp-representatives", "seed": 2, "numerics": False,
        "cluster": {"topology": "fat_tree", "devices": 8, "gpus_per_node": 2, "nodes_per_leaf": 2,
                    "device": "h100-80gb", "link": {"bandwidth": "450 GB/s", "latency": "0.25 us"},
                    "inter_node_link": {"bandwidth": "50 GB/s", "latency": "1.35 us"}},
        "model": {"name": "llama", "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn_hidden": 128},
        "data": {"name": "tokens", "batch_size": 4, "samples": 64, "seq_len": 64, "vocab": 64},
        "train": {"steps": 1, "precision": "bf16", "checkpointing": "selective"},
        "parallel": {"tp": 2, "cp": 2, "pp": 2, "sequence_parallel": True,
                     "pipeline": {"schedule": "1f1b", "microbatches": 2},
                     "sharding": {"stage": 1}, "representatives": representatives},
        "report": {"trace": False}})


def test_representatives_give_the_full_simulations_figures():
    """One rank per stage (tp 0, cp 0, replica 0) stands for its cp group too (sequence parallelism on: its
    all-gathers and reduce-scatters timed mirrored like the all-reduces): with the load-balanced chunks
    every cp rank computes as much, and its ring steps are timed with every mirrored cp group's at once. The
    bytes are the full simulation's and the step within 1%; the memory of the other cp ranks within 2% (their
    ring steps keep the other half: a received block's first chunk rather than the queries' second)."""
    full, represented = run(at_scale(False)).data, run(at_scale(True)).data
    assert represented["parallel"]["representatives"]
    assert represented["parallel"]["bytes_by_kind"] == full["parallel"]["bytes_by_kind"]
    assert represented["sharding"]["bytes_by_kind"] == full["sharding"]["bytes_by_kind"]
    assert represented["step_time_s"] == pytest.approx(full["step_time_s"], rel=0.01)
    for alone, mirrored in zip(full["devices"], represented["devices"]):
        assert mirrored["peak_memory_bytes"] == pytest.approx(alone["peak_memory_bytes"], rel=0.02)


# ---------------------------------------------------------------- memory, layout, bad input

@pytest.mark.parametrize("base,checkpointing,layout", [
    (GPT, "none", {"cp": 2}), (GPT, "none", {"cp": 2, "tp": 2, "sequence_parallel": True}),
    (GPT, "none", {"pp": 2, "cp": 2, "microbatches": 2}), (GPT, "full", {"cp": 4}), (LLAMA, "full", {"pp": 2, "cp": 2}),
    (GPT, "selective", {"cp": 2, "tp": 2}),
], ids=lambda value: value["name"] if isinstance(value, dict) and "seed" in value
    else value if isinstance(value, str) else ids(value))
def test_the_memory_plan_holds_what_a_run_holds(base, checkpointing, layout):
    spec = scenario({**base, "train": {**base["train"], "steps": 1}}, checkpointing, **dict(layout))
    ran = run(spec)
    for plan, device in zip(plan_memory(spec), ran.data["devices"]):
        assert plan.peak_bytes == device["peak_memory_bytes"]
        assert plan.by_category == device["peak_memory_bytes_by_category"]


def test_cp_sits_between_tp_and_pp_and_leaves_3d_ranks_as_they_were():
    layout = Layout(dp=2, pp=2, cp=2, tp=2)
    first, second = layout.rank_groups(0), layout.rank_groups(1)
    assert first.tp == (0, 1) and first.cp == (0, 2) and first.pp == (0, 4) and first.dp == (0, 8)
    assert second.dp_cp == (1, 9, 3, 11)
    for placement in (("tp", "pp", "dp"), ("dp", "tp", "pp")):
        flat = Layout(dp=2, pp=2, tp=2, placement=placement)
        assert flat.groups("pp") == \
            Layout(dp=2, pp=2, tp=2, placement=tuple(d for d in flat.placement if d != "cp")).groups("pp")


@pytest.mark.parametrize("raw,field", [
    ({"parallel": {"cp": 3}}, "parallel.cp"),  # 16 tokens do not cut into 6 chunks
    ({"parallel": {"cp": 2, "tp": 2, "sequence_parallel": True}, "data": {"seq_len": 4}}, "parallel.cp"),
    ({"parallel": {"cp": 2}, "model": {"name": "mlp"}, "data": {"name": "digits"}}, "parallel.cp"),
    ({"parallel": {"cp": 2}, "train": {"checkpointing": {"segments": 9}}}, "train.checkpointing"),
    ({"parallel": {"placement": ["tp", "cp", "dp"]}}, "parallel.placement"),
])
def test_bad_input_is_one_line_naming_the_field(tmp_path, capsys, raw, field):
    spec = {**GPT, "cluster": {"devices": 2 * raw["parallel"].get("tp", 1) * raw["parallel"].get("cp", 1)}}
    for section, values in raw.items():
        spec[section] = {**spec.get(section, {}), **values}
    if spec["model"]["name"] == "mlp":
        spec["model"] = {"name": "mlp"}
        spec["data"] = {"name": "digits", "batch_size": 8}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err, err
