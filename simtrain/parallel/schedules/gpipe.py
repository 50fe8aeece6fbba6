"""GPipe (Huang et al., "GPipe", 2019): every forward of the step, then every backward.

Each rank holds one model part (rank r: part r) and all m microbatches'
activations at the turn. With equal stages the idle time of every rank (the
bubble) is (p - 1)(t_f + t_b) per step.

    build(stages=2, microbatches=2, chunks=1).actions[1]
    # (Action("F", 1, 0), Action("F", 1, 1), Action("B", 1, 0), Action("B", 1, 1))
"""
from .actions import Action, Schedule, looped_placement, one_chunk


def build(stages: int, microbatches: int, chunks: int, source=None) -> Schedule:
    one_chunk("gpipe", chunks)
    return Schedule("gpipe", looped_placement(stages, 1), tuple(
        tuple([Action("F", rank, m) for m in range(microbatches)] + [Action("B", rank, m) for m in range(microbatches)])
        for rank in range(stages)))
