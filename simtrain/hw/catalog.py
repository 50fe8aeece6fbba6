"""Device catalog: what one simulated GPU can compute and hold.

A `DeviceSpec` gives a GPU's dense peak FLOP/s per dtype, its HBM capacity and
bandwidth, the fraction of peak a training kernel reaches (`efficiency`) and
a fixed cost per kernel (`kernel_overhead`, default 0). The compute model
charges `flops / spec.flops_rate(dtype) + kernels x kernel_overhead` seconds.

`CATALOG` holds public datasheet figures for common SXM parts; a scenario names
one, tweaks one, or describes its own GPU (`cluster.device`, typed and
validated as scenario.DeviceFields), and `resolve_device` turns any of those
into a `DeviceSpec`:

    resolve_device("a100-40gb")
    resolve_device({"base": "a100-40gb", "efficiency": 0.4, "memory": "80 GiB"})
    resolve_device({"name": "mygpu", "memory": "40 GiB", "memory_bandwidth": "1.5 TB/s",
                    "peak_flops": {"fp32": "20 TFLOP/s", "tf32": "80 TFLOP/s",
                                   "fp16": "160 TFLOP/s", "bf16": "160 TFLOP/s"}})
    resolve_device("calibration/device.yaml", base_dir=scenario.base_dir)   # the same keys, in a file

Memory capacities are binary: an "80 GB" HBM part holds 80 GiB of DRAM cells
(five 16 GiB stacks), and nvidia-smi reports 81920 MiB for an A100 80GB.
"""
import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import ValidationError

from ..errors import ScenarioError
from ..scenario import DTYPES, DeviceFields
from ..scenario.fields import first_error
from ..user_files import load_yaml_file, user_path

DEFAULT_EFFICIENCY = 0.5

_FILE_KEYS = ("name", "peak_flops", "memory", "memory_bandwidth", "efficiency", "kernel_overhead")
_T = 1e12  # TFLOP/s
_GIB = 2.0**30


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One GPU model: dense peak FLOP/s by dtype, HBM size and bandwidth, efficiency."""

    name: str
    peak_flops: dict[str, float] = dataclasses.field(hash=False)  # left out of hash(): a dict is unhashable
    memory_bytes: float
    memory_bandwidth: float
    efficiency: float = DEFAULT_EFFICIENCY
    # Seconds each kernel costs beyond its FLOPs (launch and dispatch); 0 for the catalog's GPUs, whose
    # datasheets give none; simtrain calibrate measures it on a host, where it is Python's and torch's
    # per-operator overhead.
    kernel_overhead_s: float = 0.0

    def __post_init__(self):
        if sorted(self.peak_flops) != sorted(DTYPES):
            raise ValueError(f"device {self.name}: peak_flops keys must be {DTYPES}, got {sorted(self.peak_flops)}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"device {self.name}: efficiency must be in (0, 1], got {self.efficiency}")
        object.__setattr__(self, "peak_flops", dict(self.peak_flops))

    def flops_rate(self, dtype: str) -> float:
        """FLOP/s this device sustains in `dtype`: peak times efficiency."""
        if dtype not in self.peak_flops:
            raise ScenarioError(f"device {self.name}: unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
        return self.peak_flops[dtype] * self.efficiency


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
    ),
    # NVIDIA A100 Tensor Core GPU datasheet (1758950-r4, 2021), A100 40GB SXM, dense figures
    # (the starred ones are with sparsity, twice these): FP32 19.5 TFLOP/s, TF32 tensor 156,
    # BF16 tensor 312, FP16 tensor 312; 40 GB HBM2 at 1,555 GB/s.
    "a100-40gb": DeviceSpec(
        name="a100-40gb",
        peak_flops={"fp32": 19.5 * _T, "tf32": 156 * _T, "fp16": 312 * _T, "bf16": 312 * _T},
        memory_bytes=40 * _GIB,
        memory_bandwidth=1555e9,
    ),
    # Same datasheet, A100 80GB SXM: same FLOP/s as the 40GB part; 80 GB HBM2e at 2,039 GB/s.
    "a100-80gb": DeviceSpec(
        name="a100-80gb",
        peak_flops={"fp32": 19.5 * _T, "tf32": 156 * _T, "fp16": 312 * _T, "bf16": 312 * _T},
        memory_bytes=80 * _GIB,
        memory_bandwidth=2039e9,
    ),
    # NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM: FP32 67 TFLOP/s; TF32 989,
    # BF16 1,979 and FP16 1,979 TFLOP/s are listed "with sparsity", dense is half of each:
    # 494.5, 989.5, 989.5. 80 GB HBM3 at 3.35 TB/s.
    "h100-80gb": DeviceSpec(
        name="h100-80gb",
        peak_flops={"fp32": 67 * _T, "tf32": 494.5 * _T, "fp16": 989.5 * _T, "bf16": 989.5 * _T},
        memory_bytes=80 * _GIB,
        memory_bandwidth=3.35e12,
    ),
}


def resolve_device(value, field: str = "cluster.device", base_dir=None) -> DeviceSpec:
    """A DeviceSpec from a catalog name, a device file, or device fields (scenario.DeviceFields, or a mapping of
    its keys: a catalog `base` with some fields changed, or a whole device).

    A string ending in .yaml or .yml is a device file (what `simtrain calibrate` writes): a mapping
    with the device fields' keys but base, read relative to `base_dir` (then the working folder).
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
        return override_device(_lookup(fields.base, f"{field}.base"), fields.changes())
    return DeviceSpec(name=fields.name, peak_flops=fields.peak_flops.given(), memory_bytes=fields.memory,
                      memory_bandwidth=fields.memory_bandwidth,
                      efficiency=DEFAULT_EFFICIENCY if fields.efficiency is None else fields.efficiency,
                      kernel_overhead_s=fields.kernel_overhead or 0.0)


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
    peak_flops of some dtypes, memory, memory_bandwidth, efficiency, kernel_overhead)."""
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
    return dataclasses.replace(base, **replaced)


def _lookup(name: str, field: str) -> DeviceSpec:
    key = name.strip().lower()
    if key not in CATALOG:
        raise ScenarioError(f"{field}: unknown device {name!r}; known: {', '.join(sorted(CATALOG))}")
    return CATALOG[key]
