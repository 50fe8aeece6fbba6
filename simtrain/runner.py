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

from .hw.cluster import build_cluster, run_to_end
from .report import Report, RunResult, build_report
from .scenario import Scenario
from .schemes.sync import SyncDataParallel
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
        cluster = build_cluster(scenario.cluster, scenario.base_dir, record=scenario.report.trace)
        data = load_dataset(scenario.data.name, scenario.data.loader_options(), scenario.seed)
        model = build_model(scenario.model.name, scenario.model.builder_options(), data.info, scenario.seed)
        optimizer = scenario.train.optimizer
        world = cluster.size
        replicas = [
            Replica(copy.deepcopy(model), build_loader(scenario, data.train, world, rank),
                    optimizer.name, optimizer.builder_options())
            for rank in range(world)
        ]
        sampling = SamplingMonitor([replica.loader for replica in replicas], scenario.train.steps,
                                   train_loss=lambda: evaluate(replicas[0].model, data.train)[0], then=on_step)
        scheme = SyncDataParallel(cluster, replicas, scenario.parallel.scheme, scenario.train.steps,
                                  optimizer.name, optimizer.builder_options(), on_step=sampling.on_step)
        scheme.start()
        run_to_end(cluster.env)
        stuck = scheme.comm.stuck()
        if stuck:
            raise RuntimeError(f"collective deadlock: ranks {stuck} wait for peers that never posted")
        final_model = replicas[0].model
        final_loss, _ = evaluate(final_model, data.train)
        _, final_accuracy = evaluate(final_model, data.test)
    result = RunResult(
        steps=scenario.train.steps,
        samples_per_step=world * scenario.data.batch_size,
        loss_curve=scheme.loss_curve,
        final_loss=final_loss,
        final_accuracy=final_accuracy,
        single_device_step_s=scheme.single_device_step_s(),
        final_models=[replica.model for replica in replicas],
        wall_time_s=time.perf_counter() - wall_start,
        extra={"sampling": sampling.section()},
    )
    return build_report(scenario, cluster, result)


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset, batch_size: int = 1024) -> tuple[float, float]:
    """Mean cross entropy and accuracy of `model` over `dataset`."""
    was_training = model.training
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    for start in range(0, len(dataset), batch_size):
        items = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        x = torch.stack([item[0] for item in items])
        y = torch.stack([torch.as_tensor(item[1]) for item in items])
        logits = model(x)
        total_loss += F.cross_entropy(logits, y, reduction="sum").item()
        correct += int((logits.argmax(dim=1) == y).sum())
        count += len(items)
    model.train(was_training)
    return total_loss / count, correct / count
