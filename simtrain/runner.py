"""Scenario -> cluster + job -> Report.

    from simtrain import load_scenario, run
    report = run(load_scenario("scenarios/quickstart.yaml", ["cluster.devices=8"]))
    print(report.data["step_time_s"])

A scenario is one job on all of its cluster's devices (job.py): the runner
builds the cluster and the job, starts it, runs the clock to its end and
reports. Nothing here depends on the scheme: what differs between schemes is
behind the protocol in simtrain/schemes/__init__.py.

With faults (`cluster.faults`, `cluster.random_faults`) or checkpoints
(`train.checkpoint`), hw/faults.py applies the faults while the job runs,
recovery.py decides what the job does about a lost device, and the report
gains a `faults` section. Its `goodput` is the fault-free time over the time
taken, where the fault-free time is measured: the same scenario without
faults and without checkpoints, simulated once more. A job a fault
stopped (`JobFailed`) still reports, with `status: failed` and the reason.

Initialization follows the DDP contract: `torch.manual_seed(seed)` right before
the model is built, and every replica is a copy of that model. Torch runs on
one host thread so results are the same on every machine. The final loss is
the final model's mean cross entropy over the whole training set and the final
accuracy its accuracy on the test set; like the training-set loss curve
(evaluation.py), evaluating costs no simulated time.
"""
import gc
import time
from contextlib import contextmanager

import torch
from pydantic import Field

from .errors import JobFailed, OutOfMemory, ScenarioError
from .evaluation import TrainLossMonitor, evaluate
from .fleet.section import fleet_section
from .hw.cluster import Cluster, run_to_end
from .hw.fault_schedule import scheduled_faults
from .hw.faults import FaultInjector
from .job import Job
from .layout_search import layouts_that_fit
from .memory_plan import plan_memory
from .preflight import preflight
from .recovery import Recovery
from .report import Report, RunResult, build_report
from .report.sections import ReportSection, register_section
from .scenario import Scenario
from .schemes import scheme_name
from .strategies.mirrored_ranks import Counterparts
from .train.model_flops import model_flops_per_step
from .train.sampling import sampling_section
from .units import format_bytes
from .user_code import user_code_errors


# A run allocates millions of objects that live to its end (spans, events, step programs, ledgers). At Python's
# default thresholds (700, 10, 10) the cyclic garbage collector traverses them again and again: 1.9 s of a 9.6 s
# 16,384-GPU step, measured with gc.callbacks (2026-12-07). A run collects its youngest generation 70 times less
# often; it still collects, so a run of millions of steps frees its cycles as it goes.
RUN_COLLECTOR_THRESHOLDS = (50_000, 20, 20)


@contextmanager
def paced_collector():
    """Python's cyclic garbage collector at RUN_COLLECTOR_THRESHOLDS for the block, its thresholds restored
    after."""
    thresholds = gc.get_threshold()
    gc.set_threshold(*RUN_COLLECTOR_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


@contextmanager
def single_thread():
    """Torch on one host thread, for the block: the same numbers on every machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def simulated_cluster(scenario: Scenario, resolved) -> Cluster:
    """The scenario's cluster, keeping what its report asks for: spans for a trace (Chrome, Kineto or Chakra)
    or for faults (a lost device's are cut: hw/eventlog.py), a pipeline's messages for Chakra, the counted parts
    of communication for Kineto, each device's memory over the run for the Chrome trace's counters."""
    report = scenario.report
    cluster = Cluster.from_resolved(resolved, record=report.trace or report.kineto or report.chakra
                                    or scenario.has_faults, seed=scenario.seed)
    if report.chakra:
        cluster.log.keep_messages()  # a pipeline's sends and receives (report/chakra.py)
    if report.kineto:
        cluster.log.keep_communication_parts()  # the NCCL kernels, waits for peers left out (report/kineto.py)
    if report.trace:
        cluster.record_memory_changes()
    return cluster


def run(scenario: Scenario, on_step=None) -> Report:
    """Simulate the scenario; on_step(step, sim_time_s, loss) is called after every step (update, for async)."""
    if scenario.pbt is not None:
        raise ScenarioError("pbt: a population runs with simtrain.run_population (simtrain/studies/pbt.py)")
    resolved = preflight(scenario)  # everything `simtrain validate` checks, before the clock starts
    wall_start = time.perf_counter()
    steps = scenario.train.steps
    faulty = scenario.has_faults
    with user_code_errors(scenario), single_thread(), paced_collector():
        cluster = simulated_cluster(scenario, resolved)
        scheduled_faults(scenario, cluster.topology)  # checks the faults' names and the spares against the cluster
        world = cluster.size - scenario.cluster.spares
        # Faults change links under the collectives: no group timing of a ring's transfers
        # (Network.time_ring, hw/ring_timing.py).
        job = Job(scenario, cluster, range(world), numerics=scenario.numerics,
                  on_step=lambda *step: monitor.on_step(*step), alone=not faulty)
        scheme = job.scheme
        monitor = TrainLossMonitor(scheme.trained_model, job.data.train if scenario.numerics else None,
                                   scenario.report.every, steps, then=on_step)
        if faulty:
            recovery = Recovery(job, list(range(world, cluster.size)), on_rewind=monitor.rewind)
            injector = FaultInjector(cluster, scenario, job.ranks, recovery.device_lost)
            injector.start(job.finished)
        job.start()
        out_of_memory = failure = None
        try:
            run_to_end(cluster.env)
        except OutOfMemory as error:  # the step stops here; report what is known so far
            out_of_memory = _out_of_memory_section(scenario, job, error, steps_done=len(scheme.loss_curve))
        except JobFailed as error:  # a fault stopped the job: report what is known so far
            failure = str(error)
        stuck = [] if out_of_memory or failure else scheme.stuck()
        if stuck:
            raise RuntimeError(f"collective deadlock: ranks {stuck} wait for peers that never posted")
        if out_of_memory or failure:
            scheme.stopped()
        job.finish()
        final_loss = final_accuracy = None  # numerics off: nothing was computed
        if scenario.numerics:
            trained = scheme.trained_model()  # assembled once for both
            final_loss, _ = evaluate(trained, job.data.train)
            _, final_accuracy = evaluate(trained, job.data.test)
    sections = {"amp": job.replicas[0].precision.report()}
    if scenario.fleet is not None and not out_of_memory:  # weeks around the measured step (simtrain/fleet/)
        sections["fleet"] = fleet_section(scenario, cluster, job, cluster.log.last_end_s / steps)
    if faulty:
        sections["failure"] = failure
        sections["faults"] = recovery.report_section(injector, _fault_free_time_s(scenario), cluster.log.last_end_s,
                                                    failed=failure is not None)
    if out_of_memory or failure:  # the schemes' and samplers' sections describe whole runs
        if out_of_memory:
            sections["out_of_memory"] = out_of_memory
    else:
        sections.update(scheme.report_sections())
        if scenario.data.sampling != "uniform":
            sections["sampling"] = sampling_section([replica.loader for replica in job.replicas])
    model_flops = model_flops_per_step(scenario, job.data, scheme.samples_per_step())
    result = RunResult(
        scheme=scheme_name(scenario.parallel),
        steps=len(scheme.loss_curve) if out_of_memory or failure else steps,
        status="out_of_memory" if out_of_memory else "failed" if failure else "ok",
        samples_per_step=scheme.samples_per_step(),
        loss_curve=scheme.loss_curve,
        train_loss_curve=monitor.curve,
        time_to_target_s=(monitor.time_to(scenario.train.target_loss)
                          if scenario.train.target_loss is not None else None),
        final_loss=final_loss,
        final_accuracy=final_accuracy,
        single_device_step_s=scheme.single_device_step_s(),
        final_models=scheme.final_models(),
        wall_time_s=time.perf_counter() - wall_start,
        extra=sections,
        mirror_of=scheme.mirror_of,
        counterparts=Counterparts(job) if scheme.mirror_of and scenario.report.chakra else None,
        model_flops_per_step=model_flops.per_step,
        model_flops_formula=model_flops.formula,
        tokens_per_sample=model_flops.tokens_per_sample,
    )
    return build_report(scenario, cluster, result)


def _fault_free_time_s(scenario: Scenario) -> float:
    """Simulated seconds the scenario takes without faults and without checkpoints: goodput's numerator."""
    cluster = scenario.cluster.model_copy(update={"faults": [], "random_faults": None})
    fault_free = scenario.model_copy(update={
        "cluster": cluster, "train": scenario.train.model_copy(update={"checkpoint": None}),
        "report": scenario.report.model_copy(update={"trace": False})})
    fault_free._base_dir = scenario.base_dir
    return run(fault_free).data["sim_time_s"]


def _out_of_memory_section(scenario: Scenario, job: Job, error: OutOfMemory, steps_done: int) -> dict:
    """report.json's `out_of_memory`: the device whose allocation went past its capacity, the peak its step would
    reach (the step replayed to its end on ledgers that do not stop, as `simtrain memory` replays it:
    memory_plan.py), what batch and which layouts would fit."""
    index = next(index for index, device in enumerate(job.devices) if device.memory.device == error.device)
    plan = plan_memory(scenario)[index]
    layouts = layouts_that_fit(scenario)
    advice = f"the largest per-device batch size that fits is {plan.largest_batch}"
    if layouts:
        advice += "; with the same global batch, these layouts fit: " + "; ".join(fit.summary() for fit in layouts)
    held = ", ".join(f"{category} {format_bytes(nbytes)}" for category, nbytes in plan.by_category.items() if nbytes)
    return {
        "rank": job.devices[index].rank,
        "device": plan.device,
        "step": steps_done,
        "capacity_bytes": plan.capacity_bytes,
        "needed_bytes": plan.peak_bytes,
        "bytes_by_category": plan.by_category,
        "stopped_at_bytes": sum(error.by_category.values()),
        "largest_batch_size_that_fits": plan.largest_batch,
        "layouts_that_fit": [{"dp": fit.dp, "pp": fit.pp, "tp": fit.tp, "cp": fit.cp,
                              "sequence_parallel": fit.sequence_parallel, "batch_size": fit.batch_size,
                              "microbatches": fit.microbatches, "sharding_stage": fit.stage,
                              "checkpointing": fit.checkpointing, "peak_bytes": fit.peak_bytes,
                              "step_time_s": fit.step_time_s} for fit in layouts],
        "message": f"out of memory on {error.device}: its step needs {format_bytes(plan.peak_bytes)} of "
                   f"{format_bytes(plan.capacity_bytes)} at its peak ({held}); {advice}",
    }


class LayoutThatFits(ReportSection):
    dp: int = Field(description="data-parallel replicas")
    pp: int = Field(description="pipeline stages")
    tp: int = Field(description="tensor-parallel ranks per stage")
    cp: int = Field(description="context-parallel ranks sharing each sequence")
    sequence_parallel: bool = Field(description="parallel.sequence_parallel")
    batch_size: int = Field(description="data.batch_size: the global batch over dp")
    microbatches: int = Field(description="parallel.pipeline.microbatches: a pipeline's, else accumulation steps")
    sharding_stage: int = Field(description="parallel.sharding.stage")
    checkpointing: str = Field(description="train.checkpointing")
    peak_bytes: int = Field(description="the largest device's peak over a step")
    step_time_s: float = Field(description="the replayed step's simulated seconds (layout_search.py)")


class OutOfMemorySection(ReportSection):
    rank: int = Field(description="the device that ran out of memory")
    device: str = Field(description="its catalog name")
    step: int = Field(description="steps done before it ran out")
    capacity_bytes: int = Field(description="its memory")
    needed_bytes: int = Field(description="the peak its step would reach, as `simtrain memory` replays it "
                                          "(memory_plan.py)")
    bytes_by_category: dict[str, int] = Field(description="that peak by category")
    stopped_at_bytes: int = Field(description="what it held when the allocation past its capacity stopped the run")
    largest_batch_size_that_fits: int = Field(description="the largest per-device batch size that fits "
                                                          "(memory_plan.py)")
    layouts_that_fit: list[LayoutThatFits] = Field(
        description="up to three dp x pp x tp layouts, with or without full recomputation, that fit the same "
                    "global batch on the same devices (layout_search.py)")
    message: str = Field(description="the one line the CLI prints")


register_section("out_of_memory", OutOfMemorySection, "where a run that ran out of memory stopped (runner.py)")
