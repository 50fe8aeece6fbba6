"""A run's Chakra files by name, each made when it is read: 16,384 ranks' traces would not fit in memory at once.

A rank's file is its metadata and its nodes (report/chakra.py), each framed
as chakra's protolib frames a message (its length as a varint, then the
message). The attributes that name the rank's process group (`pg_name`) or
its peer (`comm_src`, `comm_dst`) are written last in each node (a repeated
field may come in parts), so that a mirrored rank's file under
representatives is its representative's nodes, encoded once, with those
attributes its own (strategies/mirrored_ranks.py's Counterparts name them).
A process group of the traces is a communicator's collectives of one label
(a stream of their own: ZeRO-3's all-gathers and reduce-scatters run side by
side on one communicator), named in rank order, then in the order first
seen on the rank.

    files = chakra_files(cluster, ranks=[0, 1, 2, 3], steps=2)   # a Mapping: {"et.0.et": b"...", ...}
    for name, payload in files.items(): ...                      # one rank's file made at a time
"""
import json
from collections.abc import Mapping

from ..hw.eventlog import Span
from ..version import __version__
from .chakra import (SCHEMA, WAIT_KINDS, buffer_bytes, chakra_module, collective, launches_folded, messages_as_nodes,
                     nodes)


def chakra_files(cluster, ranks: list[int], steps: int, mirror_of: dict[int, int] | None = None,
                 counterparts=None) -> "ChakraFiles":
    """Each rank's trace, `et.<rank>.et`, and `comm_group.json` (a group's name -> its ranks), from the cluster's
    event log (which must have kept its spans), by file name, each made when read (report/chakra_files.py);
    `steps` is written in the metadata, for a step time. A rank in `mirror_of` (a device rank -> its
    representative's) writes its representative's compute; its communication is its own where it posted it
    (users' code: torchdist/representatives.py), else (`counterparts`, strategies/mirrored_ranks.py) its
    representative's with its own groups and peers."""
    pb = chakra_module()
    mirror_of = mirror_of or {}
    spans_by_rank: dict[int, list[Span]] = {rank: [] for rank in ranks
                                            if counterparts is None or rank not in mirror_of}
    for span in cluster.log.spans:
        if span.rank in spans_by_rank and span.kind not in WAIT_KINDS:
            spans_by_rank[span.rank].append(span)
    if counterparts is None:
        for rank, representative in mirror_of.items():
            spans_by_rank[rank] += [span for span in spans_by_rank[representative] if span.kind != "communication"]
    messages_as_nodes(cluster.log.messages or [], spans_by_rank)
    spans_by_rank = {rank: launches_folded(spans) for rank, spans in spans_by_rank.items()}
    return ChakraFiles(pb, ranks, steps, spans_by_rank, buffer_bytes(spans_by_rank),
                       mirror_of if counterparts is not None else {}, counterparts)


class ChakraFiles(Mapping):
    """`et.<rank>.et` for each rank, then `comm_group.json`; a rank's file made when read (a representative's
    nodes encoded once, for every rank that mirrors it)."""

    def __init__(self, pb, ranks: list[int], steps: int, spans_by_rank: dict[int, list[Span]],
                 sizes: dict[tuple, int], mirror_of: dict[int, int], counterparts):
        self._pb, self._ranks, self._steps, self._spans, self._sizes = pb, ranks, steps, spans_by_rank, sizes
        self._mirror_of, self._counterparts = mirror_of, counterparts
        self._representatives = set(mirror_of.values())
        self._records_of: dict[int, list] = {}  # a representative -> its nodes' records (`_records`)
        self._attributes: dict[tuple, bytes] = {}  # (name, value) -> the attribute as a node's field
        self._names, self._groups, self._own_groups = _named_groups(ranks, spans_by_rank, mirror_of, counterparts)

    def __iter__(self):
        yield from (f"et.{rank}.et" for rank in self._ranks)
        yield "comm_group.json"

    def __len__(self) -> int:
        return len(self._ranks) + 1

    def __getitem__(self, name: str) -> bytes:
        if name == "comm_group.json":
            return (json.dumps({group_name: list(group) for group_name, group in self._groups.items()}, indent=1)
                    + "\n").encode()
        rank = self._rank(name)
        representative = self._mirror_of.get(rank, rank)
        own_groups, peers = self._own_groups.get(rank), {}
        parts = [_framed(self._pb.GlobalMetadata(version=SCHEMA, attr=[
            self._pb.AttributeProto(name="schema", string_val=SCHEMA),
            self._pb.AttributeProto(name="generator", string_val=f"simtrain {__version__}"),
            self._pb.AttributeProto(name="rank", int64_val=rank),
            self._pb.AttributeProto(name="steps", int64_val=self._steps)]).SerializeToString())]
        for record in self._records(representative):
            if type(record) is bytes:
                parts.append(record)
                continue
            fixed, varying = record
            own = []
            for attribute, key in varying:
                if attribute == "pg_name":
                    group, label = key
                    value = self._names[id(own_groups[id(group)] if own_groups is not None else group), label]
                elif own_groups is not None:  # a mirrored rank's peer
                    value = peers.get(key)
                    if value is None:
                        value = peers[key] = self._counterparts.peer(rank, key)
                else:
                    value = key
                own.append(self._attribute(attribute, value))
            parts.append(_framed(fixed + b"".join(own)))
        return b"".join(parts)

    def _rank(self, name: str) -> int:
        prefix, _, rest = name.partition(".")
        number, _, suffix = rest.partition(".")
        if prefix != "et" or suffix != "et" or not number.isdigit() or int(number) not in self._spans \
                and int(number) not in self._mirror_of:
            raise KeyError(name)
        return int(number)

    def _records(self, rank: int) -> list:
        """A rank's nodes as records: the framed bytes of a run of nodes that name no group or peer, or a node's
        bytes without those attributes and what they name."""
        if rank in self._records_of:
            return self._records_of[rank]
        records, run = [], []
        for node, varying in nodes(self._pb, self._spans[rank], self._sizes):
            if varying:
                if run:
                    records.append(b"".join(run))
                    run = []
                records.append((node.SerializeToString(), varying))
            else:
                run.append(_framed(node.SerializeToString()))
        if run:
            records.append(b"".join(run))
        if rank in self._representatives:
            self._records_of[rank] = records
        return records

    def _attribute(self, name: str, value) -> bytes:
        """The attribute `name` of `value` (a group's name, a rank) as a node's field, encoded once."""
        key = (name, value)
        if key not in self._attributes:
            attribute = (self._pb.AttributeProto(name=name, string_val=value) if type(value) is str
                         else self._pb.AttributeProto(name=name, int64_val=value))
            self._attributes[key] = self._pb.Node(attr=[attribute]).SerializeToString()
        return self._attributes[key]


def _named_groups(ranks: list[int], spans_by_rank: dict[int, list[Span]], mirror_of: dict[int, int], counterparts
                  ) -> tuple[dict[tuple, str], dict[str, tuple], dict[int, dict[int, tuple]]]:
    """((a group's id, a label) -> its name; a name -> its group's ranks; a mirrored rank -> {the id of a group of
    its representative's -> its own group of that kind}). Under representatives a group of the same ranks is one
    tuple wherever it appears, as a communicator's is."""
    interned: dict[tuple, tuple] = {}
    if mirror_of:
        for spans in spans_by_rank.values():
            spans[:] = [span._replace(group=interned.setdefault(span.group, span.group)) if collective(span)
                        else span for span in spans]
    names: dict[tuple, str] = {}
    groups: dict[str, tuple] = {}
    own_groups: dict[int, dict[int, tuple]] = {}
    streams_of: dict[int, list[tuple]] = {}  # a representative -> its collectives' (group, label), first seen first

    def name(group: tuple, label: str) -> None:
        if (id(group), label) not in names:
            names[id(group), label] = str(len(names))
            groups[names[id(group), label]] = group

    for rank in ranks:
        if rank not in mirror_of:
            for span in spans_by_rank[rank]:
                if collective(span):
                    name(span.group, span.name)
            continue
        representative = mirror_of[rank]
        if representative not in streams_of:
            streams_of[representative] = list(dict.fromkeys((span.group, span.name)
                                                            for span in spans_by_rank[representative]
                                                            if collective(span)))
        own = own_groups[rank] = {}
        for group, label in streams_of[representative]:
            if id(group) not in own:
                translated = counterparts.group(rank, group)
                own[id(group)] = interned.setdefault(translated, translated)
            name(own[id(group)], label)
    return names, groups, own_groups


def _framed(message: bytes) -> bytes:
    """A message as protolib's encodeMessage frames it: its length as a varint, then the message."""
    length, prefix = len(message), bytearray()
    while length > 0x7F:
        prefix.append(length & 0x7F | 0x80)
        length >>= 7
    prefix.append(length)
    return bytes(prefix) + message
