"""One operator recorder: a model costs the same under `simtrain run` and under `simtrain.dist.spawn`.

References: torch's FlopCounterMode (the FLOPs), a closed form (a linear layer's kernels and bytes), and
simtrain run against a user's own DDP loop on simulated ranks.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.flop_counter import FlopCounterMode

import simtrain
import simtrain.dist
from simtrain.op_cost import OperatorRecorder
from simtrain.scenario import load_scenario
from simtrain.train.data import load_dataset
from simtrain.train.models import build_model

WORLD, BATCH, STEPS = 2, 16, 3
SCENARIO = f"""name: recorder
seed: 0
cluster: {{topology: ring, devices: {WORLD}}}
model: {{name: mlp, hidden: [32, 32]}}
data: {{name: digits, batch_size: {BATCH}}}
train: {{steps: {STEPS}, optimizer: {{name: sgd, lr: 0.1}}}}
report: {{trace: false}}
"""


def test_flops_are_torchs_flop_counter_s():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    x = torch.randn(4, 3, 8, 8)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), torch.zeros(4, dtype=torch.long)).backward()
    with OperatorRecorder() as recorder:
        F.cross_entropy(model(x), torch.zeros(4, dtype=torch.long)).backward()
    assert recorder.flops == counter.get_total_flops() > 0
    assert recorder.flops_by_dtype == {torch.float32: recorder.flops}


def test_a_linear_layer_is_one_kernel_of_its_flops_and_bytes():
    layer, x = nn.Linear(64, 32), torch.empty(16, 64)
    with OperatorRecorder() as recorder:
        layer(x)
    # addmm (the transposed weight is a view, a kernel of no cost): reads x, W, b and writes y, fp32
    assert recorder.kernels == 2 and recorder.flops == 2 * 16 * 64 * 32
    assert recorder.take() == ((2.0 * 16 * 64 * 32, 4.0 * (16 * 64 + 64 * 32 + 32 + 16 * 32), 1, "fp32",
                                ("gemm", 16, 32, 1)),)


def test_one_model_one_batch_costs_the_same_compute_under_run_and_spawn(tmp_path):
    path = tmp_path / "recorder.yaml"
    path.write_text(SCENARIO)
    scenario = load_scenario(path)
    simulated = simtrain.run(scenario).data
    info = load_dataset("digits", {}, seed=0).info

    def ddp_loop(rank, world):  # a user's own DDP training loop, batches of the same shape
        dist.init_process_group("simtrain")
        model = DistributedDataParallel(build_model(scenario.model, info, seed=0))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(rank)
        for _ in range(STEPS):
            x = torch.randn(BATCH, *info.input_shape, generator=generator)
            y = torch.randint(0, info.num_classes, (BATCH,), generator=generator)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

    spawned = simtrain.dist.spawn(ddp_loop, scenario=path).report.data
    for run_device, spawn_device in zip(simulated["devices"], spawned["devices"]):
        assert run_device["breakdown_s"]["compute"] > 0
        assert spawn_device["compute_s"] == pytest.approx(run_device["breakdown_s"]["compute"], rel=1e-12)
