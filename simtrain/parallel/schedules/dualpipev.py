"""DualPipeV (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, and github.com/deepseek-ai/DualPipe): the V.

The 2p model parts fold into a V over the p ranks: rank r holds part r on the
way down and part 2p - 1 - r on the way back, so rank 0 holds the first part
and the last (the loss). DualPipe's schedule, cut in half: rank r runs, in
order (the phases of torch.distributed.pipelining's ScheduleDualPipeV; here
"down" is part r and "up" part 2p - 1 - r):

1. 2(p - r - 1) forwards of down;
2. r + 1 pairs: a forward of down, a forward of up;
3. p - r - 1 times: an input backward (I) of up, a W held back from an earlier
   I if any, a forward of up;
4. m - 2p + r + 1 times: a forward of down overlapped with a whole backward of
   up (on the last rank the first pair runs apart, which shortens its bubble),
   then a forward of up overlapped with a whole backward of down;
5. p - r - 1 times: a backward of up, then a forward of up overlapped with a
   backward of down;
6. r + 1 pairs of backwards, up then down; from the middle pair on (for an odd
   rank from its up, an even rank from its down) they split into I, their W
   held back;
7. p - r - 1 times: a held-back W, then a backward of down (I once split);
8. the W passes still held back.

It needs m >= 2p (phase 4 runs at least once on rank 0). Overlapped pairs are
`Overlapped(F, B)`: the engine runs them one after the other (one device
computes one thing at a time; what overlapping buys is one's communication
behind the other's compute, and the engine's sends and receives are posted
without waiting already: schemes/pipeline.py). The DualPipe README gives the
bubble as (PP/2 - 1)(F&B + B - 3W) for PP = 2p parts, F, B, W of one part
and F&B a pair overlapped; run in sequence, F&B = F + B.

    build(stages=2, microbatches=4, chunks=2).placement   # ((0, 3), (1, 2))
"""
from .actions import Action, Overlapped, Schedule, at_least, v_placement


def build(stages: int, microbatches: int, chunks: int, source=None) -> Schedule:
    if chunks != 2:
        raise ValueError(f"parallel.pipeline.virtual_stages: dualpipev holds exactly 2 model parts per rank (the V), "
                         f"got {chunks}")
    at_least("dualpipev", microbatches, 2 * stages, f"2 x pp = {2 * stages}, as many as model parts")
    return Schedule("dualpipev", v_placement(stages),
                    tuple(_RankPlan(stages, rank, microbatches).actions() for rank in range(stages)))


class _RankPlan:
    """One rank's actions, built phase by phase; each part's next microbatch counted per kind."""

    def __init__(self, stages: int, rank: int, microbatches: int):
        self.stages, self.rank, self.microbatches = stages, rank, microbatches
        self.down, self.up = rank, 2 * stages - 1 - rank
        self.next = {}  # (part, "F" | "I") -> its next microbatch
        self.held: list[Action] = []  # W passes held back, oldest first
        self.steps: list = []

    def forward(self, part: int) -> Action:
        return self._take(part, "F", "F")

    def backward(self, part: int, split: bool = False) -> Action:
        """A whole backward (B) of `part`'s next microbatch, or with `split` its I, its W held back."""
        action = self._take(part, "I", "I" if split else "B")
        if split:
            self.held.append(Action("W", part, action.microbatch))
        return action

    def _take(self, part: int, counter: str, kind: str) -> Action:
        microbatch = self.next.get((part, counter), 0)
        self.next[part, counter] = microbatch + 1
        return Action(kind, part, microbatch)

    def held_weight(self) -> list[Action]:
        return [self.held.pop(0)] if self.held else []

    def actions(self) -> tuple:
        p, r, down, up = self.stages, self.rank, self.down, self.up
        steps = [self.forward(down) for _ in range(2 * (p - r - 1))]
        for _ in range(r + 1):
            steps += [self.forward(down), self.forward(up)]
        for _ in range(p - r - 1):
            steps += [self.backward(up, split=True), *self.held_weight(), self.forward(up)]
        for pair in range(self.microbatches - 2 * p + r + 1):
            if pair == 0 and r == p - 1:
                steps += [self.forward(down), self.backward(up)]
            else:
                steps.append(Overlapped(self.forward(down), self.backward(up)))
            steps.append(Overlapped(self.forward(up), self.backward(down)))
        for _ in range(p - r - 1):
            steps += [self.backward(up), Overlapped(self.forward(up), self.backward(down))]
        split = False
        for pair in range(r + 1):
            split = split or (pair == (r + 1) // 2 and r % 2 == 1)
            steps.append(self.backward(up, split))
            split = split or (pair == (r + 1) // 2 and r % 2 == 0)
            steps.append(self.backward(down, split))
        for _ in range(p - r - 1):
            steps += [*self.held_weight(), self.backward(down, split)]
        return tuple(steps + self.held)
