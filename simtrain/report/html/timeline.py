"""report.html's timeline of the first step: what each rank did when, from the run's trace.json.

trace.json (report/trace.py) has a track per rank, its spans by kind (compute,
communication, optimizer, bubble, idle...), and a second track for the
communication stream of a rank whose transfers overlap its work. The chart
draws the first step, from 0 to the end of the first step in report.json's
`loss_curve` (async: `step_time_s`), a row per track that has spans of its
own, at most `MAX_TRACKS`: in a pipeline each stage's forwards (light) and
backwards (dark), its sends and receives and its bubble. Under
`parallel.representatives` the mirrored ranks ran no program of their own and
have no row. Spans of one kind that touch are drawn as one rectangle.

Without trace.json (report.trace: false) the section says how to get one and
gives report.json's pipeline figures (schedule, microbatches, bubble).

    html = timeline_section(report, trace)      # trace: trace.json's object, or None
"""
from html import escape

from ...units import format_seconds
from .svg import KIND_COLOURS, LABEL_WIDTH_PX, figure, legend, line, nice_ticks, rect, text

MAX_TRACKS = 64
CHART_WIDTH_PX = 980
TRACK_HEIGHT_PX = 18
TRACK_PITCH_PX = 24
FORWARD_COLOUR = "#7FB8DE"  # a lighter compute blue: forwards beside backwards


def step_window_s(report: dict) -> float:
    """The end of the first step: the first point of the loss curve (async: step_time_s; else the run)."""
    if report["scheme"] != "async" and report["loss_curve"]:
        return report["loss_curve"][0][0]
    return report["step_time_s"] or report["sim_time_s"]


def timeline_section(report: dict, trace: dict | None) -> str:
    parallel = report.get("parallel") or {}
    pipeline = _pipeline_line(parallel)
    title = "Pipeline timeline of the first step" if parallel.get("pp", 1) > 1 else "Timeline of the first step"
    if trace is None:
        return (f'<section id="timeline"><h2>{title}</h2><p class="note">This run wrote no trace.json: run it '
                "again with <code>--set report.trace=true</code> for a timeline per rank.</p>"
                f"<p>{escape(pipeline)}</p></section>")
    end_s = step_window_s(report)
    if end_s <= 0:
        return (f'<section id="timeline"><h2>{title}</h2><p class="note">No simulated time passed: there is no '
                f"step to draw.</p></section>")
    tracks, skipped = _tracks(trace, end_s)
    shown = tracks[:MAX_TRACKS]
    chart = _chart(shown, end_s) if shown else '<p class="note">No span in the first step.</p>'
    notes = []
    if skipped and parallel.get("representatives"):
        notes.append(f"{skipped} ranks ran no program of their own (their representative's figures stand for them)")
    elif skipped:
        notes.append(f"{skipped} tracks with no work in the first step are left out")
    if len(tracks) > len(shown):
        notes.append(f"the first {len(shown)} of {len(tracks)} tracks are drawn")
    note = "".join(f'<p class="note">{escape(sentence)}.</p>' for sentence in notes)
    return (f'<section id="timeline"><h2>{title}</h2><p>From 0 to {escape(format_seconds(end_s))}, the end of the '
            f"first step, as trace.json (open it in ui.perfetto.dev for every step) records it. "
            f"{escape(pipeline)}</p>{note}{chart}</section>")


def _pipeline_line(parallel: dict) -> str:
    if parallel.get("pp", 1) <= 1:
        return ""
    parts = [f"{parallel['pp']} stages", f"schedule {parallel.get('schedule')}",
             f"{parallel.get('microbatches')} microbatches"]
    if (parallel.get("virtual_stages") or 1) > 1:
        parts.append(f"{parallel['virtual_stages']} virtual stages")
    if parallel.get("bubble_fraction") is not None:
        parts.append(f"bubble {parallel['bubble_fraction']:.1%} of the ranks' time")
    return "Pipeline: " + ", ".join(parts) + "."


def _tracks(trace: dict, end_s: float) -> tuple[list[tuple[str, list]], int]:
    """[(track name, [(kind, name, start_s, end_s), ...] merged)] of the jobs' tracks with work before end_s,
    in trace order; and how many tracks had none (mirrored ranks)."""
    events = trace["traceEvents"]
    job_pids = {event["pid"] for event in events if event.get("ph") == "M" and event.get("name") == "process_name"
                and str(event["args"]["name"]).startswith("job ")}
    names, spans = {}, {}
    for event in events:
        if event.get("pid") not in job_pids:
            continue
        key = (event["pid"], event.get("tid"))
        if event.get("ph") == "M" and event.get("name") == "thread_name":
            names[key] = event["args"]["name"]
        elif event.get("ph") == "X":
            start_s = event["ts"] * 1e-6
            if start_s < end_s and event["dur"] > 0:  # a span of no time has nothing to draw
                spans.setdefault(key, []).append((_kind(event), event["name"], start_s,
                                                  min(end_s, start_s + event["dur"] * 1e-6)))
    tracks, skipped = [], 0
    for key in names:
        work = [span for span in spans.get(key, []) if span[0] != "idle"]
        if not work:
            skipped += 1
            continue
        tracks.append((names[key], _merged(sorted(spans[key], key=lambda span: (span[2], span[3])))))
    return tracks, skipped


def _kind(event: dict) -> str:
    """The span's colour key: its category, forward compute apart from the rest."""
    if event["cat"] == "compute" and event["name"].startswith("forward"):
        return "forward"
    return event["cat"]


def _merged(spans: list) -> list:
    merged = []
    for kind, name, start, end in spans:
        if merged and merged[-1][0] == kind and abs(merged[-1][3] - start) <= 1e-12 * max(1.0, end):
            previous = merged[-1]
            merged[-1] = (kind, previous[1] if previous[1] == name else kind, previous[2], end)
        else:
            merged.append((kind, name, start, end))
    return merged


def _colour(kind: str) -> str:
    return FORWARD_COLOUR if kind == "forward" else KIND_COLOURS.get(kind, "#888")


def _chart(tracks: list, end_s: float) -> str:
    kinds = list(dict.fromkeys(kind for _, spans in tracks for kind, *_ in spans if kind != "idle"))
    order = ["forward", "compute", *[kind for kind in KIND_COLOURS if kind != "compute"]]
    kinds = sorted(kinds, key=lambda kind: order.index(kind) if kind in order else len(order))
    names = {"forward": "compute: forward", "compute": "compute: backward and other"}
    plot_left, plot_width = LABEL_WIDTH_PX, CHART_WIDTH_PX - LABEL_WIDTH_PX - 20
    elements, legend_height = legend(plot_left, 6, [(names.get(kind, kind), _colour(kind)) for kind in kinds],
                                     plot_width)
    top = 6 + legend_height + 22
    bottom = top + TRACK_PITCH_PX * len(tracks)
    ticks = [tick for tick in nice_ticks(end_s, 8) if tick <= end_s * (1 + 1e-9)]
    for tick in ticks:
        x = plot_left + plot_width * tick / end_s
        elements.append(line(x, top - 6, x, bottom, stroke="#e3e3e3"))
        elements.append(text(x, top - 9, format_seconds(tick), anchor="middle", size=11, fill="#555"))
    for index, (name, spans) in enumerate(tracks):
        y = top + TRACK_PITCH_PX * index + (TRACK_PITCH_PX - TRACK_HEIGHT_PX) / 2
        elements.append(text(plot_left - 8, y + TRACK_HEIGHT_PX - 4.5, name, anchor="end", css_class="row-label"))
        parts = [f'<g data-track="{escape(name, quote=True)}">']
        for kind, label, start, stop in spans:
            if kind == "idle":
                continue
            parts.append(rect(plot_left + plot_width * start / end_s, y, plot_width * (stop - start) / end_s,
                              TRACK_HEIGHT_PX, _colour(kind),
                              title=f"{label}: {format_seconds(start)} to {format_seconds(stop)}",
                              kind=kind, start_s=repr(start), end_s=repr(stop)))
        parts.append("</g>")
        elements.append("".join(parts))
    elements.append(line(plot_left, top - 6, plot_left, bottom, stroke="#777"))
    return figure(CHART_WIDTH_PX, bottom + 8, elements, "timeline")
