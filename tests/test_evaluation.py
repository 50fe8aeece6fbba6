"""Training-set loss curve and time to target: against losses computed by hand."""
import math

import pytest
import torch
from torch.utils.data import TensorDataset

from simtrain.evaluation import TrainLossMonitor, evaluate


def uniform_model(classes=4, features=3):
    model = torch.nn.Linear(features, classes)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    return model


def dataset(labels):
    x = torch.randn(len(labels), 3, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, torch.tensor(labels))


def test_evaluate_uniform_logits_give_log_classes():
    loss, accuracy = evaluate(uniform_model(), dataset([0, 1, 2, 3, 0, 1, 2, 3, 0, 1]))
    assert loss == pytest.approx(math.log(4))
    assert accuracy == pytest.approx(3 / 10)  # argmax of equal logits is class 0: samples 0, 4, 8


def test_monitor_records_every_few_steps_and_the_last_and_finds_the_target():
    model = uniform_model()
    seen = []
    monitor = TrainLossMonitor(lambda: model, dataset([0] * 10), every=2, steps=5, then=lambda *a: seen.append(a))
    for step in range(5):
        if step == 3:  # from then on the model is sure of class 0, every sample's label
            model.bias.data = torch.tensor([10.0, 0.0, 0.0, 0.0])
        monitor.on_step(step, 0.5 * (step + 1), loss=float(step))
    sure = math.log(1 + 3 * math.exp(-10))
    assert [point[:2] for point in monitor.curve] == [[2, 1.0], [4, 2.0], [5, 2.5]]
    assert [point[2] for point in monitor.curve] == pytest.approx([math.log(4), sure, sure], abs=1e-6)  # float32
    assert monitor.time_to(1.5) == 1.0
    assert monitor.time_to(1e-3) == 2.0
    assert monitor.time_to(1e-5) is None
    assert len(seen) == 5 and seen[-1] == (4, 2.5, 4.0)
