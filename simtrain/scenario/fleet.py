"""The scenario's `fleet` section: a long run's failures, recoveries and checkpoints (simtrain/fleet/).

    fleet:
      horizon: 54 d                 # weeks of training, simulated event by event around the measured step
      spares: 16                    # hosts in the spare pool; null: as many as needed
      checkpoint: {interval: 30 min, mode: async}
      components: {gpu: {mtbf: 10000 h}}   # per unit; the others keep their defaults

The defaults are the Llama 3 405B pre-training run's (Llama Team, "The Llama 3
Herd of Models", 2024, Table 5: 419 unexpected interruptions in 54 days on
16,384 H100 GPUs, 2,048 hosts of 8), each category turned into a mean time
between failures of one unit: `54 d x units / interruptions`. Table 5's rows
go to components so:

- gpu (per GPU): faulty GPU 148, GPU SRAM 19, GPU system processor 17,
  silent data corruption 6, thermal interface and sensor 6 (196);
- hbm (per GPU): HBM3 memory 72;
- nic (per GPU, one NIC each): NIC 7;
- host (per host): host maintenance 32, SSD 3, power supply 3, chassis 2,
  IO expansion board 2, CPU 2, system memory 2 (46);
- cable (per GPU-to-leaf cable): network switch/cable 35 (Table 5 does not
  split switches from cables; the default puts them on the hosts' cables);
- software (per host): software bug 54, NCCL watchdog timeout 7, dependency
  2 (63): the job restarts on the same hosts;
- nvswitch, leaf, spine, storage: no row of their own in Table 5: they do
  not fail unless given an `mtbf`.
"""
from typing import Literal

from pydantic import Field, model_validator

from ..limits import MAX_DEVICES, MAX_FAULTS, MAX_SEED, MAX_SLOWDOWN, MAX_STEPS
from .fields import Bandwidth, Bytes, Count, Duration, Real, Section, long_time

LongDuration = long_time(positive=False)  # seconds, up to limits.QUANTITY_RANGES["long_time"]: "54 d", "2 h"
LongInterval = long_time(positive=True)

COMPONENTS = ("gpu", "hbm", "nic", "nvswitch", "host", "cable", "leaf", "spine", "storage", "software")
_LLAMA3_DAYS = 54 * 86400.0  # Table 5's window
_LLAMA3_GPUS, _LLAMA3_HOSTS = 16_384, 2_048


class ComponentSpec(Section):
    """How often one unit of a component fails, and how long a host it took out is away."""

    mtbf: LongInterval | None = Field(None, description="Mean time between failures of one unit (s); null: it "
                                                        "does not fail.")
    repair: LongDuration = Field(
        86400.0, description="Seconds until a host the failure took out is back in the spare pool (an assumption, "
                             "not a published figure: give your fleet's; it matters only with a finite "
                             "fleet.spares).")


def _llama3(interruptions: int, units: int) -> dict:
    return {"mtbf": _LLAMA3_DAYS * units / interruptions}


DEFAULT_COMPONENTS = {
    "gpu": _llama3(196, _LLAMA3_GPUS), "hbm": _llama3(72, _LLAMA3_GPUS), "nic": _llama3(7, _LLAMA3_GPUS),
    "nvswitch": {}, "host": _llama3(46, _LLAMA3_HOSTS), "cable": _llama3(35, _LLAMA3_GPUS), "leaf": {},
    "spine": {}, "storage": {}, "software": _llama3(63, _LLAMA3_HOSTS),
}


class ComponentsSpec(Section):
    """Every component's failures; a component given keeps the default of each field it does not give."""

    gpu: ComponentSpec = Field(ComponentSpec(**DEFAULT_COMPONENTS["gpu"]), description="One GPU (its blast "
                                                                                          "radius: its host).")
    hbm: ComponentSpec = Field(ComponentSpec(**DEFAULT_COMPONENTS["hbm"]), description="One GPU's HBM (its host).")
    nic: ComponentSpec = Field(ComponentSpec(**DEFAULT_COMPONENTS["nic"]), description="One GPU's NIC (its host).")
    nvswitch: ComponentSpec = Field(ComponentSpec(), description="One host's NVSwitch fabric (its host).")
    host: ComponentSpec = Field(ComponentSpec(**DEFAULT_COMPONENTS["host"]), description="One host: CPU, memory, "
                                                                                            "power, SSD (itself).")
    cable: ComponentSpec = Field(ComponentSpec(**DEFAULT_COMPONENTS["cable"]), description="One cable of the "
                                 "topology: a GPU's to its leaf (its host) or a switch's to a switch (no host).")
    leaf: ComponentSpec = Field(ComponentSpec(), description="One leaf switch: a switch cabled to GPUs of several "
                                                            "hosts (every host with a GPU on it).")
    spine: ComponentSpec = Field(ComponentSpec(), description="One spine switch: a switch cabled to no GPU (no "
                                                             "host: the job restarts on the same hosts).")
    storage: ComponentSpec = Field(ComponentSpec(), description="The checkpoint storage, one unit (no host).")
    software: ComponentSpec = Field(ComponentSpec(**DEFAULT_COMPONENTS["software"]), description="Software on "
                                    "one host: a bug, a watchdog timeout (no host: the job restarts on the same).")

    @model_validator(mode="before")
    @classmethod
    def _keep_unset_defaults(cls, raw):
        if not isinstance(raw, dict):
            return raw
        return {name: {**DEFAULT_COMPONENTS[name], **value} if name in DEFAULT_COMPONENTS and isinstance(value, dict)
                else value for name, value in raw.items()}


class StragglerSpec(Section):
    """GPUs that slow down for a while (throttling): the synchronous step runs at the slowest one's pace."""

    mtbf: LongInterval = Field(description="Mean time between slowdowns of one GPU (s).")
    slowdown: Real(gt=1, le=MAX_SLOWDOWN) = Field(description="The step time's factor while a GPU is slow.")
    duration: LongInterval = Field(description="How long a slowdown lasts (s).")


class FleetCheckpointSpec(Section):
    """Checkpoints of the fleet's job: how often, sync or async, where to, what they cost."""

    interval: LongInterval = Field(1800.0, description="Training time between checkpoints (s), rounded to whole "
                                                       "steps (at least one).")
    mode: Literal["sync", "async"] = Field(
        "async", description="sync: training waits for the write to storage; async: it waits only for the "
                             "snapshot to host memory, and the write goes on in the background (one at a time: a "
                             "checkpoint due while the previous one is being written waits for it).")
    bytes_per_gpu: Bytes | None = Field(None, description="One GPU's checkpoint (bytes); null: its weights and "
                                                          "optimizer state as the simulated step held them.")
    storage_bandwidth: Bandwidth = Field(
        2e12, description="The storage's bandwidth, shared by every GPU writing or reading at once (bytes/s): "
                          "Llama 3's Tectonic sustained 2 TB/s (Llama 3 paper, section 3.3.1).")
    host_bandwidth: Bandwidth = Field(31.5e9, description="One GPU's copy to host memory, for an async snapshot "
                                                          "(bytes/s; PCIe 4.0 x16, as train.checkpoint).")
    latency: Duration = Field(1e-6, description="Latency of a write or a read (s).")
    replicas: Count(8, minimum=0) = Field(
        0, description="In-memory copies of each checkpoint on other hosts (Gemini, SOSP 2023): after its "
                       "snapshot, each host sends it to `replicas` peers over `peer_bandwidth`; a failure that takes "
                       "at most `replicas` hosts restarts from them.")
    peer_bandwidth: Bandwidth = Field(50e9, description="A host's bandwidth to a peer's memory (bytes/s; one "
                                                        "400 Gb/s NIC).")


class FleetRecoverySpec(Section):
    """What a restart costs: detection, then relaunch, communicator initialisation and checkpoint load."""

    detection: LongDuration = Field(
        600.0, description="From a failure to the job's teardown (s): torch's default NCCL watchdog timeout, 10 "
                           "minutes (torch.distributed.constants.default_pg_nccl_timeout).")
    relaunch: LongDuration = Field(
        120.0, description="Scheduling and starting the processes again (s): an assumption, not a published "
                           "figure; give your scheduler's.")
    init_per_gpu: Duration = Field(
        0.003, description="Communicator initialisation per GPU of the job (s): MegaScale (NSDI 2024, section 4) "
                           "brings it under 30 s for more than 10,000 GPUs.")


class FailureSpec(Section):
    """One failure of a replayed log."""

    at: LongDuration = Field(description="When it happens (s).")
    component: Literal[COMPONENTS] = Field(description="What failed.")
    unit: Count(10 * MAX_DEVICES, minimum=0) = Field(0, description="Which unit: a GPU's rank, a host's index, "
                                                                    "a cable's or switch's index (simtrain/fleet/).")


class FleetSpec(Section):
    """A long run of the scenario's job: the step is simulated, then failures and recoveries event by event."""

    horizon: LongInterval = Field(_LLAMA3_DAYS, description="How long the fleet runs (s); the default: Llama 3's "
                                                            "54 days.")
    target_steps: Count(MAX_STEPS * 1000) | None = Field(None, description="Stop when this many steps are done "
                                                                           "(within the horizon); null: run to it.")
    seed: Count(MAX_SEED, minimum=0) | None = Field(None, description="Seed of the draws; null: the scenario's.")
    gpus_per_host: Count(MAX_DEVICES) | None = Field(None, description="GPUs per host; null: cluster.gpus_per_node, "
                                                                       "else hosts of 8 (of fewer when 8 does not "
                                                                       "divide the GPUs: their greatest common "
                                                                       "divisor).")
    spares: Count(MAX_DEVICES, minimum=0) | None = Field(None, description="Hosts in the spare pool; null: as many "
                                                                           "as needed, at once.")
    components: ComponentsSpec = Field(ComponentsSpec(), description="Failure rates per component.")
    failures: list[FailureSpec] = Field([], max_length=MAX_FAULTS, description="A failure log to replay instead "
                                                                               "of drawing failures; [] draws.")
    stragglers: StragglerSpec | None = Field(None, description="Slow GPUs; null: none.")
    checkpoint: FleetCheckpointSpec = Field(FleetCheckpointSpec(), description="Checkpoints.")
    recovery: FleetRecoverySpec = Field(FleetRecoverySpec(), description="What a restart costs.")

    @model_validator(mode="after")
    def _failures_in_order(self) -> "FleetSpec":
        for index in range(1, len(self.failures)):
            if self.failures[index].at < self.failures[index - 1].at:
                raise ValueError(f"fleet.failures.{index}.at: failures must be in time order")
        return self
