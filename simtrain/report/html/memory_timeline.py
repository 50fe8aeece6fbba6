"""report.html's memory over the first step: each rank's bytes by category, stacked, as trace.json's counters hold them.

A run that records its spans (report.trace) keeps every change of a device's
memory (hw/device.py's MemoryLedger.changes), written to trace.json as one
counter per rank, "memory rank N", its bytes by category after each moment
its memory changed (report/trace.py). The chart draws those counters from 0
to the end of the first step, categories stacked in the order they first held
bytes, one small chart per rank that ran (at most `MAX_RANKS`, the first in
rank order; mirrored ranks ran no program and have no counter). Each chart's
`data-peak-bytes` is the largest total it draws. More than `MAX_POINTS`
changes in the window are cut into that many equal slices of time, each drawn
at the moment its total was highest, so a peak is never smoothed away.

    html = memory_over_step(trace, end_s=2.4e-3)      # "" when trace.json has no memory counters
"""
from html import escape

from ...units import format_bytes, format_seconds
from .svg import LABEL_WIDTH_PX, SERIES_COLOURS, binary_unit, figure, legend, line, nice_ticks, number, text

MAX_RANKS = 8
MAX_POINTS = 400
CHART_WIDTH_PX = 980
PLOT_HEIGHT_PX = 90
PITCH_PX = 112


def memory_counters(trace: dict) -> dict[int, list[tuple[float, dict[str, int]]]]:
    """Rank -> [(seconds, bytes by category), ...] in time order, from trace.json's "memory rank N" counters."""
    counters: dict[int, list] = {}
    for event in trace["traceEvents"]:
        if event.get("ph") == "C" and str(event.get("name", "")).startswith("memory rank "):
            counters.setdefault(int(event["name"].removeprefix("memory rank ")), []).append(
                (event["ts"] * 1e-6, {name: int(nbytes) for name, nbytes in event["args"].items()}))
    return {rank: sorted(samples, key=lambda sample: sample[0]) for rank, samples in sorted(counters.items())}


def memory_over_step(trace: dict | None, end_s: float) -> str:
    """The charts (an SVG), or "" when there is no trace, no counter or no time to draw."""
    counters = memory_counters(trace) if trace is not None else {}
    if not counters or end_s <= 0:
        return ""
    ranks = list(counters)[:MAX_RANKS]
    windows = {rank: _window(counters[rank], end_s) for rank in ranks}
    categories = list(dict.fromkeys(name for samples in windows.values() for _, held in samples
                                    for name, nbytes in held.items() if nbytes))
    colours = {name: SERIES_COLOURS[index % len(SERIES_COLOURS)] for index, name in enumerate(categories)}
    top_bytes = max((sum(held.values()) for samples in windows.values() for _, held in samples), default=0)
    unit_name, unit_bytes = binary_unit(top_bytes)
    plot_left, plot_width = LABEL_WIDTH_PX, CHART_WIDTH_PX - LABEL_WIDTH_PX - 20
    elements, legend_height = legend(plot_left, 6, [(name, colours[name]) for name in categories], plot_width)
    top = 6 + legend_height + 22
    ticks = [tick for tick in nice_ticks(end_s, 8) if tick <= end_s * (1 + 1e-9)]
    bottom = top + PITCH_PX * len(ranks)
    for tick in ticks:
        x = plot_left + plot_width * tick / end_s
        elements.append(line(x, top - 6, x, bottom - (PITCH_PX - PLOT_HEIGHT_PX), stroke="#e3e3e3"))
        elements.append(text(x, top - 9, format_seconds(tick), anchor="middle", size=11, fill="#555"))
    scale = max(top_bytes, 1)
    for index, rank in enumerate(ranks):
        base = top + PITCH_PX * index + PLOT_HEIGHT_PX
        samples = windows[rank]
        peak = max((sum(held.values()) for _, held in samples), default=0)
        elements.append(text(plot_left - 8, base - PLOT_HEIGHT_PX / 2, f"rank {rank}", anchor="end",
                             css_class="row-label"))
        elements.append(text(plot_left - 8, base - PLOT_HEIGHT_PX / 2 + 15, f"peak {format_bytes(peak)}",
                             anchor="end", size=11, fill="#555"))
        parts = [f'<g data-memory-rank="{rank}" data-peak-bytes="{peak}">']
        parts.extend(_areas(samples, categories, colours, end_s, scale, plot_left, plot_width, base))
        parts.append("</g>")
        elements.append("".join(parts))
        elements.append(line(plot_left, base, plot_left + plot_width, base, stroke="#777"))
        for fraction in (0.5, 1.0):
            y = base - PLOT_HEIGHT_PX * fraction
            elements.append(text(plot_left + plot_width + 4, y + 4, f"{scale * fraction / unit_bytes:.3g} {unit_name}",
                                 size=10, fill="#777"))
    return figure(CHART_WIDTH_PX + 50, bottom - (PITCH_PX - PLOT_HEIGHT_PX) + 8, elements, "memory over the step")


def _window(samples: list[tuple[float, dict[str, int]]], end_s: float) -> list[tuple[float, dict[str, int]]]:
    """The samples before end_s, at most MAX_POINTS of them."""
    inside = [sample for sample in samples if sample[0] < end_s]
    if len(inside) <= MAX_POINTS:
        return inside
    slices: dict[int, tuple[float, dict[str, int]]] = {}
    for time, held in inside:
        index = min(int(time / end_s * MAX_POINTS), MAX_POINTS - 1)
        if index not in slices or sum(held.values()) > sum(slices[index][1].values()):
            slices[index] = (time, held)
    return [slices[index] for index in sorted(slices)]


def _areas(samples, categories, colours, end_s, scale, left, width, base) -> list[str]:
    """One polygon per category: a step function of its bytes stacked on the categories before it."""
    if not samples:
        return []
    times = [time for time, _ in samples] + [end_s]
    polygons = []
    below = [0] * len(samples)
    for name in categories:
        above = [low + held.get(name, 0) for low, (_, held) in zip(below, samples)]
        upper, lower = [], []
        for index, (low, high) in enumerate(zip(below, above)):
            x0 = left + width * times[index] / end_s
            x1 = left + width * times[index + 1] / end_s
            upper += [(x0, base - PLOT_HEIGHT_PX * high / scale), (x1, base - PLOT_HEIGHT_PX * high / scale)]
            lower += [(x0, base - PLOT_HEIGHT_PX * low / scale), (x1, base - PLOT_HEIGHT_PX * low / scale)]
        points = " ".join(f"{number(x)},{number(y)}" for x, y in upper + lower[::-1])
        polygons.append(f'<polygon points="{points}" fill="{colours[name]}" data-category="{escape(name)}">'
                        f"<title>{escape(name)}</title></polygon>")
        below = above
    return polygons
