"""report.json's JSON Schema, generated from the typed core (core.py) and the registered sections.

    from simtrain.report.schema import report_schema
    schema = report_schema()                # a dict: JSON Schema draft 2020-12
    schema["properties"]["flops"]["description"]

`report_schema()` reads the schema shipped beside this module
(report.schema.json). `generate_schema()` builds it from what is registered:
the core's keys (required where every run writes them) and, as optional
top-level properties, every section registered so far (sections.py). A
section is registered when its owner's module is imported, and the owners
sit in the layers above this one, so the shipped file is written by
tests/test_report_schema.py (`python tests/test_report_schema.py`), which
imports every owner and fails while the file differs from what the sections
give. The docs' report.json reference is generated from the shipped schema,
and the test suite validates every report.json it writes against it.
"""
import json
from pathlib import Path
from typing import Optional

from pydantic import Field, create_model

from .core import ReportCore
from .sections import SECTIONS

SHIPPED = Path(__file__).with_name("report.schema.json")


def report_schema() -> dict:
    """The JSON Schema of report.json, as shipped."""
    return json.loads(SHIPPED.read_text())


def generate_schema() -> dict:
    """The JSON Schema of report.json from the core and the sections registered so far, each described."""
    sections = {key: (Optional[registered.annotation], Field(None, description=registered.description))
                for key, registered in sorted(SECTIONS.items())}
    model = create_model("ReportJson", __base__=ReportCore, **sections)
    schema = model.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "report.json",
            "description": "What `simtrain run` (and `simtrain launch`, `simtrain.run_population`) writes: the "
                           "run's figures, its devices and links, and the sections its techniques register.",
            **{key: value for key, value in schema.items() if key not in ("title", "description")}}
