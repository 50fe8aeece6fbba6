"""Device catalog: what one simulated GPU can compute and hold.

A `DeviceSpec` gives a GPU's dense peak FLOP/s per dtype, its HBM capacity and
bandwidth, the fraction of peak a training kernel reaches (`efficiency`) and
a fixed cost per kernel (`kernel_overhead`, default 0). The compute model
charges `flops / spec.flops_rate(dtype) + kernels x kernel_overhead` seconds.

`CATALOG` holds public datasheet figures for common SXM parts; a scenario names
one, tweaks one, or describes its own GPU, and `resolve_device` turns any of
those into a `DeviceSpec`:

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

from ..errors import ScenarioError
from ..limits import MIN_EFFICIENCY
from ..units import parse_quantity
from ..user_files import load_yaml_file, user_path

DTYPES = ("fp32", "tf32", "fp16", "bf16")
DEFAULT_EFFICIENCY = 0.5

_INLINE_KEYS = ("base", "name", "peak_flops", "memory", "memory_bandwidth", "efficiency", "kernel_overhead")
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
    """A DeviceSpec from a catalog name, a device file, a {base: ..., overrides} mapping or an inline spec.

    A string ending in .yaml or .yml is a device file (what `simtrain calibrate` writes): a mapping
    with the inline spec's keys, read relative to `base_dir` (then the working folder).
    Raises ScenarioError naming `field` (or the sub-field at fault, and the file) on any mistake.
    """
    if isinstance(value, DeviceSpec):
        return value
    if isinstance(value, str) and value.endswith((".yaml", ".yml")):
        return _device_file(value, field, base_dir)
    if isinstance(value, str):
        return _lookup(value, field)
    if not isinstance(value, Mapping):
        raise ScenarioError(f"{field}: expected a device name or a mapping, got {value!r}")
    for key in value:
        if key not in _INLINE_KEYS:
            raise ScenarioError(f"{field}: unknown key {key!r}; allowed: {', '.join(_INLINE_KEYS)}")
    if "base" in value:
        if not isinstance(value["base"], str):
            raise ScenarioError(f"{field}.base: expected a device name, got {value['base']!r}")
        return _override(_lookup(value["base"], f"{field}.base"), value, field)
    return _inline(value, field)


def _device_file(name: str, field: str, base_dir) -> DeviceSpec:
    """The spec a device file describes; a mistake names the file and the key."""
    path = user_path(name, field, ScenarioError)
    candidates = [path] if path.is_absolute() or base_dir is None else [Path(base_dir) / path, path]
    found = next((candidate for candidate in candidates if os.path.exists(candidate)), None)
    if found is None:
        raise ScenarioError(f"{field}: device file {name} not found")
    data = load_yaml_file(found, f"device file {found}", ScenarioError)
    if not isinstance(data, Mapping) or "base" in data:
        raise ScenarioError(f"device file {found}: expected a mapping of {', '.join(_INLINE_KEYS[1:])}")
    return resolve_device(dict(data), f"device file {found}")


def override_device(base: DeviceSpec, changes: Mapping, field: str) -> DeviceSpec:
    """`base` with some of its fields (name, peak_flops, memory, memory_bandwidth, efficiency)
    replaced; ScenarioError naming `field` on a mistake."""
    for key in changes:
        if key not in _INLINE_KEYS or key == "base":
            raise ScenarioError(f"{field}: unknown key {key!r}; allowed: {', '.join(_INLINE_KEYS[1:])}")
    return _override(base, changes, field)


def _lookup(name: str, field: str) -> DeviceSpec:
    key = name.strip().lower()
    if key not in CATALOG:
        raise ScenarioError(f"{field}: unknown device {name!r}; known: {', '.join(sorted(CATALOG))}")
    return CATALOG[key]


def _override(base: DeviceSpec, value: Mapping, field: str) -> DeviceSpec:
    """`base` with the fields given in `value` replaced; peak_flops may list only some dtypes."""
    changes = {}
    if "name" in value:
        changes["name"] = _name(value["name"], field)
    if "peak_flops" in value:
        changes["peak_flops"] = {**base.peak_flops, **_peak_flops(value["peak_flops"], field, partial=True)}
    if "memory" in value:
        changes["memory_bytes"] = _positive(value["memory"], "bytes", f"{field}.memory")
    if "memory_bandwidth" in value:
        changes["memory_bandwidth"] = _positive(value["memory_bandwidth"], "bandwidth", f"{field}.memory_bandwidth")
    if "efficiency" in value:
        changes["efficiency"] = _efficiency(value["efficiency"], field)
    if "kernel_overhead" in value:
        changes["kernel_overhead_s"] = parse_quantity(value["kernel_overhead"], "time", f"{field}.kernel_overhead")
    return dataclasses.replace(base, **changes)


def _inline(value: Mapping, field: str) -> DeviceSpec:
    """A spec described in full: every field but efficiency is required."""
    for key in ("name", "peak_flops", "memory", "memory_bandwidth"):
        if key not in value:
            raise ScenarioError(f"{field}: missing {key!r} (or give 'base' to start from a catalog device)")
    return DeviceSpec(
        name=_name(value["name"], field),
        peak_flops=_peak_flops(value["peak_flops"], field, partial=False),
        memory_bytes=_positive(value["memory"], "bytes", f"{field}.memory"),
        memory_bandwidth=_positive(value["memory_bandwidth"], "bandwidth", f"{field}.memory_bandwidth"),
        efficiency=_efficiency(value.get("efficiency", DEFAULT_EFFICIENCY), field),
        kernel_overhead_s=parse_quantity(value.get("kernel_overhead", 0.0), "time", f"{field}.kernel_overhead"),
    )


def _name(value, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ScenarioError(f"{field}.name: expected a non-empty string, got {value!r}")
    return value.strip()


def _peak_flops(value, field: str, partial: bool) -> dict[str, float]:
    field = f"{field}.peak_flops"
    if not isinstance(value, Mapping):
        raise ScenarioError(f"{field}: expected a mapping of dtype to FLOP/s, got {value!r}")
    for dtype in value:
        if dtype not in DTYPES:
            raise ScenarioError(f"{field}: unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    if not partial:
        missing = [dtype for dtype in DTYPES if dtype not in value]
        if missing:
            raise ScenarioError(f"{field}: missing {', '.join(missing)}; give all of {', '.join(DTYPES)}")
    return {dtype: _positive(rate, "flops", f"{field}.{dtype}") for dtype, rate in value.items()}


def _positive(value, kind: str, field: str) -> float:
    number = parse_quantity(value, kind, field)
    if number == 0:
        raise ScenarioError(f"{field}: must be positive, got {value!r}")
    return number


def _efficiency(value, field: str) -> float:
    field = f"{field}.efficiency"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScenarioError(f"{field}: expected a number in (0, 1], got {value!r}")
    if not MIN_EFFICIENCY <= value <= 1:
        raise ScenarioError(f"{field}: must be in [{MIN_EFFICIENCY:g}, 1], got {value!r}")
    return float(value)
