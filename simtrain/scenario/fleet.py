"""The scenario's `fleet` section: a long run's failures, recoveries and checkpoints (simtrain/fleet/).

    fleet:
      horizon: 54 d                 # weeks of training, simulated event by event around the measured step
      spares: 16                    # hosts in the spare pool; null: as many as needed
      checkpoint: {interval: 30 min, mode: async}
      components: {gpu: {mtbf: 10000 h}}   # per unit; the others keep their defaults

`preset` names the published failure mix `components` starts from
(scenario/fleet_presets.py; the default: the Llama 3 405B run's Table 5, its
47 planned interruptions and its 6 silent data corruptions included); each
component given keeps the preset's value of every field it does not give.
The sources of every default are in docs/guides/fleet.md ("Sources").
"""
from typing import Annotated, Literal, Union

from pydantic import ConfigDict, Field, PlainValidator, TypeAdapter, ValidationError, WithJsonSchema, model_validator

from ..limits import MAX_DEVICES, MAX_FAULTS, MAX_SEED, MAX_SLOWDOWN, MAX_STEPS
from .fields import Bandwidth, Bytes, Count, Duration, Real, Section, error_message, long_time
from .fleet_presets import LLAMA3_S, PRESET_NAMES, PRESETS, with_preset

LongDuration = long_time(positive=False)  # seconds, up to limits.QUANTITY_RANGES["long_time"]: "54 d", "2 h"
LongInterval = long_time(positive=True)
_SECONDS = TypeAdapter(LongInterval, config=ConfigDict(allow_inf_nan=False))
INTERVAL_RULES = ("young", "daly")


def _seconds_or_rule(value):
    if isinstance(value, str) and value in INTERVAL_RULES:
        return value
    try:
        return _SECONDS.validate_python(value)
    except ValidationError as error:
        raise ValueError(error_message(error.errors()[0])) from None


# seconds, or the name of an optimum (one field, no union: an error names the field alone)
CheckpointInterval = Annotated[Union[float, str], PlainValidator(_seconds_or_rule), WithJsonSchema(
    {"anyOf": [{"type": "number", "exclusiveMinimum": 0}, {"enum": list(INTERVAL_RULES)}], "unit": "s"})]

COMPONENTS = ("gpu", "hbm", "nic", "nvswitch", "host", "cable", "leaf", "spine", "storage", "software", "sdc",
              "maintenance")


class ComponentSpec(Section):
    """How often one unit of a component fails, and how long a host it took out is away."""

    mtbf: LongInterval | None = Field(None, description="Mean time between failures of one unit (s); null: it "
                                                        "does not fail.")
    repair: LongDuration = Field(
        86400.0, description="Seconds until a host the failure took out is back in the spare pool (no published "
                             "figure: an assumption, give your fleet's; it matters only with a finite "
                             "fleet.spares).")
    detection: LongDuration | None = Field(
        None, description="From this component's failure to the job's teardown (s); null: fleet.recovery.detection. "
                          "For sdc, the training that goes on, corrupted, until it is noticed.")


DEFAULT_COMPONENTS = PRESETS["llama3-405b"]["components"]


def _preset_default(component: str, description: str):
    return Field(ComponentSpec(**DEFAULT_COMPONENTS[component]), description=description)


class ComponentsSpec(Section):
    """Every component's failures; a component given keeps the preset's value of each field it does not give."""

    gpu: ComponentSpec = _preset_default("gpu", "One GPU (its blast radius: its host).")
    hbm: ComponentSpec = _preset_default("hbm", "One GPU's HBM (its host).")
    nic: ComponentSpec = _preset_default("nic", "One GPU's NIC (its host).")
    nvswitch: ComponentSpec = _preset_default("nvswitch", "One host's NVSwitch fabric (its host).")
    host: ComponentSpec = _preset_default("host", "One host: CPU, memory, power, SSD (itself).")
    cable: ComponentSpec = _preset_default("cable", "One cable of the topology: a GPU's to its leaf (its host) or a "
                                                    "switch's to a switch (no host).")
    leaf: ComponentSpec = _preset_default("leaf", "One leaf switch: a switch cabled to GPUs of several hosts (every "
                                                  "host with a GPU on it).")
    spine: ComponentSpec = _preset_default("spine", "One spine switch: a switch cabled to no GPU (no host: the job "
                                                    "restarts on the same hosts).")
    storage: ComponentSpec = _preset_default("storage", "The checkpoint storage, one unit (no host).")
    software: ComponentSpec = _preset_default("software", "Software on one host: a bug, a watchdog timeout (no "
                                                          "host: the job restarts on the same).")
    sdc: ComponentSpec = _preset_default("sdc", "Silent data corruption of one GPU: training goes on for "
                                                "`detection`, then rolls back to the last checkpoint written before "
                                                "the corruption (its host).")
    maintenance: ComponentSpec = _preset_default("maintenance", "Planned stops of the whole job, one unit "
                                                                "(firmware, configuration): after a checkpoint, "
                                                                "nothing redone, no host lost.")


class StragglerSpec(Section):
    """GPUs that slow down for a while (throttling): the synchronous step runs at the slowest one's pace."""

    mtbf: LongInterval = Field(description="Mean time between slowdowns of one GPU (s).")
    slowdown: Real(gt=1, le=MAX_SLOWDOWN) = Field(description="The step time's factor while a GPU is slow.")
    duration: LongInterval = Field(description="How long a slowdown lasts (s).")
    fails: Real(ge=0, le=1) = Field(0.0, description="The chance that a slowdown ends in its GPU's failure (a GPU "
                                                     "that degrades, then fails) rather than back at speed.")


class FleetCheckpointSpec(Section):
    """Checkpoints of the fleet's job: how often, sync or async, where to, what they cost."""

    interval: CheckpointInterval = Field(
        1800.0, description="Training time between checkpoints (s), rounded to whole steps (at least one); young or "
                            "daly: their optimum for the job's unplanned failures and the blocking part of a "
                            "checkpoint (simtrain/fleet/expected.py).")
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
        300.0, description="From a failure to the job's teardown (s), for a component without its own: Meta's "
                           "clusters run their health checks every 5 minutes (Kokolis et al., HPCA 2025, section "
                           "III-C).")
    relaunch: LongDuration = Field(
        300.0, description="Restarting the job (s), every initialisation included: Meta's restart overhead u0 = 5 "
                           "minutes (Kokolis et al., HPCA 2025, section IV).")
    init_per_gpu: Duration = Field(
        0.0, description="Communicator initialisation per GPU of the job (s), on top of relaunch: 0, inside "
                         "relaunch's 5 minutes; MegaScale (NSDI 2024, section 4) brings it under 30 s for more than "
                         "10,000 GPUs (3 ms per GPU) to scale it with the job.")


class FailureSpec(Section):
    """One failure of a replayed log."""

    at: LongDuration = Field(description="When it happens (s).")
    component: Literal[COMPONENTS] = Field(description="What failed.")
    unit: Count(10 * MAX_DEVICES, minimum=0) = Field(0, description="Which unit: a GPU's rank, a host's index, "
                                                                    "a cable's or switch's index (simtrain/fleet/).")


class FleetSpec(Section):
    """A long run of the scenario's job: the step is simulated, then failures and recoveries event by event."""

    preset: Literal[PRESET_NAMES] = Field("llama3-405b", description="The published failure mix `components` "
                                          "starts from (scenario/fleet_presets.py).")
    horizon: LongInterval = Field(LLAMA3_S, description="How long the fleet runs (s); the default: Llama 3's "
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

    @model_validator(mode="before")
    @classmethod
    def _preset_under_components(cls, raw):
        return with_preset(raw) if isinstance(raw, dict) else raw

    @model_validator(mode="after")
    def _failures_in_order(self) -> "FleetSpec":
        for index in range(1, len(self.failures)):
            if self.failures[index].at < self.failures[index - 1].at:
                raise ValueError(f"fleet.failures.{index}.at: failures must be in time order")
        return self
