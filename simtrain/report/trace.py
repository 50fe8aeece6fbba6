"""The Chrome trace of a run (chrome://tracing, Perfetto): a view of the event log and the network's records.

A process per job with a track per device (idle gaps shown; a rank whose
communication overlaps its work gets a second track for its communication
stream) and a counter per device of its memory by category over the run, and
a process of links with a track per busy link.

    trace = build_trace(cluster)
    Path("trace.json").write_text(json.dumps(trace))
"""
from ..hw.cluster import Cluster
from ..hw.eventlog import Span, exposed


def build_trace(cluster: Cluster) -> dict:
    """Chrome trace event format: a process per job with a track per device (with idle gaps),
    and a process of links with a track per busy link."""
    links_pid = len(cluster.jobs)
    events = [_meta(index, None, "process_name", f"job {name}") for index, (name, _) in enumerate(cluster.jobs)]
    events.append(_meta(links_pid, None, "process_name", "links"))
    spans_by_rank: dict[int, list] = {device.rank: [] for device in cluster.devices}
    for span in cluster.log.spans:
        spans_by_rank[span.rank].append(span)
    for index, (_, ranks) in enumerate(cluster.jobs):
        for rank in ranks:
            device = cluster.devices[rank]
            events.append(_meta(index, rank, "thread_name", f"rank {rank} ({device.node})"))
            spans = sorted(spans_by_rank[rank], key=lambda s: (s.start, s.end))
            if cluster.log.overlaps(rank):
                # Its communication stream gets a track of its own; the device's track shows the exposed part.
                stream = len(cluster.devices) + rank
                events.append(_meta(index, stream, "thread_name", f"rank {rank} communication stream"))
                events.extend(_span(index, stream, span.name, span.kind, span.start, span.end, {"bytes": span.nbytes})
                              for span in spans if span.kind == "communication")
                others = [span for span in spans if span.kind != "communication"]
                parts = exposed([(s.start, s.end) for s in spans if s.kind == "communication"],
                                [(s.start, s.end) for s in others])
                spans = sorted(others + [Span(index, rank, "communication", "exposed communication", start, end, 0, 0)
                                         for start, end in parts], key=lambda s: (s.start, s.end))
            cursor = 0.0
            for span in spans:
                if span.start > cursor:
                    events.append(_span(index, rank, "idle", "idle", cursor, span.start, {}))
                args = {"bytes": span.nbytes} if span.nbytes else {}
                if span.flops:
                    args["flops"] = span.flops
                events.append(_span(index, rank, span.name, span.kind, span.start, span.end, args))
                cursor = max(cursor, span.end)
            if cluster.log.last_end_s > cursor:
                events.append(_span(index, rank, "idle", "idle", cursor, cluster.log.last_end_s, {}))
            events.extend(_memory_counters(index, rank, device.memory.changes or ()))
    for tid, (link, intervals) in enumerate(_link_busy_intervals(cluster).items()):
        events.append(_meta(links_pid, tid, "thread_name", f"{link[0]} -> {link[1]}"))
        for start, end, nbytes, flows in intervals:
            events.append(_span(links_pid, tid, "busy", "link", start, end, {"bytes": nbytes, "transfers": flows}))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _memory_counters(pid: int, rank: int, changes: list[tuple[float, str, int]]) -> list[dict]:
    """Counter events "memory rank N": the rank's bytes by category after each moment its memory changed (of
    several changes at one moment, the state after the last)."""
    held: dict[str, int] = {}
    events = []
    for index, (time, category, nbytes) in enumerate(changes):
        held[category] = nbytes
        if index + 1 == len(changes) or changes[index + 1][0] != time:
            events.append({"ph": "C", "pid": pid, "name": f"memory rank {rank}", "ts": time * 1e6,
                           "args": dict(held)})
    return events


def _link_busy_intervals(cluster: Cluster) -> dict[tuple[str, str], list]:
    """Per directed link: merged intervals during which transfers crossed it."""
    crossing: dict[tuple[str, str], list] = {}
    for record in cluster.network.records:
        path = record.path
        for hop in zip(path, path[1:]):
            crossing.setdefault(hop, []).append((record.start, record.end, record.nbytes))
    merged = {}
    for link in sorted(crossing):
        intervals = []
        for start, end, nbytes in sorted(crossing[link]):
            if intervals and start <= intervals[-1][1]:
                last = intervals[-1]
                intervals[-1] = (last[0], max(last[1], end), last[2] + nbytes, last[3] + 1)
            else:
                intervals.append((start, end, nbytes, 1))
        merged[link] = intervals
    return merged


def _meta(pid: int, tid, name: str, value: str) -> dict:
    event = {"ph": "M", "pid": pid, "name": name, "args": {"name": value}}
    if tid is not None:
        event["tid"] = tid
    return event


def _span(pid: int, tid: int, name: str, cat: str, start: float, end: float, args: dict) -> dict:
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "cat": cat,
            "ts": start * 1e6, "dur": (end - start) * 1e6, "args": args}
