"""1F1B (PipeDream-Flush; Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", 2021): warm-up forwards, then one forward and one backward in turn, then the remaining backwards.

Rank s (part s) runs min(p - s - 1, m) warm-up forwards. The bubble is GPipe's,
(p - 1)(t_f + t_b) for equal stages, but rank s holds at most min(p - s, m)
microbatches' activations instead of m.

    build(stages=4, microbatches=8, chunks=1).actions[3][:3]
    # (Action("F", 3, 0), Action("B", 3, 0), Action("F", 3, 1))
"""
from .actions import Action, Schedule, looped_placement, one_chunk, one_forward_one_backward


def build(stages: int, microbatches: int, chunks: int, source=None) -> Schedule:
    one_chunk("1f1b", chunks)
    return Schedule("1f1b", looped_placement(stages, 1), tuple(
        tuple(one_forward_one_backward([Action("F", rank, m) for m in range(microbatches)],
                                       [Action("B", rank, m) for m in range(microbatches)],
                                       warmup=min(stages - rank - 1, microbatches)))
        for rank in range(stages)))
