"""report.json's sections: typed, each registered by the module that builds it.

A section is a pydantic model whose every field carries a description (the
docs' report.json reference is generated from them, schema.py). The module
that builds a section registers its model under the section's key, once, at
import:

    class AmpSection(ReportSection):
        precision: str = Field(description="compute dtype: fp32, fp16 or bf16")

    register_section("amp", AmpSection, "mixed precision: the dtype and what loss scaling did")

`build_report` checks every section a run hands it against the model
registered under its key (`check_section`): a key nobody registered, a field
the model does not declare, or a value of the wrong type is a bug, raised
before report.json is written. A section may also be a plain type (`failure`
is a string or null).
"""
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, TypeAdapter


class ReportSection(BaseModel):
    """A section of report.json: its fields are exactly the model's."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class RegisteredSection(NamedTuple):
    annotation: Any  # a ReportSection subclass, or a type such as `str | None`
    description: str
    owner: str  # the module that registered it


SECTIONS: dict[str, RegisteredSection] = {}


def register_section(key: str, annotation, description: str) -> None:
    """Section `key` of report.json is `annotation` (a ReportSection model or a type); registered once."""
    owner = getattr(annotation, "__module__", None) or "?"
    known = SECTIONS.get(key)
    if known is not None and known.annotation is not annotation:
        raise ValueError(f"report section {key!r} is registered already, by {known.owner}")
    SECTIONS[key] = RegisteredSection(annotation, description, owner)


def check_section(key: str, value) -> None:
    """Raise if `value` is not what section `key`'s registered model says."""
    registered = SECTIONS.get(key)
    if registered is None:
        raise KeyError(f"report section {key!r}: no module registered it (report/sections.py register_section)")
    TypeAdapter(registered.annotation).validate_python(value, strict=False)
