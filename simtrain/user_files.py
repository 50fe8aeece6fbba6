"""Files a user names: scenario and topology YAML read safely, output folders checked before a run.

Both kinds of YAML file (scenario/, hw/topology_builders.py) and every
`--set` value go through one loader, which refuses, with one line naming the
file (and the field where there is one):

- a path that is not a regular file (a folder, a pipe, a device such as
  /dev/zero), a file over `MAX_FILE_BYTES` (at most that many bytes plus one
  are ever read), bytes that are not UTF-8;
- aliases (`*name`): refused altogether, so no "billion laughs" document can
  expand; anchors alone are harmless and allowed;
- nesting deeper than `MAX_YAML_DEPTH` mappings and lists (before Python's
  recursion limit is near);
- an integer literal with more than `MAX_INTEGER_DIGITS` digits (Python refuses
  to convert 4,300 and more; the schema's bounds are far below 64).

    data = load_yaml_file(Path("scenarios/quickstart.yaml"), "scenarios/quickstart.yaml", ScenarioError)
    value = parse_yaml_text("[64, 64]", "--set model.hidden", ScenarioError)
    out = output_folder("runs/quickstart", "--out")   # checked, not created

Paths: `~` and `~user` are expanded (an unknown user is an error, not a
traceback); a NUL byte or a name longer than the file system takes is refused.
An output folder is checked before the run: it is a folder or can be created
as one, and its nearest existing parent is writable.
"""
import os
import stat
from pathlib import Path

import yaml
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

from .errors import SimtrainError
from .limits import MAX_FILE_BYTES, MAX_INTEGER_DIGITS, MAX_YAML_DEPTH
from .units import format_bytes

_INT_TAG = "tag:yaml.org,2002:int"
_NAME_MAX_BYTES = 255  # one path component, on Linux and macOS file systems
_PATH_MAX_BYTES = 4095


class _Refused(Exception):
    """A document the loader will not build; the message says why and where."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases and with a bound on nesting."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, AliasEvent):
            raise _Refused(f"line {event.start_mark.line + 1}: aliases (*{event.anchor}) are not supported; "
                           "write the value out")
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise _Refused(f"line {event.start_mark.line + 1}: nested deeper than {MAX_YAML_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def parse_yaml_text(text: str, label: str, error: type[SimtrainError]):
    """The Python value of a YAML document; `error(f"{label}: ...")` for anything refused."""
    if len(text) > MAX_FILE_BYTES:  # a --set value as long as a file may be
        raise error(f"{label}: longer than {format_bytes(MAX_FILE_BYTES)}, the most a YAML document may hold")
    loader = None
    try:
        loader = _BoundedLoader(text)  # reads the text: refuses control characters
        node = loader.get_single_node()
        if node is None:
            return None
        _check_integers(node, "")
        return loader.construct_document(node)
    except _Refused as refused:
        raise error(f"{label}: {refused}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or getattr(exc, "reason", None) or "cannot parse"
        raise error(f"{label}: not valid YAML{where}: {problem}") from None
    finally:
        if loader is not None:
            loader.dispose()


def _check_integers(node, field: str) -> None:
    """Refuse integer literals too long to convert, naming the field that holds them."""
    if isinstance(node, ScalarNode):
        if node.tag == _INT_TAG and len(node.value) > MAX_INTEGER_DIGITS:
            where = f"{field}: " if field else ""
            raise _Refused(f"{where}an integer of {len(node.value)} characters (at most "
                           f"{MAX_INTEGER_DIGITS} digits are read)")
    elif isinstance(node, SequenceNode):
        for index, child in enumerate(node.value):
            _check_integers(child, f"{field}[{index}]")
    elif isinstance(node, MappingNode):
        for key, value in node.value:
            _check_integers(key, field)
            name = key.value if isinstance(key, ScalarNode) else "?"
            _check_integers(value, f"{field}.{name}" if field else name)


def read_text_file(path: Path, label: str, error: type[SimtrainError]) -> str:
    """A regular file's text, read as UTF-8 and at most MAX_FILE_BYTES long."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise error(f"{label}: not found{_other_yaml_suffix(Path(path))}") from None
    except OSError as exc:
        raise error(f"{label}: cannot read it ({exc.strerror})") from None
    except ValueError:  # an embedded NUL byte
        raise error(f"{label}: not a valid path") from None
    if stat.S_ISDIR(info.st_mode):
        raise error(f"{label}: is a folder, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{label}: is not a regular file (a pipe, a socket or a device)")
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise error(f"{label}: cannot read it ({exc.strerror})") from None
    if len(data) > MAX_FILE_BYTES:
        raise error(f"{label}: larger than {format_bytes(MAX_FILE_BYTES)}, the most a file read may hold")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise error(f"{label}: not UTF-8 text (byte {exc.start}, line {line})") from None


def _other_yaml_suffix(path: Path) -> str:
    """"; did you mean `x.yaml`?" for a missing `x.yml` whose `x.yaml` exists (and the other way round); else ""."""
    other = {".yml": ".yaml", ".yaml": ".yml"}.get(path.suffix.lower())
    if other is None or not path.with_suffix(other).is_file():
        return ""
    return f"; did you mean `{path.with_suffix(other)}`?"


def load_yaml_file(path: Path, label: str, error: type[SimtrainError]):
    """read_text_file, then parse_yaml_text."""
    return parse_yaml_text(read_text_file(path, label, error), label, error)


def user_path(text, field: str, error: type[SimtrainError] = SimtrainError) -> Path:
    """A path the user typed, with `~` expanded; error naming `field` for one that no file system takes."""
    text = os.fspath(text)
    if "\0" in text:
        raise error(f"{field}: a path cannot hold a NUL byte, got {text!r}")
    try:
        path = Path(text).expanduser()
    except RuntimeError:  # ~user for a user this host does not know
        raise error(f"{field}: cannot expand {text.split('/')[0]!r}: no such user") from None
    for part in path.parts:
        if len(os.fsencode(part)) > _NAME_MAX_BYTES:
            raise error(f"{field}: the name {part[:24]!r}... is longer than {_NAME_MAX_BYTES} bytes")
    if len(os.fsencode(path.absolute())) > _PATH_MAX_BYTES:
        raise error(f"{field}: the path is longer than {_PATH_MAX_BYTES} bytes")
    return path


def output_folder(text, field: str) -> Path:
    """The folder a command will write to, checked (not created) before anything runs."""
    path = user_path(text, field)
    existing = path.absolute()
    while not os.path.lexists(existing):
        existing = existing.parent
    if not existing.is_dir():
        if existing == path.absolute():
            raise SimtrainError(f"{field}: {path} exists and is not a folder")
        raise SimtrainError(f"{field}: cannot create {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SimtrainError(f"{field}: cannot write in {existing}")
    return path
