"""report.html: a run's or a sweep's figures as one page to look at, drawn from its folder with no server.

    simtrain run scenarios/pipeline.yaml --no-numerics --set train.steps=2 --out runs/pipeline
    simtrain report runs/pipeline --html          # writes runs/pipeline/report.html

    from simtrain.report.html import write_html_report
    write_html_report(Path("runs/pipeline"))

- page.py: the page (headline figures, style) and `write_html_report`;
- inputs.py: reading a run's folder (report.json, trace.json) or a sweep's (sweep.json), one-line errors;
- ranks.py: the rows of the per-rank charts (equal ranks folded: representatives);
- bars.py, svg.py: the stacked-bar chart and the SVG vocabulary;
- breakdown.py, timeline.py, memory.py, links.py, whatif.py: one chart each.
"""
from .inputs import ReportInputError
from .page import write_html_report

__all__ = ["ReportInputError", "write_html_report"]
