"""The part of report.json that every run has: the run's figures, its devices and its links.

`ReportCore` lists the top-level keys report/build.py writes for every run;
the other top-level keys are sections that their owners register
(sections.py). schema.py puts the two together into report.json's JSON Schema.

    ReportCore.model_validate(json.loads(Path("runs/quickstart/report.json").read_text()), strict=False)
"""
from pydantic import ConfigDict, Field

from .flops import FlopsSection
from .sections import ReportSection

Seconds = float | None


class Breakdown(ReportSection):
    """Where the time went, by kind of work."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    compute: Seconds = Field(description="seconds of compute (forward, backward, recomputation)")
    communication: Seconds = Field(description="seconds of communication no other work of the device hid "
                                               "(exposed communication)")
    optimizer: Seconds = Field(description="seconds of optimizer steps and other memory-bound work")
    sampling: Seconds = Field(description="seconds a prioritized sampler spent drawing batches")
    bubble: Seconds = Field(description="seconds a pipeline stage waited for a peer that had not sent yet")
    idle: Seconds = Field(description="seconds of nothing: the rest of the simulated time")
    checkpoint: Seconds = Field(None, description="seconds writing checkpoints (a run with faults or checkpoints)")
    restart: Seconds = Field(None, description="seconds restarting from a checkpoint (a run with faults)")


class DeviceEntry(ReportSection):
    rank: int = Field(description="the device's global rank on the cluster")
    job: str | None = Field(description="the job that holds the device; null: a spare that never joined one")
    node: str = Field(description="the topology node the device sits on")
    device: str = Field(description="the device's catalog name")
    peak_memory_bytes: int = Field(description="the most bytes the device held at once")
    peak_memory_bytes_by_category: dict[str, int] = Field(
        description="each category's bytes at the device's peak: weights, gradients, optimizer_state, "
                    "master_weights, activations, comm_buffers, tensors (a user's dist ranks), kfac")
    capacity_bytes: int = Field(description="the device's memory")
    breakdown_s: Breakdown = Field(description="seconds the device spent on each kind of work over the run")


class LinkEntry(ReportSection):
    src: str = Field(description="the node the directed link leaves")
    dst: str = Field(description="the node it reaches")
    bytes: int = Field(description="bytes that crossed it")
    busy_s: float = Field(description="seconds during which at least one transfer crossed it")
    utilization: float = Field(description="busy_s over the simulated time")


class SharedMemoryEntry(ReportSection):
    location: str = Field(description="where the shared store sits: host or a device's node")
    node: str = Field(description="the topology node of the store")
    bandwidth_Bps: float = Field(description="the store's bandwidth, bytes per second")
    latency_s: float = Field(description="the store's latency, seconds")
    peak_memory_bytes: int = Field(description="the most bytes the store held at once")
    peak_memory_bytes_by_category: dict[str, int] = Field(description="each category's bytes at the store's peak")
    capacity_bytes: int | None = Field(description="the store's capacity; null: unbounded")


class StepTimeError(ReportSection):
    seconds: float = Field(description="the error bar of step_time_s: step_time_s x relative")
    relative: float = Field(description="the root mean square of the relative errors of the generation's "
                                        "published rows at its calibrated efficiency (hw/catalog.py, CALIBRATED)")
    generation: str = Field(description="the GPU generation whose calibration the device takes")
    rows: int = Field(description="the published rows the errors come from (the fitted row not counted)")


class ReportCore(ReportSection):
    """The top-level keys of every report.json (sections registered by their owners come beside them)."""

    name: str = Field(description="the scenario's name")
    status: str = Field(description="ok; out_of_memory or failed: the run stopped early (see out_of_memory, "
                                    "failure)")
    scheme: str = Field(description="the registry's name of the scheme that ran: data_parallel, async or "
                                    "model_parallel (it follows from the layout and parallel.mode)")
    all_reduce: str = Field(description="parallel.all_reduce: the all-reduce algorithm of the gradients "
                                        "(and of tensor-parallel activations)")
    devices_count: int = Field(description="devices on the cluster, spares included")
    sim_time_s: float = Field(description="simulated seconds from the start to the end of the last span "
                                          "(measured seconds, for `simtrain launch`)")
    steps: int = Field(description="training steps run (measured ones, for `simtrain launch`)")
    step_time_s: float | None = Field(description="sim_time_s / steps; null: no step ended")
    throughput_samples_per_s: float | None = Field(description="training samples per simulated second")
    throughput_tokens_per_s_per_device: float | None = Field(
        None, description="training tokens per simulated second per device of the job (language models: a "
                          "sample is data.seq_len tokens); null: the samples are not token sequences, or no step ran")
    breakdown_s: Breakdown = Field(description="seconds per step of each kind of work, averaged over the "
                                               "job's devices")
    step_time_error: StepTimeError | None = Field(
        None, description="step_time_s's error bar, where the device takes its generation's calibrated efficiency "
                          "(cluster.device.efficiency: calibrated): that calibration's errors on the published rows "
                          "it was not fitted on; absent otherwise")
    scaling_efficiency: float | None = Field(description="a device's own work alone (its batch's forward and "
                                                         "backward, its update: under ZeRO its shard's) over the "
                                                         "step time (weak scaling, at most 1); null: no baseline")
    flops: FlopsSection = Field(description="model TFLOP/s per device and MFU (report/flops.py)")
    final_loss: float | None = Field(description="the final model's mean cross entropy on the training set; "
                                                  "null: numerics off, or not finite")
    final_accuracy: float | None = Field(description="the final model's accuracy on the test set")
    loss_curve: list[tuple[float, float | None]] = Field(
        description="[sim_time_s, batch loss] after every step (every update, for async)")
    train_loss_curve: list[tuple[int, float, float | None]] = Field(
        description="[step, sim_time_s, training-set loss] every report.every steps")
    time_to_target_s: float | None = Field(None, description="first time the training-set loss reached "
                                                             "train.target_loss (only with a target); null: never")
    devices: list[DeviceEntry] = Field(description="every device of the cluster, by rank")
    links: list[LinkEntry] = Field(description="every directed link that carried bytes (none measured, for "
                                               "`simtrain launch`)")
    shared_memory: SharedMemoryEntry | None = Field(None, description="the shared-memory store (async "
                                                                      "schemes), when the cluster has one")
    wall_time_s: float = Field(description="host seconds the run took: the one figure that is not simulated")
    simtrain_version: str = Field(description="the simtrain version that wrote the report")
