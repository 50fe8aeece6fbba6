"""Training checkpoints of a synchronous job: what one holds, when it is written, what it costs.

With `train.checkpoint: {every, to, bandwidth, latency}`, before every step s
that is a multiple of `every` (never before step 0, nor again before the step a
restart starts from), every rank writes a checkpoint and only then goes on:

- **what**: its training state (train/training_state.py: weights and buffers,
  fp32 master weights under mixed precision, optimizer state, loss scale),
  packed, bit for bit, and its data loader's position. `nbytes` is that
  packed state's size, measured at each write (an optimizer's state appears
  at its first step); the live hyperparameters are not saved, as
  train.schedule gives them for every step;
- **cost**: a write (and a read after a restart) of S bytes takes
  `latency + S / bandwidth` with `to: host` (each rank over its own link to
  its host's memory, all ranks at once, so they do not slow one another), and
  `latency + n S / bandwidth` with `to: storage` (the job's n ranks write at
  once to one store and share its bandwidth equally). It is a `checkpoint`
  span on each rank's stream (a read is a `restart` span, recovery.py);
- **commit**: a checkpoint counts once every rank has written it; a device
  lost while it is being written leaves the previous one the latest. Before
  the first, the job's initial state (rebuilt from the seed, at no cost) is
  what a restart goes back to.

    checkpoints = Checkpoints(spec, job.replicas)
    yield from checkpoints.write(rank, replica, step, lambda: env.now)   # in the job's before_step
    checkpoints.restore(job.replicas)                         # a restart (recovery.py)
"""
from dataclasses import dataclass

from ..scenario import TrainCheckpointSpec
from ..step_ops import Busy
from .training_state import TrainingState


@dataclass
class Saved:
    """A committed checkpoint: the step it goes on from, and each rank's state and loader position."""

    step: int
    states: list[TrainingState]
    positions: list
    committed_at_s: float  # when its last rank finished writing it (0 for the initial state)


class Checkpoints:
    """A job's checkpoints: the latest committed one, the one being written, the time spent writing."""

    def __init__(self, spec: TrainCheckpointSpec, replicas: list):
        self.spec = spec
        self.world = len(replicas)
        self.saved = Saved(0, [replica.training_state() for replica in replicas],
                           [replica.loader.position() for replica in replicas], 0.0)
        self.first_step = 0  # the step the running job started from: no checkpoint is written before it
        self.committed = 0  # checkpoints committed
        self.nbytes = 0  # bytes of one rank's state at the last write
        self._writing: dict[int, list] = {}  # step -> [states, positions, ranks done]

    def seconds(self, nbytes: int) -> float:
        """One rank's write (or read) of `nbytes` while every rank of the job writes (reads) its own."""
        writers = self.world if self.spec.to == "storage" else 1
        return self.spec.latency + writers * nbytes / self.spec.bandwidth

    def due(self, step: int) -> bool:
        return step > self.first_step and step % self.spec.every == 0

    def write(self, rank: int, replica, step: int, now):
        """Step program: rank `rank` writes its state before step `step`; the checkpoint commits with the
        last rank's write. `now()` is the clock."""
        state = replica.training_state()
        self.nbytes = state.nbytes
        entry = self._writing.setdefault(step, [[None] * self.world, [None] * self.world, 0])
        entry[0][rank], entry[1][rank] = state, replica.loader.position()
        yield Busy(self.seconds(state.nbytes), f"checkpoint (step {step})", kind="checkpoint", nbytes=state.nbytes)
        entry[2] += 1
        if entry[2] == self.world:
            del self._writing[step]
            self.saved = Saved(step, entry[0], entry[1], now())
            self.committed += 1

    def restore(self, replicas: list) -> None:
        """Every rank's replica goes on from the latest committed checkpoint, bit for bit; writes begun
        after it are dropped."""
        self._writing.clear()
        self.first_step = self.saved.step
        for replica, state, position in zip(replicas, self.saved.states, self.saved.positions):
            replica.load_training_state(state, state.flat.clone())
            replica.loader.seek(position)

    def read_seconds(self, rank: int) -> float:
        """Rank `rank`'s read of its part of the latest checkpoint, every rank reading its own at once."""
        return self.seconds(self.saved.states[rank].nbytes)
