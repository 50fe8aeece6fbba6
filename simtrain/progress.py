"""Progress on the standard error: `simtrain run`'s and `compare`'s bar over a run's steps, `sweep`'s over its points.

RunProgress shows steps done, simulated time and loss, wall time spent and left.

The bar says "preparing" until the first step ends (the cluster and the job are
being built). Simulated time shows in a fitting unit (µs to hours), the wall
time left is rich's estimate from the steps' pace. A run with numerics on
that will take long gets one warning, once its pace is known (after
`WARN_AFTER_STEPS` steps): the estimated wall time, and that `--no-numerics`
times the same scenario without arithmetic. Wall time only reaches the
terminal, never a result.

SweepProgress counts a sweep's points: on a terminal a bar whose spinner and
clock turn while a long point runs; elsewhere (a log) one line a point.

The bars are transient and drawn only on a terminal: piped, the standard error
gets no bar (the commands' --quiet leaves the progress out altogether).

    with RunProgress(scenario, err_console) as progress:
        report = run(scenario, on_step=progress.on_step)
    with SweepProgress(points, err_console) as progress:
        rows = run_sweep(..., on_done=progress.on_done)
"""
import time

from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

from .units import format_seconds

WARN_AFTER_STEPS = 3
LONG_RUN_S = 120.0  # a numerics-on run expected to take longer than this gets the --no-numerics hint


class RunProgress:
    """A transient progress bar over a run's steps (every member's, for a population), with the long-run warning;
    `label` names the run (default: the scenario's name)."""

    def __init__(self, scenario, console: Console, label: str | None = None):
        population = scenario.pbt.population if scenario.pbt is not None else 1
        self.name, self.numerics = escape(label or scenario.name), scenario.numerics
        self.total = population * scenario.train.steps
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("sim {task.fields[sim]}  loss {task.fields[loss]:.4f}"),
                                 TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                                 console=console, transient=True)
        self.task = self.progress.add_task(f"{self.name}: preparing", total=self.total, sim="0 s",
                                           loss=float("nan"))
        self.first_step_at: float | None = None
        self.warned = False

    def __enter__(self) -> "RunProgress":
        if self.progress.console.is_terminal:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress.live.is_started:  # (rich's stop writes an empty line where it is not a terminal)
            self.progress.stop()

    def on_step(self, step: int, sim_time_s: float, loss: float | None) -> None:
        """After step `step` (0-based) ended at simulated time `sim_time_s`, with its loss."""
        self.progress.update(self.task, description=self.name, completed=step + 1, sim=format_seconds(sim_time_s),
                             loss=float("nan") if loss is None else loss)
        now = time.perf_counter()
        if self.first_step_at is None:
            self.first_step_at = now  # the first step's wall time includes building the job: pace from here
            return
        steps_timed = step  # steps since the first ended
        if self.numerics and not self.warned and steps_timed >= WARN_AFTER_STEPS:
            self.warned = True
            left_s = (now - self.first_step_at) / steps_timed * (self.total - step - 1)
            if left_s > LONG_RUN_S:
                self.progress.console.print(
                    f"warning: about {format_seconds(left_s)} of wall time left with numerics on; --no-numerics "
                    "gives the same times, bytes and memory without the arithmetic (no loss, no accuracy)",
                    markup=False, highlight=False, soft_wrap=True)


class SweepProgress:
    """A sweep's points done: a transient bar on a terminal, one line a point elsewhere, nothing if not `shown`
    (--quiet); `done` counts them either way."""

    def __init__(self, points: int, console: Console, shown: bool = True):
        self.console, self.done = console, 0
        self.bar, self.lines = shown and console.is_terminal, shown and not console.is_terminal
        self.progress = Progress(SpinnerColumn(), TextColumn("[bold]sweep"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("points"), TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                                 console=console, transient=True)
        self.task = self.progress.add_task("sweep", total=points)

    def __enter__(self) -> "SweepProgress":
        if self.bar:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar:
            self.progress.stop()

    def on_done(self, done: int, points: int) -> None:
        """`done` of the sweep's `points` have finished (resumed ones included)."""
        self.done = done
        if self.bar:
            self.progress.update(self.task, completed=done, total=points)
        elif self.lines:
            self.console.print(f"[{done}/{points}] points done", markup=False, highlight=False)
