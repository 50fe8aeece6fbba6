"""Activation recomputation (train.checkpointing: full, selective, sqrt and segments) against its references.

- Equivalence: full recomputation, layer by layer (schemes/layer_recompute.py), recomputation in
  segments under tp and cp (the same, units grouped), and selective recomputation of the attention
  core (train/gpt.py RecomputedAttention) train the same parameters as one device without
  recomputation on the same global batch (single-process torch through simtrain's one-device
  run), within 1e-5 (fp32), alone and with tp, cp, pp and dp.
- Layer by layer: the activation peak of a recomputed chunk, read from the device's memory
  ledger, is one layer's activations (measured on that layer alone) plus the other layers'
  kept inputs, never the whole chunk's activations. In segments: the segments' kept inputs,
  the last segment's activations (not recomputed) and one segment's while it is recomputed,
  between full recomputation's peak and none's.
- Split backwards (zero_bubble, dualpipev) with full recomputation: one device's parameters, the compute time
  of 1f1b under full recomputation, 4/3 of it without; fewer activations.
- FLOPs in segments: one more forward of every recomputed segment, by closed form (an mlp's
  Linears, 2·in·out a sample, halved by tp).
- The memory plan (`simtrain memory`) holds what a run holds under each.
- A model without attention refuses selective recomputation: one line naming
  train.checkpointing, exit 2.
"""
import pytest
import torch
from torch import nn

from simtrain import plan_memory, run
from simtrain.cli import main
from simtrain.errors import ScenarioError
from simtrain.hw.resolved_cluster import resolve_cluster
from simtrain.memory_plan import replay_step
from simtrain.scenario import validate_scenario
from simtrain.schemes.chunk_measurement import measure_chunk
from simulated_steps import flat_parameters

GPT = {"name": "gpt", "seed": 1, "cluster": {"devices": 1}, "model": {"name": "gpt", "hidden": 32, "layers": 2,
                                                                       "heads": 4},
       "data": {"name": "tokens", "batch_size": 8, "samples": 256, "seq_len": 8, "vocab": 16},
       # SGD: see tests/test_model_parallel.py (Adam magnifies the rounding noise of a zero gradient)
       "train": {"steps": 10, "optimizer": {"lr": 0.1, "momentum": 0.9}}, "report": {"trace": False, "every": 10}}
MLP = {"name": "mp", "seed": 3, "cluster": {"devices": 1}, "model": {"hidden": [32, 32, 32]},
       "data": {"name": "digits", "batch_size": 24}, "train": {"steps": 10, "optimizer": {"momentum": 0.9}},
       "report": {"trace": False, "every": 10}}


def scenario(base: dict, checkpointing: str = "none", batch: int | None = None, **parallel):
    devices = parallel.get("dp", 1) * parallel.get("pp", 1) * parallel.get("tp", 1) * parallel.get("cp", 1)
    if "microbatches" in parallel:
        parallel["pipeline"] = {"microbatches": parallel.pop("microbatches")}
    data = {**base["data"], **({"batch_size": batch} if batch else {})}
    return validate_scenario({**base, "cluster": {**base["cluster"], "devices": devices}, "data": data,
                              "train": {**base["train"], "checkpointing": checkpointing}, "parallel": parallel})



def assert_trains_what_one_device_trains(base: dict, checkpointing: str, layout: dict) -> None:
    split = run(scenario(base, checkpointing, **layout))
    alone = run(scenario(base, batch=base["data"]["batch_size"] * layout.get("dp", 1)))
    assert split.data["status"] == "ok"
    torch.testing.assert_close(flat_parameters(split.final_models[0]), flat_parameters(alone.final_models[0]),
                               rtol=0, atol=1e-5)


LAYOUTS = [{"pp": 2}, {"tp": 2}, {"pp": 2, "tp": 2}, {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2}]
ids = lambda layout: "-".join(f"{k}{v}" for k, v in layout.items()) or "one"  # noqa: E731


@pytest.mark.parametrize("layout", LAYOUTS, ids=ids)
def test_full_recomputation_layer_by_layer_trains_what_one_device_trains(layout):
    assert_trains_what_one_device_trains(GPT, "full", dict(layout))


SPLIT = {"zero_bubble": {"pp": 2, "pipeline": {"schedule": "zero_bubble", "microbatches": 4}},
         "dualpipev": {"pp": 2, "pipeline": {"schedule": "dualpipev", "microbatches": 4, "virtual_stages": 2}}}


@pytest.mark.parametrize("schedule", SPLIT)
def test_split_backwards_with_full_recomputation_train_as_one_device_and_compute_what_1f1b_does(schedule):
    """A split schedule's I pass recomputes each layer and charges its input-gradient work, its W pass the
    layers' weight gradients: one device's parameters; the compute time of 1f1b under full recomputation over the
    pipeline (the same FLOPs, cut and placed otherwise), on each device 4/3 of its time without (one more forward:
    F + 2F + F); fewer activations held than without recomputation."""
    assert_trains_what_one_device_trains(GPT, "full", dict(SPLIT[schedule]))

    def devices(checkpointing, layout):
        spec = scenario({**GPT, "numerics": False, "train": {**GPT["train"], "steps": 2}}, checkpointing,
                        **dict(layout))
        return run(spec).data["devices"]
    split, none = devices("full", SPLIT[schedule]), devices("none", SPLIT[schedule])
    looped = devices("full", {"pp": 2, "pipeline": {"microbatches": 4}})
    compute = [device["breakdown_s"]["compute"] for device in split]
    assert sum(compute) == pytest.approx(sum(device["breakdown_s"]["compute"] for device in looped), rel=1e-9)
    assert compute == pytest.approx([4 / 3 * device["breakdown_s"]["compute"] for device in none], rel=1e-6)
    for recomputed, kept in zip(split, none):
        assert (recomputed["peak_memory_bytes_by_category"]["activations"]
                < kept["peak_memory_bytes_by_category"]["activations"])


@pytest.mark.parametrize("layout", [{"pp": 2}, {"tp": 2}], ids=ids)
def test_full_recomputation_of_an_mlp_trains_what_one_device_trains(layout):
    assert_trains_what_one_device_trains(MLP, "full", dict(layout))


@pytest.mark.parametrize("base,checkpointing,layout", [
    (GPT, "sqrt", {"tp": 2}), (GPT, {"segments": 2}, {"pp": 2, "tp": 2}), (GPT, "sqrt", {"cp": 2}),
    (GPT, {"segments": 3}, {"cp": 2, "tp": 2}), (MLP, {"segments": 2}, {"tp": 2}),
], ids=lambda value: ids(value) if isinstance(value, dict) and "seed" not in value and "segments" not in value
    else str(value.get("segments")) if isinstance(value, dict) and "segments" in value
    else value["model"].get("name", "mlp") if isinstance(value, dict) else value)
def test_recomputation_in_segments_under_tp_and_cp_trains_what_one_device_trains(base, checkpointing, layout):
    assert_trains_what_one_device_trains(base, checkpointing, dict(layout))


@pytest.mark.parametrize("layout", [{}, {"dp": 2}, *LAYOUTS], ids=ids)
def test_selective_recomputation_trains_what_one_device_trains(layout):
    assert_trains_what_one_device_trains(GPT, "selective", dict(layout))


def test_a_recomputed_chunk_holds_one_layers_activations_and_the_kept_layer_inputs():
    """tp 2, pp 1: the chunk is the whole model (embedding, 4 blocks, head); the head's vocabulary is small,
    so the largest unit is a block, recomputed last-first while every block's input is kept."""
    layers, batch, seq, hidden = 4, 4, 16, 32
    spec = validate_scenario({**GPT, "numerics": False, "cluster": {"devices": 2},
                              "model": {"name": "gpt", "hidden": hidden, "layers": layers, "heads": 4},
                              "data": {**GPT["data"], "seq_len": seq, "batch_size": batch},
                              "train": {"steps": 1, "checkpointing": "full"}, "parallel": {"tp": 2}})
    job = replay_step(spec, resolve_cluster(spec.cluster), batch)
    share = job.replicas[0].model
    block, _ = share.layers[0][1]  # the first block, this rank's half of it
    block_input = torch.empty(batch, seq, hidden, device="meta").requires_grad_()
    one_layer = measure_chunk(block, share.chunk_ops, (block_input,), None, tp=2).activation_bytes
    kept_input = batch * seq * hidden * 4  # fp32
    assert job.devices[0].memory.peak["activations"] == one_layer + (layers - 1) * kept_input
    whole_chunk = measure_chunk(share.chunks[0], share.chunk_ops, (job.sample_microbatch(),), None, tp=2)
    assert job.devices[0].memory.peak["activations"] < whole_chunk.activation_bytes  # what it held before


def test_segments_hold_their_inputs_the_last_ones_activations_and_one_recomputed_segment():
    """tp 2: embedding, 4 blocks and the head are 6 blocks, {segments: 3} three segments of 2. The first two are
    recomputed, the last keeps its activations: the peak is the second segment's kept input with the last one's
    activations (its input among them), or a recomputed segment's (the first's input is the batch), each measured
    on the segment alone; below none's peak, above full recomputation's."""
    layers, batch, seq, hidden = 4, 4, 16, 32
    spec = {**GPT, "numerics": False, "cluster": {"devices": 2},
            "model": {"name": "gpt", "hidden": hidden, "layers": layers, "heads": 4},
            "data": {**GPT["data"], "seq_len": seq, "batch_size": batch}, "parallel": {"tp": 2}}
    peaks = {}
    for checkpointing in ("none", "full", {"segments": 3}):
        raw = {**spec, "train": {"steps": 1, "checkpointing": checkpointing}}
        job = replay_step(validate_scenario(raw), resolve_cluster(validate_scenario(raw).cluster), batch)
        peaks[str(checkpointing)] = job.devices[0].memory.peak["activations"]
    share = job.replicas[0].model
    assert [len(segment) for segment, _ in share.layers[0]] == [2, 2, 2]  # [embedding, block] ... [block, head]
    x, target = job.sample_microbatch(), torch.zeros(batch, seq, dtype=torch.long, device="meta")
    block_input = torch.empty(batch, seq, hidden, device="meta").requires_grad_()
    held = [measure_chunk(segment, share.chunk_ops, inputs, ends, tp=2).activation_bytes
            for (segment, _), inputs, ends in zip(share.layers[0], [(x,), (block_input,), (block_input,)],
                                                 [None, None, target])]
    kept_input = batch * seq * hidden * 4  # fp32
    assert peaks["{'segments': 3}"] == max(held[0], held[1], kept_input + held[2])
    assert peaks["full"] < peaks["{'segments': 3}"] < peaks["none"]


def test_segments_run_one_more_forward_of_every_recomputed_segment():
    """An mlp of 4 hidden Linears under tp 2: 3 blocks (two tensor-parallel pairs and the head), sqrt 2 segments, the
    pairs then the head. The devices run, beyond none's FLOPs, the pairs' forward again: each Linear's 2·in·out a
    sample, halved over the tp ranks; full runs the head's too (2·32·10 a sample on each rank, run whole)."""
    base = {**MLP, "model": {"hidden": [32] * 4}}
    executed = {}
    for checkpointing in ("none", "sqrt", "full"):
        data = run(scenario(base, checkpointing, tp=2)).data
        executed[checkpointing] = data["flops"]["device_tflops_per_device"] * 1e12 * data["sim_time_s"] * 2
    samples = base["train"]["steps"] * 2 * base["data"]["batch_size"]  # a step's batch on each of 2 tp ranks
    pairs = (2 * 64 * 32 + 3 * 2 * 32 * 32) / 2
    assert executed["sqrt"] - executed["none"] == pytest.approx(samples * pairs, rel=1e-9)
    assert executed["full"] - executed["none"] == pytest.approx(samples * (pairs + 2 * 32 * 10), rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing,layout", [("full", {"pp": 2, "tp": 2}), ("full", {"pp": 2}),
                                                  ({"segments": 2}, {"pp": 2, "tp": 2}),
                                                  ("selective", {"tp": 2}), ("selective", {})])
def test_the_memory_plan_holds_what_a_run_holds(checkpointing, layout):
    spec = scenario({**GPT, "train": {**GPT["train"], "steps": 2}}, checkpointing, **dict(layout))
    report = run(spec)
    for plan, device in zip(plan_memory(spec), report.data["devices"]):
        assert plan.peak_bytes == device["peak_memory_bytes"]
        assert plan.by_category == device["peak_memory_bytes_by_category"]


@pytest.mark.parametrize("model", [{"hidden": [32]}, {"name": "cnn"}])
def test_selective_recomputation_needs_attention(tmp_path, capsys, model):
    with pytest.raises(ScenarioError, match="train.checkpointing: selective"):
        validate_scenario({"model": model, "train": {"checkpointing": "selective"}})
    path = tmp_path / "s.yaml"
    path.write_text("train: {checkpointing: selective}\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "train.checkpointing" in err and "\n" not in err


def plain_layers() -> nn.Sequential:
    """A user's model without attention."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


@pytest.mark.parametrize("layout", [{}, {"pp": 2}], ids=ids)
def test_a_users_model_without_attention_refuses_selective_recomputation(layout):
    spec = scenario({**MLP, "model": {"name": "test_recompute:plain_layers"}}, "selective", **dict(layout))
    with pytest.raises(ScenarioError, match="train.checkpointing: selective"):
        run(spec)
