"""report.json's `parallel`: the layout a job ran, its pipeline bubble and the bytes each dimension moved.

One builder for simulated runs and `simtrain launch`. The scheme hands over
what only it knows, the layout (`layout`: dp, pp, tp and, where it has them,
placement, schedule, microbatches...); the bubble and the bytes are read from
the event log (hw/eventlog.py), summed over the job's ranks:

- `bubble_fraction`: the ranks' seconds of `bubble` spans over the ranks'
  time (sim_time_s times the ranks);
- `bytes_by_kind`: the bytes of the ranks' communication labelled as each
  kind moves them (`LABELS`): the data-parallel gradient all-reduce, pipeline
  sends, tensor-parallel collectives, the fp16 overflow vote and ring
  attention's key/value blocks. A
  representative (strategies/representatives.py) logs the bytes of every rank it
  stands for.

    section = parallel_section({"dp": 4, "pp": 1, "tp": 1}, cluster.log, ranks=[0, 1, 2, 3], sim_time_s=0.1)
"""
from pydantic import Field

from ..hw.eventlog import EventLog
from .sections import ReportSection, register_section

# Each kind's labels on communication spans: the data-parallel all-reduce is "all_reduce" under data
# parallelism alone and "dp_allreduce" beside pipeline or tensor parallelism.
LABELS = {"dp_allreduce": ("all_reduce", "dp_allreduce"), "pp_p2p": ("pp_p2p",),
          "tp_allreduce": ("tp_allreduce", "tp_allgather", "tp_reducescatter", "tp_sp_grads", "tp_regather"),
          "overflow_vote": ("overflow_vote",), "cp_ring": ("cp_kv", "cp_kv_grad")}


class BytesByKind(ReportSection):
    dp_allreduce: int = Field(description="bytes the data-parallel gradient all-reduces sent, every rank's")
    pp_p2p: int = Field(description="bytes of activations and their gradients sent between pipeline stages")
    tp_allreduce: int = Field(description="bytes the tensor-parallel all-reduces sent (under sequence parallelism "
                                          "its all-gathers and reduce-scatters, and the sums of the whole "
                                          "parameters' gradients)")
    overflow_vote: int = Field(description="bytes of the fp16 overflow vote of the model-parallel groups")
    cp_ring: int = Field(description="bytes ring attention's key/value blocks and their gradients sent around the "
                                     "context-parallel groups")


class ParallelSection(ReportSection):
    dp: int = Field(description="data-parallel degree: replicas of the model")
    pp: int = Field(description="pipeline-parallel degree: stages")
    tp: int = Field(description="tensor-parallel degree: ranks a layer is split over")
    cp: int | None = Field(None, description="context-parallel degree: ranks a sequence is split over (model "
                                             "parallel layouts)")
    placement: list[str] | None = Field(None, description="the order of the dimensions in the ranks, innermost "
                                                          "first (model parallel layouts)")
    schedule: str | None = Field(None, description="the pipeline schedule (gpipe, 1f1b, interleaved, zero_bubble, "
                                                   "dualpipev, file); null: no pipeline")
    microbatches: int | None = Field(None, description="microbatches per step (model parallel layouts; data "
                                                          "parallelism: its accumulation steps, when above 1)")
    virtual_stages: int | None = Field(None, description="model chunks per pipeline stage (interleaved "
                                                         "schedules)")
    stage_of_rank: list[int] | None = Field(None, description="each job rank's pipeline stage")
    representatives: bool | None = Field(None, description="whether one rank per stage was simulated for all "
                                                           "(strategies/representatives.py)")
    bubble_fraction: float = Field(description="the ranks' pipeline bubble over their time")
    bytes_by_kind: BytesByKind = Field(description="bytes each parallel dimension's communication moved")
    overlap: bool | None = Field(None, description="whether the gradient all-reduce overlapped the backward "
                                                   "(data parallelism)")
    buckets: int | None = Field(None, description="gradient buckets all-reduced per step (data parallelism)")


register_section("parallel", ParallelSection, "the layout, the pipeline bubble and the bytes each parallel "
                                              "dimension moved (report/parallel.py)")


def parallel_section(layout: dict, log: EventLog, ranks: list[int], sim_time_s: float) -> dict:
    """`layout` (the scheme's) completed with the bubble and the bytes that `ranks` logged."""
    moved = {kind: 0 for kind in LABELS}
    bubble_s = 0.0
    for rank in ranks:
        by_label = log.bytes_by_label(rank, "communication")
        for kind, labels in LABELS.items():
            moved[kind] += sum(by_label.get(label, 0) for label in labels)
        bubble_s += log.total(rank, "bubble")
    section = {**layout, "bubble_fraction": bubble_s / (sim_time_s * len(ranks)) if sim_time_s > 0 else 0.0,
               "bytes_by_kind": {kind: int(nbytes) for kind, nbytes in moved.items()}}
    return section
