"""report.html's memory section: each rank's memory by category over the first step, and its peak against its capacity.

Over the step: trace.json's memory counters (memory_timeline.py), when the
run wrote a trace. The peaks: report.json holds, per device, the bytes of
each category (weights, gradients, optimizer state, activations,
communication buffers...) at the moment its total peaked, one stacked bar per
row of ranks.py. The device's capacity is a dashed line where it falls within
the axis (a run near its limit); the label gives the peak and its share of
the capacity.

    html = memory_section(report, rank_rows(report), trace, end_s)
"""
from html import escape

from ...units import format_bytes, format_seconds
from .bars import Bar, Segment, stacked_bars
from .memory_timeline import memory_over_step
from .ranks import RankRow
from .svg import SERIES_COLOURS, binary_unit

NEAR_CAPACITY = 0.5  # the axis reaches the capacity when a peak holds at least this share of it


def memory_section(report: dict, rows: list[RankRow], trace: dict | None, end_s: float) -> str:
    """The section; `rows`: ranks.py's rank_rows(report); `trace`: trace.json's object or None; `end_s`: the end
    of the first step."""
    categories = list(dict.fromkeys(name for row in rows for name, nbytes in row.memory_by_category.items()
                                    if nbytes))
    colours = {name: SERIES_COLOURS[index % len(SERIES_COLOURS)] for index, name in enumerate(categories)}
    peak = max((row.peak_memory_bytes for row in rows), default=0.0)
    near = [row.capacity_bytes for row in rows if row.peak_memory_bytes >= NEAR_CAPACITY * row.capacity_bytes]
    scale = max([peak, *near])
    unit_name, unit_bytes = binary_unit(scale)
    bars = [Bar(row.label,
                [Segment(name, row.memory_by_category.get(name, 0) / unit_bytes, colours[name],
                         f"{row.ranks_text}: {name} {format_bytes(int(row.memory_by_category.get(name, 0)))}",
                         {"bytes": repr(row.memory_by_category.get(name, 0))}) for name in categories],
                f"{format_bytes(int(row.peak_memory_bytes))} of {format_bytes(int(row.capacity_bytes))} "
                f"({_share(row.peak_memory_bytes, row.capacity_bytes)})",
                marker=row.capacity_bytes / unit_bytes if near else None, tooltip=row.ranks_text)
            for row in rows]
    chart = stacked_bars(bars, scale / unit_bytes, lambda value: f"{value:g} {unit_name}", "memory by category",
                         [(name, colours[name]) for name in categories]
                         + ([("capacity (dashed)", "#222")] if near else []))
    status = ""
    if report["status"] == "out_of_memory" and isinstance(report.get("out_of_memory"), dict):
        status = f'<p class="warn">{escape(str(report["out_of_memory"].get("message", "out of memory")))}</p>'
    over_step = memory_over_step(trace, end_s)
    if over_step:
        timeline = (f"<p>Each rank's bytes by category from 0 to {escape(format_seconds(end_s))}, the end of the "
                    "first step, as trace.json's memory counters hold them.</p>" + over_step)
    elif trace is None:
        timeline = ('<p class="note">This run wrote no trace.json: run it again with '
                    "<code>--set report.trace=true</code> for memory over the step.</p>")
    else:
        timeline = ('<p class="note">This run\'s trace.json holds no memory counters in its first step (a trace '
                    "written before simtrain recorded them, or no time passed): only the peaks are drawn.</p>")
    return ('<section id="memory"><h2>Memory by category</h2><h3>Over the first step</h3>'
            f"{timeline}<h3>At the peak</h3>"
            "<p>Each device's bytes by category at the moment its total peaked over the run "
            "(<code>devices[].peak_memory_bytes_by_category</code>). <code>simtrain memory</code> replays a step's "
            f"memory plan.</p>{status}{chart}</section>")


def _share(peak: float, capacity: float) -> str:
    share = peak / capacity if capacity else 0.0
    return f"{share:.1%}" if share >= 0.001 else "<0.1%"
