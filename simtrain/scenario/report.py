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
    chakra: Flag = Field(False, description="Write chakra/et.<rank>.et, each rank's Chakra execution trace "
                                            "(mlc-chakra 1.0.0's protobuf, which ASTRA-sim replays and "
                                            "`simtrain replay` runs again), and chakra/comm_group.json, its "
                                            "process groups.")
    every: Steps = Field(10, description="Steps per point of report.json's periodic series (the training-set "
                                         "loss curve, weight norms, sampling).")
