"""A lost device in a population: only its member restarts, on a spare, from the latest round it went on from.

The semantics are Ray Tune's (a failed trial is restored from its latest
checkpoint, which under PBT is the one its last perturbation round left; the
other trials go on). Each member's job has its own recovery.py `Recovery`,
all of them taking spares from the cluster's one pool (`cluster.spares`, the
cluster's last devices), so detection, the checkpoint's read, the work redone
and the time lost are counted for a member exactly as for a job. What a
member restarts from is its `RoundCheckpoints`, in the shape recovery.py
reads a job's checkpoints:

- **what**: the state the member went on from at its latest round, per job
  rank: its own round checkpoint, or the donor's it copied there (an
  exploit), with its loader's position and its live hyperparameters (the
  explored ones after an exploit); before its first round, its initial
  state and values. It becomes the restart point once every rank of the
  member has gone on from the round (copy done); that moment is its
  `committed_at_s`, from which the work redone is counted;
- **cost**: each rank reads its part from the population's storage
  (`pbt.checkpoint`: latency + bytes / bandwidth, reads side by side, as
  the round's writes);
- **rounds**: a restarted member does not take part again in the round it
  restarts from (it took part once: its metric, checkpoint and decision
  stand); it meets the next round as it would have. A device lost while its
  member is in a round (from its first rank pausing there to its last going
  on, copy included) fails the run with one line: going back to the round
  before would make the member take part in this one twice, and the right
  restart point (this round's outcome) may not be decided yet. Async
  members are refused: a member goes on without a lost worker, which would
  never reach its next round.

With `synch: true` a round waits for every member and decides in member
order, so a restart changes no decision: the population ends bit for bit as
the fault-free one, later by the restart's time lost when the member is the
round's last (tested). Without synch a ready member is compared with the
others' latest metrics as they stand, so a restart can change what it sees.

    faults = PopulationFaults(population)      # before the members start
    faults.went_on(member, rank)                 # rank `rank` of `member` goes on from its round
    faults.round_done(member, step, state, now)  # every rank of it did, at the round of step `step`
    faults.section(fault_free_time_s, sim_time_s) # report.json's `faults`
"""
from ..errors import JobFailed
from ..hw.faults import FaultInjector
from ..recovery import Recovery
from ..train.job_checkpoint import Saved


class RoundCheckpoints:
    """A member's restart point (recovery.py reads it as a job's checkpoints): the state, loader positions and
    hyperparameters it went on from at its latest round."""

    def __init__(self, job, storage, values: dict):
        self.job = job
        self.storage = storage  # pbt.checkpoint: where the round checkpoints are kept
        self.first_step = 0  # the step the running member started from: its round is not taken again
        self.committed = 0  # rounds it went on from
        self.nbytes = 0  # bytes of one rank's state at the latest round
        self.values = dict(values)
        # each rank's loader position as it went on from the round (a rank may draw its next batch before the
        # last rank goes on)
        self.positions = [replica.loader.position() for replica in job.replicas]
        scheme = job.scheme
        self.saved = self._saved(0, {rank: scheme.training_state(rank) for rank in scheme.state_holders()}, 0.0)

    def _saved(self, step: int, state: dict, now: float) -> Saved:
        scheme = self.job.scheme
        return Saved(step, [state[scheme.state_source(rank)] for rank in range(self.job.world)], list(self.positions),
                     now)

    @staticmethod
    def due(_step: int) -> bool:
        """A member writes no checkpoint of its own between rounds."""
        return False

    def commit(self, step: int, state: dict, values: dict, now: float) -> None:
        """The member went on from its round at `step` with `state` (holder rank -> TrainingState) and `values`."""
        self.saved = self._saved(step, state, now)
        self.values = dict(values)
        self.committed += 1
        self.nbytes = max(part.nbytes for part in self.saved.states)

    def restore(self, replicas: list) -> None:
        """Every rank goes on from the restart point, bit for bit, with its loader's position and hyperparameters."""
        self.first_step = self.saved.step
        scheme = self.job.scheme
        for rank, (replica, state, position) in enumerate(zip(replicas, self.saved.states, self.saved.positions)):
            scheme.load_training_state(rank, state, state.flat.clone())
            replica.loader.seek(position)
            scheme.set_hyperparameters(rank, self.values)

    def read_seconds(self, rank: int) -> float:
        """Rank `rank`'s read of its part from storage, every rank reading its own at once."""
        return self.storage.latency + self.saved.states[rank].nbytes / self.storage.bandwidth


class PopulationFaults:
    """The population's faults: one injector for the cluster, one Recovery per member, one pool of spares."""

    def __init__(self, population):
        self.population = population
        members = population.members
        spares = list(range(len(members) * members[0].job.world, population.cluster.size))  # every member's
        for member in members:
            job = member.job
            job.checkpoints = RoundCheckpoints(job, population.spec.checkpoint, member.values)
            member.recovery = Recovery(job, spares, on_rewind=lambda step, member=member: self._rewound(member, step))
        self.injector = FaultInjector(population.cluster, population.scenario,
                                      [rank for member in members for rank in member.job.ranks], self._device_lost)
        self.injector.start(population.env.all_of([member.job.finished for member in members]))

    def _device_lost(self, device: int, event: dict) -> None:
        """The member holding `device` reacts (a spare, or a device lost before: the first member's account)."""
        members = self.population.members
        member = next((member for member in members if device in member.job.ranks), members[0])
        if device in member.job.ranks:
            event["member"] = member.id
            if member.in_round is not None:
                event["effect"] = "the run failed: the member was in a round"
                raise JobFailed(f"device {device} lost at {event['at_s']:.6g} s while member {member.id} was in its "
                                f"round at step {member.in_round}: a restart would take part in it again (not "
                                "modelled)")
        member.recovery.device_lost(device, event)

    @staticmethod
    def _rewound(member, step: int) -> None:
        member.monitor.rewind(step)
        member.arrived, member.in_round = 0, None  # ranks that paused at the next round after the loss start again

    @staticmethod
    def went_on(member, rank: int) -> None:
        """Rank `rank` of `member` goes on from its round: its loader's position is the round's."""
        member.job.checkpoints.positions[rank] = member.job.replicas[rank].loader.position()

    @staticmethod
    def round_done(member, step: int, state: dict, now: float) -> None:
        """Every rank of `member` went on from its round at `step` with `state`: its restart point from now."""
        member.job.checkpoints.commit(step, state, member.values, now)

    def section(self, fault_free_time_s: float, sim_time_s: float) -> dict:
        """report.json's `faults`: the events (each lost device's `member`), the members' restarts summed, the
        round checkpoints' count, size and write time (per member, on average), goodput."""
        population = self.population
        recoveries = [member.recovery for member in population.members]
        section = recoveries[0].report_section(self.injector, fault_free_time_s, sim_time_s, failed=False)
        checkpoints = [member.job.checkpoints for member in population.members]
        section.update(restarts=sum(recovery.restarts for recovery in recoveries),
                       pushes_lost=sum(member.job.scheme.pushes_lost for member in population.members),
                       checkpoints_committed=sum(checkpoint.committed for checkpoint in checkpoints),
                       checkpoint_bytes_per_rank=max(checkpoint.nbytes for checkpoint in checkpoints),
                       checkpoint_time_s=population.checkpoint_write_s / len(checkpoints))
        return section
