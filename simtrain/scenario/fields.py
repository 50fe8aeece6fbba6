"""The field types every section of a scenario uses: bounded counts and reals, quantities with units.

A quantity takes an SI number or a string with units ("100 GB/s", "5 us",
"40 GiB", simtrain/units.py); a count or a real refuses a boolean (YAML's
`true` is an int to Python); every section refuses unknown keys, infinities
and NaN. Each section's module builds its fields from these:

    class LinkSpec(Section):
        bandwidth: Bandwidth = Field(description="Bytes per second each way (full duplex).")
"""
from typing import Annotated, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError

from ..errors import SimtrainError
from ..limits import MAX_STEPS, MAX_WIDTH
from ..units import parse_quantity


def _quantity(kind: str):
    def parse(value):
        try:
            return parse_quantity(value, kind)
        except SimtrainError as error:  # pydantic reports ValueError with the field's location
            raise ValueError(str(error)) from None

    return BeforeValidator(parse)


def _not_a_boolean(value):
    if isinstance(value, bool):  # bool is an int to Python: `devices: true` would be 1 device
        raise ValueError(f"expected a number, got {str(value).lower()}")
    return value


def Count(maximum: int, minimum: int = 1):  # noqa: N802 (a type, as pydantic's conint)
    """An integer from `minimum` to `maximum` (limits.py); a boolean is refused."""
    return Annotated[int, BeforeValidator(_not_a_boolean), Field(ge=minimum, le=maximum)]


def Real(**bounds):  # noqa: N802 (a type, as pydantic's confloat)
    """A finite number within `bounds` (pydantic's gt, ge, lt, le); a boolean is refused."""
    return Annotated[float, BeforeValidator(_not_a_boolean), Field(**bounds)]


Number = Annotated[Union[int, float], BeforeValidator(_not_a_boolean)]  # a finite int or float, as given
Bandwidth = Annotated[float, _quantity("bandwidth"), Field(gt=0)]  # bytes/s
Duration = Annotated[float, _quantity("time")]  # seconds
Interval = Annotated[float, _quantity("time"), Field(gt=0)]  # seconds, above 0
Bytes = Annotated[float, _quantity("bytes"), Field(gt=0)]  # bytes, above 0
FlopRate = Annotated[float, _quantity("flops"), Field(gt=0)]  # FLOP/s, above 0
Flag = Annotated[bool, Strict()]  # true or false, not 1 or "yes"
Steps = Count(MAX_STEPS)
Width = Count(MAX_WIDTH)


class Section(BaseModel):
    """A scenario section: unknown keys refused, frozen; .inf and .nan refused by every number field."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def first_error(error: ValidationError) -> str:
    """A nested model's first problem as one line, "where: what" (its section names the field above it)."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    message = "unknown field" if first["type"] == "extra_forbidden" else first["msg"].removeprefix("Value error, ")
    return (f"{where}: " if where else "") + message
