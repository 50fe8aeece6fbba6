"""Quantities with units: "100 GB/s", "400 Gb/s", "5 us", "40 GiB", "19.5 TFLOP/s".

Everything inside simtrain is SI: bytes, seconds, FLOP, bytes/s, FLOP/s.
Inputs may be plain numbers (already SI) or strings with a unit. Decimal
prefixes (k, M, G, T, P) are powers of 1000, binary ones (Ki, Mi, Gi, Ti) powers
of 1024; a lowercase "b" in a bandwidth means bits.

A bandwidth given as a bare number is bytes/s (a resolved scenario writes
50e9), but one under 1 MB/s (`bandwidth: 400`, meant as 400 GB/s) is
refused: no link that trains a model is that slow, so the unit was left out.

    parse_quantity("400 GB/s", "bandwidth")  # 4e11
    parse_quantity(400, "bandwidth")         # ScenarioError: give its unit
"""
import math
import re

from .errors import ScenarioError
from .limits import QUANTITY_RANGES

_DECIMAL = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BINARY = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50}
_TIME_DIVISOR = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}  # divide: 5 us -> 5e-06 exactly
_TIME_MULTIPLIER = {"min": 60.0, "h": 3600.0, "d": 86400.0}  # a mean time between failures: "30 min", "2 h", "54 d"

_NUMBER = r"([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_PATTERN = re.compile(r"^\s*" + _NUMBER + r"\s*([A-Za-zµ/]*)\s*$")

KINDS = ("bytes", "bandwidth", "time", "flops", "long_time")
_SI_UNIT = {"bytes": "B", "bandwidth": "B/s", "time": "s", "flops": "FLOP/s", "long_time": "s"}
# A bare number under this many bytes/s is a bandwidth whose unit was left out (the module's docstring)
MIN_BARE_BANDWIDTH_BPS = 1e6


def _prefix(prefix: str) -> float:
    if prefix in _BINARY:
        return _BINARY[prefix]
    if prefix in _DECIMAL:
        return _DECIMAL[prefix]
    raise KeyError(prefix)


def _scale(unit: str, kind: str) -> float:
    """Multiplier that turns `unit` of `kind` (not time) into SI; KeyError if it does not fit."""
    if kind == "bytes":
        if not unit.endswith("B"):
            raise KeyError(unit)
        return _prefix(unit[:-1])
    if kind == "bandwidth":
        for suffix, factor in (("B/s", 1.0), ("b/s", 0.125), ("Bps", 1.0), ("bps", 0.125)):
            if unit.endswith(suffix):
                return _prefix(unit[: -len(suffix)]) * factor
        raise KeyError(unit)
    if kind == "flops":
        for suffix in ("FLOP/s", "FLOPS", "flop/s"):
            if unit.endswith(suffix):
                return _prefix(unit[: -len(suffix)])
        raise KeyError(unit)
    raise ValueError(f"unknown quantity kind {kind!r}")


def _has_unit(value) -> bool:
    """Whether a quantity's text names its unit ("400 GB/s"; not 400 nor "400")."""
    return isinstance(value, str) and bool(_PATTERN.match(value).group(2))


def parse_quantity(value, kind: str, field: str = "") -> float:
    """Turn `value` (a number, or a string with a unit) into SI units of `kind`.

    Raises ScenarioError (its message prefixed by `field` when given) for
    anything that is not a finite, non-negative quantity of that kind within
    the range simtrain takes (limits.QUANTITY_RANGES; zero is left to the field).
    """
    prefix = f"{field}: " if field else ""
    what = "time" if kind == "long_time" else kind  # a long time is a time to the user
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ScenarioError(f"{prefix}expected a {what} quantity, got {value!r}")
    if isinstance(value, str):
        match = _PATTERN.match(value)
        if not match:
            raise ScenarioError(f"{prefix}cannot read {value!r} as a {what} quantity")
        number, unit = float(match.group(1)), match.group(2)
        try:
            if kind in ("time", "long_time") and unit in _TIME_MULTIPLIER:
                number *= _TIME_MULTIPLIER[unit]
            elif kind in ("time", "long_time") and unit:
                number /= _TIME_DIVISOR[unit]
            else:
                number *= _scale(unit, kind) if unit else 1.0
        except KeyError:
            raise ScenarioError(f"{prefix}unit {unit!r} in {value!r} is not a {what} unit") from None
    else:
        try:
            number = float(value)
        except OverflowError:  # an int past float's range
            number = math.inf
    if number != number or number in (math.inf, -math.inf):
        raise ScenarioError(f"{prefix}must be a finite number, got {value!r}")
    if number < 0:
        raise ScenarioError(f"{prefix}must not be negative, got {value!r}")
    low, high = QUANTITY_RANGES[kind]
    if number and not low <= number <= high:
        raise ScenarioError(f"{prefix}{value!r} is outside the range simtrain takes, {low:g} to {high:g} "
                            f"({_SI_UNIT[kind]}; 0 where the field allows it)")
    if kind == "bandwidth" and 0 < number < MIN_BARE_BANDWIDTH_BPS and not _has_unit(value):
        raise ScenarioError(f"{prefix}{value!r} has no unit: give one, e.g. \"{value} GB/s\" (a bare number is "
                            f"bytes/s, and one under 1 MB/s is no link's)")
    return number


def parse_size(text: str, field: str = "size") -> int:
    """A byte count as nccl-tests writes it: "1K" = 1024, "64M", "1G", or "4096"."""
    match = re.match(r"^\s*([0-9]{1,20})\s*([KMGT]?)B?\s*$", str(text))
    if not match:
        raise ScenarioError(f"{field}: cannot read {text!r} as a size like 1K, 64M or 1G")
    return int(match.group(1)) * 1024 ** " KMGT".index(match.group(2) or " ")


def format_bytes(nbytes: float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def format_seconds(seconds: float) -> str:
    """Human-readable duration with a fitting unit and 3 significant digits: 0.0067987 -> '6.80 ms'."""
    seconds = float(f"{seconds:.3g}")  # rounded first, so 0.9999 s is '1.00 s', not '1.00e+03 ms'
    if seconds == 0:
        return "0 s"
    if abs(seconds) >= 1000:
        return f"{seconds:,.0f} s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{_three_digits(seconds / scale)} {unit}"
    return f"{_three_digits(seconds / 1e-9)} ns"


def _three_digits(value: float) -> str:
    """3 significant digits, trailing zeros kept (6.80), no bare trailing point (417, not 417.)."""
    return f"{value:#.3g}".rstrip(".")


def noise_free(seconds: float | None, scale: float | None) -> float | None:
    """`seconds`, or 0 when it is rounding error rather than time: under 1e-9 of `scale`, the step time it is
    part of. Sums of many spans are each off by a unit in the last place (2.2e-16 relative), and a remainder
    such as idle = step time - the rest is never exactly 0."""
    if seconds is None or not scale:
        return seconds
    return 0.0 if abs(seconds) < 1e-9 * abs(scale) else seconds
