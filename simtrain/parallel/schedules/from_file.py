"""A schedule read from a file of actions: torch.distributed.pipelining's CSV, one row of actions per rank.

`parallel.pipeline.schedule: file` with `parallel.pipeline.schedule_file:
my_schedule.csv` (relative to the scenario's folder) runs the actions the
file lists, as `_PipelineScheduleRuntime._load_csv` reads them: row r is
pipeline rank r's actions in order, each cell torch's `_Action` string:
`<part><kind><microbatch>` with kind F, I, W or B (`2F0`: part 2's forward of
microbatch 0), or an overlapped pair `(<action>;<action>)OVERLAP_F_B`. Empty
cells are skipped. SEND_F, RECV_F, SEND_B and RECV_B cells are accepted and
dropped: the engine sends an output as soon as it exists and posts every
receive a step ahead (actions.py); UNSHARD, RESHARD and REDUCE_GRAD are
refused (the data-parallel strategy decides those). Which parts a rank holds
is read off the file: the parts its actions run, in increasing order, which
must match parallel.pipeline.virtual_stages per rank.

    build(stages=2, microbatches=2, chunks=1, source=Path("1f1b.csv"))

A file 1F1B's rows (`0F0,0F1,0B0,0B1` and `1F0,1B0,1F1,1B1`) runs 1F1B's step.
"""
import csv
import re
from pathlib import Path

from .actions import KINDS, Action, Overlapped, Schedule, check_schedule
from .timeline import timeline

_ACTION = re.compile(r"(\d+)(F|I|W|B|SEND_F|RECV_F|SEND_B|RECV_B)(\d+)")
_PAIR = re.compile(r"\((.+);(.+)\)OVERLAP_F_B")
MAX_FILE_BYTES = 16_000_000  # a million actions or so: far above any pipeline's step


def build(stages: int, microbatches: int, chunks: int, source: Path | None = None) -> Schedule:
    field = "parallel.pipeline.schedule_file"
    if source is None:
        raise ValueError(f"{field}: schedule file needs a file of actions (torch's pipelining CSV)")
    try:
        with open(source, newline="", encoding="utf-8") as handle:
            text = handle.read(MAX_FILE_BYTES + 1)
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{field}: cannot read {source}: {error}") from None
    if len(text) > MAX_FILE_BYTES:
        raise ValueError(f"{field}: {source} is over {MAX_FILE_BYTES:,} bytes")
    rows = [row for row in csv.reader(text.splitlines())]
    if len(rows) != stages:
        raise ValueError(f"{field}: {source} has {len(rows)} rows of actions; parallel.pp is {stages}")
    actions = tuple(tuple(step for cell in row if (step := _parse(cell, source, rank)) is not None)
                    for rank, row in enumerate(rows))
    placement = tuple(tuple(sorted({a.part for step in steps for a in (step if type(step) is Overlapped else (step,))}))
                      for steps in actions)
    for rank, parts in enumerate(placement):
        if len(parts) != chunks:
            raise ValueError(f"{field}: rank {rank} runs parts {list(parts)}; parallel.pipeline.virtual_stages is "
                             f"{chunks}")
    schedule = Schedule("file", placement, actions)
    try:
        check_schedule(schedule, microbatches)
        timeline(schedule, microbatches, {"F": 1.0, "I": 1.0, "W": 1.0})  # no rank waits on itself
    except ValueError as error:
        raise ValueError(f"{field}: {source}: {error}") from None
    return schedule


def _parse(cell: str, source, rank: int) -> Action | Overlapped | None:
    """One cell: an action, an overlapped pair, or None (empty, or a send or receive)."""
    cell = cell.strip()
    if not cell:
        return None
    pair = _PAIR.fullmatch(cell)
    if pair is not None:
        forward, backward = (_parse(part, source, rank) for part in pair.groups())
        if type(forward) is not Action or forward.kind != "F" or type(backward) is not Action or \
                backward.kind not in ("B", "I"):
            raise ValueError(f"parallel.pipeline.schedule_file: {source} row {rank}: {cell!r} overlaps a forward "
                             "with a backward (F then B or I)")
        return Overlapped(forward, backward)
    match = _ACTION.fullmatch(cell)
    if match is None:
        raise ValueError(f"parallel.pipeline.schedule_file: {source} row {rank}: {cell!r} is not an action "
                         f"(<part><kind><microbatch>, kind one of {', '.join(KINDS)}, or an OVERLAP_F_B pair)")
    part, kind, microbatch = match.groups()
    return Action(kind, int(part), int(microbatch)) if kind in KINDS else None
