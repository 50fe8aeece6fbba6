"""Times the parts of a data-parallel training step as `simtrain launch` runs them, every rank at once.

A launched step of synchronous data parallelism without overlap (the step engine's dp-alone case
on the real backend) is a step program: the replica's forward, drawing its
batch, and backward (schemes/local_work.py forward_backward), the all-reduce of
the gradient by simtrain's ring program over point-to-point calls, and the
optimizer step, one after the other, run by the host-clock interpreter
(real/interpreter.py) on a communicator of its own (comm/gloo.py). Calibration
runs the same step program through the same interpreter and communicator, the
all-reduce on a buffer of each size in turn, and keeps the spans the
interpreter measures, so that each part is what a launched run measures:

    repeats times: for each case (a model, its width and batch size): two steps not kept, then for each all-reduce size:
        forward (the draw of the batch inside) | backward | ring all-reduce of a buffer of that size | optimizer step

Everything takes turns, so that a change of the machine's speed during
calibration (its phases last seconds on a shared host) falls on every case and
every size alike. Timed one after the other, each case or size had a window of
its own, half a second long, and a slow phase there tilted the fit: with each
size's steps together (fifteen runs, 2026-12-03), the all-reduce's points from
8 B to 1 MiB, whose times hardly differ, scattered around the fitted line by
17-38% at the largest, and that scatter set the exchange's latency and
bandwidth. A case's steps stay together within a round (a launched run trains
one model, its weights in cache), after two steps not kept (its weights and
gloo's threads have just been idle).

Timed back to back instead, each part came out faster than in training: an
all-reduce that follows another finds gloo's threads awake and its buffers in
cache, where in training it follows a millisecond of compute. And a loop of its
own, outside the interpreter, came out 7-12% faster than a launched step on the
same replica in the same process (docs/validation/fidelity.md).

The replica is built as a launched run builds it (train/replica.py: the shard
loader, the flat gradient buffer, the optimizer). `time_steps` returns this
rank's seconds, one per kept step, in the same order on every rank (so that
calibrate.py can take, for each all-reduce, the rank that arrived last, as
launch.py does).

    cases = step_cases("scenario.yaml", rank, world)
    samples = time_steps(rank, world, cases, sizes=[4, 1024, 1 << 20], repeats=20, device="cpu")
    samples["all_reduce"][1][0]       # this rank's seconds of the first case's all-reduces of 1024 bytes, a round each
"""
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from ..comm import ALL_REDUCE
from ..comm.gloo import GlooCommunicator
from ..hw.device import MemoryLedger
from ..scenario import ModelSpec, TrainSpec, load_scenario
from ..schemes.local_work import forward_backward
from ..step_ops import Collective, MemoryBound
from ..train.data import ShardLoader, load_dataset
from ..train.models import build_model
from ..train.precision import update_bytes
from ..train.replica import Replica
from .interpreter import Meter, run_program

GEMM_SIZES = (64, 128, 256)  # without a scenario: a square Linear layer of each width, on a batch as wide
# with a scenario: its model also this many times as wide, so that updates of other sizes tell the update's fixed
# cost from its bandwidth (fit.py fit_update_costs)
WIDTH_FACTORS = (0.75, 1.25)
SPANS = {"forward": "forward", "backward": "backward", "optimizer step": "optimizer"}  # the meter's: the samples'


class StepCase(NamedTuple):
    label: str  # what the case trains: the scenario's model at a width and batch size, or a Linear layer
    replica: Replica
    batch: int
    update_bytes: float  # what the simulator charges for the optimizer step (train/precision.py)


def step_cases(model_of: str | None, rank: int, world: int, device="cpu") -> list[StepCase]:
    """The scenario's model on batches of half, one and two times its batch size, and on its batch size at
    WIDTH_FACTORS times its width (this rank's shard, its optimizer and precision), or square Linear layers
    trained with SGD on random batches."""
    if model_of is not None:
        scenario = load_scenario(model_of)
        data = load_dataset(scenario.data.name, scenario.data.loader_options(), scenario.seed)
        batch = scenario.data.batch_size

        def case(label: str, model: ModelSpec, size: int) -> tuple:
            return (label, build_model(model, data.info, scenario.seed),
                    ShardLoader(data.train, world, rank, size, scenario.seed), size, scenario.train)
        built = [case(f"batch {size}", scenario.model, size) for size in sorted({max(1, batch // 2), batch, 2 * batch})]
        for factor in WIDTH_FACTORS:
            model = widened(scenario.model, factor)
            if model is not None and model != scenario.model:
                built.append(case(f"{factor:g} x width, batch {batch}", model, batch))
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
        cases.append(StepCase(label, replica, batch, update_bytes(replica.params, train.precision, train.optimizer)))
    return cases


def widened(model: ModelSpec, factor: float) -> ModelSpec | None:
    """`model` with its widths `factor` times as wide, rounded: an mlp's hidden layers, a cnn's channels, a gpt's
    or llama's width (a multiple of its heads; for a llama, of twice them: rotary embeddings turn pairs) and a
    llama's ffn_hidden where given. None for a user's model, whose widths calibration does not know."""
    def scaled(width: int, unit: int = 1) -> int:
        return max(unit, unit * round(width * factor / unit))
    if model.name == "mlp":
        return model.model_copy(update={"hidden": [scaled(width) for width in model.hidden]})
    if model.name == "cnn":
        return model.model_copy(update={"channels": [scaled(width) for width in model.channels]})
    if model.name in ("gpt", "llama"):
        unit = model.heads * (2 if model.name == "llama" else 1)
        changes = {"hidden": [scaled(model.width, unit)]}
        if model.ffn_hidden is not None:
            changes["ffn_hidden"] = scaled(model.ffn_hidden)
        return model.model_copy(update=changes)
    return None


def time_steps(rank: int, world: int, cases: list[StepCase], sizes: list[int], repeats: int, device) -> dict:
    """{"forward" | "backward" | "optimizer": [[seconds per kept step] per case],
    "all_reduce": [[[seconds per round] per case] per size]}: this rank's."""
    samples = {part: [[] for _ in cases] for part in SPANS.values()}
    samples["all_reduce"] = [[[] for _ in cases] for _ in sizes]
    comm, meter = GlooCommunicator(range(world)), Meter()
    ledger = MemoryLedger("calibration", float("inf"))
    buffers = [torch.ones(max(world, size // 4), dtype=torch.float32, device=device) for size in sizes]
    meter.start_recording()
    for _ in range(repeats):
        for case_index, case in enumerate(cases):
            dist.barrier()
            for size_index in [None, None, *range(len(sizes))]:  # two steps not kept, then one a size
                meter.boundary()
                run_program(_step_program(case, rank, world, buffers[size_index or 0]), comm, ledger, meter)
                for span in meter.spans if size_index is not None else ():
                    seconds = span.end - span.start
                    if span.kind == "communication":
                        samples["all_reduce"][size_index][case_index].append(seconds)
                    else:
                        samples[SPANS[span.name]][case_index].append(seconds)
                meter.spans.clear()
    return samples


def _step_program(case: StepCase, rank: int, world: int, buffer: torch.Tensor):
    """A launched step of sync data parallelism without overlap, the all-reduce on `buffer`."""
    yield from forward_backward(case.replica)
    yield Collective(ALL_REDUCE["ring"](rank, world, buffer, average=True), "all_reduce")
    case.replica.step()
    yield MemoryBound(case.update_bytes, "optimizer step", kind="optimizer", updates=1)
