"""How a job's devices cooperate each step: the scheme registry and the protocol the runner relies on.

A scheme is built as `SCHEMES[parallel.scheme](job, on_step)` and provides
what `Scheme` lists. Its core is `program(rank)`: the rank's whole training as
a step program (simtrain/step_ops.py), which the job starts on its backend
clock and the memory plan replays on meta tensors. A new scheme is one file
and one line in SCHEMES.

- sync.py: data parallelism with a gradient all-reduce every step (one entry
  per all-reduce algorithm in simtrain.comm.ALGORITHMS);
- asynchronous.py: workers that pull and push through a shared-memory store;
- model_parallel.py: pipeline and tensor parallelism, mixed with data
  parallelism (any `parallel.pp` or `parallel.tp` above 1, whatever the
  all-reduce algorithm).

    scheme = build_scheme(job, on_step=None)
    job.start(); run_to_end(job.cluster.env)
    scheme.stuck() or scheme.report_sections()

Every program runs `yield from job.before_step(rank, step)` before each step
and ends there if it returns False: the one place a job changes hyperparameters
or pauses a rank between steps (job.py).

A lost device (recovery.py) needs more of a scheme than the protocol below:
sync.py restarts (`program(rank, first_step)`, `rewind(step)`, `regroup()`),
asynchronous.py goes on without the worker (`lose_worker(rank)`); scenario.py
refuses lost devices and checkpoints under model_parallel.py.
"""
from typing import Callable, Protocol

from torch import nn

from ..comm import ALGORITHMS
from .asynchronous import AsynchronousSGD
from .model_parallel import ModelParallel
from .sync import SyncDataParallel


class Scheme(Protocol):
    """What the runner and the memory plan rely on."""

    loss_curve: list[tuple[float, float | None]]  # (sim_time_s, loss) per step (per update for async)

    def program(self, rank: int):
        """Job rank `rank`'s training: a generator of step-program operations."""

    @classmethod
    def steps_until_every_rank_stepped(cls, world: int) -> int:
        """The `train.steps` after which every rank has run one step (what the memory plan replays)."""

    def stuck(self) -> list[int]:
        """Ranks waiting for peers that never came, once the clock has stopped (a deadlock)."""

    def trained_model(self) -> nn.Module:
        """The model the run trains (rank 0's replica, or the shared parameters)."""

    def final_models(self) -> list[nn.Module]:
        """What the run ends with, in rank order (one shared model for async)."""

    def samples_per_step(self) -> int:
        """Samples one step (one update for async) consumes across the job."""

    def single_device_step_s(self) -> float | None:
        """Seconds one device alone would need per step: the scaling-efficiency baseline."""

    def report_sections(self) -> dict:
        """The scheme's own sections of report.json."""

    # Where the training state lives: "replicated" (every job rank holds all of it), "sharded" (each rank
    # its own part) or "store" (the cluster's shared-memory store).
    state_placement: str

    # Whether every collective the scheme runs on the job's communicator is one ring all-reduce program
    # (comm/ring_schedule.py's RingAllReduce): then a job alone on its network may time them as a group.
    only_ring_all_reduces: bool

    def set_hyperparameters(self, rank: int, values: dict) -> None:
        """Set live hyperparameters ({"train.optimizer.lr": 0.1}) from job rank `rank`'s next step on
        (train/hyperparameters.py)."""

    def training_state(self, rank: int):
        """A packed copy of what job rank `rank` trains on from (train/training_state.py TrainingState);
        the whole state for replicated and store placements."""

    def load_training_state(self, rank: int, state, flat) -> None:
        """Job rank `rank` goes on from `flat`, its received copy of `state.flat`, bit for bit."""


SCHEMES: dict[str, Callable] = {
    **dict.fromkeys(ALGORITHMS, SyncDataParallel),
    "async": AsynchronousSGD,
}


def build_scheme(job, on_step=None) -> Scheme:
    """The scheme `job.scenario.parallel` asks for, for this job."""
    parallel = job.scenario.parallel
    if parallel.model_parallel:
        return ModelParallel(job, on_step)
    return SCHEMES[parallel.scheme](job, on_step)
