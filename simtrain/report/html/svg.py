"""The drawing vocabulary of report.html: SVG elements as text, the colours of each kind of work, number labels.

Every chart of the page is built from these few functions, so the page is one
style and its text is deterministic: coordinates are written with two decimals,
numbers with simtrain's own formatters (units.py), and nothing depends on the
clock or on the order of a set.

    bar = rect(10, 20, 120.5, 14, KIND_COLOURS["compute"], title="compute 67.7 µs", kind="compute")
    svg = figure(400, 60, [bar, text(10, 12, "rank 0")], label="breakdown")

A rect's `data-*` attributes carry the exact figure it stands for (seconds,
bytes), so a test or a reader can check a bar against report.json.
"""
from html import escape

# The kinds of work of report.json's breakdown_s (report/core.py's Breakdown), in the order bars stack.
# Okabe and Ito's colour-blind safe palette (https://jfly.uni-koeln.de/color/), grey for idle.
KIND_COLOURS = {
    "compute": "#0072B2",
    "communication": "#E69F00",
    "optimizer": "#009E73",
    "sampling": "#CC79A7",
    "bubble": "#D55E00",
    "checkpoint": "#56B4E9",
    "restart": "#882255",
    "idle": "#C8C8C8",
}
# Further series (memory categories, sweep lines): the same palette, then more, in order of first appearance.
SERIES_COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9", "#882255", "#F0E442",
                  "#332288", "#44AA99", "#999933", "#AA4499")
FONT = "font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif"
LABEL_WIDTH_PX = 190  # the left margin that holds a row's name


def number(value: float) -> str:
    """A coordinate: two decimals, no trailing zeros (deterministic and short)."""
    text = f"{value:.2f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def rate_text(value: float) -> str:
    """A rate for reading: whole with thousands separators from 100 up, else three significant digits."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def binary_unit(nbytes: float) -> tuple[str, int]:
    """The largest of B, KiB, MiB, GiB, TiB that `nbytes` holds at least once: the axis counts in it."""
    name, size = "B", 1
    for candidate in ("KiB", "MiB", "GiB", "TiB"):
        if nbytes < size * 1024:
            break
        name, size = candidate, size * 1024
    return name, size


def attributes(**values) -> str:
    """` name="value"` for each value that is not None; `data_x` is written `data-x`, `class_` `class`."""
    return "".join(f' {name.rstrip("_").replace("_", "-")}="{escape(str(value), quote=True)}"'
                   for name, value in values.items() if value is not None)


def rect(x: float, y: float, width: float, height: float, fill: str, title: str | None = None, **data) -> str:
    """A filled rectangle; `title` is its tooltip, `data` its figures (`data-seconds`, ...)."""
    tooltip = f"<title>{escape(title)}</title>" if title else ""
    extra = attributes(**{f"data_{name}": value for name, value in data.items()})
    return (f'<rect x="{number(x)}" y="{number(y)}" width="{number(max(width, 0.0))}" '
            f'height="{number(height)}" fill="{fill}"{extra}>{tooltip}</rect>')


def text(x: float, y: float, content: str, anchor: str = "start", size: int = 12, weight: str = "normal",
         fill: str = "#222", css_class: str | None = None, title: str | None = None) -> str:
    """A label at (x, y), its baseline at y; `title` its tooltip."""
    tooltip = f"<title>{escape(title)}</title>" if title else ""
    return (f'<text x="{number(x)}" y="{number(y)}" text-anchor="{anchor}" font-size="{size}" '
            f'font-weight="{weight}" fill="{fill}"{attributes(class_=css_class)}>{tooltip}{escape(content)}</text>')


def line(x1: float, y1: float, x2: float, y2: float, stroke: str = "#999", width: float = 1.0,
         dash: str | None = None) -> str:
    return (f'<line x1="{number(x1)}" y1="{number(y1)}" x2="{number(x2)}" y2="{number(y2)}" stroke="{stroke}" '
            f'stroke-width="{number(width)}"{attributes(stroke_dasharray=dash)}/>')


def circle(x: float, y: float, radius: float, fill: str, stroke: str = "none", title: str | None = None,
           **data) -> str:
    tooltip = f"<title>{escape(title)}</title>" if title else ""
    extra = attributes(**{f"data_{name}": value for name, value in data.items()})
    return (f'<circle cx="{number(x)}" cy="{number(y)}" r="{number(radius)}" fill="{fill}" stroke="{stroke}"'
            f'{extra}>{tooltip}</circle>')


def polyline(points: list[tuple[float, float]], stroke: str, width: float = 2.0, dash: str | None = None) -> str:
    coordinates = " ".join(f"{number(x)},{number(y)}" for x, y in points)
    return (f'<polyline points="{coordinates}" fill="none" stroke="{stroke}" stroke-width="{number(width)}"'
            f'{attributes(stroke_dasharray=dash)}/>')


def figure(width: float, height: float, elements: list[str], label: str) -> str:
    """An inline <svg> of the given size holding `elements`; `label` names the chart (data-chart, aria-label)."""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{number(width)}" height="{number(height)}" '
            f'viewBox="0 0 {number(width)} {number(height)}" role="img" aria-label="{escape(label)}" '
            f'data-chart="{escape(label)}" style="{FONT}">' + "".join(elements) + "</svg>")


def legend(x: float, y: float, entries: list[tuple[str, str]], max_width: float) -> tuple[list[str], float]:
    """Swatches and names left to right, wrapping at max_width; the elements and the height they take."""
    elements, cursor_x, cursor_y = [], x, y
    for name, colour in entries:
        width = 18 + 7.2 * len(name) + 16
        if cursor_x + width > x + max_width and cursor_x > x:
            cursor_x, cursor_y = x, cursor_y + 18
        elements.append(f'<rect x="{number(cursor_x)}" y="{number(cursor_y)}" width="12" height="12" '
                        f'fill="{colour}" data-legend="{escape(name, quote=True)}"/>')
        elements.append(text(cursor_x + 17, cursor_y + 10.5, name, size=12))
        cursor_x += width
    return elements, cursor_y - y + 18


def nice_ticks(maximum: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least `maximum` (1, 2, 2.5 or 5 times a power of ten apart)."""
    if maximum <= 0:
        return [0.0]
    raw = maximum / count
    power = 10.0 ** _floor_log10(raw)
    step = next(power * m for m in (1, 2, 2.5, 5, 10) if power * m >= raw)
    ticks, value = [], 0.0
    while value < maximum * (1 + 1e-9):
        ticks.append(value)
        value = round(value + step, 12)
    return [*ticks, value] if ticks[-1] < maximum else ticks


def _floor_log10(value: float) -> int:
    exponent = 0
    while value >= 10:
        value /= 10
        exponent += 1
    while value < 1:
        value *= 10
        exponent -= 1
    return exponent


def rank_ranges(ranks: list[int]) -> str:
    """Ranks as short ranges: [0, 1, 2, 3, 8] -> '0-3, 8' (at most eight ranges, then how many more ranks)."""
    ranges, start = [], None
    for index, rank in enumerate(ranks):
        if start is None:
            start = rank
        if index + 1 == len(ranks) or ranks[index + 1] != rank + 1:
            ranges.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    if len(ranges) <= 8:
        return ", ".join(ranges)
    shown = ranges[:8]
    counted = sum(1 + (int(r.split("-")[1]) - int(r.split("-")[0]) if "-" in r else 0) for r in shown)
    return ", ".join(shown) + f", … ({len(ranks) - counted} more)"
