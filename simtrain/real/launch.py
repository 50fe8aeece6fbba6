"""`simtrain launch`: a scenario's training on real torch.distributed, measured by the host clock.

    simtrain launch scenarios/quickstart.yaml --nproc 2                      # spawned gloo processes
    torchrun --nproc-per-node 8 -m simtrain launch scenario.yaml             # the group torchrun starts

One process per rank (real/processes.py). Each builds only its own rank's
replica (or, under pipeline and tensor parallelism, its share of the model),
data shard and optimizer, through the same `Job` as `simtrain run` on the
real backend (real/backend.py): the same seed before the model is built,
the same DistributedSampler shard, the same techniques. It then runs the
scheme's own step program for that rank, `scheme.program(rank)`, with the
real interpreter (real/interpreter.py): the numerics the program does run as
they do in a simulation, its collectives and a pipeline's messages run their
comm programs over point-to-point calls on each group's own process group
(or, with `collective="native"`, an all-reduce is one `dist.all_reduce`), and
the operations a simulation charges become host-clock spans. There is no
second description of a step.

The first `warmup` steps are not measured; before step `warmup` every rank
meets at a barrier, and its spans count from there. Afterwards rank 0
gathers every rank's spans (and, under model parallelism, the shares of the
model, assembled into the whole one), splits each collective span into idle
(until the rank that took least time in it, i.e. the last to arrive, had
arrived) and communication (the rest: the time the slowest-arriving rank
spent in it; a pipeline's messages are left whole), and
logs them on the same kind of event log a simulation fills: report.json
(report/build.py build_report: the same schema, with `"measured": true` and a
`measurement` section), trace.json and final_model.pt come out of the same code.
The measurement section also says (`warning`, one line, printed by the CLI)
when the timings cannot be trusted: the load average above the cores when the
ranks started, or the measured steps spread too widely (real/machine_load.py).

Refused, one line each: populations, the nccl backend (replicas and their
buffers live on the CPU here), and the support table's rows for simtrain
launch (parallel/support.py: async, whose step programs move bytes through a
simulated shared-memory store; numerics off). A sharded rank ends by
gathering its shard groups' fp32 chunks over the network, the whole model it
reports (distributed_optimizer.py's `finish`).

    data = launch("scenarios/quickstart.yaml", [], nproc=2, out=Path("runs/quickstart-real"))
"""
import time
from pathlib import Path

import torch.distributed as dist
from pydantic import Field

from ..errors import ScenarioError, SimtrainError
from ..evaluation import evaluate
from ..hw.cluster import build_cluster
from ..job import Job
from ..parallel.support import Case, refuse
from ..report import RunResult, build_report
from ..report.sections import ReportSection, register_section
from ..scenario import Scenario, load_scenario
from ..schemes import scheme_name
from ..train.model_flops import model_flops_per_step
from .backend import RealBackend
from .interpreter import Meter
from .machine_load import load_average, load_warning, relative_spread
from .processes import join, spawn, torchrun_world

BACKENDS = ("gloo", "nccl")


def scenario_for(scenario_file, overrides, world: int) -> Scenario:
    """The scenario on `world` devices, checked for what launch runs; SimtrainError naming the field."""
    scenario = load_scenario(scenario_file, [*overrides, f"cluster.devices={world}"])
    if scenario.pbt is not None:
        raise ScenarioError(f"{scenario_file}: pbt: a population runs simulated only (simtrain run)")
    refuse(Case(scenario, launched=True), lambda line: ScenarioError(f"{scenario_file}: {line}"))
    return scenario


def check_options(scenario: Scenario, backend: str, warmup: int) -> None:
    """The launch options against the scenario; SimtrainError naming the option."""
    if backend == "nccl":
        raise SimtrainError("--backend: nccl needs CUDA tensors, and launch's replicas and gradient buckets live "
                            "on the CPU; use gloo")
    if warmup >= scenario.train.steps:
        raise SimtrainError(f"--warmup: {warmup} warm-up steps leave none of train.steps {scenario.train.steps} "
                            "to measure")


def check_switches(scenario: Scenario, topology, collective: str) -> None:
    """NCCL's choice may run on a switch that reduces (NVLS), which no process of the group stands for;
    ScenarioError naming the field."""
    if scenario.parallel.all_reduce == "nccl" and collective == "programs" and topology.reducing:
        raise ScenarioError(f"parallel.all_reduce: nccl may reduce in the switches {sorted(topology.reducing)} of "
                            f"topology {topology.name}, which launch's processes cannot stand for; use ring")


def launch(scenario_file, overrides, nproc: int | None, out: Path, backend: str = "gloo",
           collective: str = "programs", warmup: int = 3) -> dict | None:
    """Train for real and write out/ (report.json, trace.json, final_model.pt, scenario.resolved.yaml).

    Under torchrun (its variables set) this process is one rank of its group; else `nproc` processes are
    spawned. Returns report.json's data on rank 0 (None on the others)."""
    group = torchrun_world()
    world = group.world if group is not None else nproc
    if group is not None and nproc is not None and nproc != group.world:
        raise SimtrainError(f"--nproc: {nproc}, but torchrun started {group.world} processes")
    if world is None:
        raise SimtrainError("--nproc: required outside torchrun")
    scenario = scenario_for(scenario_file, overrides, world)
    check_options(scenario, backend, warmup)
    args = (str(scenario_file), list(overrides), collective, warmup, str(out), backend)
    cluster = build_cluster(scenario.cluster, scenario.base_dir, record=False)
    check_switches(scenario, cluster.topology, collective)
    if group is None:
        # Rank 0's job, built here first: a mistake in the cluster, model or data is one line before any
        # process starts (a rank's error would come back as its traceback).
        Job(scenario, cluster, range(world))
        return spawn(_rank_main, world, args=args, backend=backend)[0]
    join(backend)
    try:
        data = _rank_main(group.rank, group.world, *args)
        dist.barrier()
        return data
    finally:
        dist.destroy_process_group()


def _rank_main(rank: int, world: int, scenario_file: str, overrides: list, collective: str, warmup: int,
               out: str, backend: str) -> dict | None:
    """One rank's training, measured; rank 0 gathers every rank's spans and writes the report."""
    wall_start = time.perf_counter()
    load = load_average()
    scenario = scenario_for(scenario_file, overrides, world)
    cluster = build_cluster(scenario.cluster, scenario.base_dir, record=True, seed=scenario.seed,
                            enforce_capacity=False)
    meter = Meter()
    step_starts: list[float] = []  # host clock (perf_counter) at the start of every step

    def between_steps(rank_, step):
        if step == warmup:
            dist.barrier()  # every rank starts the measured window together
            meter.start_recording()
        meter.boundary()
        step_starts.append(time.perf_counter())
        return True
        yield  # a step program (job.py before_step)

    job = Job(scenario, cluster, range(world), between_steps=between_steps,
              backend=RealBackend(rank, meter, collective))
    job.backend.start(job, rank, job.scheme.program(rank))
    end = meter.now()
    job.finish()
    model = job.replicas[rank].model
    mine = {"spans": meter.spans, "end_s": end, "step_starts_s": [t - meter.origin for t in step_starts],
            "losses": job.scheme.rank_losses(rank), "ledger": job.devices[rank].memory,
            "pieces": model.pieces() if job.scheme.holds_shares else None}
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank != 0:
        return None
    report = _measured_report(scenario, cluster, job, gathered, warmup, backend, collective, wall_start, load)
    report.write(Path(out))
    return report.data


def _measured_report(scenario: Scenario, cluster, job: Job, ranks: list[dict], warmup: int, backend: str,
                     collective: str, wall_start: float, load: float):
    """report.json of the measured run, from every rank's spans, through report.py like a simulation's."""
    steps = scenario.train.steps
    measured_steps = steps - warmup
    least = _least_times(ranks)
    unattributed = 0.0
    for rank, measured in enumerate(ranks):
        seen: dict[str, int] = {}
        for span in measured["spans"]:
            start = span.start
            if span.kind == "communication":
                index = seen[span.name] = seen.get(span.name, -1) + 1
                if span.name in least:
                    start = max(span.start, span.end - least[span.name][index])
            cluster.log.span(rank, span.kind, span.name, start, span.end, nbytes=span.nbytes, flops=span.flops)
        cluster.devices[rank].memory = measured["ledger"]
        named = sum(span.end - span.start for span in measured["spans"])
        unattributed += max(0.0, measured["end_s"] - named)  # ends of the window minus every span
    model = (job.scheme.assemble({rank: measured["pieces"] for rank, measured in enumerate(ranks)})
             if job.scheme.holds_shares else job.replicas[0].model)
    final_loss, _ = evaluate(model, job.data.train)
    _, final_accuracy = evaluate(model, job.data.test)
    step_ends = [*ranks[0]["step_starts_s"][1:], ranks[0]["end_s"]]
    measured_step_s = [end - start for start, end in zip(ranks[0]["step_starts_s"][warmup:], step_ends[warmup:])]
    losses = [[loss for r in ranks for loss in r["losses"][step]] for step in range(steps)]
    loss_curve = [(t, sum(values) / len(values)) for t, values in zip(step_ends, losses)]
    per_step = {name: sum(span.end - span.start for r in ranks for span in r["spans"] if span.name == name)
                / len(ranks) / measured_steps for name in ("forward", "backward")}
    measurement = {
        "backend": backend,
        "collective": collective,
        "warmup_steps": warmup,
        "train_steps": steps,
        "forward_s": per_step["forward"],
        "backward_s": per_step["backward"],
        "unattributed_s": unattributed / len(ranks) / measured_steps,
        "clock": "time.perf_counter of each rank, from a barrier before the first measured step",
        "memory": "the step program's ledger (what it holds), not measured",
        "load_average_before": load,
        "warning": load_warning(load, {"step time": relative_spread(measured_step_s)}),
    }
    model_flops = model_flops_per_step(scenario, job.data, job.scheme.samples_per_step())
    result = RunResult(
        scheme=scheme_name(scenario.parallel),
        steps=measured_steps,
        samples_per_step=job.scheme.samples_per_step(),
        loss_curve=loss_curve,
        train_loss_curve=[[steps, step_ends[-1], final_loss]],
        time_to_target_s=None,
        final_loss=final_loss,
        final_accuracy=final_accuracy,
        single_device_step_s=None,
        final_models=[model],
        wall_time_s=time.perf_counter() - wall_start,
        # the scheme's layout, completed from the event log like a simulation's (report/parallel.py)
        extra={"amp": job.replicas[0].precision.report(), "parallel": job.scheme.report_sections()["parallel"],
               "measured": True, "measurement": measurement},
        model_flops_per_step=model_flops.per_step,
        model_flops_formula=model_flops.formula,
        tokens_per_sample=model_flops.tokens_per_sample,
    )
    report = build_report(scenario, cluster, result)
    report.data["links"] = []  # bytes on each link are not measured
    return report


def _least_times(ranks: list[dict]) -> dict[str, list[float]]:
    """For each communication that every rank ran equally often (a collective of the job, of its dp or tp
    groups): the least time any rank spent in its i-th run, from the last arrival to the end. A pipeline's
    messages, which differ in number by stage, are left whole."""
    names = sorted({span.name for rank in ranks for span in rank["spans"] if span.kind == "communication"})
    least = {}
    for name in names:
        runs = [[span.end - span.start for span in rank["spans"] if span.kind == "communication" and span.name == name]
                for rank in ranks]
        if len({len(times) for times in runs}) == 1:
            least[name] = [min(times) for times in zip(*runs)]
    return least


class MeasurementSection(ReportSection):
    backend: str = Field(description="the torch.distributed backend: gloo")
    collective: str = Field(description="how collectives ran: simtrain's programs over point-to-point calls, or "
                                        "native (torch.distributed's own all-reduce, whose bytes are not seen)")
    warmup_steps: int = Field(description="steps run before the measured window")
    train_steps: int = Field(description="steps run in all")
    forward_s: float = Field(description="measured seconds of forward per step, averaged over the ranks")
    backward_s: float = Field(description="measured seconds of backward per step, averaged over the ranks")
    unattributed_s: float = Field(description="host seconds per step in no span (Python between operations)")
    clock: str = Field(description="the clock the spans were measured with")
    memory: str = Field(description="where the memory figures come from")
    load_average_before: float = Field(description="the host's 1-minute load average when the ranks started")
    warning: str | None = Field(description="why the timings cannot be trusted (the load average above the cores, "
                                            "or measured steps spread too widely: real/machine_load.py), or null")


register_section("measured", bool, "true: the figures were measured on real torch.distributed (simtrain launch)")
register_section("measurement", MeasurementSection, "how a measured run was measured (real/launch.py)")
