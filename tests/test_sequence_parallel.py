"""Sequence parallelism (parallel.sequence_parallel) and activation memory per layer, against their references.

- Equivalence: sequence parallelism, alone under tp and with pp, dp, full and selective
  recomputation, trains the same parameters as one device on the same global batch
  (single-process torch through simtrain's one-device run), within 1e-5 (fp32).
- Activation bytes per transformer layer, read from the device's memory ledger (one layer more,
  minus one layer less), are Korthikanti et al. 2022's Table 2 formulas adjusted term by term for
  what simtrain's layer saves (docs/guides/long-sequences.md): no dropout (the paper's two sbh
  masks, the attention's as²b mask and its 2as²b output), fp32 LayerNorm statistics (16bs, /t
  under sp) and the causal mask (s² bytes, recomputed under selective). Under sp the inputs of the
  column-parallel Linears are kept as the rank's shard (4sbh/t, the paper's) and gathered again in the
  backward, as Megatron-Core keeps them. Exactly.
- Bytes: a reduce-scatter and an all-gather move what an all-reduce moves, so the tp
  collectives of a step move the bytes of the all-reduces they replace; the sums of the whole
  parameters' gradients are one ring all-reduce more; a pipeline boundary carries 1/tp.
- The memory plan (`simtrain memory`) holds what a run holds under each combination.
- Bad input: sp without tp, a sequence that tp does not divide, a model without a sequence:
  one line naming parallel.sequence_parallel, exit 2.
"""
import pytest
import torch

from simtrain import plan_memory, run
from simtrain.cli import main
from simtrain.hw.resolved_cluster import resolve_cluster
from simtrain.memory_plan import replay_step
from simtrain.scenario import validate_scenario
from simulated_steps import bytes_by_label, flat_parameters, one_step

GPT = {"name": "gpt", "seed": 1, "cluster": {"devices": 1}, "model": {"name": "gpt", "hidden": 32, "layers": 2,
                                                                       "heads": 4},
       "data": {"name": "tokens", "batch_size": 8, "samples": 256, "seq_len": 8, "vocab": 16},
       # SGD: see tests/test_model_parallel.py (Adam magnifies the rounding noise of a zero gradient)
       "train": {"steps": 10, "optimizer": {"lr": 0.1, "momentum": 0.9}}, "report": {"trace": False, "every": 10}}


def scenario(base: dict = GPT, checkpointing: str = "none", batch: int | None = None, **parallel):
    devices = parallel.get("dp", 1) * parallel.get("pp", 1) * parallel.get("tp", 1)
    if "microbatches" in parallel:
        parallel["pipeline"] = {"microbatches": parallel.pop("microbatches")}
    data = {**base["data"], **({"batch_size": batch} if batch else {})}
    return validate_scenario({**base, "cluster": {**base["cluster"], "devices": devices}, "data": data,
                              "train": {**base["train"], "checkpointing": checkpointing}, "parallel": parallel})



ids = lambda layout: "-".join(f"{k}{v}" for k, v in layout.items())  # noqa: E731


@pytest.mark.parametrize("checkpointing,layout", [
    ("none", {"tp": 2}), ("none", {"tp": 4}), ("none", {"pp": 2, "tp": 2}),
    ("none", {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2}),
    ("full", {"tp": 2}), ("full", {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2}),
    ("selective", {"tp": 4}), ("selective", {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2}),
], ids=lambda value: value if isinstance(value, str) else ids(value))
def test_sequence_parallelism_trains_what_one_device_trains(checkpointing, layout):
    layout = dict(layout)
    split = run(scenario(GPT, checkpointing, sequence_parallel=True, **layout))
    alone = run(scenario(GPT, batch=GPT["data"]["batch_size"] * layout.get("dp", 1)))
    assert split.data["status"] == "ok"
    torch.testing.assert_close(flat_parameters(split.final_models[0]), flat_parameters(alone.final_models[0]),
                               rtol=0, atol=1e-5)


# ---------------------------------------------------------------- Table 2: activation bytes per layer

S, B, H, A = 64, 2, 64, 4  # sequence, micro-batch, hidden, heads


def layer_bytes(tp: int, sp: bool, checkpointing: str, numerics: bool = False) -> int:
    """Activation bytes one more transformer layer holds, from the memory ledger of a step (fp16; numerics off:
    the memory plan's replay, on: a run): the activation peak with 3 layers minus that with 2."""
    def peak(layers: int) -> int:
        spec = validate_scenario({
            "name": "table2", "numerics": numerics, "cluster": {"devices": tp, "device": {"base": "a100-80gb"}},
            "model": {"name": "gpt", "hidden": H, "layers": layers, "heads": A},
            "data": {"name": "tokens", "batch_size": B, "seq_len": S, "vocab": 64, "samples": 64},
            "train": {"steps": 1, "precision": "fp16", "checkpointing": checkpointing},
            "parallel": {"tp": tp, "sequence_parallel": sp}, "report": {"trace": False}})
        job = one_step(spec) if numerics else replay_step(spec, resolve_cluster(spec.cluster), B)
        return job.devices[0].memory.peak["activations"]
    return peak(3) - peak(2)


def simtrain_layer(t: int, sp: bool, selective: bool) -> float:
    """Table 2 with simtrain's layer: no dropout (-2sbh, or -2sbh/t under sp, of masks; -3as²b/t of the
    attention's mask and output: the softmax's output is what attention over V saves), LayerNorm
    statistics in fp32 (+16bs, /t under sp) and the causal mask (+s², recomputed under selective)."""
    sbh = S * B * H
    stats = 16 * B * S / (t if sp else 1)
    core = 0 if selective else sbh * 2 * A * S / (H * t) + S * S
    if sp:
        return sbh * 32 / t + stats + core
    return sbh * (8 + 24 / t) + stats + core


@pytest.mark.slow
@pytest.mark.parametrize("tp,sp,checkpointing", [(1, False, "none"), (2, False, "none"), (4, False, "none"),
                                                 (2, True, "none"), (4, True, "none"), (2, False, "selective"),
                                                 (4, False, "selective"), (2, True, "selective"),
                                                 (4, True, "selective"), (1, False, "selective")])
def test_activation_bytes_per_layer_are_table_2_with_simtrains_layer(tp, sp, checkpointing):
    selective = checkpointing == "selective"
    measured = layer_bytes(tp, sp, checkpointing)
    assert measured == simtrain_layer(tp, sp, selective)


def test_a_run_with_numerics_holds_the_layer_megatron_core_keeps_under_sp():
    assert layer_bytes(2, True, "none", numerics=True) == simtrain_layer(2, True, selective=False)


def test_the_backward_gathers_each_column_parallel_input_again():
    """Under sp each column-parallel region's input (the QKV and first MLP Linears' of every layer, the vocabulary
    head's) is all-gathered again in the backward: per microbatch, each of the t ranks sends (t - 1)/t of the
    whole b s h activation (fp32 here), with numerics on and off alike."""
    base = {**GPT, "train": {**GPT["train"], "steps": 1}}
    t, layers = 4, GPT["model"]["layers"]
    b, s, h = GPT["data"]["batch_size"], GPT["data"]["seq_len"], GPT["model"]["hidden"]
    for numerics in (True, False):
        moved = bytes_by_label(one_step(scenario({**base, "numerics": numerics}, tp=t, sequence_parallel=True)))
        assert moved["tp_regather"] == (2 * layers + 1) * (t - 1) * b * s * h * 4


# ---------------------------------------------------------------- bytes on the links

def test_reduce_scatters_and_all_gathers_move_what_the_all_reduces_moved():
    base = {**GPT, "train": {**GPT["train"], "steps": 1}}
    plain = bytes_by_label(one_step(scenario(base, tp=4)))
    split = bytes_by_label(one_step(scenario(base, tp=4, sequence_parallel=True)))
    sequence = split["tp_allgather"] + split["tp_reducescatter"]
    # the vocabulary-parallel loss's own all-reduce stays one
    blocks = plain["tp_allreduce"] - split["tp_allreduce"]
    assert sequence == blocks > 0
    # the whole parameters' gradients (LayerNorms, the row-split Linears' biases, position embeddings) summed
    # once per step by a 4-rank ring: each rank sends 2 x 3/4 of them
    hidden, layers, seq = 32, 2, 8
    whole = layers * (4 * hidden + 2 * hidden) + seq * hidden + 2 * hidden
    assert split["tp_sp_grads"] == 4 * 2 * 3 * whole * 4 // 4


def test_a_pipeline_boundary_carries_a_tp_th_of_the_sequence():
    base = {**GPT, "train": {**GPT["train"], "steps": 1}}
    plain = bytes_by_label(one_step(scenario(base, pp=2, tp=2)))
    split = bytes_by_label(one_step(scenario(base, pp=2, tp=2, sequence_parallel=True)))
    assert split["pp_p2p"] * 2 == plain["pp_p2p"] > 0


def test_the_gather_again_runs_beside_the_input_gradient():
    """With links slow enough that the gather outlasts the compute beside it (closed form: tp 2, one ring step
    of half the b s h activation in fp32, T = bytes / bandwidth), each column-parallel region's backward posts
    the gather when its Linears' backward starts, runs the first half of it (the input gradient) meanwhile,
    awaits the gather T after the post, then runs the second half (the weight gradient)."""
    rate, bandwidth = 1e9, 2e6
    device = {"base": "a100-40gb", "efficiency": 1.0, "peak_flops": {"fp32": rate, "tf32": rate}}
    spec = scenario({**GPT, "numerics": False, "train": {**GPT["train"], "steps": 1},
                     "cluster": {"devices": 1, "device": device, "link": {"bandwidth": bandwidth, "latency": 0}}},
                    tp=2, sequence_parallel=True)
    spans = [span for span in one_step(spec).cluster.log.spans if span.rank == 0]
    b, s, h = GPT["data"]["batch_size"], GPT["data"]["seq_len"], GPT["model"]["hidden"]
    transfer_s = b * s * h * 4 / 2 / bandwidth
    regathers = [i for i, span in enumerate(spans) if span.name == "tp_regather"]
    assert len(regathers) == 2 * GPT["model"]["layers"] + 1  # the QKV and first MLP Linears', the head's
    for i in regathers:
        beside, waited, after = spans[i - 1], spans[i], spans[i + 1]
        assert (beside.kind, beside.name, after.kind, after.name) == ("compute", "backward_part", "compute", "backward")
        assert waited.start == beside.end and after.start == waited.end
        assert waited.end == pytest.approx(beside.start + transfer_s, rel=1e-12)
        assert after.end - after.start == pytest.approx(beside.end - beside.start, rel=1e-12)


# ---------------------------------------------------------------- the memory plan, bad input

@pytest.mark.slow
@pytest.mark.parametrize("checkpointing,layout", [("none", {"tp": 2}), ("selective", {"tp": 2}),
                                                  ("full", {"pp": 2, "tp": 2}), ("selective", {"pp": 2, "tp": 2}),
                                                  ("none", {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2})],
                         ids=lambda value: value if isinstance(value, str) else ids(value))
def test_the_memory_plan_holds_what_a_run_holds(checkpointing, layout):
    spec = scenario({**GPT, "train": {**GPT["train"], "steps": 2}}, checkpointing, sequence_parallel=True,
                    **dict(layout))
    report = run(spec)
    for plan, device in zip(plan_memory(spec), report.data["devices"]):
        assert plan.peak_bytes == device["peak_memory_bytes"]
        assert plan.by_category == device["peak_memory_bytes_by_category"]


@pytest.mark.parametrize("overrides,expected", [
    (["parallel.sequence_parallel=true"], "needs parallel.tp > 1"),
    (["parallel.sequence_parallel=true", "parallel.tp=2", "cluster.devices=2"], "llama models' blocks, not mlp"),
    (["parallel.sequence_parallel=true", "parallel.tp=4", "cluster.devices=4", "model.name=gpt",
      "model.hidden=32", "model.heads=4", "data.name=tokens", "data.seq_len=6"], "data.seq_len 6"),
])
def test_bad_sequence_parallel_layouts_print_one_line_and_exit_2(tmp_path, capsys, overrides, expected):
    path = tmp_path / "s.yaml"
    path.write_text("train: {steps: 1}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(path), *(arg for override in overrides for arg in ("--set", override))])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "parallel.sequence_parallel" in err and expected in err and "\n" not in err
