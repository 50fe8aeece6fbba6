"""The cluster's event log: every timed action on a device, recorded once.

A span is (job, rank, kind, name, start, end, nbytes, flops) in simulated
seconds, where rank is the device's global rank on the cluster and job the
index of the job that holds the device (0 until a job takes it). Kinds used
by simtrain: "compute", "communication", "optimizer" (and more as techniques
add them). Transfers on links are kept by the network (`Network.records`);
reports, traces and plots are views of these two logs.

Asked to (`keep_communication_parts`), the log also keeps the parts of each
rank's communication that counted (`communication_parts`, spans of the
seconds counted in parts by `count`: a collective's transfers, without the
waits for peers inside it), from which the Kineto traces draw their NCCL
kernels (report/kineto.py).
A rank's part of a collective also names its group (the global ranks of its
communicator) and the program that ran (`op`: "all_reduce",
"ring_all_reduce", ...), which a Chakra execution trace needs
(report/chakra.py), and where its bytes do not tell its buffer (a
representative's, which count every group it stands for) the buffer too; an NCCL call's launch latency, a span of its own before
the call's transfers, is the op "<collective> launch". Asked to
(`keep_messages`), the log also keeps each posted point-to-point message (a
pipeline's activations): a Chakra trace's sends and receives.

Totals are kept as spans arrive, whether or not the spans themselves are
kept: seconds per (rank, kind), and bytes and FLOPs per (rank, kind, label).
Bytes that move without a span of their own (a send posted without waiting
for it) are counted with `count_bytes`.

    log.assign([4, 5, 6, 7], job=1)        # a second job takes devices 4-7
    log.span(5, "compute", "forward", 0.0, 1e-3, flops=2e9)
    log.total(5, "compute"), log.flops(5, "compute"), log.bytes_by_label(5, "communication")

A rank whose communication can overlap its own work (a collective posted on
its communication stream during the backward) is tracked: its spans are kept
as intervals, and its exposed communication is the communication time when
no other span of the rank runs. For every other rank it is the total.
"""
from typing import NamedTuple


class Span(NamedTuple):
    job: int
    rank: int
    kind: str
    name: str
    start: float
    end: float
    nbytes: float
    flops: float
    group: tuple = ()  # a collective's: the global ranks of its communicator, in its rank order
    op: str = ""  # a collective's: the name of the program its rank ran
    posted_s: float | None = None  # a posted collective's: when its first transfer began (start: when awaited)
    buffer: int = 0  # a representative's collective's: its buffer in bytes (its bytes count the groups it stands for)


class Message(NamedTuple):
    """A posted point-to-point message (a pipeline's activation): global ranks, its tag on its communicator, and
    when its transfer ran; kept only when asked for (`keep_messages`: a Chakra trace's sends and receives)."""

    src: int
    dst: int
    tag: int
    nbytes: float
    start: float
    end: float
    label: str
    op: str  # the name of the program that sent it (comm/simulated.py program_name)


class EventLog:
    """Append-only list of spans plus running totals: time per (rank, kind), bytes and FLOPs per
    (rank, kind, label).

    With `record=False` only the totals are kept: that is how very large
    timing studies run without holding millions of spans in memory.
    """

    def __init__(self, record: bool = True):
        self.record = record
        self.spans: list[Span] = []
        self.communication_parts: list[Span] | None = None  # counted communication, once keep_communication_parts
        self.totals: dict[tuple[int, str], float] = {}
        self._bytes: dict[tuple[int, str], dict[str, float]] = {}  # (rank, kind) -> label -> bytes
        self._flops: dict[tuple[int, str], dict[str, float]] = {}  # (rank, kind) -> label -> FLOPs
        self.job_of: dict[int, int] = {}  # global rank -> index of the job holding it
        # When the last span ended: the end of the run. The clock itself may run on past it to
        # a network timeout that a rate change made stale (it fires and does nothing).
        self.last_end_s = 0.0
        self._overlapping: dict[int, tuple[list, list]] = {}  # rank -> (communication, other) intervals
        self.messages: list[Message] | None = None  # posted point-to-point messages, once keep_messages is called

    def keep_messages(self) -> None:
        """Keep every posted point-to-point message from now on (`message`)."""
        self.messages = []

    def keep_communication_parts(self) -> None:
        """Keep the counted parts of every rank's communication from now on (`communication_parts`)."""
        self.communication_parts = []

    def message(self, message: Message) -> None:
        if self.messages is not None:
            self.messages.append(message)

    def track_overlap(self, rank: int) -> None:
        """Rank `rank`'s communication may overlap its other spans: keep its intervals."""
        self._overlapping.setdefault(rank, ([], []))

    def assign(self, ranks: list[int], job: int) -> None:
        """Devices `ranks` now belong to job `job`: their spans carry its index."""
        for rank in ranks:
            self.job_of[rank] = job

    def span(self, rank: int, kind: str, name: str, start: float, end: float,
             nbytes: float = 0, flops: float = 0) -> None:
        """Rank `rank` spent start..end on `kind`: the seconds are counted and the span kept."""
        self.count(rank, kind, start, end, name)
        self.show(rank, kind, name, start, end, nbytes, flops)

    def count(self, rank: int, kind: str, start: float, end: float, label: str) -> None:
        """The seconds start..end of `rank` count as `kind`, shown as part of a longer span named `label`
        (`show`)."""
        key = (rank, kind)
        self.totals[key] = self.totals.get(key, 0.0) + (end - start)
        if end > self.last_end_s:
            self.last_end_s = end
        tracked = self._overlapping.get(rank)
        if tracked is not None:
            tracked[kind != "communication"].append((start, end))
        if self.communication_parts is not None and kind == "communication":
            self.communication_parts.append(Span(self.job_of.get(rank, 0), rank, kind, label, start, end, 0, 0))

    def show(self, rank: int, kind: str, name: str, start: float, end: float,
             nbytes: float = 0, flops: float = 0, group: tuple = (), op: str = "",
             counted_bytes: float = 0, posted_s: float | None = None, buffer: int = 0) -> None:
        """Keep a span whose seconds were counted in parts (`count`): a rank's collective is one span from its
        first transfer to its last, while a wait for a peer within it counts as idle. Its bytes and FLOPs are
        counted here, once; `counted_bytes`, bytes it moved that were counted already (`count_bytes`: a
        posted collective's, as it sent them), join the span's own; `posted_s`, a posted collective's first
        transfer (the span itself shows the part the rank awaited); `buffer`, a representative's collective's
        buffer in bytes."""
        key = (rank, kind)
        if nbytes:
            _add(self._bytes, key, name, nbytes)
        if flops:
            _add(self._flops, key, name, flops)
        if self.record:
            self.spans.append(Span(self.job_of.get(rank, 0), rank, kind, name, start, end, nbytes + counted_bytes,
                                   flops, group, op, posted_s, buffer))

    def count_bytes(self, rank: int, kind: str, label: str, nbytes: float) -> None:
        """Rank `rank` moved `nbytes` for `label`: bytes that no span of its own carries (a span's are counted
        by `span`)."""
        _add(self._bytes, (rank, kind), label, nbytes)

    def cut(self, rank: int, now: float) -> None:
        """Rank's spans stop at `now` (its device was lost, or its job torn down): a span running past now
        ends there, one not started yet is dropped with its bytes and FLOPs (a span cut short keeps them:
        its work had started). Needs `record` (a run with faults records)."""
        if not self.record:
            raise RuntimeError("cutting spans needs an event log that records them")
        kept = []
        for span in self.spans:
            if span.rank == rank and span.end > now:
                self.totals[rank, span.kind] -= span.end - max(span.start, now)
                if span.start >= now:
                    self._uncount(span)
                    continue
                span = span._replace(end=now)
            kept.append(span)
        self.spans = kept
        if self.communication_parts is not None:
            self.communication_parts = [part if part.rank != rank or part.end <= now else part._replace(end=now)
                                        for part in self.communication_parts if part.rank != rank or part.start < now]
        self.last_end_s = max((span.end for span in kept), default=0.0)
        for intervals in self._overlapping.get(rank, ()):
            intervals[:] = [(start, min(end, now)) for start, end in intervals if start < now]

    def _uncount(self, span: Span) -> None:
        if span.nbytes:
            _add(self._bytes, (span.rank, span.kind), span.name, -span.nbytes)
        if span.flops:
            _add(self._flops, (span.rank, span.kind), span.name, -span.flops)

    def total(self, rank: int, kind: str) -> float:
        """Seconds that rank spent on spans of kind."""
        return self.totals.get((rank, kind), 0.0)

    def bytes_by_label(self, rank: int, kind: str) -> dict[str, float]:
        """Bytes that rank moved in spans (and counts) of kind, by label, in the order labels first came."""
        return dict(self._bytes.get((rank, kind), {}))

    def flops(self, rank: int, kind: str) -> float:
        """FLOPs that rank ran in spans of kind, every label."""
        return sum(self._flops.get((rank, kind), {}).values())

    def overlaps(self, rank: int) -> bool:
        return rank in self._overlapping

    def exposed_communication(self, rank: int) -> float:
        """Seconds of rank's communication during which none of its other spans ran."""
        total = self.total(rank, "communication")
        if rank not in self._overlapping:
            return total
        communication, other = self._overlapping[rank]
        return total - sum(end - start for start, end in communication) + sum(
            end - start for start, end in exposed(communication, other))


def _add(totals: dict, key: tuple[int, str], label: str, amount: float) -> None:
    by_label = totals.setdefault(key, {})
    by_label[label] = by_label.get(label, 0) + amount


def exposed(communication: list[tuple[float, float]], other: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of the (disjoint) communication intervals during which none of the other intervals runs."""
    return _outside(sorted(communication), union(sorted(other)))


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted intervals merged where they touch or overlap."""
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _outside(intervals: list[tuple[float, float]], disjoint: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of sorted `intervals` outside the sorted, disjoint `disjoint`."""
    parts, first = [], 0
    for start, end in intervals:
        while first < len(disjoint) and disjoint[first][1] <= start:
            first += 1
        index = first
        while index < len(disjoint) and disjoint[index][0] < end:
            if disjoint[index][0] > start:
                parts.append((start, disjoint[index][0]))
            start = max(start, disjoint[index][1])
            index += 1
        if end > start:
            parts.append((start, end))
    return parts
