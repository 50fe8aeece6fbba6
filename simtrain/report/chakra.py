"""Chakra execution traces of a run: the event log as the per-rank graphs that ASTRA-sim replays.

Chakra (MLCommons, `mlc-chakra` 1.0.0 on PyPI, imported as `chakra`) stores
a rank's work as a file of length-prefixed protobuf messages
(chakra/schema/protobuf/et_def.proto): a `GlobalMetadata`, then one `Node`
per operation, each naming the nodes it depends on. ASTRA-sim reads one file
per rank, `<prefix>.<rank>.et`, and the process groups as a JSON object from
a group's name to its ranks (its `--comm-group-configuration`).

A rank's spans become its nodes, in the order they started:

- a collective (a span that names its group: hw/eventlog.py) is a
  `COMM_COLL_NODE` with `comm_type`, `comm_size` (the collective's buffer,
  as nccl-tests and ASTRA-sim size it) and `pg_name` (its group in
  comm_group.json: a communicator's collectives of one label, a stream of
  their own). The buffer is what the group's ranks sent, over
  2(n - 1) for an all-reduce and n - 1 for the others: every algorithm that
  simtrain runs without a switch sends each byte of an all-reduce's buffer
  2(n - 1) times in all, and of an all-gather's, reduce-scatter's,
  broadcast's or all-to-all's n - 1 times (nccl-tests' doc/PERFORMANCE.md
  bus factors, times n). The rank's own bytes are kept as `bytes_sent`;
- a posted point-to-point message (a pipeline's activations and gradients:
  hw/eventlog.py's messages) is a `COMM_SEND_NODE` on its source and a
  `COMM_RECV_NODE` on its destination, with `comm_dst` / `comm_src`,
  `comm_size` and `comm_tag`, from when both sides had posted it to when it
  arrived;
- any other span (compute, the optimizer, a transfer that is not a
  collective or a message: a context-parallel ring's pass, a copy to a
  store) is a `COMP_NODE`
  with `duration_micros` and `num_ops` (its FLOPs), the simtrain kind it
  was logged as in `kind`;
- waits (a pipeline's bubble) are no nodes: the dependencies reproduce them;
  an NCCL call's launch latency is part of its collective's node (which
  starts where the launch did).

The collective's type comes from its names as Chakra's own PyTorch converter
finds it (pytorch_converter.py `get_collective_comm_type`: "allreduce",
"alltoall", "allgather", "reducescatter", "broadcast" in the name, `_` and
`-` left out), applied to the program's name, else to the span's label.

Dependencies are the order within each stream of the rank (its compute
stream; each communicator's stream; its other transfers) and, across
streams, the last node of every other stream that had ended when the node
started: what the run's order was. Messages run side by side (a pipeline
posts several): each depends on what had ended when it started, none on the
message before it. `duration_micros` is whole microseconds,
as the schema says; the exact simulated seconds ride along as `start_s` and
`duration_s`, which `simtrain replay` prefers (ASTRA-sim reads neither).

Under representatives every rank still gets its trace, as ASTRA-sim needs
one a rank. A mirrored rank of a scenario (strategies/representatives.py)
ran nothing of its own: its trace is its representative's nodes, each
collective over the rank's own group of that kind and each message to or
from its own peer (strategies/mirrored_ranks.py); a representative's
collective carries its buffer (its bytes count every group it stands for).
A stood-in rank of users' code (torchdist/representatives.py) posted its
own communication: its trace is its representative's compute and its own
collectives and messages. Either way the files are the ones a run of every
rank writes (tests/test_chakra.py).

    for node, varying in nodes(pb, spans, sizes): ...   # a rank's nodes (report/chakra_files.py writes the files)
"""
from typing import NamedTuple

from ..errors import ScenarioError
from ..hw.eventlog import Span

SCHEMA = "1.0.2-chakra.1.0.0"  # what chakra 1.0.0's text converter writes as the traces' schema
WAIT_KINDS = ("bubble", "idle", "lost")  # spans that are waits, not work: no node
# Chakra's PyTorch converter's table (pytorch_converter.py get_collective_comm_type), in its order.
COMM_TYPES = (("allreduce", "ALL_REDUCE"), ("alltoall", "ALL_TO_ALL"), ("allgather", "ALL_GATHER"),
              ("reducescatter", "REDUCE_SCATTER"), ("broadcast", "BROADCAST"))
COMPUTE_STREAM, TRANSFER_STREAM = 0, 1  # a node's `stream` attribute; a communicator's: 2 + its order on the rank


def comm_type_of(*names: str) -> str | None:
    """The Chakra collective type that the first of `names` (a program's name, a span's label) to name one names,
    or None: a reduce-scatter labelled "tp_allgather" (an all-gather's backward) is a reduce-scatter."""
    for name in names:
        normalized = name.replace("_", "").replace("-", "").lower()
        found = next((kind for key, kind in COMM_TYPES if key in normalized), None)
        if found is not None:
            return found
    return None


def bytes_per_buffer_byte(comm_type: str, group_size: int) -> int:
    """Bytes a group of `group_size` ranks sends in all per byte of a collective's buffer (the module
    docstring)."""
    return (group_size - 1) * (2 if comm_type == "ALL_REDUCE" else 1)


def chakra_module():
    """chakra's protobuf messages (et_def_pb2); a refusal in one line where mlc-chakra is not installed."""
    try:
        from chakra.schema.protobuf import et_def_pb2
    except ImportError as error:
        raise ScenarioError(f"Chakra traces need mlc-chakra==1.0.0 (pip install 'simtrain[chakra]'): {error}") \
            from None
    return et_def_pb2


class PointToPoint(NamedTuple):
    """A rank's side of a posted message (eventlog.Message), shaped as a span for `_nodes`."""

    kind: str  # "send" or "recv"
    name: str
    start: float
    end: float
    nbytes: float
    peer: int
    tag: int
    flops: float = 0
    group: tuple = ()
    op: str = ""
    posted_s: float | None = None


def messages_as_nodes(messages: list, spans_by_rank: dict[int, list]) -> None:
    """Each message of a program that names no collective (a pipeline's, a ring step's: the messages of a posted
    collective are its own) becomes a send on its source and a receive on its destination; the spans of such
    programs that a rank logged with that label give way to them."""
    labels: dict[int, set] = {}
    for message in messages:
        if comm_type_of(message.op) is not None:  # a posted collective's (ZeRO-3's prefetch)
            continue
        for rank, kind, peer in ((message.src, "send", message.dst), (message.dst, "recv", message.src)):
            if rank in spans_by_rank:
                spans_by_rank[rank].append(PointToPoint(kind, message.label, message.start, message.end,
                                                        message.nbytes, peer, message.tag))
                labels.setdefault(rank, set()).add(message.label)
    for rank, spans in spans_by_rank.items():
        spans[:] = [span for span in spans if not (span.kind == "communication" and span.group and
                                                   span.name in labels.get(rank, ()) and comm_type_of(span.op) is None)]


def launches_folded(spans: list[Span]) -> list[Span]:
    """A rank's spans in start order, each NCCL launch (op "<collective> launch") folded into the collective that
    follows it on its group: that collective starts where its launch did."""
    folded, launched = [], {}
    # a posted collective (ZeRO-3's prefetched all-gather) started with its first transfer, before it was awaited
    spans = [span._replace(start=span.posted_s) if span.posted_s is not None and span.posted_s < span.start
             else span for span in spans]
    for span in sorted(spans, key=lambda s: (s.start, s.end)):
        if span.op.endswith(" launch"):
            launched[span.group] = span.start
        elif span.group in launched and collective(span):
            folded.append(span._replace(start=launched.pop(span.group)))
        else:
            folded.append(span)
    return sorted(folded, key=lambda s: (s.start, s.end))


def _stream(span: Span) -> tuple:
    """A collective's stream: its communicator (one group tuple each: hw/eventlog.py) and its label."""
    return id(span.group), span.name


def collective(span: Span) -> bool:
    """Whether a span is a collective of a group that the trace names (its program's name or label names its
    type)."""
    return span.kind == "communication" and len(span.group) > 1 and comm_type_of(span.op, span.name) is not None


def buffer_bytes(spans_by_rank: dict[int, list[Span]]) -> dict[tuple, int]:
    """(communicator, label, program, k) -> the buffer of the communicator's k-th such collective, from what its
    ranks sent (those of them that ran it: the others count as their mean)."""
    sent: dict[tuple, list[float]] = {}
    for spans in spans_by_rank.values():
        seen: dict[tuple, int] = {}
        for span in spans:
            if collective(span) and not span.buffer:
                key = (id(span.group), span.name, span.op)
                k = seen[key] = seen.get(key, -1) + 1
                sent.setdefault((*key, k), []).append((len(span.group), comm_type_of(span.op, span.name),
                                                       span.nbytes))
    sizes = {}
    for key, amounts in sent.items():
        size, comm_type, _ = amounts[0]
        total = sum(nbytes for _, _, nbytes in amounts)
        sizes[key] = round(total * size / len(amounts) / bytes_per_buffer_byte(comm_type, size))
    return sizes


def nodes(pb, spans: list[Span], sizes: dict[tuple, int]):
    """A rank's nodes, its spans in start order: ids from 1, each depending on the previous node of its stream
    and on the last node of every other stream that had ended when it started (an earlier node only). Each comes
    with what names the rank's group or peer, left out of the node: ("pg_name", (group, label)), ("comm_dst" or
    "comm_src", peer) (report/chakra_files.py writes them)."""
    streams: dict[object, list] = {}  # stream -> [(end_s, id)] of its nodes so far, in order
    numbers = {"compute": COMPUTE_STREAM, "transfers": TRANSFER_STREAM, "messages": TRANSFER_STREAM}
    seen: dict[tuple, int] = {}
    for node_id, span in enumerate(spans, start=1):
        node = pb.Node(id=node_id, name=span.name, start_time_micros=round(span.start * 1e6),
                       duration_micros=round((span.end - span.start) * 1e6))
        attrs = [pb.AttributeProto(name="is_cpu_op", bool_val=False),
                 pb.AttributeProto(name="start_s", double_val=span.start),
                 pb.AttributeProto(name="duration_s", double_val=span.end - span.start)]
        if type(span) is PointToPoint:
            stream = "messages"
            send = span.kind == "send"
            node.type = pb.COMM_SEND_NODE if send else pb.COMM_RECV_NODE
            varying = (("comm_dst" if send else "comm_src", span.peer),)
            attrs += [pb.AttributeProto(name="comm_size", int64_val=round(span.nbytes)),
                      pb.AttributeProto(name="comm_tag", int64_val=span.tag)]
            if send:
                attrs.append(pb.AttributeProto(name="bytes_sent", int64_val=round(span.nbytes)))
        elif collective(span):
            key = (id(span.group), span.name, span.op)
            k = seen[key] = seen.get(key, -1) + 1
            stream = _stream(span)
            node.type = pb.COMM_COLL_NODE
            comm_type = comm_type_of(span.op, span.name)
            if span.buffer:  # a representative's: its bytes count every group it stands for
                size = span.buffer
                sent = size * bytes_per_buffer_byte(comm_type, len(span.group)) / len(span.group)
            else:
                size, sent = sizes[(*key, k)], span.nbytes
            varying = (("pg_name", (span.group, span.name)),)
            attrs += [pb.AttributeProto(name="comm_type", int64_val=pb.CollectiveCommType.Value(comm_type)),
                      pb.AttributeProto(name="comm_size", int64_val=size),
                      pb.AttributeProto(name="bytes_sent", int64_val=round(sent))]
        else:
            stream, varying = "transfers" if span.kind == "communication" else "compute", ()
            node.type = pb.COMP_NODE
            attrs += [pb.AttributeProto(name="num_ops", int64_val=round(span.flops)),
                      pb.AttributeProto(name="kind", string_val=span.kind)]
            if span.nbytes and span.kind == "communication":
                attrs.append(pb.AttributeProto(name="bytes_sent", int64_val=round(span.nbytes)))
        # a stream's number: compute's, transfers', else 2 + the communicators' streams seen before on the rank
        attrs.append(pb.AttributeProto(name="stream", int64_val=numbers.setdefault(stream, len(numbers) - 1)))
        node.attr.extend(attrs)
        deps = []
        for other, ended in streams.items():
            if other == stream and stream != "messages":  # posted messages run side by side: no chain of them
                deps.append(ended[-1][1])
            else:
                done = [other_id for end_s, other_id in ended if end_s <= span.start]
                if done:
                    deps.append(done[-1])
        node.data_deps.extend(sorted(set(deps)))
        streams.setdefault(stream, []).append((span.end, node_id))
        _trim(streams, stream)
        yield node, varying


def _trim(streams: dict, stream) -> None:
    """Keep a stream's last nodes only: a node further back ended before its successor on the stream did, and
    depending on that successor covers it."""
    ended = streams[stream]
    if len(ended) > 64:
        del ended[:-64]
