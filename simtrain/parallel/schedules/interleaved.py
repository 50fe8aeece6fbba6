"""Interleaved 1F1B (Narayanan et al. 2021, section 2.2): v model chunks per rank, 1F1B over microbatch-chunk pairs.

Rank r holds parts r, r + p, ..., r + (v - 1)p (looped placement). Its pairs go
in groups of p microbatches per chunk: p microbatches through chunk 0, the same
through chunk 1, ..., then the next p microbatches; backwards run the chunks in
reverse. The bubble shrinks to (p - 1)(t_f + t_b) / v for stage times t_f, t_b
(v chunks' worth). m must be a multiple of p, as in Megatron-LM's schedule.

    build(stages=2, microbatches=4, chunks=2).actions[0][:4]
    # (Action("F", 0, 0), Action("F", 0, 1), Action("F", 2, 0), Action("F", 2, 1))
"""
from .actions import Action, Schedule, looped_placement, one_forward_one_backward


def build(stages: int, microbatches: int, chunks: int, source=None) -> Schedule:
    if microbatches % stages:
        raise ValueError(f"parallel.pipeline.microbatches: interleaved needs a multiple of pp {stages}, got "
                         f"{microbatches}")
    total = microbatches * chunks

    def microbatch(k: int) -> int:
        return k // (stages * chunks) * stages + k % stages

    def rank_actions(rank: int) -> tuple[Action, ...]:
        forwards = [Action("F", k // stages % chunks * stages + rank, microbatch(k)) for k in range(total)]
        backwards = [Action("B", (chunks - 1 - k // stages % chunks) * stages + rank, microbatch(k))
                     for k in range(total)]
        warmup = total if microbatches == stages else min((stages - rank - 1) * 2 + (chunks - 1) * stages, total)
        return tuple(one_forward_one_backward(forwards, backwards, warmup))

    return Schedule("interleaved", looped_placement(stages, chunks), tuple(rank_actions(r) for r in range(stages)))
