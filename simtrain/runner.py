"""Scenario -> cluster + workload -> Report.

    from simtrain import load_scenario, run
    report = run(load_scenario("scenarios/quickstart.yaml", ["cluster.devices=8"]))
    print(report.data["step_time_s"])

Initialization follows the DDP contract: `torch.manual_seed(seed)` right before
the model is built, and every replica is a copy of that model. Torch runs on
one host thread so results are the same on every machine. The final loss is
the final model's mean cross entropy over the whole training set and the final
accuracy its accuracy on the test set; evaluating costs no simulated time.
"""
import copy
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from .errors import OutOfMemory, ScenarioError
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
from .train.sampling import SamplingMonitor, build_loader


@contextmanager
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run(scenario: Scenario, on_step=None) -> Report:
    """Simulate the scenario; on_step(step, sim_time_s, loss) is called after every step."""
    wall_start = time.perf_counter()
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
        sampling = SamplingMonitor([replica.loader for replica in replicas], scenario.train.steps,
                                   train_loss=lambda: evaluate(replicas[0].model, data.train)[0], then=on_step)
        asynchronous = scenario.parallel.scheme == "async"
        if asynchronous and scenario.train.precision != "fp32":  # its shared fp32 parameters have no master copy
            raise ScenarioError(f"train.precision: {scenario.train.precision} runs with the synchronous schemes "
                                "(naive, ring, tree), not with async")
        if asynchronous and (optimizer.name == "kfac" or scenario.parallel.sync_batchnorm):
            field = "train.optimizer.name: kfac" if optimizer.name == "kfac" else "parallel.sync_batchnorm"
            raise ScenarioError(f"{field} needs a synchronous scheme (naive, ring or tree), not async")
        if asynchronous:
            # No sampling monitor: it evaluates replica 0, a stale copy here, every few updates.
            scheme = AsynchronousSGD(cluster, replicas, model, scenario.parallel.async_, scenario.train.steps,
                                     optimizer.name, optimizer.builder_options(), on_step=on_step)
        else:
            scheme = SyncDataParallel(cluster, replicas, scenario.parallel.scheme, scenario.train.steps,
                                      optimizer.name, optimizer.builder_options(), on_step=sampling.on_step,
                                      sync_batchnorm=scenario.parallel.sync_batchnorm,
                                      report_every=scenario.report.every)
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
        # Async: the shared parameters are the model; the replicas hold stale copies.
        final_models = [scheme.shared_model] if asynchronous else [replica.model for replica in replicas]
        final_model = final_models[0]
        final_loss, _ = evaluate(final_model, data.train)
        _, final_accuracy = evaluate(final_model, data.test)
    result = RunResult(
        steps=len(scheme.loss_curve) if out_of_memory else scenario.train.steps,
        status="out_of_memory" if out_of_memory else "ok",
        samples_per_step=(1 if asynchronous else world) * scenario.data.batch_size,
        loss_curve=scheme.loss_curve,
        final_loss=final_loss,
        final_accuracy=final_accuracy,
        single_device_step_s=scheme.single_device_step_s(),
        final_models=final_models,
        wall_time_s=time.perf_counter() - wall_start,
        # The sampling section's windows count steps of every loader; async loaders draw about steps / world.
        # Out of memory: the schemes' and sampler's sections describe whole runs and are left out.
        extra={"out_of_memory": out_of_memory, "amp": replicas[0].precision.report()} if out_of_memory else {
               **({"async": scheme.report_section()} if asynchronous else {"sampling": sampling.section()}),
               "amp": replicas[0].precision.report(),
               **({} if asynchronous else scheme.report_sections()),  # weight_norms, kfac
               },
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


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset, batch_size: int = 1024) -> tuple[float, float]:
    """Mean cross entropy and accuracy of `model` over `dataset`."""
    was_training = model.training
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    for start in range(0, len(dataset), batch_size):
        x, y = _rows(dataset, start, min(start + batch_size, len(dataset)))
        parameter = next(model.parameters(), None)
        if parameter is not None and x.is_floating_point():  # a mixed-precision model mid-training
            x = x.to(parameter.dtype)
        logits = model(x).float()
        total_loss += F.cross_entropy(logits, y, reduction="sum").item()
        correct += int((logits.argmax(dim=1) == y).sum())
        count += len(y)
    model.train(was_training)
    return total_loss / count, correct / count


def _rows(dataset, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples start..end-1 of `dataset` as one (x, y) batch (sliced directly from a TensorDataset)."""
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        return dataset.tensors[0][start:end], dataset.tensors[1][start:end]
    items = [dataset[i] for i in range(start, end)]
    return torch.stack([item[0] for item in items]), torch.stack([torch.as_tensor(item[1]) for item in items])
