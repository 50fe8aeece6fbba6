"""report.html's step breakdown: where each rank's step went, from report.json's devices.

One bar per row of ranks.py (a rank, or a representative and the ranks it
stands for): compute, exposed communication, optimizer, sampling, pipeline
bubble, checkpoint and restart (a run with faults), idle, each the device's
`breakdown_s` over the run divided by `steps`, as report.json's top-level
`breakdown_s` averages them. The bar's length is the step; the label at its
end is its total.

    html = breakdown_section(report, rank_rows(report))   # a <section>: a heading, a sentence and the chart
"""
from html import escape

from ...units import format_seconds
from .bars import Bar, Segment, stacked_bars
from .ranks import RankRow
from .svg import KIND_COLOURS


def breakdown_section(report: dict, rows: list[RankRow]) -> str:
    """The section; `rows`: ranks.py's rank_rows(report)."""
    kinds = [kind for kind in KIND_COLOURS if any(row.breakdown_s.get(kind) for row in rows)]
    bars = [Bar(row.label, [Segment(kind, row.breakdown_s.get(kind) or 0.0, KIND_COLOURS[kind],
                                    f"{row.ranks_text}: {kind} {format_seconds(row.breakdown_s.get(kind) or 0.0)}",
                                    {"seconds": repr(row.breakdown_s.get(kind) or 0.0)})
                            for kind in kinds],
                f"{format_seconds(row.step_total_s)}", tooltip=row.ranks_text) for row in rows]
    scale = max((row.step_total_s for row in rows), default=0.0)
    chart = (stacked_bars(bars, scale, format_seconds, "step breakdown", [(kind, KIND_COLOURS[kind]) for kind in kinds])
             if scale > 0 else '<p class="note">No simulated time passed: there is nothing to draw.</p>')
    per = "per step" if report["steps"] else "over the run (no step ended)"
    folded = sum(len(row.ranks) for row in rows if len(row.ranks) > 1 and not row.mean)
    notes = []
    if (report.get("parallel") or {}).get("representatives"):
        notes.append("one representative per pipeline stage was simulated for the ranks that mirror it "
                     "(parallel.representatives): a row is a representative and the ranks it stands for")
    elif folded:
        shared = sum(1 for row in rows if len(row.ranks) > 1)
        notes.append(f"ranks whose figures are equal share a row ({folded} ranks in {shared} rows)")
    if any(row.mean for row in rows):
        notes.append(f"more than {len(rows)} different ranks: each row is the mean of consecutive ranks")
    note = "".join(f"<p class=\"note\">{escape(text)}.</p>" for text in notes)
    return (f'<section id="breakdown"><h2>Step breakdown per rank</h2>'
            f"<p>Seconds {per} of each kind of work on every rank of the job (report.json's "
            f"<code>devices[].breakdown_s</code> over <code>steps</code>); communication counts only what no other "
            f"work of the device hid. Mean over the job: {_mean_line(report)}.</p>{note}{chart}</section>")


def _mean_line(report: dict) -> str:
    breakdown = report["breakdown_s"]
    return escape(", ".join(f"{kind} {format_seconds(seconds)}" for kind, seconds in breakdown.items()
                            if seconds) or "none")
