"""Device catalog: datasheet figures, inline specs and the errors a scenario can hit."""
import dataclasses

import pytest

from simtrain.errors import ScenarioError
from simtrain.hw.catalog import ALIASES, CATALOG, DTYPES, OPTIONAL_DTYPES, DeviceSpec, resolve_device

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
    # H100 datasheet (2023), PCIe: 51 FP32; 756 TF32 and 1,513 FP16/BF16 with sparsity; 80 GB HBM2e at 2 TB/s.
    "h100-pcie-80gb": ((51, 756 / 2, 1513 / 2, 1513 / 2), 80, 2000),
    # Meta's Grand Teton H100: 96 GB HBM2e (torchtitan PR #554) at 2.4 TB/s (torchao's roofline); no datasheet, so
    # the H100 SXM's FLOP/s.
    "h100-grand-teton-96gb": ((67, 989 / 2, 1979 / 2, 1979 / 2), 96, 2400),
    # H800 datasheet (2023), SXM: the H100 SXM's FLOP/s and memory.
    "h800-80gb": ((67, 989 / 2, 1979 / 2, 1979 / 2), 80, 3350),
    # H200 datasheet (2024), SXM: the H100 SXM's FLOP/s; 141 GB HBM3e at 4.8 TB/s.
    "h200-141gb": ((67, 989 / 2, 1979 / 2, 1979 / 2), 141, 4800),
    # HGX B200 page, per GPU: 75 FP32; 2.2 PF TF32 and 4.5 PF FP16/BF16 with sparsity; 180 GB at 7.7 TB/s.
    "b200-180gb": ((75, 2200 / 2, 4500 / 2, 4500 / 2), 180, 7700),
    # GB200 NVL72 page (2025), rack over 72 GPUs: 5,760 TF FP32; 180 PF TF32 and 360 PF FP16/BF16 with sparsity;
    # 13.4 TB at 576 TB/s -> 186 GB at 8 TB/s.
    "gb200-186gb": ((5760 / 72, 180e3 / 72 / 2, 360e3 / 72 / 2, 360e3 / 72 / 2), 186, 576e3 / 72),
    # GB300 NVL72 page (2025), over 72 GPUs: 6 PF FP32; 180 PF TF32 and 360 PF FP16/BF16 with sparsity; Blackwell
    # Ultra blog (2025): 288 GB at 8 TB/s.
    "gb300-288gb": ((83.3, 180e3 / 72 / 2, 360e3 / 72 / 2, 360e3 / 72 / 2), 288, 8000),
}

# Dense TFLOP/s of the optional dtypes (fp8, mxfp8, nvfp4; None: the part has none), NVLink GB/s both directions,
# SMs enabled: the datasheets above, the block-scaled formats at their plain format's rate on Blackwell.
OPTIONAL_RATES = {
    "h100-pcie-80gb": ((3026 / 2, None, None), 600, 114),  # NVLink bridge; H100 whitepaper's 114 SMs
    "h100-grand-teton-96gb": ((3958 / 2, None, None), 900, 132),  # the H100 SXM's
    "h800-80gb": ((3958 / 2, None, None), 400, 132),  # NVLink cut to 400 GB/s; DeepSeek-V3 report's 132 SMs
    "b200-180gb": ((9000 / 2, 9000 / 2, 18000 / 2), 1800, 148),  # FP8 9 PF, FP4 18 PF with sparsity
    "gb200-186gb": ((720e3 / 72 / 2, 720e3 / 72 / 2, 1440e3 / 72 / 2), 1800, 152),  # rack FP8 720, FP4 1,440 PF
    "gb300-288gb": ((720e3 / 72 / 2, 720e3 / 72 / 2, 1080e3 / 72), 1800, 152),  # FP4 1,080 PF dense
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
    # Volta, Ampere and Hopper whitepapers (V100 80, A100 108, H100 SXM5 132, H100 PCIe 114; the H200, H800 and
    # Grand Teton H100 the SXM5's GH100 part); B200: 2 dies of 74 enabled SMs; GB200 and GB300: the 152 the CUDA
    # runtime reports
    assert {name: spec.streaming_multiprocessors for name, spec in CATALOG.items()} == {
        "v100-16gb": 80, "a100-40gb": 108, "a100-80gb": 108, "h100-80gb": 132, "h100-pcie-80gb": 114,
        "h100-grand-teton-96gb": 132, "h800-80gb": 132, "h200-141gb": 132, "b200-180gb": 148, "gb200-186gb": 152,
        "gb300-288gb": 152}
    assert resolve_device({"base": "h100-80gb", "efficiency": 0.4}).streaming_multiprocessors == 132
    custom = {"name": "mygpu", "memory": "40 GiB", "memory_bandwidth": "1.5 TB/s",
              "peak_flops": {dtype: "20 TFLOP/s" for dtype in DTYPES}}
    assert resolve_device(custom).streaming_multiprocessors is None


def test_catalog_has_every_required_part():
    assert set(DATASHEETS) <= set(CATALOG)
    for spec in CATALOG.values():
        assert tuple(spec.peak_flops)[:len(DTYPES)] == DTYPES and set(spec.peak_flops) <= {*DTYPES, *OPTIONAL_DTYPES}


@pytest.mark.parametrize("name", sorted(OPTIONAL_RATES))
def test_optional_rates_nvlink_and_sms_match_the_datasheets(name):
    rates, nvlink_gbps, sms = OPTIONAL_RATES[name]
    spec = CATALOG[name]
    expected = {dtype: rate * T for dtype, rate in zip(OPTIONAL_DTYPES, rates) if rate is not None}
    assert {dtype: spec.peak_flops[dtype] for dtype in OPTIONAL_DTYPES if dtype in spec.peak_flops} == \
        pytest.approx(expected, rel=1e-3)
    assert spec.nvlink_bandwidth == nvlink_gbps * 1e9
    assert spec.streaming_multiprocessors == sms


def test_gb300_nvfp4_is_one_and_a_half_gb200s_and_blackwell_mxfp8_runs_at_fp8():
    assert CATALOG["gb300-288gb"].peak_flops["nvfp4"] == 1.5 * CATALOG["gb200-186gb"].peak_flops["nvfp4"]
    for name in ("b200-180gb", "gb200-186gb", "gb300-288gb"):
        assert CATALOG[name].peak_flops["mxfp8"] == CATALOG[name].peak_flops["fp8"]


def test_a_bare_part_name_resolves_when_the_catalog_has_one_part_of_it():
    assert resolve_device("gb200") is CATALOG["gb200-186gb"]
    assert resolve_device(" GB300 ") is CATALOG["gb300-288gb"]
    assert resolve_device({"base": "h800", "efficiency": 0.4}).nvlink_bandwidth == 400e9
    assert ALIASES == {"v100": "v100-16gb", "h800": "h800-80gb", "h200": "h200-141gb", "b200": "b200-180gb",
                       "gb200": "gb200-186gb", "gb300": "gb300-288gb"}
    with pytest.raises(ScenarioError, match=r"^cluster\.device: unknown device 'h100'; known: a100-40gb"):
        resolve_device("h100")  # three parts: h100-80gb, h100-pcie-80gb, h100-grand-teton-96gb


def test_a_device_gives_block_scaled_rates_in_the_scenario():
    spec = resolve_device({"base": "b200", "peak_flops": {"nvfp4": "10 PFLOP/s"}})
    assert spec.peak_flops["nvfp4"] == 10e15 and spec.peak_flops["mxfp8"] == 4500 * T
    assert "nvfp4" not in resolve_device("h100-80gb").peak_flops


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
        ("a200", "cluster.device: unknown device 'a200'; known: a100-40gb, a100-80gb, b200-180gb, gb200-186gb, "
                 "gb300-288gb, h100-80gb, h100-grand-teton-96gb, h100-pcie-80gb, h200-141gb, h800-80gb, v100-16gb"),
        (7, "cluster.device: expected a device name or a mapping, got 7"),
        ({"base": "a200"}, "cluster.device.base: unknown device 'a200'; known: a100-40gb"),
        ({"base": 3}, "cluster.device.base: Input should be a valid string"),
        ({"base": "a100-40gb", "efficiency": 0},
         "cluster.device.efficiency: Input should be greater than or equal to 0.000001"),
        ({"base": "a100-40gb", "efficiency": 1.5},
         "cluster.device.efficiency: Input should be less than or equal to 1"),
        ({"base": "a100-40gb", "efficiency": "high"},
         "cluster.device.efficiency: expected a number or calibrated, got 'high'"),
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
