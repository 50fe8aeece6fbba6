"""A schedule's timeline with fixed action times: the closed-form world its papers reason in (pure logic).

`timeline(schedule, microbatches, costs)` runs every rank's actions in order,
each as soon as its rank is free and its inputs exist: a forward after the
previous part's forward of its microbatch, an input backward (I, or B) after
the next part's input backward, W after its I; transfers are free. An
overlapped pair runs its forward, then its backward; given a cost "FB", it
runs as one unit of that time once both its inputs are there, as DualPipe
counts its F&B and as the engine runs it (schemes/pipeline.py). A schedule
that waits on itself raises ValueError naming a rank stuck and the action it
waits at. Each rank's bubble is the step's span less its busy time, as the
papers count it:

    line = timeline(build_schedule("1f1b", 4, 8, 1), 8, {"F": 1.0, "B": 2.0})
    line.bubble_s[0]   # 9.0 = (p - 1)(t_f + t_b)
"""
from dataclasses import dataclass

from .actions import Overlapped, Schedule


@dataclass(frozen=True)
class Timeline:
    step_s: float  # when the last action of any rank ends
    busy_s: tuple[float, ...]  # per rank: the time its actions take
    ends: dict  # (kind, part, microbatch) -> when it ended

    @property
    def bubble_s(self) -> tuple[float, ...]:
        """Per rank: the step's time it spends idle."""
        return tuple(self.step_s - busy for busy in self.busy_s)


def timeline(schedule: Schedule, microbatches: int, costs: dict[str, float]) -> Timeline:
    """Run `schedule` with `costs` seconds per action kind ("F", "I", "W"; "B" defaults to I + W; "FB", when
    given, an overlapped pair's)."""
    cost = dict(costs)
    cost.setdefault("B", cost.get("I", 0.0) + cost.get("W", 0.0))
    last = schedule.parts - 1
    ends: dict[tuple, float] = {}
    free = [0.0] * schedule.stages
    busy = [0.0] * schedule.stages
    queues = [[unit for step in steps for unit in ([step] if type(step) is Overlapped and "FB" in cost
                                                    else _units(step))] for steps in schedule.actions]
    position = [0] * schedule.stages
    while any(position[r] < len(queues[r]) for r in range(schedule.stages)):
        moved = False
        for rank, queue in enumerate(queues):
            while position[rank] < len(queue):
                unit = queue[position[rank]]
                actions = tuple(unit) if type(unit) is Overlapped else (unit,)
                needs = [need for action in actions for need in _inputs(action, last)
                         if need not in [tuple(a) for a in actions]]
                if any(need not in ends for need in needs):
                    break
                took = cost["FB"] if type(unit) is Overlapped else cost[unit.kind]
                start = max([free[rank], *(ends[need] for need in needs)])
                free[rank] = start + took
                busy[rank] += took
                for action in actions:
                    ends[tuple(action)] = free[rank]
                    if action.kind == "B":
                        ends[("I", action.part, action.microbatch)] = free[rank]
                position[rank] += 1
                moved = True
        if not moved:
            stuck = next(r for r in range(schedule.stages) if position[r] < len(queues[r]))
            raise ValueError(f"rank {stuck} waits forever at {queues[stuck][position[stuck]]}")
    return Timeline(max(free), tuple(busy), ends)


def _units(step) -> tuple:
    """A schedule entry as the actions it runs in sequence."""
    return tuple(step) if type(step) is Overlapped else (step,)


def _inputs(action, last: int) -> list:
    """What `action` waits for: the keys of `ends` it needs."""
    if action.kind == "F":
        return [] if action.part == 0 else [("F", action.part - 1, action.microbatch)]
    if action.kind == "W":
        return [("I", action.part, action.microbatch)]
    needs = [("F", action.part, action.microbatch)]
    return needs if action.part == last else needs + [("I", action.part + 1, action.microbatch)]
