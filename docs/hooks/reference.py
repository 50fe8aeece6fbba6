"""The generated reference pages: written at build time from the code, never by hand.

mkdocs runs this hook (`hooks:` in mkdocs.yml). On every build it adds four
pages that exist only in the built site, never in the repository:

- reference/scenario.md: every scenario key, from the pydantic schema
  (`Scenario.model_json_schema()`), with its type, default, unit and description;
- reference/cli.md: every command and option, walked from the click group;
- reference/report.md: every report.json key, from the report's JSON Schema
  (`simtrain.report.schema.report_schema()`) once the package ships it;
- reference/support.md: what combines, from the support table
  (`simtrain.parallel.support`): each feature, and each combination simtrain
  refuses, not built yet (naming the framework that runs it) or run by neither.

A field's unit is the schema's own `unit` where it gives one; else, for a
quantity field (one that takes "50 GB/s", "5 us", "40 GiB"), the SI unit its
validator converts to. A field without a description is shown with an empty one.
"""
import html
import inspect
import json

import click
from mkdocs.structure.files import File

PAGES = {
    "reference/scenario.md": "scenario_page",
    "reference/cli.md": "cli_page",
    "reference/report.md": "report_page",
    "reference/support.md": "support_page",
}


def on_files(files, config):
    for path, builder in PAGES.items():
        files.append(File.generated(config, path, content=globals()[builder]()))
    return files


# -- the scenario ---------------------------------------------------------------------------------------------------

def scenario_page() -> str:
    from simtrain.scenario import Scenario

    schema = Scenario.model_json_schema()
    rows = list(_schema_rows(schema, schema, "", Scenario, {}))
    lines = [
        "# Scenario keys",
        "",
        "Generated from the pydantic schema (`simtrain.scenario.Scenario.model_json_schema()`) when the site is "
        "built. A section's keys follow its row; `--set section.key=value` overrides any of them. Quantities take "
        "a number in the unit shown or a string with a unit (`\"50 GB/s\"`, `\"5 us\"`, `\"40 GiB\"`).",
        "",
        "| key | type | default | unit | description |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| `{key}` | {_cell(kind)} | {_cell(default)} | {_cell(unit)} | {_cell(text)} |"
              for key, kind, default, unit, text in rows]
    return "\n".join(lines) + "\n"


def _schema_rows(root: dict, node: dict, prefix: str, model, section_default: dict):
    """(key, type, default, unit, description) for every property under `node`, depth first, in schema order.

    A key's default is its own, else the one its section's default gives it (`cluster.link.bandwidth`)."""
    for name, prop in node.get("properties", {}).items():
        key = f"{prefix}{name}"
        section = _section(root, prop)
        value = prop.get("default", section_default.get(name, _NO_DEFAULT))
        default = "" if value is _NO_DEFAULT or isinstance(value, dict) else _literal(value)
        yield key, _type(root, prop), default, _unit(prop, model, name), prop.get("description", "")
        if section is not None:
            yield from _schema_rows(root, section, key + ".", _field_model(model, name),
                                    value if isinstance(value, dict) else {})


_NO_DEFAULT = object()


def _resolve(root: dict, prop: dict) -> dict:
    while "$ref" in prop:
        prop = root["$defs"][prop["$ref"].rsplit("/", 1)[1]]
    return prop


def _section(root: dict, prop: dict) -> dict | None:
    """The object schema a property holds (directly, or as the one non-null choice of an anyOf), else None."""
    choices = [_resolve(root, choice) for choice in prop.get("anyOf", [prop])]
    objects = [choice for choice in choices if "properties" in choice]
    return objects[0] if len(objects) == 1 else None


def _type(root: dict, prop: dict) -> str:
    if "anyOf" in prop:
        return " or ".join(dict.fromkeys(_type(root, choice) for choice in prop["anyOf"]))
    if "$ref" in prop:
        target = _resolve(root, prop)
        return "section" if "properties" in target else _type(root, target)
    if "enum" in prop:
        return " | ".join(_literal(value) for value in prop["enum"])
    if "const" in prop:
        return _literal(prop["const"])
    kind = prop.get("type", "any")
    if kind == "array":
        if "prefixItems" in prop:
            return "[" + ", ".join(_type(root, item) for item in prop["prefixItems"]) + "]"
        return f"list of {_type(root, prop.get('items', {}))}"
    if kind == "object" and "additionalProperties" in prop and isinstance(prop["additionalProperties"], dict):
        return f"map to {_type(root, prop['additionalProperties'])}"
    return {"integer": "int", "number": "number", "string": "str", "boolean": "bool", "null": "null",
            "object": "map"}.get(kind, kind)


def _unit(prop: dict, model, name: str) -> str:
    """The schema's `unit`, else the SI unit of a quantity field's validator (units.py's kinds), else none."""
    if "unit" in prop:
        return prop["unit"]
    field = _field(model, name)
    if field is None:
        return ""
    from simtrain import units

    for annotation in [field.annotation, *field.metadata]:
        for validator in _validators(annotation):
            kind = inspect.getclosurevars(validator).nonlocals.get("kind")
            if kind in units._SI_UNIT:
                return units._SI_UNIT[kind]
    return ""


def _validators(annotation):
    """The validator functions inside an annotation (Annotated metadata, also inside unions)."""
    func = getattr(annotation, "func", None)
    if callable(func):
        yield func
    for part in getattr(annotation, "__metadata__", ()):
        yield from _validators(part)
    for part in getattr(annotation, "__args__", ()) or ():
        yield from _validators(part)


def _field(model, name: str):
    if model is None:
        return None
    for field_name, field in getattr(model, "model_fields", {}).items():
        if (field.alias or field_name) == name:
            return field
    return None


def _field_model(model, name: str):
    """The pydantic model a section field holds (through Optional), for the units of its keys."""
    field = _field(model, name)
    if field is None:
        return None
    candidates = [field.annotation, *getattr(field.annotation, "__args__", ())]
    return next((c for c in candidates if inspect.isclass(c) and hasattr(c, "model_fields")), None)


# -- the command line -----------------------------------------------------------------------------------------------

def cli_page() -> str:
    lines = ["# Command line", "",
             "Generated from the click commands (`simtrain.cli`) when the site is built. "
             "Every command takes `--help`.", ""]
    for path, command in _commands(_group(), ("simtrain",)):
        lines += _command_section(path, command)
    return "\n".join(lines) + "\n"


def _group() -> click.Group:
    from simtrain import cli

    return next(obj for obj in (getattr(cli, "main", None), getattr(cli, "cli", None)) if isinstance(obj, click.Group))


def _commands(command: click.Command, path: tuple):
    yield path, command
    if isinstance(command, click.Group):
        for name in sorted(command.commands):
            yield from _commands(command.commands[name], (*path, name))


def _command_section(path: tuple, command: click.Command) -> list[str]:
    context = click.Context(command, info_name=" ".join(path))
    lines = [f"## `{' '.join(path)}`", "", "```text", command.get_usage(context), "```", ""]
    if command.help:
        lines += [inspect.cleandoc(command.help), ""]
    params = [param for param in command.params if param.name != "help"]
    if params:
        lines += ["| option | type | default | description |", "|---|---|---|---|"]
        for param in params:
            names = ", ".join(f"`{name}`" for name in [*param.opts, *param.secondary_opts])
            if isinstance(param, click.Argument):
                names = f"`{param.human_readable_name}` (argument)"
            default = param.default  # click's own "no default" is a sentinel object
            default = _literal(default) if isinstance(default, (str, int, float)) and default is not False else ""
            help_text = getattr(param, "help", None) or ""
            if param.required:
                help_text = ("required. " + help_text).strip()
            lines.append(f"| {names} | {_cell(_param_type(param.type))} | {_cell(default)} | {_cell(help_text)} |")
        lines.append("")
    return lines


def _param_type(kind: click.ParamType) -> str:
    if isinstance(kind, click.Choice):
        return " | ".join(f"`{choice}`" for choice in kind.choices)
    if isinstance(kind, click.types._NumberRangeBase):
        low, high = ("" if bound is None else bound for bound in (kind.min, kind.max))
        return f"{kind.name.replace(' range', '')} {low}..{high}"
    return kind.name


# -- report.json ----------------------------------------------------------------------------------------------------

def report_page() -> str:
    try:
        from simtrain.report.schema import report_schema
    except ModuleNotFoundError as error:
        if error.name not in ("simtrain.report.schema", "simtrain.report"):
            raise
        return ("# report.json keys\n\nThe JSON Schema of report.json is not yet shipped "
                "(`simtrain.report.schema.report_schema()`); this page is generated from it once it is. "
                "Until then, each guide describes the keys its feature adds.\n")
    schema = report_schema()
    lines = ["# report.json keys", "",
             "Generated from report.json's JSON Schema (`simtrain.report.schema.report_schema()`) when the site "
             "is built. `a.b` is key `b` inside object `a`; `a[].b` is key `b` of each item of list `a`.", "",
             "| key | type | description |", "|---|---|---|"]
    lines += [f"| `{key}` | {_cell(kind)} | {_cell(text)} |" for key, kind, text in _report_rows(schema, schema, "")]
    return "\n".join(lines) + "\n"


def _report_rows(root: dict, node: dict, prefix: str):
    node = _resolve(root, node)
    for name, prop in node.get("properties", {}).items():
        key = f"{prefix}{name}"
        yield key, _type(root, prop), prop.get("description", "") or _resolve(root, prop).get("description", "")
        target = _resolve(root, prop)
        section = _section(root, prop)
        if section is not None:
            yield from _report_rows(root, section, key + ".")
        elif target.get("type") == "array" and _section(root, target.get("items", {})) is not None:
            yield from _report_rows(root, _section(root, target["items"]), key + "[].")


# -- what combines -------------------------------------------------------------------------------------------------

def support_page() -> str:
    from simtrain.parallel.support import FEATURES, REFUSED

    not_built = [row for row in REFUSED if row.built_by]
    neither = [row for row in REFUSED if not row.built_by]
    lines = [
        "# What combines",
        "",
        "Generated from the support table (`simtrain/parallel/support.py`) when the site is built. A feature is "
        "one thing a scenario can use; each row below is a combination of features simtrain refuses, with the one "
        "line `simtrain validate` (or `simtrain launch`) prints for it, `<name>` standing for the scenario's value. "
        "Any other combination runs, given each feature's own needs (sequence parallelism needs tp, offload a ZeRO "
        "stage, representatives numerics off; `parallel.overlap` is DDP's, ZeRO overlaps with its own "
        "flags): tests/test_support_table.py validates against this table every pair of the features below that "
        "one scenario can hold, and tests/test_combinations.py runs every pair of 24 of them (the parallel "
        "dimensions, each pipeline schedule, the ZeRO stages, HSDP, offload, ep, the precisions, recomputation, "
        "gradient accumulation, restart, numerics off, representatives) that the table lets run: each trains, "
        "and in fp32 to the parameters one device trains in plain torch.",
        "",
        f"{len(REFUSED)} combinations are refused: {len(not_built)} not built in simtrain, which Megatron-Core or "
        f"torchtitan run (each goes when simtrain builds it), and {len(neither)} that neither framework runs."
        if not_built else f"{len(REFUSED)} combinations are refused, each one that neither Megatron-Core nor "
        "torchtitan runs: simtrain runs every combination of these features that either framework runs.",
        "",
        "## Features",
        "",
        "| feature | scenario keys | refused with |",
        "|---|---|---|",
    ]
    for feature in FEATURES:
        partners = [_features([group for group in row.groups if feature.name not in group])
                    + (" (not built)" if row.built_by else "")
                    for row in REFUSED if any(feature.name in group for group in row.groups)]
        lines.append(f"| {feature.name} | {_cell(feature.keys)} | {_cell('; '.join(partners))} |")
    lines += ["", "## Not built in simtrain", ""]
    if not_built:
        lines += ["Megatron-Core or torchtitan runs each of these combinations; simtrain refuses it until it is "
                  "built.", "", "| features | verdict | what the frameworks do | simtrain's line |",
                  "|---|---|---|---|"]
        lines += [f"| {_features(row.groups)} | {row.verdict} | {_cell(row.frameworks)} | {_line(row.line)} |"
                  for row in not_built]
    else:
        lines.append("None: simtrain runs every combination of these features that Megatron-Core or torchtitan runs.")
    lines += ["", "## Refused: neither framework runs it", "",
              "Neither Megatron-Core nor torchtitan runs these combinations (often: one of the features is "
              "simtrain's own).", "", "| features | why | simtrain's line |", "|---|---|---|"]
    lines += [f"| {_features(row.groups)} | {_cell(row.frameworks)} | {_line(row.line)} |" for row in neither]
    return "\n".join(lines) + "\n"


def _features(groups) -> str:
    """Features, each group of alternatives joined by "or"."""
    return " × ".join(" or ".join(group) for group in groups)


def _line(template: str) -> str:
    """A row's line in code, each {name} the table fills in shown as <name>."""
    return _cell("`" + template.replace("{", "<").replace("}", ">") + "`")


# -- cells ----------------------------------------------------------------------------------------------------------

def _literal(value) -> str:
    return "`" + json.dumps(value) + "`"


def _cell(text) -> str:
    """A table cell: on one line, `|` escaped, and `<`, `>` and `&` outside code spans written as entities
    (markdown would take `runs/<name>/` for an HTML tag and drop `<name>`)."""
    parts = " ".join(str(text).split()).replace("|", "\\|").split("`")
    return "`".join(part if index % 2 else html.escape(part, quote=False) for index, part in enumerate(parts))
