"""Reading a scenario file and applying `--set` overrides.

    scenario = load_scenario("scenarios/quickstart.yaml", ["cluster.devices=16"])

Overrides are `dotted.path=value` with the value parsed as YAML; they are
validated like the file. Every error is a ScenarioError whose one-line message
names the file and the field.
"""
from ..errors import ScenarioError
from ..user_files import load_yaml_file, parse_yaml_text, user_path
from .root import Scenario, validate_scenario


def load_scenario(path, overrides: list[str] | tuple[str, ...] = ()) -> Scenario:
    """Read, override and validate a scenario file."""
    path = user_path(path, "scenario file", ScenarioError)
    raw = load_yaml_file(path, str(path), ScenarioError)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ScenarioError(f"{path}: a scenario must be a mapping of fields")
    for override in overrides:
        apply_override(raw, override, str(path))
    return validate_scenario(raw, source=str(path), base_dir=path.parent)


def load_cluster(path, overrides: list[str] | tuple[str, ...], devices: int | None) -> Scenario:
    """A scenario file, or a file of its cluster section alone, read, overridden and validated: the cluster some
    workload of the user's own runs on. `devices`, when given, sets the device count unless the topology is a file
    of its own."""
    path = user_path(path, "--cluster", ScenarioError)
    raw = load_yaml_file(path, str(path), ScenarioError)
    if not isinstance(raw, dict):
        raise ScenarioError(f"{path}: expected a scenario or a cluster section (a mapping of fields)")
    if "cluster" not in raw:
        raw = {"cluster": raw}
    if not isinstance(raw["cluster"], dict):
        raise ScenarioError(f"{path}: cluster: expected a mapping of fields")
    topology = raw["cluster"].get("topology", "")
    if devices is not None and not (isinstance(topology, str) and topology.endswith((".yaml", ".yml"))):
        raw["cluster"]["devices"] = devices
    for override in overrides:
        apply_override(raw, override, str(path))
    return validate_scenario(raw, source=str(path), base_dir=path.parent)


def apply_override(raw: dict, override: str, source: str = "--set") -> None:
    """Set `dotted.path=value` (value parsed as YAML) in the raw scenario mapping."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise ScenarioError(f"--set {override!r}: expected dotted.path=value")
    value = parse_yaml_text(text, f"--set {key}", ScenarioError)
    parts = key.strip().split(".")
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ScenarioError(f"--set {key}: {'.'.join(parts[: depth + 1])} is not a mapping in {source}")
        node = child
    node[parts[-1]] = value
