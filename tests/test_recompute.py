"""Activation recomputation (train.checkpointing: full and selective) against its references.

- Equivalence: full recomputation, layer by layer (schemes/layer_recompute.py), and selective
  recomputation of the attention core (train/gpt.py RecomputedAttention) train the same
  parameters as one device without recomputation on the same global batch (single-process
  torch through simtrain's one-device run), within 1e-5 (fp32), alone and with tp, pp and dp.
- Layer by layer: the activation peak of a recomputed chunk, read from the device's memory
  ledger, is one layer's activations (measured on that layer alone) plus the other layers'
  kept inputs, never the whole chunk's activations.
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
    devices = parallel.get("dp", 1) * parallel.get("pp", 1) * parallel.get("tp", 1)
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


@pytest.mark.parametrize("layout", [{"pp": 2}, {"tp": 2}], ids=ids)
def test_full_recomputation_of_an_mlp_trains_what_one_device_trains(layout):
    assert_trains_what_one_device_trains(MLP, "full", dict(layout))


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


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing,layout", [("full", {"pp": 2, "tp": 2}), ("full", {"pp": 2}),
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
