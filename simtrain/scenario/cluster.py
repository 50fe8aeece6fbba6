"""The scenario's `cluster` section: topology, devices, links, shared memory, faults.

    cluster:
      topology: ring                     # a builder (hw/topology_builders.py) or a topology YAML file
      devices: 4
      device: a100-40gb                  # a catalog name, a device file, or a device described here
      link: {bandwidth: 50 GB/s, latency: 5 us}

hw/cluster.py builds the cluster these fields describe (hw/catalog.py turns
`device` into a device spec; hw/faults.py applies `faults`).
"""
from typing import Annotated, Literal, Union

from pydantic import (AfterValidator, BeforeValidator, Field, PlainSerializer, ValidationError, WrapValidator,
                      model_validator)

from ..limits import (MAX_COMPUTE_JITTER, MAX_COMPUTE_JITTER_FIXED, MAX_DEVICES, MAX_FAULTS, MAX_SEED, MAX_SLOWDOWN,
                      MIN_EFFICIENCY)
from .fields import Bandwidth, Bytes, Count, Duration, Flag, FlopRate, Interval, Real, Section, first_error

DTYPES = ("fp32", "tf32", "fp16", "bf16")  # the dtypes every device has a peak FLOP/s for
# The dtypes only some devices have: fp8 (Hopper and later), the block-scaled mxfp8 and nvfp4 (Blackwell). Rates
# only: train.precision takes fp8 of them, as no model here trains in mxfp8 or nvfp4.
OPTIONAL_DTYPES = ("fp8", "mxfp8", "nvfp4")


class LinkSpec(Section):
    """One class of network link: its bandwidth each way and its latency per hop."""

    bandwidth: Bandwidth = Field(description="Bytes per second the link moves in each direction (full duplex), "
                                             "shared max-min fairly by the flows crossing it (bytes/s).")
    latency: Duration = Field(0.0, description="Seconds a transfer waits per hop before its bytes move (s).")


class PeakFlops(Section):
    """Dense peak FLOP/s per dtype (datasheet figures without sparsity)."""

    fp32: FlopRate | None = Field(None, description="Peak FP32 FLOP/s (FLOP/s).")
    tf32: FlopRate | None = Field(None, description="Peak TF32 tensor-core FLOP/s (FLOP/s).")
    fp16: FlopRate | None = Field(None, description="Peak FP16 tensor-core FLOP/s (FLOP/s).")
    bf16: FlopRate | None = Field(None, description="Peak BF16 tensor-core FLOP/s (FLOP/s).")
    fp8: FlopRate | None = Field(None, description="Peak FP8 tensor-core FLOP/s; null: the device has none "
                                                   "(FLOP/s).")
    mxfp8: FlopRate | None = Field(None, description="Peak MXFP8 (FP8 with a scale per 32 values) tensor-core "
                                                     "FLOP/s; null: the device has none (FLOP/s).")
    nvfp4: FlopRate | None = Field(None, description="Peak NVFP4 (FP4 with a scale per 16 values) tensor-core "
                                                     "FLOP/s; null: the device has none (FLOP/s).")

    def given(self) -> dict[str, float]:
        """The dtypes given, with their FLOP/s."""
        return {dtype: rate for dtype in (*DTYPES, *OPTIONAL_DTYPES) if (rate := getattr(self, dtype)) is not None}


def _number_or_calibrated(value, number):
    """`calibrated` as given, anything else validated as the number it must be (a word that is neither: named)."""
    if value == "calibrated":
        return value
    try:
        return number(value)
    except ValidationError as error:
        if isinstance(value, str) and error.errors()[0]["type"] == "float_parsing":
            raise ValueError(f"expected a number or calibrated, got {value!r}") from None
        raise


# A fraction of peak, or `calibrated`: the figure fitted for the part's generation (hw/catalog.py, CALIBRATED)
Efficiency = Annotated[Real(ge=MIN_EFFICIENCY, le=1), WrapValidator(_number_or_calibrated),
                       PlainSerializer(lambda value: value)]


class DeviceFields(Section):
    """A device described in the scenario: a catalog device with some fields changed (`base`), or a whole
    device (every field but efficiency and the fixed costs: kernel_overhead, pass_overhead, update_overhead).
    hw/catalog.py turns it into a device spec."""

    base: str | None = Field(None, description="Catalog device whose figures the other fields change "
                                               "(a100-40gb, a100-80gb, b200-180gb, gb200-186gb, gb300-288gb, "
                                               "h100-80gb, h100-grand-teton-96gb, h100-pcie-80gb, h200-141gb, "
                                               "h800-80gb, v100-16gb; or a bare name the catalog has one part "
                                               "of: gb200).")
    name: str | None = Field(None, min_length=1, description="The device's name in reports.")
    peak_flops: PeakFlops | None = Field(None, description="Dense peak FLOP/s per dtype; with base, only the "
                                                           "dtypes that change.")
    memory: Bytes | None = Field(None, description="HBM capacity (bytes; '80 GiB').")
    memory_bandwidth: Bandwidth | None = Field(None, description="HBM bandwidth (bytes/s; '2 TB/s').")
    efficiency: Efficiency | None = Field(
        None, description="Fraction of peak FLOP/s a training kernel reaches (default 0.5 for a whole device); "
                          "calibrated: the figure fitted for the base part's GPU generation on one published row, "
                          "under the compute model it was fitted under (hw/catalog.py, CALIBRATED).")
    kernel_overhead: Duration | None = Field(None, description="Seconds each kernel costs beyond its FLOPs "
                                                               "(launch and dispatch; default 0) (s).")
    pass_overhead: Duration | None = Field(None, description="Seconds each pass (a forward, a backward) costs "
                                                             "beyond its kernels (the host's work around them; "
                                                             "default 0) (s).")
    update_overhead: Duration | None = Field(None, description="Seconds each optimizer step costs beyond its bytes "
                                                               "and kernels (the optimizer's own work around them; "
                                                               "default 0) (s).")

    @model_validator(mode="after")
    def _whole_or_based(self) -> "DeviceFields":
        if self.base is None:
            for key in ("name", "peak_flops", "memory", "memory_bandwidth"):
                if getattr(self, key) is None:
                    raise ValueError(f"missing {key!r} (or give 'base' to start from a catalog device)")
            missing = [dtype for dtype in DTYPES if getattr(self.peak_flops, dtype) is None]
            if missing:
                raise ValueError(f"peak_flops: missing {', '.join(missing)}; give all of {', '.join(DTYPES)}")
        return self

    def changes(self) -> dict:
        """The fields given (without base), by name."""
        return {key: getattr(self, key) for key in self.model_fields_set - {"base"}}


def _device(value):
    """A device name (or file) as given; a mapping as DeviceFields, its first problem one line."""
    if isinstance(value, (str, DeviceFields)):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"expected a device name or a mapping, got {value!r}")
    try:
        return DeviceFields.model_validate(value)
    except ValidationError as error:  # ".memory: ...": the key continues the field's path (root.py)
        problem = first_error(error)
        raise ValueError(f".{problem}" if error.errors()[0]["loc"] else problem) from None


# A catalog name, a device file (.yaml: what simtrain calibrate writes), or device fields.
Device = Annotated[Union[str, DeviceFields], BeforeValidator(_device)]


class DeviceOverride(Section):
    """One rank's device: another device, some changed fields, a slowdown."""

    device: Device | None = Field(None, description="Replaces cluster.device for this rank (a catalog name, a "
                                                    "device file or device fields).")
    slowdown: Real(gt=0, le=MAX_SLOWDOWN) = Field(1.0, description="Every span on the rank's compute stream "
                                                                   "takes this many times longer (a straggler).")
    efficiency: Real(ge=MIN_EFFICIENCY, le=1) | None = Field(None, description="The rank's fraction of peak "
                                                                               "FLOP/s.")
    peak_flops: PeakFlops | None = Field(None, description="The rank's peak FLOP/s for some or all dtypes.")
    memory: Bytes | None = Field(None, description="The rank's HBM capacity (bytes).")
    memory_bandwidth: Bandwidth | None = Field(None, description="The rank's HBM bandwidth (bytes/s).")

    def device_fields(self) -> dict:
        """The device fields this override changes, by name."""
        fields = {"efficiency": self.efficiency, "peak_flops": self.peak_flops, "memory": self.memory,
                  "memory_bandwidth": self.memory_bandwidth}
        return {key: value for key, value in fields.items() if value is not None}


class SharedMemorySpec(Section):
    """The store holding the shared parameters: host DRAM over each device's host link, or a
    store attached to a node of the topology (a parameter server). The defaults are a DGX A100's
    host: one AMD EPYC 7742 socket's eight DDR4-3200 channels (8 x 25.6 GB/s = 204.8 GB/s, AMD's
    EPYC 7002 datasheet) behind one PCIe 4.0 x16 link per GPU (16 GT/s x 16 lanes x 128/130
    encoding = 31.5 GB/s per direction, PCI-SIG base specification 4.0)."""

    location: str = Field("host", description="host, or the name of a topology node the store is attached to.")
    bandwidth: Bandwidth = Field(204.8e9, description="Bandwidth of the store itself, shared by every reader and "
                                                      "writer (bytes/s).")
    latency: Duration = Field(0.0, description="Latency of the store's own link (s).")
    host_link: LinkSpec = Field(LinkSpec(bandwidth=31.5e9, latency=1e-6),
                                description="Location host: each device's link to the store.")
    capacity: Bytes | None = Field(None, description="Bytes the store holds; null: unlimited (bytes).")
    host: str | None = Field(None, description="Location host: the server whose CPUs step an offloaded optimizer "
                                               "(parallel.sharding.offload) at their DRAM bandwidth, a name of "
                                               "hw/host_compute.py's catalog (dgx-a100, dgx-h100); null: at the "
                                               "store's bandwidth.")

    @model_validator(mode="after")
    def _host_link_only_for_the_host(self) -> "SharedMemorySpec":
        default = type(self).model_fields["host_link"].default
        if self.location != "host" and self.host_link != default:
            raise ValueError(f"cluster.shared_memory.host_link: only for location host, not {self.location!r}")
        if self.location != "host" and self.host is not None:
            raise ValueError(f"cluster.shared_memory.host: only for location host, not {self.location!r}")
        return self


class FaultSpec(Section):
    """One fault: a link degraded (bandwidth_factor, healed at `until` if given) or failed, or a device lost."""

    at: Duration = Field(description="Simulated time the fault happens (s).")
    link: tuple[str, str] | None = Field(None, description="The two nodes of the topology link at fault.")
    device: Count(MAX_DEVICES - 1, minimum=0) | None = Field(None, description="The lost device's index (its "
                                                                                "global rank).")
    bandwidth_factor: Real(gt=0, le=1) | None = Field(None, description="The degraded link moves bytes at this "
                                                                        "fraction of its rate.")
    fail: Flag = Field(False, description="true: the link or the device fails.")
    until: Duration | None = Field(None, description="A degraded link is healed at this time (s).")

    @model_validator(mode="after")
    def _one_fault(self) -> "FaultSpec":
        if (self.link is None) == (self.device is None):
            raise ValueError("give either link: [u, v] or device: N")
        if self.device is not None:
            if not self.fail or self.bandwidth_factor is not None or self.until is not None:
                raise ValueError("a device fault is {at, device: N, fail: true}")
        elif self.fail == (self.bandwidth_factor is not None):
            raise ValueError("a link fault gives either bandwidth_factor or fail: true")
        if self.until is not None:
            if self.bandwidth_factor is None:
                raise ValueError("until: only a degraded link (bandwidth_factor) is healed")
            if self.until <= self.at:
                raise ValueError(f"until: must be after at ({self.until:g} s <= {self.at:g} s)")
        return self


class RandomFaultsSpec(Section):
    """Faults drawn as they come: every device of the job (every link) fails after an exponential time of
    mean `device_mtbf` (`link_mtbf`), independently; a failed link stays failed."""

    device_mtbf: Interval | None = Field(None, description="Mean time between failures of one device (s).")
    link_mtbf: Interval | None = Field(None, description="Mean time between failures of one link (s).")
    seed: Count(MAX_SEED, minimum=0) | None = Field(None, description="Seed of the draws; null: the scenario's "
                                                                      "seed.")

    @model_validator(mode="after")
    def _something_fails(self) -> "RandomFaultsSpec":
        if self.device_mtbf is None and self.link_mtbf is None:
            raise ValueError("give device_mtbf, link_mtbf or both")
        return self


class MessageWorkSpec(Section):
    """The CPU work of each message a rank sends over gloo, beyond the wire: posting it, waking gloo's threads,
    the reduction's add (real/calibrate.py fits it from training's ring: the exchange less the ping-pong)."""

    latency: Duration = Field(description="Seconds of one core's time per message (s).")
    bandwidth: Bandwidth | None = Field(None, description="Bytes per second of one core's time (bytes/s); null: no "
                                                          "work per byte.")


# The topology builders' names (hw/topology_builders.py builds each); any other `cluster.topology` is a YAML file.
TOPOLOGY_BUILDERS: tuple[str, ...] = ("ring", "fully_connected", "switch", "torus2d", "hierarchical", "fat_tree",
                                      "clos3")


def _host_noise(seconds: float) -> float:
    """cluster.compute_jitter_fixed: a host's noise, at most MAX_COMPUTE_JITTER_FIXED seconds."""
    if seconds > MAX_COMPUTE_JITTER_FIXED:
        raise ValueError(f"must be at most {MAX_COMPUTE_JITTER_FIXED:g} s, got {seconds:g} s")
    return seconds


class ClusterSpec(Section):
    """The simulated cluster: its topology, devices and links (hw/cluster.py builds it)."""

    topology: str = Field("ring", description=f"A topology builder's name ({', '.join(TOPOLOGY_BUILDERS)}) or the "
                                              "path of a topology YAML file.")
    devices: Count(MAX_DEVICES) | None = Field(None, description="Number of devices (spares included); null: "
                                                                 "the count a topology file gives.")
    device: Device = Field("a100-40gb", description="Every device's model: a catalog name, a device file (.yaml, "
                                                    "as simtrain calibrate writes) or device fields.")
    link: LinkSpec = Field(LinkSpec(bandwidth=50e9, latency=5e-6), description="The links a builder makes (each "
                                                                               "GPU's links within a host).")
    inter_node_link: LinkSpec | None = Field(None, description="hierarchical: each GPU's NIC to the spine.")
    gpus_per_node: Count(MAX_DEVICES) | None = Field(None, description="hierarchical, fat_tree, clos3: GPUs a host.")
    nodes_per_leaf: Count(MAX_DEVICES) = Field(
        20, description="fat_tree: nodes whose same-rail NICs share a leaf switch (a DGX SuperPOD scalable unit: "
                        "20 nodes, NVIDIA DGX SuperPOD reference architecture); clos3: hosts a rack (Meta: 2).")
    oversubscription: Real(ge=1, le=MAX_DEVICES) = Field(
        1.0, description="fat_tree: a leaf's downlink to uplink bandwidth (1: non-blocking); clos3: a pod's.")
    leaves_per_pod: Count(MAX_DEVICES) = Field(
        192, description="clos3: racks (leaf switches) per pod under one non-blocking layer of cluster switches "
                         "(Llama 3's cluster: 192 racks of 16 GPUs, Grattafiori et al. 2024, section 3.3.1).")
    torus_shape: tuple[Count(MAX_DEVICES), Count(MAX_DEVICES)] | None = Field(
        None, description="torus2d: rows and columns.")
    overrides: dict[Count(MAX_DEVICES - 1, minimum=0), DeviceOverride] = Field(
        {}, description="Per rank: another device, changed device fields, a slowdown (heterogeneous devices).")
    compute_jitter: Real(ge=0, le=MAX_COMPUTE_JITTER) = Field(
        0.0, description="Standard deviation of log(time factor) of every compute span: lognormal noise drawn "
                         "from the rank's own seeded Generator.")
    compute_jitter_fixed: Annotated[Duration, AfterValidator(_host_noise)] = Field(
        0.0, description="Noise of every compute span that does not grow with it (a host's scheduler waking a "
                         "rank late), s: a span of mean t then has variance t² (e^σ² - 1) + s², lognormal, σ "
                         "the compute_jitter (hw/device.py; `simtrain calibrate` fits both) (s).")
    compute_model: Literal["flops", "roofline", "kernels"] = Field(
        "flops", description="What a forward or backward costs (hw/device.py): its FLOPs at peak x efficiency "
                             "(flops); per operator the slower of its FLOPs and its HBM bytes at bandwidth x "
                             "efficiency (roofline: op_cost.py); or the roofline with each GEMM at the share of "
                             "its tiles' waves it fills and fused attention at its kernel's published rate "
                             "(kernels: hw/kernel_model.py).")
    shared_memory: SharedMemorySpec | None = Field(None, description="The store async training keeps its "
                                                                     "parameters in; null: none (async gets "
                                                                     "the default host store).")
    faults: Annotated[list[FaultSpec], Field(max_length=MAX_FAULTS)] = Field(
        [], description="Faults at given times (hw/faults.py).")
    random_faults: RandomFaultsSpec | None = Field(None, description="Faults drawn from a seeded Generator.")
    spares: Count(MAX_DEVICES - 1, minimum=0) = Field(
        0, description="The last `spares` devices stay idle, to replace a lost one (recovery.py).")
    fault_detection: Duration = Field(
        0.1, description="Seconds from a device's loss until its job notices: torchrun's elastic agent polls its "
                         "workers every --monitor-interval (default 0.1 s in torch 2.13, torch/distributed/run.py) "
                         "(s).")
    host_cores: Count(MAX_DEVICES) | None = Field(
        None, description="The CPU cores of the one host whose processes the ranks are (a calibrated run, "
                          "real/calibrate.py): compute and memory-bound work takes a core while it runs, the cores "
                          "shared by processor sharing when the ranks outnumber them (hw/host_cores.py); null: "
                          "devices that each compute on their own.")
    host_message_work: MessageWorkSpec | None = Field(
        None, description="With host_cores: each message a rank sends first takes this work of a core "
                          "(hw/host_cores.py), the links then being the wire alone; null: none.")

    @model_validator(mode="after")
    def _host_cores_without_faults(self) -> "ClusterSpec":
        if self.host_cores is not None and (self.faults or self.random_faults):
            raise ValueError("host_cores: does not run with faults (a lost process's core time is not modelled)")
        if self.host_message_work is not None and self.host_cores is None:
            raise ValueError("host_message_work: needs host_cores (the cores the work runs on)")
        return self
