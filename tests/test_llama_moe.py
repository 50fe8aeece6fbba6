"""Mixture of experts on llama (train/llama_moe.py) as on gpt: SwiGLU experts, expert parallelism, model FLOPs.

References: single-process torch (the whole MoE llama on the concatenation of every data-parallel rank's batch,
rank order, SGD: test_expert_parallel's one_device) for the parameters under expert parallelism, with data
parallelism alone and under pp and tp (with sequence parallelism and without); the SwiGLU's closed form, 6·h·W
forward FLOPs a token, and PaLM's 6N + 12LHQT with N a token's activated weights, against the operator recorder's
count; the numerics-off exchanges against their closed-form bytes; one-line errors for bad input.
"""
import pytest
import torch

import simtrain
from simtrain.cost import measure_step_cost
from simtrain.errors import ScenarioError
from simtrain.op_cost import OperatorRecorder
from simtrain.scenario import validate_scenario
from simtrain.scenario.model import MoESpec
from simtrain.train.gpt import build_gpt
from simtrain.train.llama import LlamaBlock, build_llama
from simtrain.train.llama_moe import LlamaMoEBlock, SwiGLUExpert, llama_moe_block
from simtrain.train.model_flops import gpt_flops_per_sequence, llama_flops_per_sequence
from simtrain.train.moe import moe_block
from simulated_steps import bytes_by_label, one_step
from test_expert_parallel import assert_same_parameters, one_device

HIDDEN, FFN, EXPERTS = 16, 24, 4
EXCHANGES = ("moe dispatch", "moe combine", "moe dispatch backward", "moe combine backward")


def scenario(devices, ep=2, numerics=True, routing=None, steps=2, expert_hidden=None, shared_experts=0, **parallel):
    moe = {"experts": EXPERTS, "top_k": 2, "aux_loss_coeff": 0.0, "shared_experts": shared_experts,
           "expert_hidden": expert_hidden, **({"routing": routing} if routing else {})}
    return validate_scenario({
        "name": "t", "seed": 3, "numerics": numerics,
        "cluster": {"topology": "switch", "devices": devices, "device": "h100-80gb"},
        "model": {"name": "llama", "hidden": HIDDEN, "layers": 2, "heads": 4, "kv_heads": 2, "ffn_hidden": FFN,
                  "moe": moe},
        "data": {"name": "tokens", "batch_size": 4, "seq_len": 8, "vocab": 32},
        "train": {"steps": steps, "optimizer": {"name": "sgd", "lr": 0.1}, "precision": "fp32"},
        "parallel": {"ep": ep, **parallel}, "report": {"trace": False},
    })


# ---------------------------------------------------------------- the block

def test_every_nth_llama_block_is_moe_with_swiglu_experts_of_their_width():
    model = build_llama(32, HIDDEN, 4, 4, 2, FFN, 1e4, llama_moe_block(MoESpec(experts=4, shared_experts=1,
                                                                               every=2, expert_hidden=8)))
    blocks = list(model)[1:-1]
    assert [type(block) for block in blocks] == [LlamaBlock, LlamaMoEBlock] * 2
    moe = blocks[1].moe
    assert not hasattr(blocks[1], "w1")  # the dense MLP is replaced
    assert all(isinstance(expert, SwiGLUExpert) for expert in [*moe.experts, *moe.shared])
    assert (moe.experts[0].w1.weight.shape, moe.experts[0].w2.weight.shape) == ((8, HIDDEN), (HIDDEN, 8))
    default = LlamaMoEBlock(HIDDEN, 4, 2, FFN, 1e4, MoESpec(experts=2))
    assert default.moe.experts[0].w3.out_features == FFN  # Mixtral's: an expert of the dense MLP's width


def test_the_block_is_llamas_attention_then_the_moe_layer():
    """x + attention(norm(x)), then x + moe(norm(x)), the layer's own forward on the block's normalized stream."""
    torch.manual_seed(0)
    block = LlamaMoEBlock(HIDDEN, 4, 2, FFN, 1e4, MoESpec(experts=4, top_k=2, shared_experts=1))
    x = torch.randn(2, 8, HIDDEN)
    mid = x + block._attention(block.attention_norm(x))
    expected = mid + block.moe(block.ffn_norm(mid))
    torch.testing.assert_close(block(x), expected, rtol=0, atol=0)


def test_a_swiglu_expert_is_its_formula_and_costs_6hw_forward_flops_a_token():
    torch.manual_seed(0)
    hidden, width, tokens = 16, 40, 7
    expert = SwiGLUExpert(hidden, width)
    h = torch.randn(tokens, hidden)
    with OperatorRecorder() as recorder:
        out = expert(h)
    manual = torch.nn.functional.silu(h @ expert.w1.weight.T) * (h @ expert.w3.weight.T) @ expert.w2.weight.T
    torch.testing.assert_close(out, manual)
    assert recorder.flops == 6 * hidden * width * tokens


@pytest.mark.parametrize("moe", [MoESpec(experts=4, top_k=2), MoESpec(experts=4, top_k=1, shared_experts=1, every=2,
                                                                        expert_hidden=40)])
def test_meta_flops_are_the_activated_weights_closed_form(moe):
    """Numerics off (balanced routing): forward + backward FLOPs are 6N + 12LHQT per token with N counting in each
    MoE block the router and the top_k + shared SwiGLU experts, 3·h·W weights each."""
    layers, width, heads, kv_heads, ffn, vocab, seq_len, batch = 4, 32, 4, 2, 48, 64, 16, 2
    with torch.device("meta"):
        model = build_llama(vocab, width, layers, heads, kv_heads, ffn, 1e4, llama_moe_block(moe))
    tokens = torch.empty((batch, seq_len), dtype=torch.long, device="meta")
    cost = measure_step_cost(model, tokens, tokens)
    assert cost.forward_flops + cost.backward_flops == batch * llama_flops_per_sequence(
        layers, width, heads, kv_heads, ffn, vocab, seq_len, moe)


def test_gpt_experts_of_a_width_of_their_own_are_counted_by_that_width():
    """model.moe.expert_hidden on gpt: ExpertMLPs of that width, and the closed form counts them so."""
    layers, width, heads, vocab, seq_len, batch = 2, 32, 4, 64, 16, 2
    moe = MoESpec(experts=4, top_k=2, shared_experts=1, expert_hidden=40)
    with torch.device("meta"):
        model = build_gpt(vocab, seq_len, width, layers, heads, moe_block(moe))
    assert model[1].moe.experts[0].expand.out_features == 40
    tokens = torch.empty((batch, seq_len), dtype=torch.long, device="meta")
    cost = measure_step_cost(model, tokens, tokens)
    assert cost.forward_flops + cost.backward_flops == batch * gpt_flops_per_sequence(layers, width, vocab, seq_len,
                                                                                      moe)
    assert gpt_flops_per_sequence(layers, width, vocab, seq_len, MoESpec(expert_hidden=4 * width)) == \
        gpt_flops_per_sequence(layers, width, vocab, seq_len, MoESpec())  # the default is the dense MLP's width


# ---------------------------------------------------------------- expert parallelism against one device

def test_ep2_with_data_parallelism_trains_to_the_parameters_of_one_device():
    """dp = ep = 2 (the step engine, strategies/expert_model_parallel.py), experts of their own width and a shared one,
    two steps."""
    spec = scenario(2, expert_hidden=12, shared_experts=1)
    report = simtrain.run(spec)
    reference, dropped = one_device(spec, 2)
    assert_same_parameters(report.final_model, reference)
    assert report.data["moe"]["dropped_tokens"] == dropped == [0, 0]


def test_ep2_pp2_trains_to_the_parameters_of_one_device():
    """ep 2 x pp 2 over 4 devices (dp 2), 2 microbatches: each stage holds one MoE block, run as regions between its
    ep group's exchanges (train/moe_exchange.py)."""
    spec = scenario(4, pp=2, pipeline={"microbatches": 2})
    job = one_step(spec)
    reference, _ = one_device(spec, 2)
    assert_same_parameters(job.scheme.trained_model(), reference)


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "without sp"])
def test_ep2_tp2_trains_to_the_parameters_of_one_device(sequence_parallel):
    """ep 2 x tp 2 over 4 devices, with sequence parallelism or without, and a shared expert: the attention cut by
    heads, the experts whole on each tp rank, each routing its part of the sequence (without sequence
    parallelism, taken from the whole stream, the layer's output summed back over tp)."""
    spec = scenario(4, tp=2, sequence_parallel=sequence_parallel, shared_experts=1)
    job = one_step(spec)
    reference, _ = one_device(spec, 2)
    assert_same_parameters(job.scheme.trained_model(), reference)


# ---------------------------------------------------------------- numerics off

def test_without_numerics_zipf_routing_runs_with_data_parallelism():
    """dp = ep = 2, zipf routing: expert 0 takes the most tokens; the run reports the drawn routing."""
    report = simtrain.run(scenario(2, numerics=False, routing={"model": "zipf", "zipf_exponent": 1.5}, steps=1))
    moe = report.data["moe"]
    assert moe["routing"] == "zipf" and moe["imbalance"][0] > 1.2
    assert moe["expert_share"][0] == max(moe["expert_share"])


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "without sp"])
def test_without_numerics_balanced_routing_under_pp_and_tp_moves_the_closed_form_bytes(sequence_parallel):
    """ep 2 x tp 2 x pp 2 over 8 devices (dp 2), 2 microbatches: each rank routes its 2 x 8 / 2 = 8 tokens a
    microbatch evenly, top 2 over 4 experts, half of its 16 assignments to the other ep rank, each a fp32 token of
    HIDDEN elements, in each of the 4 exchanges of the one MoE block a stage holds (its part of the sequence,
    with sequence parallelism or without)."""
    spec = scenario(8, numerics=False, steps=1, tp=2, pp=2, sequence_parallel=sequence_parallel,
                    pipeline={"microbatches": 2})
    job = one_step(spec)
    moe = job.scheme.report_sections()["moe"]
    assert moe["routing"] == "balanced" and moe["imbalance"] == [1.0]
    exchanged = sum(bytes_by_label(job)[label] for label in EXCHANGES)
    ranks, microbatches, leaving = 8, 2, 8
    assert moe["all_to_all_bytes"] == [exchanged] == [4 * ranks * microbatches * leaving * HIDDEN * 4]


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("arguments,expected", [
    (dict(expert_hidden=0), "model.moe.expert_hidden"),
    (dict(ep=3), "parallel.ep: 3 does not divide model.moe.experts 4"),
])
def test_bad_input_is_one_line_naming_the_key(arguments, expected):
    with pytest.raises(ScenarioError, match=expected) as error:
        scenario(4, **arguments)
    assert "\n" not in str(error.value)


def test_moe_every_past_the_llamas_layers_is_refused():
    with pytest.raises(ScenarioError, match="model.moe.every: 3 is past the llama's 2 model.layers"):
        validate_scenario({"model": {"name": "llama", "layers": 2, "moe": {"every": 3}},
                           "data": {"name": "tokens"}})
