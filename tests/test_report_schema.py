"""report.json's JSON Schema: generated from the typed sections, shipped, and describing every key.

`python tests/test_report_schema.py` writes simtrain/report/report.schema.json from the sections
registered by their owners; the tests fail while the shipped file differs from it. (Every report.json
the suite writes is validated against the shipped schema: tests/conftest.py.)
"""
import json

import jsonschema
import pytest

import simtrain.real.launch  # noqa: F401  (registers `measured` and `measurement`)
import simtrain.runner  # noqa: F401  (registers the sections of every simulated run: the schemes', recovery's...)
import simtrain.studies.pbt  # noqa: F401  (registers `pbt`)
from simtrain.report.schema import SHIPPED, generate_schema, report_schema
from simtrain.report.sections import SECTIONS, ReportSection, register_section


def test_the_shipped_schema_is_the_one_the_sections_give():
    assert report_schema() == generate_schema(), "regenerate it: python tests/test_report_schema.py"


def _undescribed(node, path="") -> list[str]:
    """Paths of properties in a JSON Schema without a description."""
    missing = []
    if isinstance(node, dict):
        for name, prop in node.get("properties", {}).items():
            if "description" not in prop:
                missing.append(f"{path}.{name}")
        for key, value in node.items():
            missing += _undescribed(value, f"{path}.{key}" if key not in ("properties", "$defs") else path)
    elif isinstance(node, list):
        for item in node:
            missing += _undescribed(item, path)
    return missing


def test_every_key_has_a_description():
    assert _undescribed(report_schema()) == []


def test_a_section_of_the_wrong_shape_is_refused():
    schema = report_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "t"}, schema)  # the core's keys are required


def test_a_key_is_registered_once():
    class Other(ReportSection):
        pass

    with pytest.raises(ValueError, match="registered already"):
        register_section("amp", Other, "another amp")
    assert SECTIONS["amp"].owner == "simtrain.train.precision"


if __name__ == "__main__":
    SHIPPED.write_text(json.dumps(generate_schema(), indent=2) + "\n")
    print(f"wrote {SHIPPED}")
