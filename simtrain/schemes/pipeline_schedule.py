"""Pipeline schedules: the order in which one stage runs its microbatches' forwards and backwards (pure logic).

`pipeline_schedule(name, stages, stage, microbatches, virtual_stages)` is the
list of `Action(kind, microbatch, chunk)` that device `stage` of `stages`
runs in one training step, where `chunk` is which of its `virtual_stages`
model chunks (chunk c of device s is model part c * stages + s):

- `gpipe` (Huang et al., "GPipe", 2019): every forward, then every backward;
  each stage holds all m microbatches' activations at the turn. Idle time
  (the bubble) is (p - 1)(t_f + t_b) per step for equal stages.
- `1f1b` (PipeDream-Flush; Narayanan et al., "Efficient Large-Scale Language
  Model Training on GPU Clusters Using Megatron-LM", 2021): p - s - 1 warm-up
  forwards on stage s, then one forward and one backward in turn, then the
  remaining backwards. The same bubble as GPipe, but stage s holds at most
  p - s microbatches' activations.
- `interleaved` (the same paper, section 2.2): each device holds v chunks and
  runs 1F1B over microbatch-chunk pairs, in groups of p microbatches per
  chunk; the bubble shrinks to (p - 1)(t_f + t_b) / v. Needs m to be a
  multiple of p, as Megatron-LM's schedule does.

    pipeline_schedule("1f1b", stages=4, stage=3, microbatches=8, virtual_stages=1)[:3]
    # [Action("forward", 0, 0), Action("backward", 0, 0), Action("forward", 1, 0)]
"""
from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class Action(NamedTuple):
    kind: str  # "forward" | "backward"
    microbatch: int
    chunk: int


def pipeline_schedule(name: str, stages: int, stage: int, microbatches: int, virtual_stages: int = 1) -> list[Action]:
    """Stage `stage`'s actions of one training step, in order."""
    if name == "gpipe":
        return ([Action("forward", m, 0) for m in range(microbatches)]
                + [Action("backward", m, 0) for m in range(microbatches)])
    if name == "1f1b":
        return _one_forward_one_backward(
            [Action("forward", m, 0) for m in range(microbatches)],
            [Action("backward", m, 0) for m in range(microbatches)],
            warmup=min(stages - stage - 1, microbatches))
    if name == "interleaved":
        return _interleaved(stages, stage, microbatches, virtual_stages)
    raise ValueError(f"unknown pipeline schedule {name!r} (known: {', '.join(SCHEDULES)})")


def _one_forward_one_backward(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """`warmup` forwards, then forward and backward in turn, then the remaining backwards."""
    actions = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards):
        actions += [forward, backward]
    return actions + backwards[len(forwards) - warmup:]


def _interleaved(stages: int, stage: int, microbatches: int, chunks: int) -> list[Action]:
    """1F1B over (microbatch, chunk) pairs: p microbatches through chunk 0, the same through chunk 1, ...,
    then the next p microbatches; backwards run the chunks in reverse."""
    total = microbatches * chunks

    def microbatch(k: int) -> int:
        return k // (stages * chunks) * stages + k % stages

    forwards = [Action("forward", microbatch(k), k // stages % chunks) for k in range(total)]
    backwards = [Action("backward", microbatch(k), chunks - 1 - k // stages % chunks) for k in range(total)]
    warmup = total if microbatches == stages else min((stages - stage - 1) * 2 + (chunks - 1) * stages, total)
    return _one_forward_one_backward(forwards, backwards, warmup)
