"""What a run reports: report.json, the Chrome trace, the terminal summary's data.

Every figure is a view of the cluster's event log (device spans, with their
bytes and FLOPs) and the network's transfer records and link counters;
nothing is measured twice.

    report = build_report(scenario, cluster, run_result)
    report.write(Path("runs/quickstart"))

- build.py: `RunResult` (what a run produced beyond the event log), `build_report`, `Report`.
- flops.py: the `flops` section (model TFLOP/s per device, MFU).
- trace.py: the Chrome trace.
- kineto.py: PyTorch profiler (Kineto) traces per rank, for Holistic Trace Analysis.
- chakra.py, chakra_files.py: Chakra execution traces (report.chakra; ASTRA-sim replays them, and `simtrain replay`):
  a rank's nodes, and the files.
"""
from .build import Report, RunResult, build_report, finite_or_none, write_atomic
from .kineto import build_kineto, kineto_files
from .trace import build_trace

__all__ = ["Report", "RunResult", "build_kineto", "build_report", "build_trace", "finite_or_none", "kineto_files",
           "write_atomic"]
