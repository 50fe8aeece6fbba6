"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1): 1F1B with the backward split.

Each backward runs as I (the input gradient, which the previous rank waits
for) and W (the weight gradients, which nobody waits for). Rank s (part s)
runs 1F1B's warm-up forwards, then F, I and W in turn, but holds back s of its
W passes: the later a rank, the sooner its input gradients leave for the rank
before it, which then waits less; the held-back W passes run at the end,
where 1F1B's later ranks idle. The forwards in flight are 1F1B's (at most
p - s on rank s); what a held-back W needs of a microbatch's activations stays
from its I until it runs (schemes/pipeline.py). With equal stages the
bubble shrinks from 1F1B's (p - 1)(T_F + T_B + T_W) to (p - 1)(T_F + T_B - T_W)
(the paper's T_B is the input backward, I here): a third of it where the
three take the same time.

    build(stages=4, microbatches=8, chunks=1).actions[3][:4]
    # (Action("F", 3, 0), Action("I", 3, 0), Action("W", 3, 0), Action("F", 3, 1))
"""
from .actions import Action, Schedule, looped_placement, one_chunk


def build(stages: int, microbatches: int, chunks: int, source=None) -> Schedule:
    one_chunk("zero_bubble", chunks)
    return Schedule("zero_bubble", looped_placement(stages, 1),
                    tuple(_rank_actions(stages, rank, microbatches) for rank in range(stages)))


def _rank_actions(stages: int, rank: int, microbatches: int) -> tuple[Action, ...]:
    """Rank `rank`'s warm-up forwards, its steady F-I pairs each followed by a W held back `rank` places, its
    remaining I passes each followed by a W, and the W passes left."""
    warmup = min(stages - rank - 1, microbatches)
    held_back = rank
    actions = [Action("F", rank, m) for m in range(warmup)]
    weights: list[Action] = []
    backward = 0
    for forward in range(warmup, microbatches):
        actions += [Action("F", rank, forward), Action("I", rank, backward)]
        weights.append(Action("W", rank, backward))
        backward += 1
        if len(weights) > held_back:
            actions.append(weights.pop(0))
    for microbatch in range(backward, microbatches):
        actions.append(Action("I", rank, microbatch))
        weights.append(Action("W", rank, microbatch))
        actions.append(weights.pop(0))
    return tuple(actions + weights)
