"""Device catalog: datasheet figures, inline specs and the errors a scenario can hit."""
import dataclasses

import pytest

from simtrain.errors import ScenarioError
from simtrain.hw.catalog import CATALOG, DTYPES, DeviceSpec, resolve_device

GIB = 2**30
T = 1e12

# Dense peak TFLOP/s (fp32, tf32, fp16, bf16), HBM GiB, HBM GB/s, as the cited datasheets give them.
DATASHEETS = {
    # Tesla V100 architecture whitepaper, SXM2: 15.7 FP32, 125 tensor; no TF32/BF16 path -> FP32 rate.
    "v100-16gb": ((15.7, 15.7, 125, 15.7), 16, 900),
    # A100 datasheet, SXM: 19.5 FP32, 156 TF32, 312 FP16/BF16 (dense), 1,555 GB/s.
    "a100-40gb": ((19.5, 156, 312, 312), 40, 1555),
    # A100 datasheet, 80GB SXM: same FLOP/s, 2,039 GB/s.
    "a100-80gb": ((19.5, 156, 312, 312), 80, 2039),
    # H100 SXM datasheet: 67 FP32; 989 TF32 and 1,979 FP16/BF16 with sparsity, dense is half; 3.35 TB/s.
    "h100-80gb": ((67, 989 / 2, 1979 / 2, 1979 / 2), 80, 3350),
}


@pytest.mark.parametrize("name", sorted(DATASHEETS))
def test_catalog_matches_datasheets(name):
    (fp32, tf32, fp16, bf16), mem_gib, bw_gbps = DATASHEETS[name]
    spec = CATALOG[name]
    assert spec.name == name
    assert {dtype: spec.peak_flops[dtype] for dtype in DTYPES} == pytest.approx(
        {"fp32": fp32 * T, "tf32": tf32 * T, "fp16": fp16 * T, "bf16": bf16 * T})
    assert spec.memory_bytes == mem_gib * GIB
    assert spec.memory_bandwidth == pytest.approx(bw_gbps * 1e9)
    assert spec.efficiency == 0.5


def test_streaming_multiprocessors_are_the_whitepapers_and_a_custom_device_has_none():
    # Volta, Ampere and Hopper whitepapers (V100 80, A100 108, H100 SXM5 132; the H200 the same GH100 part);
    # B200: 2 dies of 74 enabled SMs
    assert {name: spec.streaming_multiprocessors for name, spec in CATALOG.items()} == {
        "v100-16gb": 80, "a100-40gb": 108, "a100-80gb": 108, "h100-80gb": 132, "h200-141gb": 132, "b200-180gb": 148}
    assert resolve_device({"base": "h100-80gb", "efficiency": 0.4}).streaming_multiprocessors == 132
    custom = {"name": "mygpu", "memory": "40 GiB", "memory_bandwidth": "1.5 TB/s",
              "peak_flops": {dtype: "20 TFLOP/s" for dtype in DTYPES}}
    assert resolve_device(custom).streaming_multiprocessors is None


def test_catalog_has_every_required_part():
    assert set(DATASHEETS) <= set(CATALOG)
    for spec in CATALOG.values():
        assert tuple(spec.peak_flops)[:len(DTYPES)] == DTYPES and set(spec.peak_flops) <= {*DTYPES, "fp8"}


def test_flops_rate_is_peak_times_efficiency():
    spec = resolve_device({"base": "a100-40gb", "efficiency": 0.4})
    assert spec.flops_rate("bf16") == pytest.approx(312e12 * 0.4)
    assert spec.flops_rate("fp32") == pytest.approx(19.5e12 * 0.4)


def test_flops_rate_unknown_dtype():
    with pytest.raises(ScenarioError, match=r"^device a100-40gb: unknown dtype 'fp8'; known: fp32, tf32, fp16, bf16$"):
        CATALOG["a100-40gb"].flops_rate("fp8")


def test_resolve_by_name():
    assert resolve_device("h100-80gb") is CATALOG["h100-80gb"]
    assert resolve_device(" A100-80GB ") is CATALOG["a100-80gb"]
    assert resolve_device(CATALOG["v100-16gb"]) is CATALOG["v100-16gb"]


def test_base_with_overrides():
    spec = resolve_device({"base": "a100-40gb", "efficiency": 0.4, "memory": "80 GiB"})
    assert spec.name == "a100-40gb"
    assert spec.memory_bytes == 80 * GIB
    assert spec.efficiency == 0.4
    assert spec.peak_flops == CATALOG["a100-40gb"].peak_flops
    assert spec.memory_bandwidth == 1555e9
    assert CATALOG["a100-40gb"].memory_bytes == 40 * GIB  # the catalog entry is untouched


def test_base_with_partial_peak_flops_and_name():
    spec = resolve_device({"base": "v100-16gb", "name": "v100-tuned", "peak_flops": {"fp16": "100 TFLOP/s"},
                           "memory_bandwidth": "1 TB/s"})
    assert spec.name == "v100-tuned"
    assert spec.peak_flops == {"fp32": 15.7e12, "tf32": 15.7e12, "fp16": 1e14, "bf16": 15.7e12}
    assert spec.memory_bandwidth == 1e12


def test_full_inline_spec():
    spec = resolve_device(
        {
            "name": "mygpu",
            "peak_flops": {"fp32": "20 TFLOP/s", "tf32": "80 TFLOP/s", "fp16": 1.6e14, "bf16": "160 TFLOPS"},
            "memory": "40 GiB",
            "memory_bandwidth": "1.5 TB/s",
            "efficiency": 0.6,
        }
    )
    assert spec == DeviceSpec(
        name="mygpu",
        peak_flops={"fp32": 2e13, "tf32": 8e13, "fp16": 1.6e14, "bf16": 1.6e14},
        memory_bytes=40 * GIB,
        memory_bandwidth=1.5e12,
        efficiency=0.6,
    )
    assert spec.flops_rate("fp16") == pytest.approx(0.96e14)


def test_inline_spec_default_efficiency():
    spec = resolve_device({"name": "g", "peak_flops": dict.fromkeys(DTYPES, 1e12), "memory": 1e9,
                           "memory_bandwidth": 1e11})
    assert spec.efficiency == 0.5


FULL = {"name": "g", "peak_flops": dict.fromkeys(DTYPES, "1 TFLOP/s"), "memory": "1 GiB", "memory_bandwidth": "1 TB/s"}


@pytest.mark.parametrize(
    "value, expected",
    [
        ("a200", "cluster.device: unknown device 'a200'; known: a100-40gb, a100-80gb, b200-180gb, h100-80gb, "
                 "h200-141gb, v100-16gb"),
        (7, "cluster.device: expected a device name or a mapping, got 7"),
        ({"base": "a200"}, "cluster.device.base: unknown device 'a200'; known: a100-40gb"),
        ({"base": 3}, "cluster.device.base: Input should be a valid string"),
        ({"base": "a100-40gb", "efficiency": 0},
         "cluster.device.efficiency: Input should be greater than or equal to 0.000001"),
        ({"base": "a100-40gb", "efficiency": 1.5},
         "cluster.device.efficiency: Input should be less than or equal to 1"),
        ({"base": "a100-40gb", "efficiency": "high"}, "cluster.device.efficiency: Input should be a valid number"),
        ({"base": "a100-40gb", "memroy": "80 GiB"}, "cluster.device.memroy: unknown field"),
        ({"base": "a100-40gb", "memory": -1}, "cluster.device.memory: must not be negative"),
        ({"base": "a100-40gb", "memory": "80 us"}, "cluster.device.memory: unit 'us' in '80 us' is not a bytes unit"),
        ({"base": "a100-40gb", "memory_bandwidth": 0},
         "cluster.device.memory_bandwidth: Input should be greater than 0"),
        ({"base": "a100-40gb", "peak_flops": {"fp4": 1}}, "cluster.device.peak_flops.fp4: unknown field"),
        ({"base": "a100-40gb", "peak_flops": {"fp16": "9 GB"}}, "cluster.device.peak_flops.fp16: unit 'GB'"),
        ({"base": "a100-40gb", "peak_flops": 5}, "cluster.device.peak_flops: Input should be a valid dictionary"),
        ({"base": "a100-40gb", "name": ""}, "cluster.device.name: String should have at least 1 character"),
        ({**FULL, "peak_flops": {"fp32": 1, "fp16": 1}}, "cluster.device: peak_flops: missing tf32, bf16"),
        ({k: v for k, v in FULL.items() if k != "memory"}, "cluster.device: missing 'memory'"),
        ({**FULL, "peak_flops": {**FULL["peak_flops"], "tf32": 0}},
         "cluster.device.peak_flops.tf32: Input should be greater than 0"),
        ({**FULL, "efficiency": True}, "cluster.device.efficiency: expected a number"),
    ],
)
def test_errors_are_one_line_and_name_the_field(value, expected):
    with pytest.raises(ScenarioError) as info:
        resolve_device(value)
    message = str(info.value)
    assert message.startswith(expected)
    assert "\n" not in message


def test_errors_use_the_callers_field():
    with pytest.raises(ScenarioError, match=r"^jobs\[1\]\.device\.efficiency: "):
        resolve_device({"base": "h100-80gb", "efficiency": 2}, field="jobs[1].device")


def test_spec_is_frozen_hashable_and_owns_its_flops():
    flops = dict.fromkeys(DTYPES, 1.0)
    spec = DeviceSpec(name="g", peak_flops=flops, memory_bytes=1, memory_bandwidth=1)
    flops["fp32"] = 99.0
    assert spec.peak_flops["fp32"] == 1.0
    assert hash(spec) == hash(DeviceSpec(name="g", peak_flops=dict.fromkeys(DTYPES, 1.0), memory_bytes=1,
                                         memory_bandwidth=1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.efficiency = 1.0


@pytest.mark.parametrize(
    "changes",
    [{"peak_flops": {"fp32": 1.0}}, {"efficiency": 0.0}, {"efficiency": 1.01}],
)
def test_direct_construction_checks_invariants(changes):
    kwargs = {"name": "g", "peak_flops": dict.fromkeys(DTYPES, 1.0), "memory_bytes": 1, "memory_bandwidth": 1}
    with pytest.raises(ValueError):
        DeviceSpec(**{**kwargs, **changes})
