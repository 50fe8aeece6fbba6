"""Horizontal stacked bars with an axis: the shape of report.html's breakdown, memory and link charts.

A bar is a row's label on the left, its segments left to right (each a width
proportional to its value on one scale for the whole chart), and a label on
the right; a grid line and a tick label at each round value of the axis.

    bars = [Bar("rank 0", [Segment("compute", 6.7e-5, "#0072B2", "compute 67 µs", {"seconds": 6.7e-5})], "186 µs")]
    svg = stacked_bars(bars, scale_max=2e-4, tick_label=format_seconds, label="breakdown", legend_entries=[...])

A segment of value 0 is not drawn. A `marker` (a device's capacity) is a
dashed vertical line across its row.
"""
from dataclasses import dataclass, field
from html import escape

from .svg import LABEL_WIDTH_PX, figure, legend, line, nice_ticks, rect, text

CHART_WIDTH_PX = 980
BAR_HEIGHT_PX = 16
ROW_PITCH_PX = 24
RIGHT_LABEL_PX = 200


@dataclass(frozen=True)
class Segment:
    name: str  # the kind or category: data-kind of its rect
    value: float  # in the chart's unit
    colour: str
    title: str  # the tooltip
    data: dict = field(default_factory=dict)  # data-* attributes: the exact figures


@dataclass(frozen=True)
class Bar:
    label: str
    segments: list[Segment]
    right_label: str
    marker: float | None = None  # a value to mark across the row (a capacity)
    tooltip: str | None = None  # the label's tooltip (every rank of a folded row)


def stacked_bars(bars: list[Bar], scale_max: float, tick_label, label: str,
                 legend_entries: list[tuple[str, str]]) -> str:
    """The chart as an <svg>: one row per bar, an axis from 0 to at least scale_max."""
    ticks = nice_ticks(scale_max)
    axis_max = ticks[-1] if ticks[-1] > 0 else 1.0
    plot_left = LABEL_WIDTH_PX
    plot_width = CHART_WIDTH_PX - LABEL_WIDTH_PX - RIGHT_LABEL_PX
    legend_elements, legend_height = legend(plot_left, 6, legend_entries, plot_width + RIGHT_LABEL_PX)
    top = 6 + legend_height + 22
    elements = list(legend_elements)
    bottom = top + ROW_PITCH_PX * len(bars)
    for tick in ticks:
        x = plot_left + plot_width * tick / axis_max
        elements.append(line(x, top - 6, x, bottom, stroke="#e3e3e3"))
        elements.append(text(x, top - 9, tick_label(tick), anchor="middle", size=11, fill="#555"))
    for index, bar in enumerate(bars):
        y = top + ROW_PITCH_PX * index + (ROW_PITCH_PX - BAR_HEIGHT_PX) / 2
        elements.append(text(plot_left - 8, y + BAR_HEIGHT_PX - 3.5, _clipped(bar.label), anchor="end",
                             css_class="row-label", title=bar.tooltip or bar.label))
        cursor = 0.0
        parts = [f'<g data-row="{index}" data-label="{escape(bar.label, quote=True)}">']
        for segment in bar.segments:
            if segment.value <= 0:
                continue
            x = plot_left + plot_width * cursor / axis_max
            width = plot_width * segment.value / axis_max
            parts.append(rect(x, y, width, BAR_HEIGHT_PX, segment.colour, title=segment.title, kind=segment.name,
                              **segment.data))
            cursor += segment.value
        parts.append("</g>")
        elements.append("".join(parts))
        if bar.marker is not None and bar.marker <= axis_max:
            x = plot_left + plot_width * bar.marker / axis_max
            elements.append(line(x, y - 3, x, y + BAR_HEIGHT_PX + 3, stroke="#222", width=1.5, dash="3,2"))
        end = plot_left + plot_width * cursor / axis_max
        elements.append(text(end + 6, y + BAR_HEIGHT_PX - 3.5, bar.right_label, size=11, fill="#333",
                             css_class="bar-value"))
    elements.append(line(plot_left, top - 6, plot_left, bottom, stroke="#777"))
    return figure(CHART_WIDTH_PX, bottom + 8, elements, label)


def _clipped(label: str, most: int = 28) -> str:
    return label if len(label) <= most else label[:most - 1] + "…"

