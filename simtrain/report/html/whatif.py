"""report.html for a sweep: the what-if plot, cost against speed, with its Pareto front.

Each point of `simtrain sweep` that ran is a dot: across, what a sample costs,
device-seconds per sample (the run's devices over its throughput); up, its
throughput in samples per simulated second. A point is on the Pareto front
when no other point is at least as cheap and at least as fast, and better in one
of the two: those are ringed, joined by a line and listed in a table with
their grid values. A point that failed or ran out of memory is not drawn; the
page counts them.

    html = whatif_page_body(sweep)       # sweep: inputs.SweepInputs
    front = pareto_front(points)         # points: [(cost, throughput, index)] -> the front's, cheapest first
"""
from html import escape

from ...units import format_seconds
from .svg import FONT, circle, figure, line, nice_ticks, number, polyline, rate_text, text

WIDTH_PX, HEIGHT_PX = 980, 520
LEFT_PX, RIGHT_PX, TOP_PX, BOTTOM_PX = 90, 30, 30, 60
DOT_COLOUR, FRONT_COLOUR = "#0072B2", "#D55E00"
MAX_LABELLED_POINTS = 16  # more points than this are named in their tooltips only


def pareto_front(points: list[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """The points no other beats on both cost (lower) and throughput (higher), cheapest first; of equal points
    the first in sweep order."""
    front, best = [], None
    for cost, throughput, index in sorted(points, key=lambda point: (point[0], -point[1], point[2])):
        if best is None or throughput > best:
            front.append((cost, throughput, index))
            best = throughput
    return front


def _short(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def point_label(row: dict, grid_paths: list[str]) -> str:
    return ", ".join(f"{_short(path)}={_value(row[path])}" for path in grid_paths)


def _value(value) -> str:
    return str(value).replace(" ", "") if isinstance(value, (list, dict)) else str(value)


def whatif_page_body(sweep) -> str:
    rows = {row["index"]: row for row in sweep.rows}
    points = [(devices / rows[index]["throughput_samples_per_s"], rows[index]["throughput_samples_per_s"], index)
              for index, devices in sweep.devices_by_index.items()]
    front = pareto_front(points)
    not_drawn = len(sweep.rows) - len(points)
    counts = f"{len(sweep.rows)} points, {len(points)} drawn, {len(front)} on the Pareto front"
    if not_drawn:
        statuses = sorted({row["status"] for row in sweep.rows if row["index"] not in sweep.devices_by_index})
        counts += f"; {not_drawn} not drawn ({', '.join(statuses)}: see sweep.json's error column)"
    chart = _scatter(points, front, rows, sweep.grid_paths) if points else '<p class="note">No point ran.</p>'
    return ('<section id="whatif"><h2>What-if: cost against throughput</h2>'
            "<p>Each run of the sweep: across, device-seconds per training sample (the run's devices over its "
            "throughput, lower is cheaper); up, samples per simulated second (higher is faster). Ringed points "
            "form the Pareto front: no other point is both as cheap and as fast. "
            f"{escape(counts)}.</p>{chart}{_front_table(front, rows, sweep)}</section>")


def _scatter(points, front, rows, grid_paths) -> str:
    x_ticks = nice_ticks(max(point[0] for point in points))
    y_ticks = nice_ticks(max(point[1] for point in points))
    plot_w, plot_h = WIDTH_PX - LEFT_PX - RIGHT_PX, HEIGHT_PX - TOP_PX - BOTTOM_PX

    def at(cost, throughput):
        return LEFT_PX + plot_w * cost / x_ticks[-1], TOP_PX + plot_h * (1 - throughput / y_ticks[-1])

    elements = []
    for tick in x_ticks:
        x, _ = at(tick, 0)
        elements.append(line(x, TOP_PX, x, TOP_PX + plot_h, stroke="#e3e3e3"))
        elements.append(text(x, TOP_PX + plot_h + 16, format_seconds(tick), anchor="middle", size=11, fill="#555"))
    for tick in y_ticks:
        _, y = at(0, tick)
        elements.append(line(LEFT_PX, y, LEFT_PX + plot_w, y, stroke="#e3e3e3"))
        elements.append(text(LEFT_PX - 6, y + 4, rate_text(tick), anchor="end", size=11, fill="#555"))
    elements.append(line(LEFT_PX, TOP_PX, LEFT_PX, TOP_PX + plot_h, stroke="#777"))
    elements.append(line(LEFT_PX, TOP_PX + plot_h, LEFT_PX + plot_w, TOP_PX + plot_h, stroke="#777"))
    elements.append(text(LEFT_PX + plot_w / 2, HEIGHT_PX - 14, "cost: device-seconds per sample (lower is cheaper)",
                         anchor="middle", size=13))
    elements.append(f'<text x="16" y="{number(TOP_PX + plot_h / 2)}" text-anchor="middle" font-size="13" '
                    f'transform="rotate(-90 16 {number(TOP_PX + plot_h / 2)})">throughput: samples/s '
                    "(higher is faster)</text>")
    elements.append(polyline([at(cost, throughput) for cost, throughput, _ in front], FRONT_COLOUR, width=1.5,
                             dash="5,3"))
    on_front = {index for _, _, index in front}
    for cost, throughput, index in sorted(points, key=lambda point: point[2]):
        x, y = at(cost, throughput)
        label = point_label(rows[index], grid_paths)
        title = (f"#{index} {label}: {rate_text(throughput)} samples/s, {format_seconds(cost)} device-seconds per "
                 f"sample, step {format_seconds(rows[index]['step_time_s'])}")
        elements.append(circle(x, y, 5, DOT_COLOUR, title=title, index=index, cost_s=repr(cost),
                               throughput=repr(throughput), front="true" if index in on_front else "false"))
    for cost, throughput, index in front:
        elements.append(circle(*at(cost, throughput), 9, "none", stroke=FRONT_COLOUR))
    if len(points) <= MAX_LABELLED_POINTS:
        # On a white halo. A front point's label goes above and to its left, where no point is (none is cheaper
        # and faster); another's below, to the right (in the plot's right half, to the left).
        for cost, throughput, index in sorted(points, key=lambda point: point[2]):
            x, y = at(cost, throughput)
            label = point_label(rows[index], grid_paths) or f"#{index}"
            if index in on_front:
                left = x - 12 - 6.2 * len(label) > 0
                elements.append(text(x - 10 if left else x + 10, y - 12, label, size=11,
                                     anchor="end" if left else "start", fill=FRONT_COLOUR, css_class="point-label"))
            else:
                right_half = x > LEFT_PX + plot_w / 2
                elements.append(text(x - 10 if right_half else x + 10, y + 19, label, size=11,
                                     anchor="end" if right_half else "start", fill="#555", css_class="point-label"))
    return figure(WIDTH_PX, HEIGHT_PX, elements, "what-if")


def _front_table(front, rows, sweep) -> str:
    if not front:
        return ""
    head = "".join(f"<th>{escape(path)}</th>" for path in sweep.grid_paths)
    body = []
    for cost, throughput, index in front:
        row = rows[index]
        cells = "".join(f"<td>{escape(_value(row[path]))}</td>" for path in sweep.grid_paths)
        body.append(f"<tr><td>{index}</td>{cells}<td>{sweep.devices_by_index[index]}</td>"
                    f"<td>{escape(format_seconds(row['step_time_s']))}</td><td>{rate_text(throughput)}</td>"
                    f"<td>{escape(format_seconds(cost))}</td></tr>")
    return (f'<table class="front" style="{FONT}"><caption>The Pareto front, cheapest first</caption><tr><th>#</th>'
            f"{head}<th>devices</th><th>step time</th><th>samples/s</th><th>device-s per sample</th></tr>"
            + "".join(body) + "</table>")
