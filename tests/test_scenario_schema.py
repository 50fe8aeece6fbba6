"""The scenario's schema: the reference the docs are generated from, and the one home of every default.

References: pydantic's JSON Schema of Scenario (every field of every section
says what it means); the CLI's options and simtrain.dist.spawn's keywords,
whose defaults must be the specs' own.
"""
import json

import pytest

from simtrain.cli import main
from simtrain.scenario import ClusterSpec, LinkSpec, ParallelSpec, Scenario
from simtrain.torchdist.launcher import spawn_scenario


def test_every_field_of_every_section_has_a_description():
    schema = Scenario.model_json_schema()
    models = {"Scenario": schema, **schema["$defs"]}

    def description(field):  # a section's own, or (pydantic leaves out a copy of it) its model's
        reference = field.get("$ref", "").removeprefix("#/$defs/")
        return field.get("description") or models.get(reference, {}).get("description")

    undescribed = [f"{model}.{name}" for model, definition in models.items()
                   for name, field in definition.get("properties", {}).items() if not description(field)]
    assert undescribed == []
    # every section is in it, each field once per model
    assert {"ClusterSpec", "ModelSpec", "DataSpec", "TrainSpec", "ParallelSpec", "PbtSpec", "ReportSpec",
            "DeviceFields", "LinkSpec"} <= set(models)


def collective_json(capsys, *options) -> list[dict]:
    with pytest.raises(SystemExit) as exit_info:
        main(["collective", "--devices", "4", "--sizes", "1M", "--no-numerics", "--json", *options])
    assert exit_info.value.code == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_the_cli_and_spawn_take_their_defaults_from_the_specs(capsys):
    link = ClusterSpec().link
    assert link == LinkSpec(bandwidth=50e9, latency=5e-6)
    # simtrain collective's links are cluster.link's unless given; its algorithm NCCL's choice (auto)
    default = collective_json(capsys)
    given = collective_json(capsys, "--bandwidth", "50 GB/s", "--latency", "5 us", "--algo", "auto",
                            "--topology", "ring")
    assert default == given and default[0]["algorithm"] == "auto"
    assert collective_json(capsys, "--bandwidth", "100 GB/s")[0]["time_s"] < default[0]["time_s"]
    # simtrain.dist.spawn's keywords left out are the scenario's defaults
    spec = spawn_scenario(2, None, None, None, None, None, None, None)
    assert spec.cluster.link == link and spec.parallel.all_reduce == ParallelSpec().all_reduce
    assert spec.cluster.device == ClusterSpec().device and spec.cluster.topology == ClusterSpec().topology
    halved = spawn_scenario(2, None, None, "25 GB/s", None, None, "tree", None)
    assert halved.cluster.link == LinkSpec(bandwidth=25e9, latency=link.latency)
    assert halved.parallel.all_reduce == "tree"
