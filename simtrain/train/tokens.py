"""Synthetic token sequences with structure a small transformer can learn: a seeded second-order Markov chain.

Each pair of consecutive tokens (a, b) has one likely successor
`table[a, b]`, drawn once from the seed; the next token is that successor
with probability `FOLLOW_PROBABILITY`, otherwise uniform over the vocabulary.
A model that looks back two positions (attention can; a bigram model cannot)
approaches the chain's entropy per token, the lowest loss any model reaches:

    H = -(f + r) ln(f + r) - (V - 1) r ln r,   f = FOLLOW_PROBABILITY, r = (1 - f) / V

    sequences = markov_sequences(samples=2048, length=33, vocab=64, seed=0)   # int64 (2048, 33)
    entropy_per_token(64)                                                     # 0.729 nats
"""
import math

import torch

FOLLOW_PROBABILITY = 0.9


def markov_sequences(samples: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """`samples` sequences of `length` tokens in 0..vocab-1 from the seed's chain (int64)."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.randint(0, vocab, (vocab, vocab), generator=generator)
    sequences = torch.empty(samples, length, dtype=torch.int64)
    sequences[:, :2] = torch.randint(0, vocab, (samples, 2), generator=generator)
    for position in range(2, length):
        follow = torch.rand(samples, generator=generator) < FOLLOW_PROBABILITY
        uniform = torch.randint(0, vocab, (samples,), generator=generator)
        likely = table[sequences[:, position - 2], sequences[:, position - 1]]
        sequences[:, position] = torch.where(follow, likely, uniform)
    return sequences


def entropy_per_token(vocab: int) -> float:
    """Nats per predicted token of the chain (positions 2 on): the lowest loss a model can reach there."""
    rest = (1 - FOLLOW_PROBABILITY) / vocab
    likely = FOLLOW_PROBABILITY + rest
    return -likely * math.log(likely) - (vocab - 1) * rest * math.log(rest)
