"""Shared test setup: torch on one host thread, as simtrain.run computes; every report.json checked.

References computed in a test then sum in the same order as the simulator
(bit-for-bit comparisons hold), and thousands of tiny ops skip a thread pool's
contention.

Every report.json a test writes is validated against the shipped JSON Schema
(simtrain/report/schema.py): in this process as `Report.to_json` writes it,
and, for those that other processes wrote (`simtrain launch` ranks, the CLI
run as a subprocess), in the test's tmp_path when the test ends.

Under `make test` (pytest-xdist, `--dist loadgroup`) each test goes to whichever
worker is free, except that the tests of a file sharing a module-scoped fixture
(gloo process groups, a run several tests read) stay on one worker, so the
fixture is built once. The tests marked slow are handed out first.
"""
import json

import jsonschema
import pytest
import torch

from simtrain.report import Report
from simtrain.report.schema import report_schema

REPORT_SCHEMA = report_schema()
_validator = jsonschema.Draft202012Validator(REPORT_SCHEMA)


def check_report(data: dict) -> None:
    """Raise jsonschema.ValidationError unless `data` (report.json's content) fits the schema."""
    _validator.validate(data)


def pytest_collection_modifyitems(items):
    """A test using a module-scoped fixture joins its file's xdist group (one worker builds the fixture once); the
    slow tests go first, so that neither worker ends the suite alone on one of them."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the rest keep their order
    for item in items:
        if any(definition.scope == "module" for definitions in item._fixtureinfo.name2fixturedefs.values()
               for definition in definitions):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.fixture(autouse=True)
def one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def reports_fit_the_schema():
    """Every report.json written in this process is checked as it is written."""
    to_json = Report.to_json

    def checked(self) -> str:
        text = to_json(self)
        check_report(json.loads(text))
        return text

    Report.to_json = checked
    yield
    Report.to_json = to_json


@pytest.fixture(autouse=True)
def written_reports_fit_the_schema(request):
    """report.json files other processes wrote in the test's tmp_path are checked when the test ends (a file
    without `simtrain_version`, which simtrain always writes, is a test's stand-in, not a report)."""
    folder = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if folder is not None:
        for path in sorted(folder.rglob("report.json")):
            text = path.read_text()
            if '"simtrain_version"' in text:
                check_report(json.loads(text))
