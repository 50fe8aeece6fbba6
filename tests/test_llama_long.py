"""The llama model (train/llama.py) with selective recomputation and sequence parallelism, against references.

- Equivalence: selective recomputation of the attention core, sequence parallelism (tp 2, and
  pp 2 x tp 2) and both train the same parameters as one device without them on the same global
  batch (single-process torch through simtrain's one-device run), within 1e-5 (fp32). Under
  sequence parallelism the rotations must turn each query and key by its global position and the
  RMSNorm weights' gradients be summed across tp: either wrong moves the parameters.
- Selective: the attention core's saved tensors are gone from a layer's activations, exactly
  the softmax's output and the causal mask (measured on one block alone, fp32).
- Bytes: the all-gathers and reduce-scatters of a step move what the all-reduces they replace
  moved; the RMSNorm weights' gradients are one ring all-reduce more; a pipeline boundary carries
  1/tp of the sequence.
- The memory plan (`simtrain memory`) holds what a run holds with sequence parallelism and
  selective recomputation.
"""
import pytest
import torch

from simtrain import plan_memory, run
from simtrain.cost import measure_step_cost
from simtrain.scenario import validate_scenario
from simtrain.train.llama import build_llama
from simulated_steps import bytes_by_label, flat_parameters, one_step

HIDDEN, LAYERS, HEADS, SEQ = 32, 2, 4, 8
LLAMA = {"name": "llama-long", "seed": 2, "cluster": {"devices": 1},
         "model": {"name": "llama", "hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "kv_heads": 2,
                   "ffn_hidden": 48},
         "data": {"name": "tokens", "batch_size": 8, "samples": 256, "seq_len": SEQ, "vocab": 16},
         # SGD: see tests/test_model_parallel.py (Adam magnifies the rounding noise of a zero gradient)
         "train": {"steps": 10, "optimizer": {"lr": 0.1, "momentum": 0.9}}, "report": {"trace": False, "every": 10}}


def scenario(base: dict = LLAMA, checkpointing: str = "none", batch: int | None = None, **parallel):
    devices = parallel.get("dp", 1) * parallel.get("pp", 1) * parallel.get("tp", 1)
    if "microbatches" in parallel:
        parallel["pipeline"] = {"microbatches": parallel.pop("microbatches")}
    data = {**base["data"], **({"batch_size": batch} if batch else {})}
    return validate_scenario({**base, "cluster": {"devices": devices}, "data": data,
                              "train": {**base["train"], "checkpointing": checkpointing}, "parallel": parallel})



def ids(value) -> str:
    return value if isinstance(value, str) else "-".join(f"{k}{v}" for k, v in value.items()) or "one"


# ---------------------------------------------------------------- equivalence with one device

@pytest.mark.parametrize("checkpointing,layout", [
    ("selective", {}), ("selective", {"tp": 2}), ("selective", {"pp": 2, "tp": 2, "microbatches": 2}),
    ("none", {"tp": 2, "sequence_parallel": True}),
    ("none", {"pp": 2, "tp": 2, "microbatches": 2, "sequence_parallel": True}),
    ("selective", {"tp": 2, "sequence_parallel": True}),
    ("selective", {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2, "sequence_parallel": True}),
    ("full", {"pp": 2, "tp": 2, "sequence_parallel": True}),
], ids=ids)
def test_llama_trains_what_one_device_trains(checkpointing, layout):
    layout = dict(layout)
    split = run(scenario(LLAMA, checkpointing, **layout))
    alone = run(scenario(LLAMA, batch=LLAMA["data"]["batch_size"] * layout.get("dp", 1)))
    assert split.data["status"] == "ok"
    torch.testing.assert_close(flat_parameters(split.final_models[0]), flat_parameters(alone.final_models[0]),
                               rtol=0, atol=1e-5)
    assert split.data["final_loss"] == pytest.approx(alone.data["final_loss"], abs=1e-5)


# ---------------------------------------------------------------- selective: what the core no longer keeps

def test_selective_drops_exactly_the_softmax_output_and_the_causal_mask():
    # one block's saved activations, measured (cost.py's saved-tensor hooks), fp32
    batch = 3

    def activations(selective: bool) -> int:
        torch.manual_seed(0)
        model = build_llama(16, HIDDEN, 1, HEADS, 2, 48, 10000.0)
        model[1].recompute_core = selective
        tokens = torch.randint(0, 16, (batch, SEQ))
        return measure_step_cost(model, tokens, tokens).activation_bytes

    softmax_output = batch * HEADS * SEQ * SEQ * 4  # what attention over V saves (fp32)
    causal_mask = SEQ * SEQ  # bool
    assert activations(False) - activations(True) == softmax_output + causal_mask


# ---------------------------------------------------------------- bytes on the links

def test_reduce_scatters_and_all_gathers_move_what_the_all_reduces_moved():
    base = {**LLAMA, "train": {**LLAMA["train"], "steps": 1}}
    tp = 2
    plain = bytes_by_label(one_step(scenario(base, tp=tp)))
    split = bytes_by_label(one_step(scenario(base, tp=tp, sequence_parallel=True)))
    # the vocabulary-parallel loss's own all-reduce stays one
    assert split["tp_allgather"] + split["tp_reducescatter"] == plain["tp_allreduce"] - split["tp_allreduce"] > 0
    # the RMSNorm weights (two per block, the head's), the only whole parameters, summed once per step by a
    # tp-rank ring: each rank sends 2 (tp - 1) / tp of them, 4 bytes each
    whole = LAYERS * 2 * HIDDEN + HIDDEN
    assert split["tp_sp_grads"] == tp * 2 * (tp - 1) * whole * 4 // tp


def test_a_pipeline_boundary_carries_a_tp_th_of_the_sequence():
    base = {**LLAMA, "train": {**LLAMA["train"], "steps": 1}}
    plain = bytes_by_label(one_step(scenario(base, pp=2, tp=2)))
    split = bytes_by_label(one_step(scenario(base, pp=2, tp=2, sequence_parallel=True)))
    assert split["pp_p2p"] * 2 == plain["pp_p2p"] > 0


# ---------------------------------------------------------------- the memory plan

@pytest.mark.slow
@pytest.mark.parametrize("checkpointing,layout", [
    ("selective", {"tp": 2, "sequence_parallel": True}),
    ("selective", {"pp": 2, "tp": 2, "microbatches": 2, "sequence_parallel": True}),
    ("selective", {"pp": 2}), ("none", {"tp": 2, "sequence_parallel": True})], ids=ids)
def test_the_memory_plan_holds_what_a_run_holds(checkpointing, layout):
    spec = scenario({**LLAMA, "train": {**LLAMA["train"], "steps": 2}}, checkpointing, **dict(layout))
    report = run(spec)
    for plan, device in zip(plan_memory(spec), report.data["devices"]):
        assert plan.peak_bytes == device["peak_memory_bytes"]
        assert plan.by_category == device["peak_memory_bytes_by_category"]
