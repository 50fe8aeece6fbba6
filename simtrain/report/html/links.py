"""report.html's link utilisation: how long each directed link carried bytes, from report.json's links.

A link's utilisation is `busy_s / sim_time_s` (report/build.py): the share of
the run during which at least one transfer crossed it. One bar per link, the
busiest first (ties in report.json's order), at most `MAX_LINKS`; the label
gives the share and the bytes. A sentence counts the links that carried nothing
and, past `MAX_LINKS`, how busy the links not drawn were at most.

    html = links_section(report)
"""
from html import escape

from ...units import format_bytes
from .bars import Bar, Segment, stacked_bars
from .svg import KIND_COLOURS

MAX_LINKS = 40


def links_section(report: dict) -> str:
    links = report["links"]
    busy = sorted((link for link in links if link["bytes"] or link["busy_s"]),
                  key=lambda link: -link["utilization"])  # sorted() is stable: ties keep report.json's order
    idle = len(links) - len(busy)
    shown = busy[:MAX_LINKS]
    bars = [Bar(f"{link['src']} → {link['dst']}",
                [Segment("busy", 100 * link["utilization"], KIND_COLOURS["communication"],
                         f"{link['src']} → {link['dst']}: busy {100 * link['utilization']:.2f}% of the run, "
                         f"{format_bytes(link['bytes'])}",
                         {"utilization": repr(link["utilization"]), "bytes": link["bytes"]})],
                f"{100 * link['utilization']:.1f}% · {format_bytes(link['bytes'])}") for link in shown]
    sentences = [f"{len(links)} directed links, {len(busy)} carried bytes"]
    if idle:
        sentences.append(f"{idle} carried none")
    if len(busy) > len(shown):
        rest = busy[len(shown)]["utilization"]
        sentences.append(f"the {len(shown)} busiest are drawn; the other {len(busy) - len(shown)} were busy "
                         f"{100 * rest:.1f}% of the run or less")
    chart = (stacked_bars(bars, max((100 * link["utilization"] for link in shown), default=0.0),
                          lambda share: f"{share:g}%", "link utilisation", [("busy", KIND_COLOURS["communication"])])
             if shown else '<p class="note">No link carried bytes.</p>')
    return ('<section id="links"><h2>Link utilisation</h2>'
            "<p>The share of the run during which at least one transfer crossed each directed link "
            "(report.json's <code>links[].busy_s</code> over <code>sim_time_s</code>), and the bytes it "
            f"carried. {escape('; '.join(sentences))}.</p>{chart}</section>")
