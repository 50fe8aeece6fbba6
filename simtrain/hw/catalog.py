"""Device catalog: what one simulated GPU can compute and hold.

A `DeviceSpec` gives a GPU's dense peak FLOP/s per dtype (fp32, tf32, fp16,
bf16; fp8 on the parts whose tensor cores have it, Hopper and later; mxfp8 and
nvfp4, the block-scaled formats, on Blackwell's), its HBM capacity and
bandwidth, its NVLink bandwidth (the datasheet's, both directions together:
what to divide by two for `cluster.link`, which is per direction), the
fraction of peak a training kernel reaches (`efficiency`) and a fixed cost per
kernel (`kernel_overhead`, default 0), per pass (`pass_overhead`, default 0: a
forward or a backward) and per optimizer step (`update_overhead`, default 0).
The compute model charges `flops / spec.flops_rate(dtype) + kernels x
kernel_overhead + passes x pass_overhead` seconds, an optimizer step `bytes /
(memory_bandwidth x efficiency) + kernels x kernel_overhead + update_overhead`.
The catalog's parts also give their streaming multiprocessors (SMs): work that
runs while a communication kernel holds some of them (Transformer Engine's
`num_sm` with `set_sm_margin`, strategies/tp_overlap.py) runs on the others, at
that share of the rate (hw/device.py); a device described without them (None)
runs every kernel on all of its compute.

`CATALOG` holds public datasheet figures for common data-center parts; a
scenario names one (or a part's bare name where the catalog has one part of
that name, `ALIASES`: `gb200` for gb200-186gb), tweaks one, or describes its
own GPU (`cluster.device`, typed and validated as scenario.DeviceFields), and
`resolve_device` turns any of those into a `DeviceSpec`:

    resolve_device("a100-40gb")
    resolve_device({"base": "a100-40gb", "efficiency": 0.4, "memory": "80 GiB"})
    resolve_device({"name": "mygpu", "memory": "40 GiB", "memory_bandwidth": "1.5 TB/s",
                    "peak_flops": {"fp32": "20 TFLOP/s", "tf32": "80 TFLOP/s",
                                   "fp16": "160 TFLOP/s", "bf16": "160 TFLOP/s"}})
    resolve_device("calibration/device.yaml", base_dir=scenario.base_dir)   # the same keys, in a file

Memory capacities are binary: an "80 GB" HBM part holds 80 GiB of DRAM cells
(five 16 GiB stacks), and nvidia-smi reports 81920 MiB for an A100 80GB. The
H200's "141 GB", the B200's "180 GB", the GB200's "186 GB" and the GB300's
"288 GB" are read the same way.
"""
import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from pydantic import ValidationError

from ..errors import ScenarioError
from ..scenario import DTYPES, OPTIONAL_DTYPES, DeviceFields
from ..scenario.fields import first_error
from ..user_files import load_yaml_file, user_path

DEFAULT_EFFICIENCY = 0.5

_FILE_KEYS = ("name", "peak_flops", "memory", "memory_bandwidth", "efficiency", "kernel_overhead", "pass_overhead",
              "update_overhead")
_T = 1e12  # TFLOP/s
_GIB = 2.0**30


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One GPU model: dense peak FLOP/s by dtype, HBM size and bandwidth, efficiency."""

    name: str
    # Every dtype of DTYPES; those of OPTIONAL_DTYPES (fp8, mxfp8, nvfp4) only on parts that have them. Left out
    # of hash(): a dict is unhashable.
    peak_flops: dict[str, float] = dataclasses.field(hash=False)
    memory_bytes: float
    memory_bandwidth: float
    efficiency: float = DEFAULT_EFFICIENCY
    # Seconds each kernel costs beyond its FLOPs (launch and dispatch); 0 for the catalog's GPUs, whose
    # datasheets give none; simtrain calibrate measures it on a host, where it is Python's and torch's
    # per-operator overhead.
    kernel_overhead_s: float = 0.0
    # Seconds each pass over the model (a forward, a backward) costs beyond its kernels: the host's work around
    # them (the framework's Python, the batch's draw, the autograd engine's start). 0 for the catalog's GPUs;
    # simtrain calibrate measures it on a host (real/step_fit.py).
    pass_overhead_s: float = 0.0
    # Seconds each optimizer step costs beyond its bytes and kernels: the optimizer's own Python around them. 0
    # for the catalog's GPUs; simtrain calibrate measures it on a host, apart from pass_overhead (an update's
    # fixed cost is not a pass's: real/step_fit.py).
    update_overhead_s: float = 0.0
    # The datasheet's NVLink bandwidth per GPU, both directions together (bytes/s); None: not given. What a
    # scenario's cluster.link describes (per direction: half of it); the catalog's figure is for reference.
    nvlink_bandwidth: float | None = None
    # Streaming multiprocessors the part has enabled; None: not given (then no kernel takes any from another)
    streaming_multiprocessors: int | None = None
    # The fraction of its dense peak the generation's fused attention kernel is published to reach: what the
    # kernel compute model (kernel_model.py) charges attention at; None: none published (then the efficiency).
    attention_efficiency: float | None = None
    # The GPU generation (ampere, hopper, blackwell...): whose calibration `efficiency: calibrated` takes
    generation: str | None = None

    def __post_init__(self):
        keys = [dtype for dtype in (*DTYPES, *OPTIONAL_DTYPES) if dtype in self.peak_flops]
        if sorted(self.peak_flops) != sorted(keys) or not set(DTYPES) <= set(keys):
            raise ValueError(f"device {self.name}: peak_flops keys must be {DTYPES} (and optionally "
                             f"{OPTIONAL_DTYPES}), got {sorted(self.peak_flops)}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"device {self.name}: efficiency must be in (0, 1], got {self.efficiency}")
        object.__setattr__(self, "peak_flops", {dtype: self.peak_flops[dtype] for dtype in keys})

    @property
    def has_fixed_costs(self) -> bool:
        """Whether work costs more than its FLOPs or bytes: a calibrated host's kernels, passes or updates."""
        return bool(self.kernel_overhead_s or self.pass_overhead_s or self.update_overhead_s)

    def flops_rate(self, dtype: str) -> float:
        """FLOP/s this device sustains in `dtype`: peak times efficiency."""
        if dtype not in self.peak_flops:
            raise ScenarioError(f"device {self.name}: unknown dtype {dtype!r}; known: {', '.join(self.peak_flops)}")
        return self.peak_flops[dtype] * self.efficiency


# FlashAttention-2 on A100 (Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
# Partitioning", arXiv 2307.08691, 2023, abstract): "reaching 50-73% of the theoretical maximum FLOPs/s on A100".
FLASH_ATTENTION_2_AMPERE = 0.73
# FlashAttention-3 on H100 (Shah et al., "FlashAttention-3: Fast and Accurate Attention with Asynchrony and
# Low-precision", arXiv 2407.08608, 2024, abstract): "with FP16 reaching up to 740 TFLOPs/s (75% utilization)".
# Hopper's parts share the kernel; Blackwell's have no published figure of theirs.
FLASH_ATTENTION_3_HOPPER = 0.75

CATALOG: dict[str, DeviceSpec] = {
    # NVIDIA Tesla V100 GPU Architecture whitepaper (2017), Tesla V100 SXM2:
    # 15.7 TFLOP/s FP32, 125 Tensor TFLOP/s (FP16 inputs), 16 GB HBM2 at 900 GB/s.
    # Volta has no TF32 or BF16 tensor-core path: TF32 math falls back to plain FP32
    # (cuBLAS ignores the TF32 mode), and BF16 is not native, so both run at FP32 rate.
    "v100-16gb": DeviceSpec(
        name="v100-16gb",
        peak_flops={"fp32": 15.7 * _T, "tf32": 15.7 * _T, "fp16": 125 * _T, "bf16": 15.7 * _T},
        memory_bytes=16 * _GIB,
        memory_bandwidth=900e9,
        nvlink_bandwidth=300e9,  # the whitepaper's six NVLink 2.0 links, 300 GB/s
        streaming_multiprocessors=80,  # the whitepaper: Tesla V100 has 80 of the full GV100's 84 SMs
        generation="volta",
    ),
    # NVIDIA A100 Tensor Core GPU datasheet (1758950-r4, 2021), A100 40GB SXM, dense figures
    # (the starred ones are with sparsity, twice these): FP32 19.5 TFLOP/s, TF32 tensor 156,
    # BF16 tensor 312, FP16 tensor 312; 40 GB HBM2 at 1,555 GB/s.
    "a100-40gb": DeviceSpec(
        name="a100-40gb",
        peak_flops={"fp32": 19.5 * _T, "tf32": 156 * _T, "fp16": 312 * _T, "bf16": 312 * _T},
        memory_bytes=40 * _GIB,
        memory_bandwidth=1555e9,
        nvlink_bandwidth=600e9,  # the datasheet's NVLink 600 GB/s
        # NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020), Figure 6: "GA100 Full GPU with 128 SMs
        # (A100 Tensor Core GPU has 108 SMs)"
        streaming_multiprocessors=108,
        attention_efficiency=FLASH_ATTENTION_2_AMPERE,
        generation="ampere",
    ),
    # Same datasheet, A100 80GB SXM: same FLOP/s as the 40GB part; 80 GB HBM2e at 2,039 GB/s.
    "a100-80gb": DeviceSpec(
        name="a100-80gb",
        peak_flops={"fp32": 19.5 * _T, "tf32": 156 * _T, "fp16": 312 * _T, "bf16": 312 * _T},
        memory_bytes=80 * _GIB,
        memory_bandwidth=2039e9,
        nvlink_bandwidth=600e9,
        streaming_multiprocessors=108,  # the same GA100 part (the whitepaper's 108 SMs)
        attention_efficiency=FLASH_ATTENTION_2_AMPERE,
        generation="ampere",
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM: FP32 67 TFLOP/s; TF32 989, BF16 1,979,
    # FP16 1,979 and FP8 3,958 TFLOP/s are listed "with sparsity", dense is half of each: 494.5, 989.5,
    # 989.5, 1,979. 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s.
    "h100-80gb": DeviceSpec(
        name="h100-80gb",
        peak_flops={"fp32": 67 * _T, "tf32": 494.5 * _T, "fp16": 989.5 * _T, "bf16": 989.5 * _T,
                    "fp8": 1979 * _T},
        memory_bytes=80 * _GIB,
        memory_bandwidth=3.35e12,
        nvlink_bandwidth=900e9,
        # NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022): the H100 SXM5 has 132 SMs (of the full
        # GH100's 144)
        streaming_multiprocessors=132,
        attention_efficiency=FLASH_ATTENTION_3_HOPPER,
        generation="hopper",
    ),
    # Same datasheet, H100 PCIe: FP32 51 TFLOP/s; with sparsity TF32 756, BF16/FP16 1,513 and FP8 3,026, dense
    # half of each: 378, 756.5, 1,513. 80 GB HBM2e at 2 TB/s; an NVLink bridge joins two cards at 600 GB/s.
    "h100-pcie-80gb": DeviceSpec(
        name="h100-pcie-80gb",
        peak_flops={"fp32": 51 * _T, "tf32": 378 * _T, "fp16": 756.5 * _T, "bf16": 756.5 * _T,
                    "fp8": 1513 * _T},
        memory_bytes=80 * _GIB,
        memory_bandwidth=2.0e12,
        nvlink_bandwidth=600e9,
        streaming_multiprocessors=114,  # the H100 architecture whitepaper (2022): H100 PCIe has 114 SMs
        attention_efficiency=FLASH_ATTENTION_3_HOPPER,
        generation="hopper",
    ),
    # Meta's H100 in its Grand Teton servers, a custom part NVIDIA publishes no datasheet for: "Meta's H100s also
    # have the SXM form factor despite having 96GB HBM2e" (pytorch/torchtitan PR #554, 2024); "2.4 TB per second,
    # custom to Meta's H100 variant" (pytorch/ao, torchao/testing/training/roofline_utils.py); "non-standard.
    # They have HBM2e and are limited to a lower TDP. The actual peak TFLOPs should be between SXM and NVL, and we
    # don't know the exact value" (TorchTitan paper, arXiv 2410.06511, 2024). No source found gives its power limit
    # (the issue's ~500 W) or its SM count; its FLOP/s, NVLink and SMs are the H100 SXM's (the NVIDIA datasheet
    # value: an upper bound; H100 NVL's dense BF16 is 835 TFLOP/s). Not the 80 GB HBM3, 700 W H100 that the Llama 3
    # paper (2024) trained on Grand Teton: that one is h100-80gb.
    "h100-grand-teton-96gb": DeviceSpec(
        name="h100-grand-teton-96gb",
        peak_flops={"fp32": 67 * _T, "tf32": 494.5 * _T, "fp16": 989.5 * _T, "bf16": 989.5 * _T,
                    "fp8": 1979 * _T},
        memory_bytes=96 * _GIB,
        memory_bandwidth=2.4e12,
        nvlink_bandwidth=900e9,
        streaming_multiprocessors=132,
        attention_efficiency=FLASH_ATTENTION_3_HOPPER,
        generation="hopper",
    ),
    # NVIDIA H800 Tensor Core GPU datasheet (2023), H800 SXM: the H100 SXM's FP32 67 and, with sparsity, TF32 989,
    # BF16/FP16 1,979 and FP8 3,958 TFLOP/s (dense half of each), FP64 cut to 1 TFLOP/s; 80 GB HBM3 at 3.35 TB/s;
    # NVLink 400 GB/s (the H100's 900 GB/s, cut).
    "h800-80gb": DeviceSpec(
        name="h800-80gb",
        peak_flops={"fp32": 67 * _T, "tf32": 494.5 * _T, "fp16": 989.5 * _T, "bf16": 989.5 * _T,
                    "fp8": 1979 * _T},
        memory_bytes=80 * _GIB,
        memory_bandwidth=3.35e12,
        nvlink_bandwidth=400e9,
        # DeepSeek-V3 Technical Report (arXiv 2412.19437, 2024): its all-to-all kernels take 20 of the H800's 132
        # SMs
        streaming_multiprocessors=132,
        attention_efficiency=FLASH_ATTENTION_3_HOPPER,
        generation="hopper",
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (2024), H200 SXM: the H100's compute (the same GH100 die: FP32
    # 67, and with sparsity TF32 989, BF16/FP16 1,979, FP8 3,958 TFLOP/s; dense half of each); 141 GB HBM3e
    # at 4.8 TB/s; NVLink 900 GB/s.
    "h200-141gb": DeviceSpec(
        name="h200-141gb",
        peak_flops={"fp32": 67 * _T, "tf32": 494.5 * _T, "fp16": 989.5 * _T, "bf16": 989.5 * _T,
                    "fp8": 1979 * _T},
        memory_bytes=141 * _GIB,
        memory_bandwidth=4.8e12,
        nvlink_bandwidth=900e9,
        # the H100 SXM5's GH100 configuration (its whitepaper's 132 SMs); the H200 datasheet lists no SM count
        # and gives the H100 SXM's compute figures, which 132 SMs at the same clocks make
        streaming_multiprocessors=132,
        attention_efficiency=FLASH_ATTENTION_3_HOPPER,
        generation="hopper",
    ),
    # NVIDIA HGX B200 specifications (nvidia.com's HGX platform page, "Individual Blackwell GPU
    # Specifications", HGX B200 column; the DGX B200 datasheet gives the same per-GPU figures times 8):
    # FP32 75 TFLOP/s; with sparsity TF32 2.2, FP16/BF16 4.5, FP8 9 and FP4 18 PFLOP/s, dense half of each: 1,100,
    # 2,250, 4,500 and 9,000 TFLOP/s. 180 GB HBM3e at 7.7 TB/s; fifth-generation NVLink 1.8 TB/s.
    # Blackwell's block-scaled formats run on the same tensor-core paths as their plain ones (NVIDIA lists one
    # "FP8/FP6" and one "FP4" rate; torchao's roofline, roofline_utils.py, times MXFP8 GEMMs at the FP8 peak):
    # mxfp8 at the FP8 rate, nvfp4 at the FP4 rate. The same holds for gb200-186gb and gb300-288gb.
    "b200-180gb": DeviceSpec(
        name="b200-180gb",
        peak_flops={"fp32": 75 * _T, "tf32": 1100 * _T, "fp16": 2250 * _T, "bf16": 2250 * _T,
                    "fp8": 4500 * _T, "mxfp8": 4500 * _T, "nvfp4": 9000 * _T},
        memory_bytes=180 * _GIB,
        memory_bandwidth=7.7e12,
        nvlink_bandwidth=1.8e12,
        # two dies of 80 SMs, 74 of each enabled: 148 (NVIDIA's Blackwell datasheets give none; the count the
        # CUDA runtime reports, as Chips and Cheese's "Nvidia's B200: Keeping the CUDA Juggernaut Rolling", 2025)
        streaming_multiprocessors=148,
        generation="blackwell",
    ),
    # NVIDIA GB200 NVL72 specifications (nvidia.com's GB200 NVL72 page, 2025), the rack's figures over its 72 GPUs:
    # FP32 5,760 TFLOP/s -> 80; with sparsity TF32 180, FP16/BF16 360, FP8/FP6 720 and FP4 1,440 PFLOP/s -> dense
    # 1,250, 2,500, 5,000 and 10,000 TFLOP/s (the B200's silicon at a higher clock and power); up to 13.4 TB HBM3e
    # at 576 TB/s -> 186 GB at 8 TB/s; NVLink 130 TB/s -> 1.8 TB/s. The 2024 Blackwell announcement gave 192 GB a
    # GPU (384 GB a superchip); the page's shipping 186 GB is taken, as MLPerf's GB200-186GB systems list it.
    "gb200-186gb": DeviceSpec(
        name="gb200-186gb",
        peak_flops={"fp32": 80 * _T, "tf32": 1250 * _T, "fp16": 2500 * _T, "bf16": 2500 * _T,
                    "fp8": 5000 * _T, "mxfp8": 5000 * _T, "nvfp4": 10000 * _T},
        memory_bytes=186 * _GIB,
        memory_bandwidth=8e12,
        nvlink_bandwidth=1.8e12,
        # NVIDIA's GB200 documents give no SM count; the CUDA runtime reports 152 (the notes on FlashInfer's NVFP4
        # sparse MLA decode kernel, flashinfer-ai/flashinfer#5716: "GB200 (152 SMs)", "B200 (148 SMs)"), and
        # GB200's MIG slices hold more SMs than B200's (NVIDIA/gpu-operator PR #1303, 2025: 32 against 30 in a
        # 1g.47gb slice)
        streaming_multiprocessors=152,
        generation="blackwell",
    ),
    # NVIDIA GB300 NVL72 specifications (nvidia.com's GB300 NVL72 page, 2025), over its 72 GPUs: FP32 6 PFLOP/s ->
    # 83.3 TFLOP/s (Verda's per-GPU table, "NVIDIA GB300 NVL72: GPU Architecture & Performance", 2025, gives 80;
    # NVIDIA's figure is taken); with sparsity TF32 180, FP16/BF16 360 and FP8/FP6 720 PFLOP/s -> dense 1,250,
    # 2,500 and 5,000; FP4 1,080 PFLOP/s dense -> 15,000 TFLOP/s, 1.5 times GB200's. "Inside NVIDIA Blackwell
    # Ultra: The Chip Powering the AI Factory Era" (NVIDIA technical blog, 2025): 15 PFLOP/s dense NVFP4, 288 GB
    # HBM3e at 8 TB/s, NVLink 1.8 TB/s a GPU.
    "gb300-288gb": DeviceSpec(
        name="gb300-288gb",
        peak_flops={"fp32": 83.3 * _T, "tf32": 1250 * _T, "fp16": 2500 * _T, "bf16": 2500 * _T,
                    "fp8": 5000 * _T, "mxfp8": 5000 * _T, "nvfp4": 15000 * _T},
        memory_bytes=288 * _GIB,
        memory_bandwidth=8e12,
        nvlink_bandwidth=1.8e12,
        # the blog's 160 SMs are "the full GPU implementation"; the CUDA runtime reports 152 on a GB300 (the
        # FlashInfer notes above: "GB300 (152 SMs)"), which is taken
        streaming_multiprocessors=152,
        generation="blackwell",
    ),
}


class Calibration(NamedTuple):
    """A GPU generation's fitted device efficiency, the compute model it was fitted under, and the relative errors
    ((simulated - published) / published) of the generation's other published rows at that figure: what a
    prediction's error bar is made of (`spread`)."""

    efficiency: float
    compute_model: str
    residuals: tuple[float, ...]

    @property
    def spread(self) -> float:
        """The root mean square of the residuals: the relative error bar of a prediction at this calibration."""
        return math.sqrt(sum(error * error for error in self.residuals) / len(self.residuals))


# One calibration per GPU generation: the device efficiency at which one published row's simulated TFLOP/s per GPU
# matches its figure, used unchanged for every other row of the generation (`efficiency: calibrated`), under the
# compute model it was fitted under, with those rows' errors. A generation without a row fitted has none.
CALIBRATED = {
    # Narayanan et al. 2021 (Megatron-LM), Table 1, the 1T row: 163 TFLOP/s per GPU on 3,072 A100s
    # (python bench/megatron_lm_table1.py --calibrate gpt-1008b); the nine other rows' errors, python bench/megatron_lm_table1.py,
    # 2026-12-07 (docs/validation/megatron.md). Under the roofline: the kernel model's one tile leaves the table's
    # small-model rows 14-22% slow.
    "ampere": Calibration(0.7076, "roofline",
                          (-0.089, -0.098, -0.110, -0.100, -0.023, 0.019, 0.001, 0.003, -0.009)),
    # Megatron-LM's README, H100 weak-scaling table, the 1.7B row: 408.8 TFLOP/s per GPU on 48 H100s, the one row
    # without model parallelism (python bench/megatron_core_h100.py --calibrate gpt-1.7b --compute-model kernels);
    # the eight other rows' errors, python bench/megatron_core_h100.py, 2026-12-07
    # (docs/validation/megatron-core-h100.md)
    "hopper": Calibration(0.6329, "kernels", (0.030, -0.012, 0.018, -0.022, 0.000, -0.006, -0.044, -0.076)),
}


def calibration_of(device) -> tuple[str, Calibration] | None:
    """The generation and calibration a scenario's `cluster.device` takes (`efficiency: calibrated` on a base
    part), or None where it gives its own efficiency."""
    if not isinstance(device, DeviceFields) or device.efficiency != "calibrated" or device.base is None:
        return None
    generation = _lookup(device.base, "cluster.device.base").generation
    return generation, CALIBRATED[generation]


# A part's bare name (gb200) for the catalog's one part of that name (gb200-186gb); none for a name several
# parts share (a100, h100).
_PARTS = [name.split("-")[0] for name in CATALOG]
ALIASES = {part: name for part, name in zip(_PARTS, CATALOG) if _PARTS.count(part) == 1}


def resolve_device(value, field: str = "cluster.device", base_dir=None,
                   compute_model: str | None = None) -> DeviceSpec:
    """A DeviceSpec from a catalog name, a device file, or device fields (scenario.DeviceFields, or a mapping of
    its keys: a catalog `base` with some fields changed, or a whole device).

    A string ending in .yaml or .yml is a device file (what `simtrain calibrate` writes): a mapping
    with the device fields' keys but base, read relative to `base_dir` (then the working folder).
    `efficiency: calibrated` takes the base part's generation's fitted figure (CALIBRATED), which must have been
    fitted under `compute_model` where that is given.
    Raises ScenarioError naming `field` (or the sub-field at fault, and the file) on any mistake.
    """
    if isinstance(value, DeviceSpec):
        return value
    if isinstance(value, str) and value.endswith((".yaml", ".yml")):
        return _device_file(value, field, base_dir)
    if isinstance(value, str):
        return _lookup(value, field)
    fields = value if isinstance(value, DeviceFields) else _device_fields(value, field)
    if fields.base is not None:
        base = _lookup(fields.base, f"{field}.base")
        changes = fields.changes()
        if changes.get("efficiency") == "calibrated":
            changes["efficiency"] = calibrated_efficiency(base, f"{field}.efficiency", compute_model)
        return override_device(base, changes)
    if fields.efficiency == "calibrated":
        raise ScenarioError(f"{field}.efficiency: calibrated needs a base part (whose GPU generation was fitted)")
    return DeviceSpec(name=fields.name, peak_flops=fields.peak_flops.given(), memory_bytes=fields.memory,
                      memory_bandwidth=fields.memory_bandwidth,
                      efficiency=DEFAULT_EFFICIENCY if fields.efficiency is None else fields.efficiency,
                      kernel_overhead_s=fields.kernel_overhead or 0.0, pass_overhead_s=fields.pass_overhead or 0.0,
                      update_overhead_s=fields.update_overhead or 0.0)


def calibrated_efficiency(spec: DeviceSpec, field: str, compute_model: str | None = None) -> float:
    """The efficiency fitted for `spec`'s GPU generation (CALIBRATED); a ScenarioError naming `field` where no row
    of that generation was fitted, or where it was fitted under another compute model than `compute_model`."""
    calibration = CALIBRATED.get(spec.generation)
    if calibration is None:
        raise ScenarioError(f"{field}: calibrated: no published row of {spec.name}'s generation "
                            f"({spec.generation or 'unknown'}) has been fitted; give a number (fitted: "
                            f"{', '.join(CALIBRATED)})")
    if compute_model is not None and compute_model != calibration.compute_model:
        raise ScenarioError(f"{field}: calibrated: the {spec.generation} figure was fitted under compute_model: "
                            f"{calibration.compute_model}, not {compute_model}; set that or give a number")
    return calibration.efficiency


def _device_fields(value, field: str) -> DeviceFields:
    """A mapping validated as device fields; the first problem one line naming `field` and the key."""
    if not isinstance(value, Mapping):
        raise ScenarioError(f"{field}: expected a device name or a mapping, got {value!r}")
    try:
        return DeviceFields.model_validate(dict(value))
    except ValidationError as error:
        problem = first_error(error)  # "key: what", or "what" for the mapping as a whole
        raise ScenarioError(f"{field}.{problem}" if error.errors()[0]["loc"] else f"{field}: {problem}") from None


def _device_file(name: str, field: str, base_dir) -> DeviceSpec:
    """The spec a device file describes; a mistake names the file and the key."""
    path = user_path(name, field, ScenarioError)
    candidates = [path] if path.is_absolute() or base_dir is None else [Path(base_dir) / path, path]
    found = next((candidate for candidate in candidates if os.path.exists(candidate)), None)
    if found is None:
        raise ScenarioError(f"{field}: device file {name} not found")
    data = load_yaml_file(found, f"device file {found}", ScenarioError)
    if not isinstance(data, Mapping) or "base" in data:
        raise ScenarioError(f"device file {found}: expected a mapping of {', '.join(_FILE_KEYS)}")
    return resolve_device(dict(data), f"device file {found}")


def override_device(base: DeviceSpec, changes: Mapping) -> DeviceSpec:
    """`base` with some of its fields changed: `changes` holds scenario.DeviceFields' values by name (name,
    peak_flops of some dtypes, memory, memory_bandwidth, efficiency, kernel_overhead, pass_overhead,
    update_overhead)."""
    replaced = {}
    if changes.get("name") is not None:
        replaced["name"] = changes["name"]
    if changes.get("peak_flops") is not None:
        replaced["peak_flops"] = {**base.peak_flops, **changes["peak_flops"].given()}
    if changes.get("memory") is not None:
        replaced["memory_bytes"] = changes["memory"]
    if changes.get("memory_bandwidth") is not None:
        replaced["memory_bandwidth"] = changes["memory_bandwidth"]
    if changes.get("efficiency") is not None:
        replaced["efficiency"] = changes["efficiency"]
    if changes.get("kernel_overhead") is not None:
        replaced["kernel_overhead_s"] = changes["kernel_overhead"]
    if changes.get("pass_overhead") is not None:
        replaced["pass_overhead_s"] = changes["pass_overhead"]
    if changes.get("update_overhead") is not None:
        replaced["update_overhead_s"] = changes["update_overhead"]
    return dataclasses.replace(base, **replaced)


def require_rate(specs: list[DeviceSpec], dtype: str, field: str) -> None:
    """A ScenarioError naming `field` unless every device in `specs` has a peak FLOP/s for `dtype`."""
    lacking = sorted({spec.name for spec in specs if dtype not in spec.peak_flops})
    if lacking:
        having = sorted(name for name, spec in CATALOG.items() if dtype in spec.peak_flops)
        raise ScenarioError(f"{field}: {dtype} needs devices with an {dtype} rate; {', '.join(lacking)} has none "
                            f"(the catalog's with one: {', '.join(having)}; or give cluster.device's "
                            f"peak_flops.{dtype})")


def _lookup(name: str, field: str) -> DeviceSpec:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in CATALOG:
        raise ScenarioError(f"{field}: unknown device {name!r}; known: {', '.join(sorted(CATALOG))}")
    return CATALOG[key]
