"""Chakra execution traces read and checked before a replay: every node decoded, every promise kept.

A rank's file (`<prefix>.<rank>.et`) is a sequence of protobuf messages,
each prefixed by its length as a varint (chakra 1.0.0's protolib): a
`GlobalMetadata`, then `Node`s. The files are read with chakra's own
messages, and refused in one line naming the file and the node where they
break a promise a replay relies on:

- the file: not past MAX_CHAKRA_FILE_BYTES (checked before it is read); each
  message whole (a truncated file) and protobuf (a file of something else);
  every rank 0..N-1 present, once;
- the nodes: at most MAX_CHAKRA_NODES in all the files (counted as they are
  decoded: a huge file stops there); a known type; ids unique; every
  dependency a node of the file; no cycle;
- the process groups: given a comm_group.json (ASTRA-sim's
  `--comm-group-configuration`: a group's name to its ranks), a collective's
  `pg_name` is one of its groups (none: every rank), whose ranks have traces
  and hold the node's own; without one, as in ASTRA-sim, every collective
  runs on every rank;
- the partners: each rank of a group runs the same collectives on it, in the
  same order, of the same type and size; every send has its receive.

    traces = read_traces(["runs/quickstart/chakra"])
    traces.world, traces.groups["0"], traces.ranks[0][:3]
"""
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ScenarioError
from ..limits import MAX_CHAKRA_FILE_BYTES, MAX_CHAKRA_NODES
from ..report.chakra import chakra_module

RANK_OF_NAME = re.compile(r"\.(\d{1,9})\.et$")  # ASTRA-sim's `<prefix>.<rank>.et`
COMM_GROUP_FILE = "comm_group.json"
ALL_RANKS = ""  # the group of a collective that names none: every rank, as ASTRA-sim takes it


@dataclass(frozen=True)
class TraceNode:
    """One node of a rank's trace, as a replay needs it."""

    id: int
    name: str
    type: str  # Chakra's NodeType name: "COMP_NODE", "COMM_COLL_NODE", "COMM_SEND_NODE", ...
    deps: tuple[int, ...]  # data and control dependencies: ids of nodes of the same rank
    duration_s: float  # recorded (`duration_s`, else `duration_micros`); 0: none
    end_s: float | None  # when it ended in the trace's own run; None: the trace has no start times
    flops: float  # `num_ops`
    cpu: bool  # `is_cpu_op`: work of the host, beside the device's stream
    kind: str  # what a replay logs its time as (`kind`, written by simtrain; else "compute" or "communication")
    comm_type: str | None  # a collective's CollectiveCommType name
    comm_size: int  # a collective's buffer, a send's or receive's message, in bytes
    group: str  # a collective's pg_name (ALL_RANKS: none)
    peer: int | None  # a send's comm_dst, a receive's comm_src
    tag: int


@dataclass
class Traces:
    """Every rank's nodes (rank -> nodes in file order), the process groups (name -> ranks), the steps the traces
    hold (their metadata's `steps`; 1 without), and the files read."""

    ranks: dict[int, list[TraceNode]]
    groups: dict[str, tuple[int, ...]]
    steps: int
    files: dict[int, Path]

    @property
    def world(self) -> int:
        return len(self.ranks)

    @property
    def nodes(self) -> int:
        return sum(len(nodes) for nodes in self.ranks.values())


def read_traces(paths: list[str]) -> Traces:
    """The traces of `paths` (files `<prefix>.<rank>.et`, or folders of them, with their comm_group.json), decoded
    and checked (the module docstring)."""
    files, group_file = _files(paths)
    pb = chakra_module()
    budget = [MAX_CHAKRA_NODES]
    ranks, steps = {}, set()
    for rank, path in files.items():
        ranks[rank], rank_steps = _read(pb, path, budget, group_file is not None)
        steps.add(rank_steps)
    if len(steps) > 1:
        raise ScenarioError(f"{files[0].parent}: the ranks' traces hold different numbers of steps: "
                            f"{sorted(steps)}")
    groups = _groups(group_file, sorted(ranks))
    traces = Traces(ranks, groups, steps.pop(), files)
    for rank, nodes in ranks.items():
        _check_graph(files[rank], nodes)
    _check_partners(traces)
    return traces


def _files(paths: list[str]) -> tuple[dict[int, Path], Path | None]:
    found, group_files = [], []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found += sorted(path.glob("*.et"))
            group_files += [path / COMM_GROUP_FILE] if (path / COMM_GROUP_FILE).is_file() else []
        elif path.name == COMM_GROUP_FILE:
            group_files.append(path)
        elif path.is_file():
            found.append(path)
        else:
            raise ScenarioError(f"{name}: no such file or folder")
    if not found:
        raise ScenarioError(f"{', '.join(paths)}: no Chakra trace (<prefix>.<rank>.et) there")
    if len(group_files) > 1:
        raise ScenarioError(f"{', '.join(map(str, group_files))}: more than one {COMM_GROUP_FILE}; give one")
    files: dict[int, Path] = {}
    for path in found:
        match = RANK_OF_NAME.search(path.name)
        if match is None:
            raise ScenarioError(f"{path}: a Chakra trace is named <prefix>.<rank>.et (ASTRA-sim's naming)")
        rank = int(match.group(1))
        if rank in files:
            raise ScenarioError(f"{path}: rank {rank} has another trace, {files[rank]}")
        files[rank] = path
    missing = sorted(set(range(max(files) + 1)) - set(files))
    if missing:
        raise ScenarioError(f"{found[0].parent}: missing rank {missing[0]}: no <prefix>.{missing[0]}.et among the "
                            f"traces given (ranks {', '.join(map(str, sorted(files)))})")
    return dict(sorted(files.items())), (group_files[0] if group_files else None)


def _read(pb, path: Path, budget: list[int], grouped: bool) -> tuple[list[TraceNode], int]:
    """The nodes of one file and its steps; `budget[0]`, the nodes all files may still hold, counted down;
    `grouped`: a comm_group.json came with the traces (without one, every collective is on every rank)."""
    size = path.stat().st_size
    if size > MAX_CHAKRA_FILE_BYTES:
        raise ScenarioError(f"{path}: {size} bytes, past the limit of {MAX_CHAKRA_FILE_BYTES} bytes for a Chakra "
                            f"trace (MAX_CHAKRA_FILE_BYTES)")
    data = path.read_bytes()
    metadata = pb.GlobalMetadata()
    offset = _parse(path, data, 0, metadata, "its metadata")
    steps = _attrs(metadata.attr).get("steps", 1)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ScenarioError(f"{path}: metadata steps: expected a positive integer, got {steps!r}")
    nodes = []
    while offset < len(data):
        budget[0] -= 1
        if budget[0] < 0:
            raise ScenarioError(f"{path}: more than {MAX_CHAKRA_NODES} nodes in the traces given, past the limit "
                                f"(MAX_CHAKRA_NODES)")
        node = pb.Node()
        offset = _parse(path, data, offset, node, f"message {len(nodes) + 2}")
        nodes.append(_node(pb, path, node, grouped))
    return nodes, steps


def _parse(path: Path, data: bytes, offset: int, message, what: str) -> int:
    """Decode the length-prefixed message at `offset` into `message`; the offset after it."""
    from google.protobuf.message import DecodeError

    length, shift, start = 0, 0, offset
    while True:
        if offset >= len(data) or shift > 63:
            raise ScenarioError(f"{path}: {what} at byte {start}: its length is cut short or not a varint "
                                f"(truncated, or not a Chakra trace)")
        byte = data[offset]
        offset += 1
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    if length > len(data) - offset:
        raise ScenarioError(f"{path}: {what} at byte {start} claims {length} bytes, {len(data) - offset} are left "
                            f"(truncated, or not a Chakra trace)")
    try:
        message.ParseFromString(data[offset:offset + length])
    except DecodeError as error:
        raise ScenarioError(f"{path}: {what} at byte {start} is not a Chakra {type(message).__name__} "
                            f"({error})") from None
    return offset + length


def _attrs(attrs) -> dict:
    values = {}
    for attr in attrs:
        field = attr.WhichOneof("value")
        if field is not None:
            value = getattr(attr, field)
            values[attr.name] = list(value.values) if field.endswith("_list") else value
    return values


def _node(pb, path: Path, node, grouped: bool) -> TraceNode:
    kind = pb.NodeType.Name(node.type) if node.type in pb.NodeType.values() else None
    if kind in (None, "INVALID_NODE"):
        raise ScenarioError(f"{path}: node {node.id} ({node.name!r}): type {node.type} is not a Chakra node type "
                            f"(not a Chakra trace?)")
    attrs = _attrs(node.attr)
    where = f"{path}: node {node.id} ({node.name!r})"
    comm_type = None
    if kind == "COMM_COLL_NODE":
        number = _integer(attrs, "comm_type", where, 0)
        if number not in pb.CollectiveCommType.values():
            raise ScenarioError(f"{where}: comm_type {number} is not a Chakra collective type")
        comm_type = pb.CollectiveCommType.Name(number)
    duration_s = _number(attrs, "duration_s", where, node.duration_micros * 1e-6)
    start_s = _number(attrs, "start_s", where, node.start_time_micros * 1e-6)
    timed = "start_s" in attrs or node.start_time_micros > 0
    peer = attrs.get("comm_dst" if kind == "COMM_SEND_NODE" else "comm_src")
    if kind in ("COMM_SEND_NODE", "COMM_RECV_NODE") and (isinstance(peer, bool) or not isinstance(peer, int)):
        raise ScenarioError(f"{where}: a {kind} names its peer rank in "
                            f"{'comm_dst' if kind == 'COMM_SEND_NODE' else 'comm_src'}")
    return TraceNode(
        id=node.id, name=node.name, type=kind, deps=tuple(dict.fromkeys([*node.data_deps, *node.ctrl_deps])),
        duration_s=duration_s, end_s=start_s + duration_s if timed else None,
        flops=_number(attrs, "num_ops", where, 0), cpu=bool(attrs.get("is_cpu_op", False)),
        kind=str(attrs.get("kind", "communication" if kind.startswith("COMM") else "compute")),
        comm_type=comm_type, comm_size=_integer(attrs, "comm_size", where, 0),
        group=str(attrs.get("pg_name", "")) if grouped else ALL_RANKS,
        peer=peer, tag=_integer(attrs, "comm_tag", where, 0))


def _number(attrs: dict, name: str, where: str, default: float) -> float:
    value = attrs.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e30:
        raise ScenarioError(f"{where}: {name}: expected a number from 0, got {value!r}")
    return float(value)


def _integer(attrs: dict, name: str, where: str, default: int) -> int:
    value = attrs.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**62:
        raise ScenarioError(f"{where}: {name}: expected an integer from 0, got {value!r}")
    return value


def _groups(path: Path | None, ranks: list[int]) -> dict[str, tuple[int, ...]]:
    groups = {ALL_RANKS: tuple(ranks)}
    if path is None:
        return groups
    if path.stat().st_size > MAX_CHAKRA_FILE_BYTES:
        raise ScenarioError(f"{path}: past the limit of {MAX_CHAKRA_FILE_BYTES} bytes (MAX_CHAKRA_FILE_BYTES)")
    try:
        raw = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as error:
        raise ScenarioError(f"{path}: not JSON ({error})") from None
    if not isinstance(raw, dict):
        raise ScenarioError(f"{path}: expected an object from a group's name to its ranks")
    for name, members in raw.items():
        if not isinstance(members, list) or not members or not all(
                isinstance(rank, int) and not isinstance(rank, bool) for rank in members):
            raise ScenarioError(f"{path}: group {name!r}: expected a list of ranks, got {members!r}")
        if len(set(members)) != len(members):
            raise ScenarioError(f"{path}: group {name!r}: rank {_first_repeat(members)} is named twice")
        absent = [rank for rank in members if rank not in groups[ALL_RANKS]]
        if absent:
            raise ScenarioError(f"{path}: group {name!r} names rank {absent[0]}, which has no trace (ranks "
                                f"{', '.join(map(str, ranks))})")
        groups[name] = tuple(members)
    return groups


def _first_repeat(members: list[int]) -> int:
    seen = set()
    return next(rank for rank in members if rank in seen or seen.add(rank))


def _check_graph(path: Path, nodes: list[TraceNode]) -> None:
    """Ids unique, every dependency a node of the file, no cycle (Kahn's algorithm)."""
    by_id = {}
    for node in nodes:
        if node.id in by_id:
            raise ScenarioError(f"{path}: node id {node.id} is used twice ({by_id[node.id].name!r}, {node.name!r})")
        by_id[node.id] = node
    waiting = {}
    dependents: dict[int, list[int]] = {}
    for node in nodes:
        for dep in node.deps:
            if dep not in by_id:
                raise ScenarioError(f"{path}: node {node.id} ({node.name!r}) depends on node {dep}, which the "
                                    f"trace does not have")
            dependents.setdefault(dep, []).append(node.id)
        waiting[node.id] = len(node.deps)
    ready = [node.id for node in nodes if not node.deps]
    done = 0
    while ready:
        done += 1
        for dependent in dependents.get(ready.pop(), ()):
            waiting[dependent] -= 1
            if waiting[dependent] == 0:
                ready.append(dependent)
    if done < len(nodes):
        stuck = next(node for node in nodes if waiting[node.id])
        raise ScenarioError(f"{path}: node {stuck.id} ({stuck.name!r}) is on or after a dependency cycle: it can "
                            f"never run")


def _check_partners(traces: Traces) -> None:
    """Each group's ranks run the same collectives in the same order; every send meets its receive."""
    runs: dict[str, dict[int, list[TraceNode]]] = {}
    sends: dict[tuple[int, int, int], list[TraceNode]] = {}
    receives: dict[tuple[int, int, int], list[TraceNode]] = {}
    for rank, nodes in traces.ranks.items():
        where = traces.files[rank]
        for node in sorted(nodes, key=lambda node: node.id):
            if node.type == "COMM_COLL_NODE":
                members = traces.groups.get(node.group)
                if members is None:
                    raise ScenarioError(f"{where}: node {node.id} ({node.name!r}): pg_name {node.group!r} is not a "
                                        f"group of {COMM_GROUP_FILE} (groups: {', '.join(sorted(traces.groups))})")
                if rank not in members:
                    raise ScenarioError(f"{where}: node {node.id} ({node.name!r}) runs on group {node.group!r}, "
                                        f"ranks {list(members)}, which does not hold rank {rank}")
                runs.setdefault(node.group, {}).setdefault(rank, []).append(node)
            elif node.type in ("COMM_SEND_NODE", "COMM_RECV_NODE"):
                if node.peer not in traces.ranks or node.peer == rank:
                    raise ScenarioError(f"{where}: node {node.id} ({node.name!r}): peer rank {node.peer} is not "
                                        f"another rank of the traces")
                key = (rank, node.peer, node.tag) if node.type == "COMM_SEND_NODE" else (node.peer, rank, node.tag)
                (sends if node.type == "COMM_SEND_NODE" else receives).setdefault(key, []).append(node)
    for group, by_rank in runs.items():
        members = traces.groups[group]
        longest = max(members, key=lambda rank: len(by_rank.get(rank, [])))
        for rank in members:
            mine, theirs = by_rank.get(rank, []), by_rank[longest]
            for index, node in enumerate(theirs):
                other = mine[index] if index < len(mine) else None
                if other is None:
                    raise ScenarioError(f"{traces.files[longest]}: node {node.id} ({node.name!r}), collective "
                                        f"#{index + 1} of rank {longest} on group {group!r}, has no partner on "
                                        f"rank {rank}, which runs {len(mine)} there")
                if (other.comm_type, other.comm_size) != (node.comm_type, node.comm_size):
                    raise ScenarioError(f"{traces.files[rank]}: node {other.id} ({other.name!r}), collective "
                                        f"#{index + 1} of rank {rank} on group {group!r}, is a {other.comm_type} of "
                                        f"{other.comm_size} B where rank {longest} runs a {node.comm_type} of "
                                        f"{node.comm_size} B")
    for key in sorted(set(sends) | set(receives)):
        posted, met = sends.get(key, []), receives.get(key, [])
        if [node.comm_size for node in posted] != [node.comm_size for node in met]:
            src, dst, tag = key
            raise ScenarioError(f"{traces.files[src]}: rank {src} sends {[n.comm_size for n in posted]} B to rank "
                                f"{dst} (tag {tag}), which receives {[n.comm_size for n in met]} B")
