"""`simtrain report`: a run's (or a sweep's) figures as one page to look at. cli.py adds it to the command line.

    simtrain report runs/pipeline --html                 # runs/pipeline/report.html
    simtrain report runs/sweep --html --out sweep.html   # a sweep's what-if plot and Pareto front

A folder that does not exist, one without report.json or sweep.json, or a file
in it that is not a report prints one line naming the path, exit code 2.
"""
from pathlib import Path

import click

from .errors import SimtrainError
from .user_files import user_path


@click.command()
@click.argument("folder")
@click.option("--html", "as_html", is_flag=True,
              help="Write one self-contained page (inline SVG, no server, no network): the step breakdown per "
                   "rank, the timeline of the first step, memory by category, link utilisation; for a sweep's "
                   "folder, the what-if plot and its Pareto front.")
@click.option("--out", default=None, help="Where the page goes [default: report.html in FOLDER].")
def report(folder, as_html, out):
    """Draw a run's folder (report.json, trace.json) or a sweep's (sweep.json) as a page to look at."""
    if not as_html:
        raise SimtrainError("simtrain report: say --html (the one format it writes); the run's summary is in "
                            "report.json, and `simtrain run` prints it")
    from .report.html import write_html_report

    path = write_html_report(user_path(folder, "FOLDER", SimtrainError),
                             None if out is None else user_path(out, "--out", SimtrainError))
    click.echo(f"wrote {path}")
