"""What a job does when it loses a device: go on without it, restart from its last checkpoint, or fail.

hw/faults.py stops a lost device (its program ends where it stands, its
stream's span is cut, its flows in flight are dropped) and calls
`Recovery.device_lost`. Then the scheme's `device_lost` hook
(schemes/scheme.py) says whether the job goes on without the device or
restarts:

- **async** (schemes/asynchronous.py): the other workers never wait for it
  and go on. Its update in progress is settled by the store: a push whose
  bytes had not all reached the store is lost (counted) and its claim on the
  updates returns to the others, so the job still applies `train.steps`
  updates, each once; a push that had arrived is applied. Losing every worker
  fails the job.
- **sync** (schemes/model_parallel.py and the other synchronous schemes): the other ranks run on until they wait in the
  all-reduce for a rank that will never post. The job notices the loss
  `cluster.fault_detection` seconds after it (torchrun's agent polls its
  workers every --monitor-interval, 0.1 s by default in torch 2.13) and tears
  every rank down where it stands (programs ended, spans cut, flows dropped,
  memory freed). Without `train.checkpoint` the job fails. With it, a spare
  (`cluster.spares`, the cluster's last devices, idle until then) takes the
  lost rank's place, with its rank, replica and data shard, and every rank
  reads its own part of the latest checkpoint back (`restart` span:
  train/job_checkpoint.py's read time), runs the scheme's `resume` (a
  sharded rank gathers the parameters its shard leaves out) and trains
  again from its step on communicators rebuilt over the devices as they are
  (Job.restart, the scheme's `regroup`). Every layout (pp, tp, cp, ep,
  sharded) restarts this one way: the steps after it are
  re-simulated for real, with the same batches, so the final model is the
  fault-free run's bit for bit (tested). With no spare left the job fails:
  shrinking to the survivors is not modelled (it would change the global
  batch and the data each rank reads, so the model would no longer be the
  fault-free run's).

Each loss's event in report.json says what happened and what it cost:
`detection_s` (fault to detection), `reload_s` (reading the checkpoint: the
slowest rank's part), `resume_s` (from then until every rank has fetched
what its part leaves out), `redone_s` (the simulated time between the moment training last went on from
that checkpoint, when it committed or after an earlier restart, and the
fault: work lost, redone after the restart), `steps_redone`, and
`time_lost_s`, their sum. A restarted job's time is then the fault-free
time plus that sum (tested).

    recovery = Recovery(job, spares=[4], on_rewind=monitor.rewind)
    injector = FaultInjector(cluster, scenario, job.ranks, recovery.device_lost)
"""
from typing import Any

from pydantic import Field

from .errors import JobFailed
from .report.sections import ReportSection, register_section
from .step_ops import Busy
from .train.hyperparameters import values_at


class Recovery:
    """A job's reaction to lost devices, and its account of them."""

    def __init__(self, job, spares: list[int], on_rewind=None):
        self.job = job
        self.env = job.cluster.env
        self.spares = spares  # global ranks of idle devices, taken in this order (a population's members share it)
        self.on_rewind = on_rewind  # (step) -> None: forget records after step (the training-loss monitor)
        self.detection_s = job.scenario.cluster.fault_detection
        self.resumed_at_s = 0.0  # when training last went on from the latest checkpoint
        self.restarts = 0
        self._lost = []  # (job rank, event) lost and not yet detected
        self._down = []  # job ranks whose device is lost and not replaced

    def device_lost(self, device: int, event: dict) -> None:
        """Global device `device` is lost now; `event` (report.json) is filled in with what it did."""
        job, cluster = self.job, self.job.cluster
        if device in self.spares:
            self.spares.remove(device)
            event["effect"] = "an idle spare: no longer available"
            return
        if device not in job.ranks or job.ranks.index(device) in self._down:
            event["effect"] = "none: the device was already lost"
            return
        rank = job.ranks.index(device)
        event.update(node=cluster.devices[device].node, job_rank=rank)
        self._down.append(rank)
        self._stop([rank])
        went_on = job.scheme.device_lost(rank)  # None: the job restarts from its checkpoint
        if went_on is not None:
            event.update(went_on)
            if len(self._down) == job.world:
                event["effect"] = "the job failed: every worker is lost"
                raise JobFailed(f"device {device} ({event['node']}) lost at {event['at_s']:.6g} s: every async "
                                "worker is lost")
            event["effect"] = "the job goes on without the worker"
            return
        job.lost.add(rank)  # its program stopped unfinished (with every rank lost, the job has not finished)
        self._lost.append((rank, event))
        if len(self._lost) == 1:
            self.env.timeout(self.detection_s).callbacks.append(self._detected)

    def _stop(self, ranks: list[int]) -> None:
        """Job ranks `ranks` stop now: programs ended, devices' spans cut and memory freed, flows dropped."""
        job = self.job
        for rank in ranks:
            if job.processes[rank].is_alive:
                job.processes[rank].interrupt()
            job.devices[rank].abort()
            job.abandon(rank)
        job.cluster.network.cancel_flows([job.devices[rank].node for rank in ranks])

    def _detected(self, _event) -> None:
        """The job notices its lost devices: restart on spares from the latest checkpoint, or fail."""
        job, now, log = self.job, self.env.now, self.job.cluster.log
        lost, self._lost = self._lost, []
        finished = job.finished.triggered  # the others finished without it: the run ended then
        for rank, event in lost:
            event["detected_at_s"] = now
            event["detection_s"] = now - event["at_s"]
            until = max(event["at_s"], log.last_end_s) if finished else now
            log.span(job.ranks[rank], "lost", "lost (until detected)", event["at_s"], until)
        if finished:
            for _, event in lost:
                event["effect"] = "none: the job had finished"
            return
        self._stop([rank for rank in range(job.world) if rank not in [lost_rank for lost_rank, _ in lost]])
        checkpoints = job.checkpoints
        reason = None
        if checkpoints is None:
            reason = "no train.checkpoint to restart from"
        elif len(self.spares) < len(lost):
            reason = (f"no spare left to replace it (cluster.spares; {len(self.spares)} left; shrinking to the "
                      "survivors is not modelled)")
        if reason is not None:
            for _, event in lost:
                event["effect"] = f"the job failed: {reason}"
            rank, event = lost[0]
            raise JobFailed(f"device {job.ranks[rank]} ({event['node']}) lost at {event['at_s']:.6g} s: {reason}")
        step, done = checkpoints.saved.step, len(job.scheme.loss_curve)
        reload_s = max(checkpoints.read_seconds(rank) for rank in range(job.world))  # the job's last rank to read
        # 0 for a loss while the checkpoint was being read back after an earlier one
        redone_s = max(0.0, lost[0][1]["at_s"] - max(self.resumed_at_s, checkpoints.saved.committed_at_s))
        for index, (rank, event) in enumerate(lost):
            spare = self.spares.pop(0)
            job.replace(rank, spare)
            event.update(effect="restarted on a spare", spare=spare, checkpoint_step=step,
                         steps_redone=done - step if index == 0 else 0, reload_s=reload_s if index == 0 else 0.0,
                         resume_s=0.0, redone_s=redone_s if index == 0 else 0.0)
            event["time_lost_s"] = event["detection_s"] + event["reload_s"] + event["redone_s"]
        self._down = []
        self.restarts += 1
        self._rewind(step)
        self.resumed_at_s = now + reload_s
        resumed = [self.env.event() for _ in range(job.world)]
        self.env.all_of(resumed).callbacks.append(lambda _: self._resumed(lost[0][1], now + reload_s))
        job.restart(step, lambda rank: self._reload(rank, step, resumed[rank]))

    def _rewind(self, step: int) -> None:
        """Every rank's replica, loader and hyperparameters back to the checkpoint of step `step`."""
        job = self.job
        job.checkpoints.restore(job.replicas)
        scenario = job.scenario
        values = values_at(scenario.train.schedule, step, lambda path: _field(scenario, path))
        if values:
            for rank in range(job.world):
                job.scheme.set_hyperparameters(rank, values)
        job.scheme.rewind(step)
        if self.on_rewind is not None:
            self.on_rewind(step)

    def report_section(self, injector, fault_free_time_s: float, sim_time_s: float, failed: bool) -> dict:
        """report.json's `faults`: every fault and what it did, the checkpoints' cost, the time lost, goodput."""
        job, events = self.job, injector.events
        checkpoints = job.checkpoints
        lost = [event for event in events if "time_lost_s" in event]
        members = job.cluster.jobs[job.index][1]  # every device that held a rank of the job, spares that joined too
        written = sum(job.cluster.log.total(device, "checkpoint") for device in members)
        return {
            "events": events,
            "spares_left": list(self.spares),
            "restarts": self.restarts,
            "steps_redone": sum(event["steps_redone"] for event in lost),
            "pushes_lost": job.scheme.pushes_lost,
            "flows_rerouted": sum(event.get("flows_rerouted", 0) for event in events),
            "time_lost_s": sum(event["time_lost_s"] for event in lost),
            "checkpoints_committed": checkpoints.committed if checkpoints is not None else 0,
            "checkpoint_bytes_per_rank": checkpoints.nbytes if checkpoints is not None else 0,
            # time a rank of the job spent writing checkpoints (over the devices that held it), on average
            "checkpoint_time_s": written / job.world,
            "fault_free_time_s": fault_free_time_s,
            # None: the job failed (it never finished its work), or took no time
            "goodput": fault_free_time_s / sim_time_s if sim_time_s > 0 and not failed else None,
        }

    def _reload(self, rank: int, step: int, resumed):
        """Step program of job rank `rank` before it trains again: read its part of the checkpoint of step `step`,
        fetch what that leaves out (the scheme's `resume`), then fire `resumed`."""
        job = self.job
        yield Busy(job.checkpoints.read_seconds(rank), f"restart (read checkpoint of step {step})", kind="restart")
        yield from job.scheme.resume(rank)
        resumed.succeed()

    def _resumed(self, event: dict, read_at_s: float) -> None:
        """Every rank has read the checkpoint and fetched what it leaves out: the restart's `resume_s`, from the
        last read to the last rank ready, is time lost too."""
        self.resumed_at_s = self.env.now
        event["resume_s"] = self.env.now - read_at_s
        event["time_lost_s"] += event["resume_s"]


def _field(scenario, path: str):
    """The scenario's value of a dotted field ("train.optimizer.lr")."""
    value = scenario
    for part in path.split("."):
        value = getattr(value, part)
    return value


class FaultsSection(ReportSection):
    events: list[dict[str, Any]] = Field(
        description="every fault in the order it struck: at_s, source (scenario or random), kind (link_failed, "
                    "link_degraded, link_healed, device_lost), link [u, v] or device, member (in a population), and "
                    "what it did: effect, bandwidth_factor, flows_crossing, flows_rerouted, bytes_rerouted, "
                    "links_failed, node, detected_at_s, detection_s, reload_s, resume_s, redone_s, steps_redone, time_lost_s (those that "
                    "apply)")
    spares_left: list[int] = Field(description="spare devices not used at the end")
    restarts: int = Field(description="restarts from a checkpoint")
    steps_redone: int = Field(description="steps run again after restarts")
    pushes_lost: int = Field(description="asynchronous updates lost with their worker")
    flows_rerouted: int = Field(description="transfers moved to another route by a link's failure")
    time_lost_s: float = Field(description="seconds lost to faults: detection, reading the checkpoint, resuming "
                                          "and steps redone")
    checkpoints_committed: int = Field(description="checkpoints written in full")
    checkpoint_bytes_per_rank: int = Field(description="bytes of one rank's checkpoint")
    checkpoint_time_s: float = Field(description="seconds a rank of the job spent writing checkpoints, on average")
    fault_free_time_s: float = Field(description="simulated seconds of the same scenario without faults and "
                                                 "checkpoints")
    goodput: float | None = Field(description="fault_free_time_s over the time taken; null: the job failed")


register_section("faults", FaultsSection, "faults, what each did, checkpoints, time lost and goodput (a run with "
                                          "faults or checkpoints: recovery.py)")
register_section("failure", str | None, "why a fault stopped the job; null: it did not (a run with faults)")
