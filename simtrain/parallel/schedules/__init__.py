"""Pipeline schedules as data: per rank, a list of actions over model parts, and the parts each rank holds.

A schedule (actions.py) is what torch.distributed.pipelining calls a pipeline
order: per pipeline rank, its forwards (F), input backwards (I), weight
backwards (W), whole backwards (B) and overlapped forward-backward pairs, in
order, and its placement (which model parts each rank holds). The engine
(schemes/pipeline.py) runs any such list. Each schedule is one file with one
function, `build(stages, microbatches, chunks, source) -> Schedule`, that
raises ValueError naming the scenario field it cannot run with; a new schedule
is its file and one line of `REGISTRY`. Pure Python: `simtrain validate`
builds the schedule to check it, without torch.

    schedule = pipeline_schedule(scenario.parallel.pipeline, pp=4, microbatches=8, base_dir=scenario.base_dir)
    schedule.actions[0][:2], schedule.placement[0]

| name | file | paper |
| --- | --- | --- |
| gpipe | gpipe.py | Huang et al. 2019 |
| 1f1b | one_f_one_b.py | Narayanan et al. 2021 (PipeDream-Flush) |
| interleaved | interleaved.py | Narayanan et al. 2021, section 2.2 |
| zero_bubble | zero_bubble.py | Qi et al. 2024, ZB-H1 |
| dualpipev | dualpipev.py | DeepSeek-V3 report 2024, DualPipe's V |
| file | from_file.py | torch.distributed.pipelining's CSV |
"""
import importlib
from pathlib import Path

from ...errors import ScenarioError
from ..support import Case, refuse
from .actions import Schedule

REGISTRY = {  # schedule name -> its module in this folder
    "gpipe": "gpipe",
    "1f1b": "one_f_one_b",
    "interleaved": "interleaved",
    "zero_bubble": "zero_bubble",
    "dualpipev": "dualpipev",
    "file": "from_file",
}


def build_schedule(name: str, stages: int, microbatches: int, chunks: int, source: Path | None = None) -> Schedule:
    """Schedule `name` for `stages` pipeline ranks, `microbatches` per step and `chunks` model parts per rank
    (ValueError, one line naming the field, where it cannot run so)."""
    if name not in REGISTRY:
        raise ValueError(f"parallel.pipeline.schedule: unknown schedule {name!r} (known: {', '.join(REGISTRY)})")
    return importlib.import_module(f"{__name__}.{REGISTRY[name]}").build(stages, microbatches, chunks, source)


def pipeline_schedule(pipeline, stages: int, microbatches: int, base_dir: Path = Path(".")) -> Schedule:
    """The schedule a scenario's `parallel.pipeline` section names, for `stages` pipeline ranks (ScenarioError,
    one line naming the field, where it cannot run): the one place schedules are checked, by `simtrain validate`
    (job_checks.py) and by the job's build (schemes/model_parts.py) alike."""
    source = None if pipeline.schedule_file is None else Path(base_dir) / Path(pipeline.schedule_file).expanduser()
    try:
        return build_schedule(pipeline.schedule, stages, microbatches, pipeline.virtual_stages, source)
    except ValueError as error:
        raise ScenarioError(str(error)) from None


def pipeline_placement(scenario, stages: int) -> tuple[tuple[int, ...], ...]:
    """The model parts each of `stages` pipeline ranks holds under `scenario`, chunk 0 first: its schedule's
    placement, the schedule checked with the rest of the scenario (the support table's rows that read the
    schedule: parallel/support.py; one-line errors naming the field)."""
    parallel = scenario.parallel
    schedule = pipeline_schedule(parallel.pipeline, stages, parallel.microbatches, scenario.base_dir)
    refuse(Case(scenario, schedule=schedule), ScenarioError)
    return schedule.placement
