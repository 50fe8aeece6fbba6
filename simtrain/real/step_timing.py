"""Times the parts of a data-parallel training step as `simtrain launch` runs them, every rank at once.

A launched step of synchronous data parallelism without overlap (schemes/sync.py
on the real backend) draws its batch, runs the forward and the backward,
all-reduces the gradient with simtrain's ring program over point-to-point calls,
and steps the optimizer, one after the other. Timed back to back instead, each
part comes out faster than in training: an all-reduce that follows another finds
gloo's threads awake and its buffers in cache, where in training it follows a
millisecond of compute; a forward timed on a fixed batch leaves out the draw. So
calibration times the parts in the loop training runs:

    for each case (a model and its batch size), for each all-reduce size, repeats + 2 times:
        draw the batch | forward | backward | ring all-reduce of a buffer of that size | optimizer step

on a `Replica` built as a launched run builds it (train/replica.py: the shard
loader, the flat gradient buffer, the optimizer). The draw is the loader's
`next_batch` (indexing the data set); the forward casts the batch, zeroes the
gradient buffer and computes the loss, as `Replica.forward` does after its draw;
the all-reduce averages, as training's does. The first two iterations of each
(case, size) are not kept. `time_steps` returns this rank's seconds, one per
kept iteration, in the same order on every rank (so that calibrate.py can take,
for each all-reduce, the rank that arrived last, as launch.py does).

    cases = step_cases("scenario.yaml", rank, world)
    samples = time_steps(rank, world, cases, sizes=[4, 1024, 1 << 20], repeats=20, device="cpu")
    samples["all_reduce"][1]          # this rank's seconds of every kept all-reduce of 1024 bytes
"""
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from ..comm import ALL_REDUCE
from ..comm.gloo import run_program
from ..scenario import TrainSpec, load_scenario
from ..train.data import ShardLoader, load_dataset
from ..train.models import build_model
from ..train.precision import update_bytes
from ..train.replica import Replica

GEMM_SIZES = (64, 128, 256)  # without a scenario: a square Linear layer of each width, on a batch as wide
PARTS = ("draw", "forward", "backward", "optimizer")  # timed per case; the all-reduce per size


class StepCase(NamedTuple):
    label: str  # what the case trains: the scenario's model at a batch size, or a Linear layer
    replica: Replica
    batch: int
    update_bytes: float  # what the simulator charges for the optimizer step (train/precision.py)
    update_kernels: int  # the operators the optimizer step dispatches (Replica.step_kernels)


def step_cases(model_of: str | None, rank: int, world: int, device="cpu") -> list[StepCase]:
    """The scenario's model on batches of half, one and two times its batch size (this rank's shard, its
    optimizer and precision), or square Linear layers trained with SGD on random batches."""
    if model_of is not None:
        scenario = load_scenario(model_of)
        data = load_dataset(scenario.data.name, scenario.data.loader_options(), scenario.seed)
        batch = scenario.data.batch_size
        built = [(f"batch {size}", build_model(scenario.model, data.info, scenario.seed),
                  ShardLoader(data.train, world, rank, size, scenario.seed), size, scenario.train)
                 for size in sorted({max(1, batch // 2), batch, 2 * batch})]
    else:
        built = []
        for width in GEMM_SIZES:
            generator = torch.Generator().manual_seed(width)
            samples = TensorDataset(torch.randn(4 * width, width, generator=generator),
                                    torch.randint(0, width, (4 * width,), generator=generator))
            built.append((f"Linear {width}", torch.nn.Sequential(torch.nn.Linear(width, width)),
                          ShardLoader(samples, 1, 0, width, seed=0), width, TrainSpec()))
    cases = []
    for label, model, loader, batch, train in built:
        replica = Replica(model.to(device), loader, train)
        cases.append(StepCase(label, replica, batch, update_bytes(replica.params, train.precision, train.optimizer),
                              replica.step_kernels()))
    return cases


def time_steps(rank: int, world: int, cases: list[StepCase], sizes: list[int], repeats: int, device) -> dict:
    """{"draw" | "forward" | "backward" | "optimizer": [[seconds per kept iteration] per case],
    "all_reduce": [[seconds per kept iteration, cases in order] per size]}: this rank's."""
    samples = {part: [[] for _ in cases] for part in PARTS}
    samples["all_reduce"] = [[] for _ in sizes]
    for case_index, case in enumerate(cases):
        for size_index, size in enumerate(sizes):
            buffer = torch.ones(max(world, size // 4), dtype=torch.float32, device=device)
            dist.barrier()
            for iteration in range(repeats + 2):
                draw, forward, backward, all_reduce, optimizer = _timed_step(case.replica, rank, world, buffer,
                                                                             device)
                if iteration < 2:
                    continue
                for part, seconds in (("draw", draw), ("forward", forward), ("backward", backward),
                                      ("optimizer", optimizer)):
                    samples[part][case_index].append(seconds)
                samples["all_reduce"][size_index].append(all_reduce)
    return samples


def _timed_step(replica: Replica, rank: int, world: int, buffer: torch.Tensor, device) -> list[float]:
    """One training step's seconds: draw, forward, backward, all-reduce of `buffer`, optimizer step."""
    marks = [time.perf_counter()]

    def mark():
        if device != "cpu":
            torch.cuda.synchronize(device)
        marks.append(time.perf_counter())

    x, y = replica.loader.next_batch()
    mark()
    x, y = replica.precision.cast_input(x).to(device), y.to(device)
    replica.last_batch = (x, y)
    replica.grad_buffer.zero_()
    loss = replica.loader.batch_loss(replica.model(x), y)
    mark()
    replica.backward(loss)
    mark()
    run_program(ALL_REDUCE["ring"](rank, world, buffer, average=True))
    mark()
    replica.step()
    mark()
    return [end - start for start, end in zip(marks, marks[1:])]
