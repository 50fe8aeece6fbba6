"""A language model's vocabulary split across tensor-parallel ranks, as Megatron-LM splits embedding and head.

Shoeybi et al., "Megatron-LM" (2019), section 3 (and Narayanan et al. 2021):
the token table's rows and the output Linear's output features are cut into
tp contiguous vocabulary ranges; rank r holds [r V/tp, (r + 1) V/tp).

- **Embedding**: each rank looks up the tokens in its range and gives zeros
  for the others (`local_lookup`); the partial embeddings summed across the
  tp group (an `AllReduceForward`, identity in backward) are the whole
  lookup, and each rank's table rows get the gradients of its own tokens.
- **Cross entropy**: each rank holds only its range's logits. A token's loss
  is the logsumexp of its logits over the whole vocabulary minus its target's
  logit. Each rank writes its range's logsumexp into row `tp_rank` and its
  target logit (0 where the target lies outside its range) into row tp of a
  zero (tp + 1, tokens) tensor (`cross_entropy_terms`). One sum all-reduce of
  that small tensor gives every rank every range's logsumexp and the target
  logits, from which every rank computes the same loss
  (`cross_entropy_from_terms`): the logits (tokens x V) are never gathered.
  The all-reduce is identity in backward: a rank's rows of the sum come from
  its own logits alone, so each rank backpropagates its slice of the whole
  vocabulary's gradient. Logits are upcast to fp32 first, as loss.py does.

    partial = local_lookup(table, tokens, start)                     # then AllReduceForward
    terms = cross_entropy_terms(logits, target, start, tp_rank, tp)   # then AllReduceForward
    loss = cross_entropy_from_terms(terms, tp)                        # the mean over every token
    ops = head_loss_ops(norm, linear, start, tp_rank, tp, AllReduceBackward)   # a head's work, as above

The one check a split needs, tp equal ranges, is train/architecture.py's `require_divides(vocab, tp, VOCAB)`.
"""
import torch
from torch import nn

from .tensor_parallel import AllReduceForward, Apply, ApplyWithTarget


def head_loss_ops(norm: nn.Module, linear: nn.Module, vocab_start: int, tp_rank: int, tp: int, gather) -> list:
    """A language model head's work under tensor parallelism, ending with the loss: `norm`, then `gather` (the
    op that makes the normalized activations whole on every rank: AllReduceBackward, or AllGather under sequence
    parallelism), `linear` to this rank's vocabulary range, the vocabulary-parallel cross entropy's terms summed
    across the group, and the loss. The logits are never gathered."""
    return [Apply(lambda x: (norm(x),)), gather(0), Apply(lambda h: (linear(h),)),
            ApplyWithTarget(lambda logits, target: (cross_entropy_terms(logits, target, vocab_start, tp_rank, tp),)),
            AllReduceForward(0), Apply(lambda terms: (cross_entropy_from_terms(terms, tp),))]


def local_lookup(table: nn.Embedding, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """Embeddings of the tokens in this rank's range [start, start + its rows), zeros for the others."""
    outside = (tokens < start) | (tokens >= start + table.weight.shape[0])
    rows = table((tokens - start).masked_fill(outside, 0))
    return rows.masked_fill(outside.unsqueeze(-1), 0.0)


def cross_entropy_terms(logits: torch.Tensor, target: torch.Tensor, start: int, tp_rank: int,
                        tp: int) -> torch.Tensor:
    """This rank's share of the (tp + 1, tokens) terms: its range's logsumexp in row `tp_rank`,
    its target logits (0 outside its range) in row tp, zeros elsewhere."""
    logits, target = logits.float().flatten(0, -2), target.flatten()
    local = target - start
    inside = (local >= 0) & (local < logits.shape[-1])
    picked = logits.gather(1, local.masked_fill(~inside, 0).unsqueeze(1)).squeeze(1)
    rows = [logits.new_zeros(logits.shape[0])] * tp
    rows[tp_rank] = logits.logsumexp(dim=-1)
    return torch.stack([*rows, picked.masked_fill(~inside, 0.0)])


def cross_entropy_from_terms(terms: torch.Tensor, tp: int) -> torch.Tensor:
    """The mean cross entropy over every token from the terms summed across the tp group."""
    return (terms[:tp].logsumexp(dim=0) - terms[tp]).mean()
