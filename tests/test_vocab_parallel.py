"""The vocabulary split across tp ranks (train/vocab_parallel.py) against whole-vocabulary references.

- Training: gpt layouts with tp > 1 (embedding rows and head split by vocabulary, the loss
  vocabulary-parallel) train the same parameters as one device on the same global batch, within 1e-5.
- Loss: the vocabulary-parallel cross entropy and each rank's gradient equal
  torch.nn.functional.cross_entropy on the gathered logits (closed reference), within 1e-6.
- Embedding: the summed partial lookups are the whole table's lookup, bit for bit.
- Cost: a tp rank's head does 1/tp of the whole head's measured FLOPs.
- A vocabulary tp does not divide is a one-line error.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from simtrain import run
from simtrain.errors import ScenarioError
from simtrain.schemes.chunk_measurement import measure_chunk
from simtrain.train.gpt import build_gpt
from simtrain.train.partition import RankModule, model_units
from simtrain.train.vocab_parallel import cross_entropy_from_terms, cross_entropy_terms, local_lookup
from test_model_parallel import GPT, flat_parameters, one_step, scenario


@pytest.mark.parametrize("layout", [{"tp": 2}, {"tp": 4}, {"pp": 2, "tp": 2, "microbatches": 2}],
                         ids=lambda layout: "-".join(f"{k}{v}" for k, v in layout.items()))
def test_vocab_parallel_gpt_trains_what_one_device_trains(layout):
    devices = layout.get("pp", 1) * layout["tp"]
    split = run(scenario(GPT, devices, **layout))
    alone = run(scenario(GPT))
    torch.testing.assert_close(flat_parameters(split.final_models[0]), flat_parameters(alone.final_models[0]),
                               rtol=0, atol=1e-5)
    assert split.data["final_loss"] == pytest.approx(alone.data["final_loss"], abs=1e-5)


def test_each_tp_rank_holds_its_vocabulary_rows_of_the_embedding_and_the_head():
    vocab, tp = GPT["data"]["vocab"], 4
    job = one_step(scenario({**GPT, "train": {**GPT["train"], "steps": 1}}, tp, tp=tp))
    for rank, replica in enumerate(job.replicas):
        share = replica.model
        assert share.chunks[0][0].tokens.weight.shape[0] == share.chunks[0][-1].logits.weight.shape[0] == vocab // tp
        for name in ("chunks.0.0.tokens.weight", "chunks.0.3.logits.weight", "chunks.0.3.logits.bias"):
            assert share.sources[name].slice == (0, rank * vocab // tp, (rank + 1) * vocab // tp)
        assert share.sources["chunks.0.0.positions.weight"].slice is None  # positions stay whole


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_cross_entropy_is_the_gathered_logits_cross_entropy(tp):
    generator = torch.Generator().manual_seed(0)
    tokens, vocab = 48, 32
    logits = torch.randn(tokens, vocab, generator=generator) * 3
    target = torch.randint(vocab, (tokens,), generator=generator)
    whole = logits.clone().requires_grad_()
    reference = F.cross_entropy(whole, target)
    reference.backward()
    shards = [shard.clone().requires_grad_() for shard in logits.chunk(tp, dim=1)]
    terms = [cross_entropy_terms(shard, target, rank * vocab // tp, rank, tp) for rank, shard in enumerate(shards)]
    summed = sum(term.detach() for term in terms)  # the sum all-reduce
    for rank in range(tp):
        received = summed.clone().requires_grad_()
        loss = cross_entropy_from_terms(received, tp)
        assert float(loss.detach()) == pytest.approx(float(reference.detach()), abs=1e-6)
        loss.backward()
        terms[rank].backward(received.grad)  # identity backward of the all-reduce
    torch.testing.assert_close(torch.cat([shard.grad for shard in shards], dim=1), whole.grad, rtol=0, atol=1e-6)


def test_summed_partial_lookups_are_the_whole_lookup():
    table = nn.Embedding(12, 5)
    tokens = torch.randint(12, (3, 7), generator=torch.Generator().manual_seed(1))
    partials = [local_lookup(nn.Embedding.from_pretrained(rows), tokens, start)
                for rows, start in zip(table.weight.detach().chunk(3), (0, 4, 8))]
    assert torch.equal(sum(partials), table(tokens).detach())


@pytest.mark.parametrize("tp", [2, 4])
def test_a_tp_ranks_head_does_one_tpth_of_the_whole_heads_flops(tp):
    batch, seq_len, hidden, vocab = 4, 8, 32, 64
    model = build_gpt(vocab=vocab, seq_len=seq_len, hidden=hidden, layers=1, heads=4)
    units = model_units(model, tensor_parallel=True)
    x = torch.randn(batch, seq_len, hidden, requires_grad=True)
    target = torch.randint(vocab, (batch, seq_len))

    def head_cost(tp_rank, degree):  # the head alone as the last model part
        share = RankModule(model, units, [len(units) - 1, 1], [1], tp_rank, degree)
        return measure_chunk(share.chunks[0], share.chunk_ops, (x,), target)

    whole = head_cost(0, 1)
    assert sum(whole.forward_flops) == 2 * batch * seq_len * hidden * vocab  # the logits Linear
    for tp_rank in range(tp):
        cost = head_cost(tp_rank, tp)
        assert sum(cost.forward_flops) * tp == sum(whole.forward_flops)
        assert sum(cost.backward_flops) * tp == sum(whole.backward_flops)


def test_a_vocabulary_tp_does_not_divide_is_a_one_line_error():
    with pytest.raises(ScenarioError) as error:
        one_step(scenario({**GPT, "data": {**GPT["data"], "vocab": 15}}, 2, tp=2))
    assert "parallel.tp" in str(error.value) and "data.vocab 15" in str(error.value)
    assert "\n" not in str(error.value)
