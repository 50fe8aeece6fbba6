"""What an importer hands back: a scenario mapping, the fields it did not carry over and why, where it came from.

    imported = Imported(source="llama3_8b.toml", raw={"name": "llama3_8b", ...},
                        not_carried=[NotCarried("training.max_norm", "gradient clipping is not modelled")])
    scenario = imported.scenario()   # validated; a refusal is one ConfigImportError line naming the source
    text = imported.to_yaml()        # the scenario YAML, the not-carried list as a comment on top

Both importers (torchtitan.py, megatron.py) place the job on the same cluster (`cluster_section`: a scenario's
cluster section, or DGX H100 hosts by default) and check every number against simtrain/limits.py before any
work (`bounded_int`), so that a huge or mistyped value ends in one line naming the file and the field.
"""
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import ConfigImportError, ScenarioError, shown_value
from ..limits import MAX_DEVICES
from ..scenario import Scenario, validate_scenario
from ..user_files import load_yaml_file, user_path

# The cluster an imported job runs on unless --cluster names another: DGX H100 hosts of 8 GPUs on NVLink (450 GB/s
# a direction at 0.8 efficiency), one 400 Gb/s NIC per GPU (at 0.96) on a non-blocking fat tree, and the Hopper
# efficiency fitted on Megatron-Core's H100 table under the kernel compute model: the cluster of
# scenarios/megatron-core-h100/ (its header says where each figure comes from).
DEFAULT_CLUSTER = {
    "topology": "fat_tree",
    "gpus_per_node": 8,
    "nodes_per_leaf": 32,
    "device": {"base": "h100-80gb", "efficiency": "calibrated"},
    "compute_model": "kernels",
    "link": {"bandwidth": "360 GB/s", "latency": "0.25 us"},
    "inter_node_link": {"bandwidth": "48 GB/s", "latency": "1.35 us"},
}
DEFAULT_DEVICES = 8  # one host: torchtitan's run_train.sh (NGPU=8) and Megatron-LM's example scripts (GPUS_PER_NODE=8)


@dataclass(frozen=True)
class NotCarried:
    """A source field the scenario does not carry over, and why."""

    field: str
    why: str


@dataclass
class Imported:
    """A scenario mapping made from another framework's config (`source`), with what it left out."""

    source: str
    raw: dict
    not_carried: list[NotCarried] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # how a field was carried over where it is not one to one

    def scenario(self) -> Scenario:
        """The scenario, validated; simtrain's refusal as one ConfigImportError line naming the source."""
        try:
            return validate_scenario(self.raw, source=f"{self.source}: the imported scenario")
        except ScenarioError as error:
            raise ConfigImportError(str(error)) from None

    def to_yaml(self) -> str:
        """The scenario as YAML, under a comment naming its source, how fields were carried and what was not."""
        header = [f"Imported by `simtrain import` from {self.source}.", *self.notes]
        header += not_carried_lines(self.not_carried) or ["Every field of the source was carried over."]
        comment = "".join(f"# {line}\n" for line in header)
        return comment + yaml.safe_dump(self.raw, sort_keys=False, width=100)


def not_carried_lines(items: list[NotCarried]) -> list[str]:
    """One line per run of fields not carried over for the same reason: "not carried over: a.x, a.y (why)"."""
    lines, fields = [], []
    for index, item in enumerate(items):
        fields.append(item.field)
        if index + 1 == len(items) or items[index + 1].why != item.why:
            lines.append(f"not carried over: {', '.join(fields)} ({item.why})")
            fields = []
    return lines


def cluster_section(cluster_file: str | None, devices: int) -> dict:
    """The cluster the imported job runs on, with `devices` devices: the `cluster` section of a scenario file (or a
    file holding a cluster section alone), else DEFAULT_CLUSTER."""
    bounded_int(devices, "--devices", "simtrain import", MAX_DEVICES)
    if cluster_file is None:
        cluster = dict(DEFAULT_CLUSTER)
        cluster["gpus_per_node"] = min(8, devices)
        return {**cluster, "devices": devices}
    path = user_path(cluster_file, "--cluster", ConfigImportError)
    raw = load_yaml_file(path, f"--cluster {path}", ConfigImportError)
    if isinstance(raw, dict) and isinstance(raw.get("cluster"), dict):
        raw = raw["cluster"]
    if not isinstance(raw, dict):
        raise ConfigImportError(f"--cluster {path}: a scenario with a cluster section, or a cluster section, "
                                "as a mapping")
    return {**raw, "devices": devices}


def bounded_int(value, field: str, source: str, maximum: int, minimum: int = 1, hint: str = "") -> int:
    """`value` if it is an integer from `minimum` to `maximum` (simtrain/limits.py); else one line naming the
    source and the field (and the `hint`). A boolean is refused (Python counts it an integer)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigImportError(f"{source}: {field}: expected an integer, got {shown_value(value)}")
    if not minimum <= value <= maximum:
        raise ConfigImportError(f"{source}: {field}: {shown_value(value)} is outside {minimum} to {maximum:,} (the "
                                f"bound simtrain checks before any work: simtrain/limits.py){hint}")
    return value


def bounded_real(value, field: str, source: str, low: float, high: float) -> float:
    """`value` if it is a finite number within [low, high]; else one line naming the source and the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigImportError(f"{source}: {field}: expected a number, got {shown_value(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer past a float's range
        number = float("inf")
    if not low <= number <= high:  # NaN fails both
        raise ConfigImportError(f"{source}: {field}: {shown_value(value)} is outside {low:g} to {high:g}")
    return number


def expect(value, kind: type, field: str, source: str, what: str):
    """`value` if it is a `kind` (a boolean only where `kind` is bool); else one line naming the source and the
    field ("expected `what`")."""
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ConfigImportError(f"{source}: {field}: expected {what}, got {shown_value(value)}")
    return value


def scenario_name(path: Path) -> str:
    """The scenario's name from the source file's stem: characters a file system takes, at most 64."""
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in path.stem).lstrip(".")[:64]
    return name or "imported"
