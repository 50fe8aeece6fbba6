"""The progress bar of `simtrain run`: steps done, simulated time and loss, wall time spent and left.

The bar says "preparing" until the first step ends (the cluster and the job are
being built). Simulated time shows in a fitting unit (µs to hours), the wall
time left is rich's estimate from the steps' pace. A run with numerics on
that will take long gets one warning, once its pace is known (after
`WARN_AFTER_STEPS` steps): the estimated wall time, and that `--no-numerics`
times the same scenario without arithmetic. Wall time only reaches the
terminal, never a result.

    with RunProgress(scenario, total_steps, err_console) as progress:
        report = run(scenario, on_step=progress.on_step)
"""
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .units import format_seconds

WARN_AFTER_STEPS = 3
LONG_RUN_S = 120.0  # a numerics-on run expected to take longer than this gets the --no-numerics hint


class RunProgress:
    """A transient progress bar over a run's steps, with the long-run warning."""

    def __init__(self, scenario, total_steps: int, console: Console):
        self.name, self.numerics, self.total = scenario.name, scenario.numerics, total_steps
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("sim {task.fields[sim]}  loss {task.fields[loss]:.4f}"),
                                 TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                                 console=console, transient=True)
        self.task = self.progress.add_task(f"{self.name}: preparing", total=total_steps, sim="0 s",
                                           loss=float("nan"))
        self.first_step_at: float | None = None
        self.warned = False

    def __enter__(self) -> "RunProgress":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
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
