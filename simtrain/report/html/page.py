"""report.html: one self-contained page of a run (or a sweep) that opens from disk with no server.

The page is HTML with its style inline and its charts inline SVG, drawn here
in Python from the run's report.json (and trace.json): no script, no font or
file fetched from anywhere. For a run it holds the headline figures, the step
breakdown per rank, the timeline of the first step, memory by category and
link utilisation; for a sweep, the what-if plot and its Pareto front. The same
folder gives the same bytes.

    path = write_html_report(Path("runs/pipeline"))                 # runs/pipeline/report.html
    path = write_html_report(Path("runs/sweep"), Path("sweep.html"))
"""
from html import escape
from pathlib import Path

from ...units import format_seconds
from .breakdown import breakdown_section
from .inputs import ReportInputError, folder_kind, job_devices, read_run, read_sweep
from .links import links_section
from .memory import memory_section
from .ranks import rank_rows
from .timeline import step_window_s, timeline_section
from .svg import rate_text
from .whatif import whatif_page_body

STYLE = """
body{font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;color:#222;background:#fff;
margin:24px auto;max-width:1010px;padding:0 12px;line-height:1.45}
h1{font-size:24px;margin:0 0 4px}
h2{font-size:18px;margin:32px 0 6px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 4px;color:#333}
p{margin:6px 0;max-width:980px}.note{color:#555;font-size:14px}.warn{color:#a33;font-weight:600}
code{background:#f3f3f3;padding:0 3px;border-radius:3px;font-size:90%}
dl.figures{display:grid;grid-template-columns:max-content 1fr;gap:2px 16px;margin:12px 0}
dl.figures dt{color:#555}dl.figures dd{margin:0;font-weight:600}
table.front{border-collapse:collapse;margin:12px 0;font-size:14px}
table.front td,table.front th{border:1px solid #ddd;padding:3px 8px;text-align:right}
table.front caption{text-align:left;font-weight:600;padding:4px 0}
svg{display:block;margin:8px 0}svg text.row-label{font-size:12px}
svg text.point-label{paint-order:stroke;stroke:#fff;stroke-width:3px;stroke-linejoin:round}
"""


def write_html_report(folder: Path, out: Path | None = None) -> Path:
    """Write the page of a run's or a sweep's folder to `out` (default: report.html in the folder)."""
    page = (run_page(read_run(folder)) if folder_kind(folder) == "run" else sweep_page(read_sweep(folder)))
    path = out if out is not None else folder / "report.html"
    try:
        path.write_text(page, encoding="utf-8")
    except OSError as error:
        raise ReportInputError(f"{path}: cannot write it ({error.strerror})") from None
    return path


def run_page(run) -> str:
    report = run.report
    rows = rank_rows(report)
    body = (_headline(report) + breakdown_section(report, rows) + timeline_section(report, run.trace)
            + memory_section(report, rows, run.trace, step_window_s(report)) + links_section(report))
    return _page(f"{report['name']}: simtrain report", body)


def sweep_page(sweep) -> str:
    grids = ", ".join(sweep.grid_paths) or "no grid"
    body = (f"<h1>simtrain sweep: {escape(sweep.folder.name)}</h1>"
            f"<p class=\"note\">simtrain sweep over {escape(grids)}: {len(sweep.rows)} points (sweep.json).</p>"
            + whatif_page_body(sweep))
    return _page(f"sweep {sweep.folder.name}: simtrain report", body)


def _page(title: str, body: str) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>{body}</body></html>\n")


def _headline(report: dict) -> str:
    parallel = report.get("parallel") or {}
    flops = report.get("flops") or {}
    devices = job_devices(report)
    figures = [("status", report["status"]), ("scheme", report["scheme"]),
               ("devices", f"{len(devices)} × {', '.join(dict.fromkeys(d['device'] for d in devices))}")]
    if parallel:
        layout = " × ".join(f"{name} {parallel[name]}" for name in ("dp", "pp", "tp", "cp") if parallel.get(name))
        figures.append(("layout", layout))
    figures.append(("simulated time", f"{format_seconds(report['sim_time_s'])} over {report['steps']} steps"))
    if report["step_time_s"] is not None:
        figures.append(("step time", format_seconds(report["step_time_s"])))
    if report["throughput_samples_per_s"] is not None:
        figures.append(("throughput", f"{rate_text(report['throughput_samples_per_s'])} samples/s"))
    if report.get("throughput_tokens_per_s_per_device") is not None:
        figures.append(("tokens/s per device", rate_text(report["throughput_tokens_per_s_per_device"])))
    if flops.get("mfu") is not None:
        figures.append(("MFU", f"{flops['mfu']:.1%} ({flops['tflops_per_device']:.3g} TFLOP/s per device)"))
    rows = "".join(f"<dt>{escape(name)}</dt><dd>{escape(str(value))}</dd>" for name, value in figures)
    return (f"<h1>{escape(report['name'])}</h1><p class=\"note\">simtrain {escape(report['simtrain_version'])}; "
            "every figure is simulated time from report.json, not the host's clock.</p>"
            f"<dl class=\"figures\">{rows}</dl>")

