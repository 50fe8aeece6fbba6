"""The scenario's `report` section: what a run writes besides report.json.

    report: {trace: false, every: 20}
"""
from pydantic import Field

from .fields import Flag, Section, Steps


class ReportSpec(Section):
    """What a run reports."""

    trace: Flag = Field(True, description="Write trace.json (Chrome trace event format).")
    kineto: Flag = Field(False, description="Write a PyTorch profiler (Kineto) trace per rank, kineto/rank0.json, "
                                            "rank1.json, ..., that Holistic Trace Analysis reads (report/kineto.py).")
    every: Steps = Field(10, description="Steps per point of report.json's periodic series (the training-set "
                                         "loss curve, weight norms, sampling).")
