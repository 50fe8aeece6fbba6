"""The cluster's event log: every timed action on a device, recorded once.

A span is (rank, kind, name, start, end, nbytes, flops) in simulated seconds.
Kinds used by simtrain: "compute", "communication", "optimizer" (and more as
techniques add them). Transfers on links are kept by the network
(`Network.records`); reports, traces and plots are views of these two logs.
"""
from typing import NamedTuple


class Span(NamedTuple):
    rank: int
    kind: str
    name: str
    start: float
    end: float
    nbytes: float
    flops: float


class EventLog:
    """Append-only list of spans plus running totals of time per (rank, kind).

    With `record=False` only the totals are kept: that is how very large
    timing studies run without holding millions of spans in memory.
    """

    def __init__(self, record: bool = True):
        self.record = record
        self.spans: list[Span] = []
        self.totals: dict[tuple[int, str], float] = {}

    def span(self, rank: int, kind: str, name: str, start: float, end: float,
             nbytes: float = 0, flops: float = 0) -> None:
        key = (rank, kind)
        self.totals[key] = self.totals.get(key, 0.0) + (end - start)
        if self.record:
            self.spans.append(Span(rank, kind, name, start, end, nbytes, flops))

    def total(self, rank: int, kind: str) -> float:
        """Seconds that rank spent on spans of kind."""
        return self.totals.get((rank, kind), 0.0)
