"""The field types every section of a scenario uses: bounded counts and reals, quantities with units.

A quantity takes an SI number or a string with units ("100 GB/s", "5 us",
"40 GiB", simtrain/units.py); a count or a real refuses a boolean (YAML's
`true` is an int to Python); every section refuses unknown keys, infinities
and NaN. Each section's module builds its fields from these:

    class LinkSpec(Section):
        bandwidth: Bandwidth = Field(description="Bytes per second each way (full duplex).")
"""
import difflib
from typing import Annotated, Union, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError

from ..errors import SimtrainError, shown_value
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


NotBoolean = BeforeValidator(_not_a_boolean)  # for numbers that are no Count or Real: a Literal of integers
Number = Annotated[Union[int, float], NotBoolean]  # a finite int or float, as given
Bandwidth = Annotated[float, _quantity("bandwidth"), Field(gt=0)]  # bytes/s
Duration = Annotated[float, _quantity("time")]  # seconds
Interval = Annotated[float, _quantity("time"), Field(gt=0)]  # seconds, above 0
Bytes = Annotated[float, _quantity("bytes"), Field(gt=0)]  # bytes, above 0
FlopRate = Annotated[float, _quantity("flops"), Field(gt=0)]  # FLOP/s, above 0
Flag = Annotated[bool, Strict()]  # true or false, not 1 or "yes"
Steps = Count(MAX_STEPS)


def long_time(positive: bool):
    """Seconds up to days or years ("54 d", "2 h"): a fleet's horizon, one component's mean time between
    failures; above 0 when `positive`."""
    return Annotated[float, _quantity("long_time"), Field(gt=0) if positive else Field(ge=0)]
Width = Count(MAX_WIDTH)


class Section(BaseModel):
    """A scenario section: unknown keys refused, frozen; .inf and .nan refused by every number field."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def first_error(error: ValidationError, model: type[BaseModel] | None = None) -> str:
    """A nested model's first problem as one line, "where: what" (its section names the field above it); with
    the `model` validated, an unknown field gets the nearest known one as a hint."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return (f"{where}: " if where else "") + error_message(first, model)


_GIVEN_VALUE_SHOWN = ("literal_error", "less_than", "less_than_equal", "greater_than", "greater_than_equal")


def error_message(first: dict, model: type[BaseModel] | None = None) -> str:
    """What one pydantic error says, without its field: an unknown field with the nearest known one (when the
    `model` is given), a value out of its choices or bounds with the value given ("Input should be less than or
    equal to 131072, got 262144")."""
    if first["type"] == "extra_forbidden":
        return "unknown field" + (did_you_mean(model, first["loc"]) if model is not None else "")
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] in _GIVEN_VALUE_SHOWN:
        message += f", got {shown_value(first['input'])}"
    return message


def did_you_mean(model: type[BaseModel], loc: tuple, prefix: str = "") -> str:
    """"; did you mean `train.steps`?" for the unknown key at `loc` in `model`: the closest key of its section
    (difflib), or "" when none is close. `prefix` is the path above `model` ("train." for TrainSpec)."""
    for part in loc[:-1]:
        if isinstance(part, int):  # an item of a list: the same section
            continue
        field = _fields_by_key(model).get(part)
        model = _section_of(field.annotation) if field is not None else None
        if model is None:
            return ""
        prefix += f"{part}."
    keys = list(_fields_by_key(model))
    close = _abbreviated(str(loc[-1]), keys) or difflib.get_close_matches(str(loc[-1]), keys, n=1)
    return f"; did you mean `{prefix}{close[0]}`?" if close else ""


# Words other frameworks add to a degree's name (Megatron's tensor_model_parallel_size, torchtitan's
# tensor_parallel_degree): left out when matching it to simtrain's short keys
_NAME_PADDING = {"model", "size", "degree"}


def _abbreviated(key: str, keys: list[str]) -> list[str]:
    """[the key] that `key` spells in full or with padding (tensor_parallel, tensor_model_parallel_size and
    tp_size are `tp`): the initials of its words, or its words without the padding; [] when neither is a key."""
    words = [word for word in key.lower().replace("-", "_").split("_") if word and word not in _NAME_PADDING]
    candidates = ("".join(word[0] for word in words), "_".join(words)) if len(words) > 1 else ("_".join(words),)
    return [candidate for candidate in candidates if candidate in keys and candidate != key][:1]


def _fields_by_key(model: type[BaseModel]) -> dict:
    """A section's fields by the key a scenario file spells (the alias, where there is one)."""
    return {field.alias or name: field for name, field in model.model_fields.items()}


def _section_of(annotation) -> type[BaseModel] | None:
    """The section class a field holds, through `X | None`, lists and Annotated; None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for argument in get_args(annotation):
        section = _section_of(argument)
        if section is not None:
            return section
    return None
