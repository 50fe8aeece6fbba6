"""units.py against hand-computed values: quantities, nccl-tests sizes, byte formatting."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simtrain.errors import ScenarioError
from simtrain.units import format_bytes, parse_quantity, parse_size


@pytest.mark.parametrize(
    "text, kind, expected",
    [
        ("100 GB/s", "bandwidth", 1e11),
        ("400 Gb/s", "bandwidth", 5e10),  # bits: 400e9 / 8
        ("200 Gbps", "bandwidth", 2.5e10),
        ("1.5 TB/s", "bandwidth", 1.5e12),
        ("5 us", "time", 5e-6),
        ("2 ms", "time", 2e-3),
        ("0.7 µs", "time", 0.7e-6),
        ("3 ns", "time", 3e-9),
        ("1 s", "time", 1.0),
        ("40 GiB", "bytes", 40 * 2**30),
        ("80 GB", "bytes", 8e10),
        ("512 KiB", "bytes", 512 * 1024),
        ("19.5 TFLOP/s", "flops", 1.95e13),
        ("989.5 TFLOPS", "flops", 9.895e14),
        ("1e3 GB", "bytes", 1e12),
        ("  7 MB  ", "bytes", 7e6),
    ],
)
def test_parse_quantity_hand_values(text, kind, expected):
    assert parse_quantity(text, kind) == pytest.approx(expected, rel=1e-12)


def test_times_divide_exactly():
    assert parse_quantity("5 us", "time") == 5e-6
    assert parse_quantity("2 ms", "time") == 2e-3
    assert parse_quantity("250 ns", "time") == 250e-9


def test_field_prefix_is_optional():
    with pytest.raises(ScenarioError, match=r"^cannot read 'x' as a time quantity$"):
        parse_quantity("x", "time")


@pytest.mark.parametrize("value, kind", [(12, "bytes"), (2.5e-6, "time"), (0, "bandwidth"), (3e11, "flops")])
def test_plain_numbers_are_si(value, kind):
    assert parse_quantity(value, kind) == value


@pytest.mark.parametrize(
    "value, kind, message",
    [
        ("-1 GB", "bytes", "must not be negative, got '-1 GB'"),
        (-1, "bytes", "must not be negative"),
        ("5 parsecs", "bytes", "unit 'parsecs'"),
        ("5 us", "bytes", "is not a bytes unit"),
        ("100 GB", "bandwidth", "is not a bandwidth unit"),
        ("3 GB/s", "time", "is not a time unit"),
        ("fast", "time", "cannot read 'fast'"),
        (True, "bytes", "expected a bytes quantity"),
        ([1], "time", "expected a time quantity"),
        (float("nan"), "time", "must be a finite number"),
        ("1e999 GB/s", "bandwidth", "must be a finite number"),
        (10**400, "bytes", "must be a finite number"),
        (1e-320, "bandwidth", "is outside the range simtrain takes, 1 to 1e+18 (B/s"),
        ("1e30 B", "bytes", "is outside the range"),
        (1e7, "time", "is outside the range"),
    ],
)
def test_parse_quantity_errors_name_the_field(value, kind, message):
    with pytest.raises(ScenarioError) as info:
        parse_quantity(value, kind, field="cluster.link.bandwidth")
    text = str(info.value)
    assert text.startswith("cluster.link.bandwidth: ")
    assert message in text
    assert "\n" not in text


@settings(max_examples=50, deadline=None, derandomize=True)
@given(
    number=st.integers(min_value=0, max_value=10**6),
    prefix=st.sampled_from([("", 1), ("k", 1e3), ("M", 1e6), ("G", 1e9), ("Ki", 2**10), ("Gi", 2**30)]),
)
def test_byte_prefixes_scale_exactly(number, prefix):
    unit, factor = prefix
    assert parse_quantity(f"{number} {unit}B", "bytes") == number * factor


@pytest.mark.parametrize(
    "text, expected",
    [("4096", 4096), ("1K", 1024), ("64M", 64 * 2**20), ("1G", 2**30), ("2GB", 2 * 2**30), ("0", 0)],
)
def test_parse_size_like_nccl_tests(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["1.5K", "-1K", "1P", "abc", ""])
def test_parse_size_errors(text):
    with pytest.raises(ScenarioError, match=r"^sizes: cannot read"):
        parse_size(text, field="sizes")


@pytest.mark.parametrize(
    "nbytes, expected",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (40 * 2**30, "40.0 GiB"),
        (3 * 2**40, "3.0 TiB"),
        (5000 * 2**40, "5000.0 TiB"),
    ],
)
def test_format_bytes(nbytes, expected):
    assert format_bytes(nbytes) == expected
