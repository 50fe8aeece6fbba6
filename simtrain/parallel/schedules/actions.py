"""What a pipeline schedule is made of: per rank, a list of actions over model parts, and where the parts live.

An action is torch.distributed.pipelining's `_Action` in plain data: a kind,
the model part it runs (torch's "stage index": part k of the pp x v parts,
whichever rank holds it) and a microbatch:

- `F`: the part's forward;
- `I`: its backward for the input gradient (what the part before it waits for);
- `W`: its backward for the weight gradients (what nobody waits for, so a
  schedule may run it later to fill a bubble; Qi et al., "Zero Bubble Pipeline
  Parallelism", 2023);
- `B`: the whole backward, I then W at once.

`Overlapped(forward, backward)` is torch's OVERLAP_F_B: a forward and a
backward of two microbatches run together (DualPipe's F&B). Sends and
receives are not actions: the engine (schemes/pipeline.py) posts every
receive of a step a step ahead and sends an output as soon as it exists, so
an explicit send order could only delay a transfer, never allow one the
implicit order forbids; a file's SEND/RECV entries are read and dropped
(from_file.py).

A `Schedule` owns its placement: `placement[r]` is the parts rank r holds, its
chunks in order (looped: r, r + p, ...; the V of DualPipeV: r and 2p - 1 - r).
`check_schedule` proves a list runs: each (microbatch, part) forwarded once and
backed once (B, or I and W), a backward after its forward and after the next
part's input backward, W after I.

    schedule = Schedule("1f1b", looped_placement(2, 1), ((Action("F", 0, 0), Action("B", 0, 0)), ...))
    schedule.chunk_of(rank=1, part=1)   # 0
    str(Action("I", 3, 1))              # "3I1", torch's spelling
"""
from dataclasses import dataclass
from typing import NamedTuple

KINDS = ("F", "I", "W", "B")
BACKWARD_KINDS = ("I", "B")  # the kinds that hand a gradient to the part before


class Action(NamedTuple):
    kind: str  # "F" | "I" | "W" | "B"
    part: int  # the model part (torch's stage index)
    microbatch: int

    def __str__(self) -> str:
        return f"{self.part}{self.kind}{self.microbatch}"


class Overlapped(NamedTuple):
    """A forward and a backward (B or I) of two microbatches run together (torch's OVERLAP_F_B)."""

    forward: Action
    backward: Action

    def __str__(self) -> str:
        return f"({self.forward};{self.backward})OVERLAP_F_B"


def computations(step: Action | Overlapped) -> tuple[Action, ...]:
    """The actions a schedule entry runs, in order."""
    return tuple(step) if type(step) is Overlapped else (step,)


@dataclass(frozen=True)
class Schedule:
    """One training step's actions of every pipeline rank, and the model parts each rank holds."""

    name: str
    placement: tuple[tuple[int, ...], ...]  # per rank: its parts, chunk 0 first
    actions: tuple[tuple[Action | Overlapped, ...], ...]  # per rank, in order

    @property
    def stages(self) -> int:
        return len(self.placement)

    @property
    def parts(self) -> int:
        return sum(len(parts) for parts in self.placement)

    def rank_of(self, part: int) -> int:
        """The rank that holds model part `part`."""
        return next(rank for rank, parts in enumerate(self.placement) if part in parts)

    def chunk_of(self, rank: int, part: int) -> int:
        """Which of rank `rank`'s chunks model part `part` is."""
        return self.placement[rank].index(part)

    def backwards_follow_forwards(self) -> bool:
        """Whether every rank runs each forward's whole backward (B) right after it: F0 B0 F1 B1 ... (1F1B on one
        stage), not every forward first (GPipe) nor the backward split in I and W (zero bubble)."""
        for steps in self.actions:
            if len(steps) % 2 or any(type(step) is Overlapped for step in steps):
                return False
            for forward, backward in zip(steps[::2], steps[1::2]):
                if ((forward.kind, backward.kind) != ("F", "B")
                        or (forward.part, forward.microbatch) != (backward.part, backward.microbatch)):
                    return False
        return True

    def splits_backward(self) -> bool:
        """Whether some backward runs as I and W apart (the engine then measures the weight gradients)."""
        return any(a.kind == "I" for steps in self.actions for step in steps for a in computations(step))


def looped_placement(stages: int, chunks: int) -> tuple[tuple[int, ...], ...]:
    """Rank r holds parts r, r + p, r + 2p, ... (Megatron-LM's interleaving; one part each when chunks is 1)."""
    return tuple(tuple(chunk * stages + rank for chunk in range(chunks)) for rank in range(stages))


def v_placement(stages: int) -> tuple[tuple[int, ...], ...]:
    """The V: rank r holds part r on the way down and part 2p - 1 - r on the way back (DualPipeV, ZB-V)."""
    return tuple((rank, 2 * stages - 1 - rank) for rank in range(stages))


def one_forward_one_backward(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """`warmup` forwards, then forward and backward in turn, then the remaining backwards."""
    actions = forwards[:warmup]
    for forward, backward in zip(forwards[warmup:], backwards):
        actions += [forward, backward]
    return actions + backwards[len(forwards) - warmup:]


def check_schedule(schedule: Schedule, microbatches: int) -> None:
    """Raise ValueError (one line, naming the rank and action) unless every rank runs each of its parts' microbatches
    forward once and backward once (B, or I then W), each backward after its forward, W after I; the order
    across ranks (a backward after the next part's) is the timeline's to prove (timeline.py)."""
    held = sorted(part for parts in schedule.placement for part in parts)
    if held != list(range(len(held))):
        raise ValueError(f"the ranks hold parts {held}; each of 0..{len(held) - 1} must be held once")
    for rank, steps in enumerate(schedule.actions):
        done: dict[tuple, int] = {}
        for step in steps:
            for action in computations(step):
                if action.kind not in KINDS:
                    raise ValueError(f"rank {rank}: {action}: unknown kind {action.kind!r} (known: F, I, W, B)")
                if action.part not in schedule.placement[rank]:
                    raise ValueError(f"rank {rank}: {action}: part {action.part} is held by another rank")
                if not 0 <= action.microbatch < microbatches:
                    raise ValueError(f"rank {rank}: {action}: microbatch out of 0..{microbatches - 1}")
                key = (action.part, action.microbatch)
                before = {"F": (), "I": ("F",), "B": ("F",), "W": ("I",)}[action.kind]
                if any((kind, *key) not in done for kind in before):
                    raise ValueError(f"rank {rank}: {action} runs before its {before[0]}")
                if (action.kind, *key) in done or action.kind in ("I", "B") and \
                        any((kind, *key) in done for kind in ("I", "B")):
                    raise ValueError(f"rank {rank}: {action} runs twice")
                done[(action.kind, *key)] = 1
        for part in schedule.placement[rank]:
            for microbatch in range(microbatches):
                if ("F", part, microbatch) not in done or not (
                        ("B", part, microbatch) in done or ("W", part, microbatch) in done):
                    raise ValueError(f"rank {rank}: part {part} microbatch {microbatch} is not run forward and "
                                     "backward (B, or I and W)")


def one_chunk(name: str, chunks: int) -> None:
    """A schedule over one model part per rank."""
    if chunks != 1:
        raise ValueError(f"parallel.pipeline.virtual_stages: {chunks} chunks per device need schedule interleaved "
                         f"(or dualpipev with 2, or a file); {name} holds one")


def at_least(name: str, microbatches: int, needed: int, why: str) -> None:
    """A schedule whose shape needs `needed` microbatches or more."""
    if microbatches < needed:
        raise ValueError(f"parallel.pipeline.microbatches: {name} needs at least {needed} ({why}), got {microbatches}")
