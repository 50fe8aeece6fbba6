"""What every scheme provides: the `Scheme` protocol, with the defaults of its hooks.

A scheme says how a job's devices cooperate each step (data parallelism,
async SGD, pipeline and tensor parallelism, ...). The runner, the memory plan,
recovery and population-based training use a scheme only through what this
protocol lists, and never ask which scheme they hold. A scheme subclasses
`Scheme` (a typing.Protocol whose hooks carry defaults) and provides what has
no default; it overrides a hook where its behaviour differs:

- `device_lost(rank)`: default None, the job restarts every rank from its
  checkpoint (recovery.py); a scheme that goes on without the device says
  what it did about it (asynchronous.py);
- `rewind(step)`, `regroup()` and `resume(rank)`: what a restart needs
  (default: forget the loss curve after `step`; nothing to rebuild; nothing
  to fetch after a rank has read its checkpoint);
- `state_source(rank)` and `state_receivers()`: where the training state
  lives. By default rank 0 holds the whole state (replicated) and every rank
  receives a copy; model parallelism has each rank take its own share, async
  keeps it in the store (rank 0 stands for the store);
- `receive_state(rank, donor, state)`: the step program by which a rank
  receives a donor job's state over the network (a PBT exploit); by default
  1/k from the donor's rank of the same index, then a ring all-gather among
  the job's ranks;
- `mirror_of`: device rank -> the device rank whose figures it reports (empty
  by default; representatives.py fills it); `pushes_lost`: updates a lost
  device had in flight and lost (0 by default).

    class MyScheme(RankReplicas, Scheme):
        def __init__(self, job, on_step=None): ...
        def program(self, rank): ...

The registry that finds a scheme for a scenario is simtrain/schemes/__init__.py;
docs/concepts/schemes.md is the guide to adding one.
"""
from types import MappingProxyType
from typing import Mapping, Protocol

import torch
from torch import nn

from ..comm.ring import ring_all_gather
from ..step_ops import Alloc, Collective, Free, Transfer


class Scheme(Protocol):
    """What the runner, the memory plan, recovery and population-based training rely on."""

    loss_curve: list[tuple[float, float | None]]  # (sim_time_s, loss) per step (per update for async)

    # Whether every collective the scheme runs on the job's communicator is one ring all-reduce program
    # (comm/ring_schedule.py's RingAllReduce): then a job alone on its network may time them as a group.
    only_ring_all_reduces: bool = False
    # each rank holds its share of the model (schemes/model_parts.py), not a whole replica (the step engine)
    holds_shares: bool = False

    # device rank -> the device rank whose figures it reports: a rank another one's program stands for
    # (strategies/representatives.py); empty when every rank runs its own program.
    mirror_of: Mapping[int, int] = MappingProxyType({})

    # Pushes a lost device had in flight and lost (report.json's faults.pushes_lost): async only loses any.
    pushes_lost: int = 0

    # ---- what every scheme provides ----------------------------------------------

    @classmethod
    def applies(cls, parallel) -> bool:
        """Whether this scheme runs a scenario whose `parallel` section (scenario.ParallelSpec) is this one;
        the registry takes the first scheme that applies (simtrain/schemes/__init__.py)."""
        ...

    def program(self, rank: int):
        """Job rank `rank`'s training: a generator of step-program operations. A scheme that restarts after a
        lost device (`device_lost` None) also takes `program(rank, first_step)`, its training from that step."""
        ...

    @classmethod
    def steps_until_every_rank_stepped(cls, world: int) -> int:
        """The `train.steps` after which every rank has run one step (what the memory plan replays)."""
        ...

    def stuck(self) -> list[int]:
        """Ranks waiting for peers that never came, once the clock has stopped (a deadlock)."""
        ...

    def trained_model(self) -> nn.Module:
        """The model the run trains (rank 0's replica, or the shared parameters)."""
        ...

    def final_models(self) -> list[nn.Module]:
        """What the run ends with, in rank order (one shared model for async)."""
        ...

    def samples_per_step(self) -> int:
        """Samples one step (one update for async) consumes across the job."""
        ...

    def single_device_step_s(self) -> float | None:
        """Seconds one device alone would need per step: the scaling-efficiency baseline."""
        ...

    def report_sections(self) -> dict:
        """The scheme's own sections of report.json."""
        ...

    def set_hyperparameters(self, rank: int, values: dict) -> None:
        """Set live hyperparameters ({"train.optimizer.lr": 0.1}) from job rank `rank`'s next step on
        (train/hyperparameters.py)."""
        ...

    def training_state(self, rank: int):
        """A packed copy of what job rank `rank` trains on from (train/training_state.py TrainingState)."""
        ...

    def load_training_state(self, rank: int, state, flat) -> None:
        """Job rank `rank` goes on from `flat`, its received copy of `state.flat`, bit for bit."""
        ...

    # ---- hooks, with their defaults --------------------------------------------------

    def device_lost(self, rank: int) -> dict | None:
        """Job rank `rank`'s device is lost now (its program has ended where it stood). None: the job stops
        every rank and restarts from its checkpoint on a spare (recovery.py); a dict: the job goes on
        without the device, and the dict (report.json's fault event) says what the scheme did about it."""
        return None

    def rewind(self, step: int) -> None:
        """Forget what came after step `step`: the job restarts there from a checkpoint (recovery.py)."""
        del self.loss_curve[step:]

    def regroup(self) -> None:
        """Rebuild what depends on the job's devices (a spare took a lost device's place): nothing by default."""

    def stopped(self) -> None:
        """The clock stopped before every program ended (out of memory, a fault that ended the job): put the
        trained models together from what the ranks hold, as the programs' end would have. Nothing by default
        (every rank holds its model whole); sharded schemes publish their shards."""

    def resume(self, rank: int):
        """Step program of job rank `rank` after it loaded a training state (a checkpoint, a PBT exploit), before
        its next step: what the state leaves out, fetched from its peers. Nothing by default (a rank's state is
        all it holds); a sharded rank gathers the parameters it does not own."""
        yield from ()

    def state_source(self, rank: int) -> int:
        """The rank whose training state job rank `rank` takes in a copy: rank 0's, the whole state, by
        default (every rank holds all of it)."""
        return 0

    def state_receivers(self) -> list[int]:
        """The job ranks that receive a copied training state: every rank by default."""
        return list(range(self.job.world))

    def state_holders(self) -> list[int]:
        """The ranks whose training states together make the whole state: what a copy captures."""
        return sorted({self.state_source(rank) for rank in self.state_receivers()})

    def receive_state(self, rank: int, donor, state):
        """Step program of job rank `rank`: receive `state` (a TrainingState of job `donor`) over the network
        and go on from it. By default 1/k of it comes from the donor's rank `rank` ("exploit"), and the job's
        k ranks ring-all-gather the rest ("exploit all-gather"): the state crosses between the groups once."""
        job = self.job
        flat = torch.empty(state.nbytes, dtype=torch.uint8)
        yield Alloc("comm_buffers", state.nbytes)
        chunks, sources = flat.tensor_split(job.world), state.flat.tensor_split(job.world)
        mine = (rank + 1) % job.world  # the chunk the ring all-gather expects ring position `rank` to hold
        yield Transfer(donor.devices[rank].node, job.devices[rank].node, chunks[mine].numel(), "exploit")
        chunks[mine].copy_(sources[mine])
        if job.world > 1:
            yield Collective(ring_all_gather(rank, (rank + 1) % job.world, (rank - 1) % job.world, chunks),
                             "exploit all-gather")
        self.load_training_state(rank, state, flat)
        yield Free("comm_buffers", state.nbytes)
