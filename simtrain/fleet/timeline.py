"""A fleet run's record over time: the steps the job stood at, and when failures struck; read back day by day.

The steps change linearly while the job trains and stay put otherwise, and
drop at a failure (the work since the checkpoint it restarts from); marks
at each change are enough to read the steps at any time.

    timeline = Timeline()
    timeline.mark(0.0, 0.0); timeline.mark(100.0, 50.0); timeline.failed(100.0)
    timeline.steps_at(40.0)                # 20.0
    timeline.daily(end_s=100.0)            # [{"day": 1, "steps": 50.0, "interruptions": 1}]
"""
import math
from bisect import bisect_right

DAY_S = 86400.0


class Timeline:
    """(time, steps) marks in time order, and the failures' times."""

    def __init__(self):
        self.times, self.steps = [0.0], [0.0]
        self.failure_times: list[float] = []

    def mark(self, time_s: float, steps: float) -> None:
        self.times.append(time_s)
        self.steps.append(steps)

    def failed(self, time_s: float) -> None:
        self.failure_times.append(time_s)

    def steps_at(self, time_s: float) -> float:
        """Steps the job stood at, at `time_s` (the last mark at that time; linear between two while training)."""
        index = bisect_right(self.times, time_s) - 1
        steps = self.steps[index]
        if index + 1 < len(self.times):
            start, end, next_steps = self.times[index], self.times[index + 1], self.steps[index + 1]
            if end > start and next_steps > steps:
                return steps + (next_steps - steps) * (time_s - start) / (end - start)
        return steps

    def daily(self, end_s: float) -> list[dict]:
        """Per day until `end_s`: the steps the job stood at when it ended, and the failures in it."""
        days = []
        for day in range(1, math.ceil(end_s / DAY_S - 1e-9) + 1):
            days.append({"day": day, "steps": self.steps_at(min(day * DAY_S, end_s)),
                         "interruptions": sum(1 for time in self.failure_times
                                              if (day - 1) * DAY_S <= time < day * DAY_S)})
        return days
