"""report.html's memory chart: each rank's peak, by category, against its capacity.

report.json holds, per device, the bytes of each category (weights,
gradients, optimizer state, activations, communication buffers...) at the
moment its total peaked, not a timeline over the step: the page says so and
draws what there is, one stacked bar per row of ranks.py. The device's
capacity is a dashed line where it falls within the axis (a run near its
limit); the label gives the peak and its share of the capacity.

    html = memory_section(report, rank_rows(report))
"""
from html import escape

from ...units import format_bytes
from .bars import Bar, Segment, stacked_bars
from .ranks import RankRow
from .svg import SERIES_COLOURS

NEAR_CAPACITY = 0.5  # the axis reaches the capacity when a peak holds at least this share of it


def memory_section(report: dict, rows: list[RankRow]) -> str:
    """The section; `rows`: ranks.py's rank_rows(report)."""
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
    return ('<section id="memory"><h2>Memory by category at the peak</h2>'
            "<p>report.json holds each device's bytes by category at the moment its total peaked "
            "(<code>devices[].peak_memory_bytes_by_category</code>), not a timeline over the step: the bars are "
            "those peaks. <code>simtrain memory</code> replays a step's memory plan.</p>"
            f"{status}{chart}</section>")


def binary_unit(nbytes: float) -> tuple[str, int]:
    """The largest of B, KiB, MiB, GiB, TiB that `nbytes` holds at least once: the axis counts in it."""
    name, size = "B", 1
    for candidate in ("KiB", "MiB", "GiB", "TiB"):
        if nbytes < size * 1024:
            break
        name, size = candidate, size * 1024
    return name, size


def _share(peak: float, capacity: float) -> str:
    share = peak / capacity if capacity else 0.0
    return f"{share:.1%}" if share >= 0.001 else "<0.1%"
