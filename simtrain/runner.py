"""Scenario -> cluster + workload -> Report.

    from simtrain import load_scenario, run
    report = run(load_scenario("scenarios/quickstart.yaml", ["cluster.devices=8"]))
    print(report.data["step_time_s"])

Initialization follows the DDP contract: `torch.manual_seed(seed)` right before
the model is built, and every replica is a copy of that model. Torch runs on
one host thread so results are the same on every machine. The final loss is
the final model's mean cross entropy over the whole training set and the final
accuracy its accuracy on the test set; like the training-set loss curve
(evaluation.py), evaluating costs no simulated time.
"""
import copy
import time
from contextlib import contextmanager

import torch

from .errors import OutOfMemory
from .evaluation import TrainLossMonitor, evaluate
from .hw.cluster import build_cluster, run_to_end
from .memory import StepMemoryModel
from .report import Report, RunResult, build_report
from .scenario import Scenario
from .schemes.asynchronous import AsynchronousSGD
from .schemes.sync import SyncDataParallel
from .train.checkpointing import apply_checkpointing
from .train.data import load_dataset
from .train.models import build_model
from .train.replica import Replica
from .train.sampling import build_loader, sampling_section


@contextmanager
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run(scenario: Scenario, on_step=None) -> Report:
    """Simulate the scenario; on_step(step, sim_time_s, loss) is called after every step (update, for async)."""
    wall_start = time.perf_counter()
    steps = scenario.train.steps
    asynchronous = scenario.parallel.scheme == "async"
    with _single_thread():
        cluster = build_cluster(scenario.cluster, scenario.base_dir, record=scenario.report.trace,
                                seed=scenario.seed)
        data = load_dataset(scenario.data.name, scenario.data.loader_options(), scenario.seed)
        model = build_model(scenario.model.name, scenario.model.builder_options(), data.info, scenario.seed)
        model = apply_checkpointing(model, scenario.train.checkpointing)
        optimizer = scenario.train.optimizer
        world = cluster.size
        replicas = [
            Replica(copy.deepcopy(model), build_loader(scenario, data.train, world, rank),
                    optimizer.name, optimizer.builder_options(),
                    scenario.train.precision, scenario.train.amp.model_dump())
            for rank in range(world)
        ]
        monitor = TrainLossMonitor(lambda: trained_model, data.train, scenario.report.every, steps, then=on_step)
        if asynchronous:
            scheme = AsynchronousSGD(cluster, replicas, model, scenario.parallel.async_, steps,
                                     optimizer.name, optimizer.builder_options(), on_step=monitor.on_step)
            trained_model = scheme.shared_model  # the replicas hold stale copies
        else:
            scheme = SyncDataParallel(cluster, replicas, scenario.parallel.scheme, steps,
                                      optimizer.name, optimizer.builder_options(), on_step=monitor.on_step,
                                      sync_batchnorm=scenario.parallel.sync_batchnorm,
                                      report_every=scenario.report.every, channels=scenario.parallel.channels)
            trained_model = replicas[0].model
        scheme.start()
        out_of_memory = None
        try:
            run_to_end(cluster.env)
        except OutOfMemory as error:  # the step stops here; report what is known so far
            out_of_memory = _out_of_memory_section(scenario, cluster, error, steps_done=len(scheme.loss_curve))
        stuck = [] if asynchronous or out_of_memory else scheme.comm.stuck()
        if stuck:
            raise RuntimeError(f"collective deadlock: ranks {stuck} wait for peers that never posted")
        for replica in replicas:  # mixed precision: the fp32 master weights are the trained model
            replica.precision.finish(replica.model)
        final_models = [trained_model] if asynchronous else [replica.model for replica in replicas]
        final_loss, _ = evaluate(trained_model, data.train)
        _, final_accuracy = evaluate(trained_model, data.test)
    sections = {"amp": replicas[0].precision.report()}
    if out_of_memory:  # the schemes' and samplers' sections describe whole runs
        sections["out_of_memory"] = out_of_memory
    else:
        sections.update(scheme.report_sections())  # async, or weight_norms and kfac
        if scenario.data.sampling != "uniform":
            sections["sampling"] = sampling_section([replica.loader for replica in replicas])
    result = RunResult(
        steps=len(scheme.loss_curve) if out_of_memory else steps,
        status="out_of_memory" if out_of_memory else "ok",
        samples_per_step=(1 if asynchronous else world) * scenario.data.batch_size,
        loss_curve=scheme.loss_curve,
        train_loss_curve=monitor.curve,
        time_to_target_s=(monitor.time_to(scenario.train.target_loss)
                          if scenario.train.target_loss is not None else None),
        final_loss=final_loss,
        final_accuracy=final_accuracy,
        single_device_step_s=scheme.single_device_step_s(),
        final_models=final_models,
        wall_time_s=time.perf_counter() - wall_start,
        extra=sections,
    )
    return build_report(scenario, cluster, result)


def _out_of_memory_section(scenario: Scenario, cluster, error: OutOfMemory, steps_done: int) -> dict:
    """report.json's `out_of_memory`: where the run stopped, what the device held, what batch would fit."""
    device = next(d for d in cluster.devices if d.memory.total > d.memory.capacity_bytes)
    largest = StepMemoryModel(scenario).largest_batch(device.rank)
    return {
        "rank": device.rank,
        "device": device.spec.name,
        "step": steps_done,
        "capacity_bytes": error.capacity_bytes,
        "needed_bytes": sum(error.by_category.values()),
        "bytes_by_category": error.by_category,
        "largest_batch_size_that_fits": largest,
        "message": f"{error}; the largest per-device batch size that fits is {largest}",
    }
