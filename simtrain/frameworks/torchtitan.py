"""torchtitan's own training, unmodified, on the simulated ranks of a cluster.

    simtrain torchtitan --cluster cluster.yaml -- --module llama3 --config llama3_8b --training.steps 3

What follows `--` is what `torchrun ... -m torchtitan.train` takes: torchtitan's `ConfigManager` parses it, its
`Trainer` is built from the config and its `train()` runs, on every rank of `simtrain.dist.spawn`. simtrain stands
in only where a real run reaches the machine:

- **the process group**: torchtitan asks for its device's default backend; a CPU's (gloo) is simtrain's for the
  run, so every group of its device mesh is a simulated one (`fake`, which torchtitan takes for mesh dimensions of
  size one, waits for no one and is let through);
- **the device**: torchtitan's device module (`torch.cuda` on a GPU) is `SimulatedGpu`, which answers from the rank's
  simulated GPU: its name, its memory and the peak of its ledger (`torch.cuda.memory_stats`'s two peaks, which
  torchtitan logs), and its bf16 peak for torchtitan's MFU; tensors live on the CPU (torchtitan's `device_type`);
- **FlexAttention**, the attention torchtitan's language models take, is a Triton kernel that torch.compile
  builds for a GPU (on a CPU it has no backward): it runs as simtrain's fused masked attention
  (`train/fused_attention.py`), the scores the block mask's `mask_mod` hides left out, charged the FLOPs of the
  score blocks the block mask keeps, as FlexAttention computes only those (`flex_attention`, below);
- **`torch.distributed.set_timeout`**, which torchtitan 0.3.0 calls after the first step, is torch nightly's
  (torchtitan's README asks for a nightly) and not in the torch simtrain runs on: while none is there, a no-op
  stands in for it (a simulated group has no timeout to set);
- **torch's context parallelism** builds each rank's block mask with `torch.compile(create_block_mask)`, which does
  not run on simulated ranks (it compiles for the host, inside a rank thread): the same function runs eagerly, with
  the same mask;
- **a pipeline schedule's `step`**: torchtitan 0.3.0 hands it the batch already cut into micro-batches, as torch
  nightly's takes it (`arg_mbs=`, `kwarg_mbs=`, `target_mbs=`); where torch's takes the whole batch only, a
  `step` that also takes the micro-batches stands in (`_step_of_microbatches`);
- **the clock**: torchtitan's timings (its `time.perf_counter`, hence its tokens per second, TFLOP/s and MFU) read
  the rank's simulated clock, after its counted operators have run (as a CUDA synchronize would); its
  `time.sleep` (rank 0 sleeps two seconds after the last step) takes none.

With numerics off (the default, `--numerics` for values) the floating-point tensors are fake
(torchdist/numerics_off.py), so no loss has a value: torchtitan's metric logging, which reads the loss and gradient
norm (`.item()`), is off, and simtrain's report gives the step times, memory and bytes instead. Tensor-parallel
ranks run alike, so one runs for all of them (`representatives`, below).
"""
import contextlib
import gc
import inspect
import io
import logging
import math
import os
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import ScenarioError
from ..hw.resolved_cluster import resolve_cluster
from ..scenario import Scenario
from ..torchdist import Representatives, SpawnResult, now_s, spawn
from ..torchdist.run import SimRun
from ..torchdist.scheduler import current_rank
from ..train.fused_attention import masked_attention
from .stand_ins import attributes_set

# Where torchtitan 0.3.0 keeps the device type and module it picked on import (`from torchtitan.tools.utils import
# device_module, device_type`): each module's own name.
_DEVICE_NAMES = {"torchtitan.tools.utils": ("device_type", "device_module"),
                 "torchtitan.components.metrics": ("device_type", "device_module"),
                 "torchtitan.distributed.utils": ("device_type", "device_module"),
                 "torchtitan.distributed.parallel_dims": ("device_type",),
                 "torchtitan.models.common.token_dispatcher": ("device_type", "device_module"),
                 "torchtitan.tools.profiler": ("device_module",)}
# The modules whose `time` torchtitan's timings read.
_CLOCK_USERS = ("torchtitan.trainer", "torchtitan.components.metrics")


@dataclass
class TitanRun:
    """What a torchtitan run on simulated ranks gave: its arguments, rank 0's step times (simulated seconds from
    the start of a training step to the end of its optimizer step, its operators all run), the last rank's losses
    (numerics on, the steps torchtitan logs; the last rank holds a last pipeline stage, where the loss is), the figures torchtitan counts its throughput by (each rank's tokens per step, its
    FLOPs per token, the ranks that share a batch: cp x tp x pp), rank 0's device, and the spawn's result (its
    report)."""

    arguments: list[str]
    step_s: list[float]
    losses: list[float]
    tokens_per_step: int
    flops_per_token: float
    non_data_parallel: int
    device_name: str
    peak_flops: float
    result: SpawnResult

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """The last step's throughput as torchtitan counts it: a rank's tokens over the step and the ranks that
        share its batch."""
        return self.tokens_per_step / self.step_s[-1] / self.non_data_parallel

    @property
    def mfu(self) -> float:
        """The last step's model FLOPs (torchtitan's count per token) over the device's bf16 peak."""
        return self.flops_per_token * self.tokens_per_s_per_gpu / self.peak_flops


def _rank_device():
    """The calling rank's simulated GPU."""
    return SimRun.active("torchtitan's device module").cluster.devices[current_rank()]


class SimulatedGpu:
    """torchtitan's device module (`torch.cuda` on a GPU), answering for the calling rank's simulated GPU."""

    def get_device_name(self, device=None) -> str:
        return _rank_device().spec.name

    def get_device_properties(self, device=None):
        spec = _rank_device().spec
        return SimpleNamespace(name=spec.name, total_memory=int(spec.memory_bytes))

    def memory_stats(self, device=None) -> dict:
        """The two peaks torchtitan reads: the ledger's, over the run so far (simtrain keeps one peak per run)."""
        peak = _rank_device().memory.peak_total
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak, "num_alloc_retries": 0,
                "num_ooms": 0}

    def synchronize(self, device=None) -> None:
        SimRun.active("torchtitan's device module").flush()

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device) -> None:
        pass

    def reset_peak_memory_stats(self, device=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass


class SimulatedClock:
    """The `time` module torchtitan's timings read: the calling rank's simulated clock (the wall clock elsewhere)."""

    @staticmethod
    def perf_counter() -> float:
        return now_s() if current_rank() is not None else time.perf_counter()

    @staticmethod
    def sleep(seconds: float) -> None:
        if current_rank() is None:
            time.sleep(seconds)

    def __getattr__(self, name):
        return getattr(time, name)


def flex_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """FlexAttention (torch.nn.attention.flex_attention's signature, as torchtitan calls it) as simtrain's fused
    masked attention: with values, the scores `block_mask.mask_mod` hides at -inf; charged the share of score
    blocks the block mask computes (its full and partial blocks)."""
    from torch.nn.attention.flex_attention import AuxOutput, create_mask
    if score_mod is not None:
        raise ScenarioError("torchtitan: FlexAttention with a score_mod: simtrain runs FlexAttention as masked "
                            "attention, which has none")
    q_length, width = q.shape[-2:]
    blocks = block_mask.kv_num_blocks.sum()
    if block_mask.full_kv_num_blocks is not None:
        blocks = blocks + block_mask.full_kv_num_blocks.sum()
    kept = min(1.0, int(blocks) * block_mask.BLOCK_SIZE[0] * block_mask.BLOCK_SIZE[1] / block_mask.numel())
    hidden = None
    if not isinstance(q, FakeTensor):  # values: the dense mask, made outside the rank's meter (a GPU makes none)
        with _disable_current_modes():
            hidden = ~create_mask(block_mask.mask_mod, block_mask.kv_num_blocks.shape[0], 1, q_length, k.shape[-2],
                                  device=q.device)
    divisor = math.sqrt(width) if scale is None else 1 / scale
    out, lse = masked_attention(q, k, v, hidden, divisor, kept)
    return out, AuxOutput(lse=lse if return_aux is not None and return_aux.lse else None)


def parse_config(arguments: list[str]):
    """torchtitan's config from its command-line `arguments` (ConfigManager's); a refusal is one line."""
    from torchtitan.config import ConfigManager
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            return ConfigManager().parse_args(list(arguments))
    except SystemExit:  # tyro prints its complaint and exits
        raise ScenarioError(f"torchtitan's arguments: {_tyro_complaint(printed.getvalue())}") from None
    except (ValueError, ImportError, AssertionError) as error:
        raise ScenarioError(f"torchtitan's arguments: {error}") from None


def _tyro_complaint(printed: str) -> str:
    """What tyro says is wrong: its message's first paragraph, between the rule of dashes under its title and the
    next, on one line (tyro wraps it where the output is not a terminal)."""
    lines = [line.strip() for line in printed.splitlines()]
    rules = [i for i, line in enumerate(lines) if line and not line.strip("-")]
    body = lines[rules[0] + 1:rules[1] if len(rules) > 1 else None] if rules else []
    return " ".join(line for line in body if line) or "refused"


def representatives(config, world: int) -> Representatives:
    """The ranks of torchtitan's mesh (pp x batch x cp x tp, row-major as it lays it out) that run alike: along the
    tensor-parallel dimension (each rank multiplies a slice of the same shape, on the same tokens). Data-parallel
    ranks do not: each reads other documents, and FlexAttention's document mask, hence its FLOPs, follows where
    they end (the witness finds them apart at the first attention). Pipeline stages hold different layers, and
    context-parallel ranks pass their keys and values to each other (a send between alike ranks cannot be stood
    in for), so those run each too."""
    parallelism = config.parallelism
    pp, cp, tp = (parallelism.pipeline_parallel_degree, parallelism.context_parallel_degree,
                  parallelism.tensor_parallel_degree)
    batch = world // (pp * cp * tp) if world % (pp * cp * tp) == 0 else 0
    if batch < 1:
        raise ScenarioError(f"torchtitan's arguments: parallelism: pp {pp} x cp {cp} x tp {tp} does not divide "
                            f"the {world} ranks")
    return Representatives((pp, batch, cp, tp), alike_dims=(3,))


@contextlib.contextmanager
def cpu_machine(device_module):
    """torchtitan set to run on the CPU, until the block ends: its device type "cpu" and its device module
    `device_module`, FlexAttention as simtrain's masked attention, context parallelism's block mask built eagerly,
    `torch.distributed.set_timeout` and the pipeline schedules' `step` of micro-batches where torch has none (see
    above). What a simulated run and a gloo run of the same job share."""
    import importlib
    changes = [(importlib.import_module(module), name, "cpu" if name == "device_type" else device_module)
               for module, names in _DEVICE_NAMES.items() for name in names]
    changes.append((importlib.import_module("torchtitan.models.common.attention").FlexAttention,
                    "_compiled_flex_attn", flex_attention))
    if not hasattr(dist, "set_timeout"):
        changes.append((dist, "set_timeout", lambda timeout, group=None: None))
    from torch.distributed.tensor.experimental._context_parallel import _attention
    from torch.nn.attention.flex_attention import create_block_mask
    changes.append((_attention, "_compiled_create_block_mask", create_block_mask))
    from torch.distributed.pipelining import schedules
    if "arg_mbs" not in inspect.signature(schedules.PipelineScheduleSingle.step).parameters:
        changes += [(schedule, "step", _step_of_microbatches(schedule.step))
                    for schedule in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti)]
    with attributes_set(changes):
        yield


def _step_of_microbatches(step):
    """A pipeline schedule's `step` that also takes the batch already cut into micro-batches, as torch nightly's does
    and torchtitan 0.3.0 calls it (`arg_mbs`, `kwarg_mbs`, `target_mbs`: one entry per micro-batch): what torch
    2.13's `step` does before and after running its micro-batches, on those given; the whole batch, as before."""
    def stepped(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True,
                loss_kwargs=None, **kwargs):
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return step(self, *args, losses=losses, return_outputs=return_outputs, loss_kwargs=loss_kwargs,
                        **kwargs)
        stages = self._stages if hasattr(self, "_stages") else [self._stage]
        for stage in stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        count = self._n_microbatches
        self._step_microbatches(arg_mbs or [()] * count, kwarg_mbs or [{}] * count, target_mbs, losses,
                                return_outputs, loss_kwargs=loss_kwargs)
        last = [stage for stage in stages if stage.is_last]
        return self._merge_outputs(last[0].output_chunks) if last and return_outputs else None

    return stepped


@contextlib.contextmanager
def simulated_machine():
    """torchtitan's device, process-group backend and clock set to simtrain's until the block ends (see above)."""
    import importlib
    changes = [(importlib.import_module(module), "time", SimulatedClock()) for module in _CLOCK_USERS]
    changes += [(importlib.import_module("torchtitan.tools.utils"), "get_peak_flops",
                 lambda device_name: _rank_device().spec.peak_flops["bf16"]),
                (dist.Backend.default_device_backend_map, "cpu", "simtrain"),
                (os.environ, "LOCAL_RANK", "0")]  # each rank is its own simulated host's device 0
    collecting = gc.isenabled()  # torchtitan's GarbageCollection turns the collector off, for the process
    try:
        with cpu_machine(SimulatedGpu()), attributes_set(changes):
            yield
    finally:
        if collecting:
            gc.enable()


@dataclass
class RankRun:
    """One rank's run of torchtitan's Trainer: the trainer (closed), each step's seconds (from its start to the end
    of its optimizer step, its operators all run: on the rank's clock, simulated or the wall's) and each logged
    step's loss (torchtitan's global average; none with numerics off)."""

    trainer: object
    step_s: list[float]
    losses: list[float]

    def throughput_figures(self) -> dict:
        """What torchtitan counts its throughput by: the rank's tokens per step, FLOPs per token and the ranks that
        share its batch (cp x tp x pp)."""
        trainer = self.trainer
        training = trainer.config.training
        return {"tokens_per_step": training.local_batch_size * training.seq_len * trainer.gradient_accumulation_steps,
                "flops_per_token": trainer.metrics_processor.num_flops_per_token,
                "non_data_parallel": trainer.parallel_dims.non_data_parallel_size}


def train(arguments: list[str], numerics: bool, log_metrics: bool | None = None) -> RankRun:
    """In a rank (of a simulated cluster, or a real process group): torchtitan's Trainer configured by `arguments`,
    built, trained and closed, as `torchtitan.train` does. Its metric logging (the loss and gradient norm read,
    and all-reduced over the data-parallel ranks, on the steps it logs) as `log_metrics` says; by default on with
    numerics, off without (see above)."""
    trainer = parse_config(arguments).build()
    run = RankRun(trainer, [], [])
    if not (numerics if log_metrics is None else log_metrics):
        trainer.metrics_processor.should_log = lambda step: False
    trainer.train_step = _timed(trainer.train_step, run.step_s)
    log = trainer.metrics_processor.log

    def logged(step, global_avg_loss, *args, **kwargs):
        run.losses.append(global_avg_loss)
        return log(step, global_avg_loss, *args, **kwargs)

    trainer.metrics_processor.log = logged
    try:
        trainer.train()
    finally:
        trainer.close()
    return run


def run_torchtitan(arguments: list[str], scenario: Scenario, numerics: bool = False,
                   log_metrics: bool | None = None) -> TitanRun:
    """torchtitan's training, as its command-line `arguments` configure it, on every device of `scenario`'s cluster:
    its Trainer built and trained on each rank (`train`'s `log_metrics`); the step times and the run's report."""
    config = parse_config(arguments)
    if config.compile.enable:
        raise ScenarioError("torchtitan's arguments: compile.enable: torch.compile does not run on simulated ranks "
                            "(its kernels are built for a GPU); pass --compile.no-enable")
    cluster = resolve_cluster(scenario.cluster, scenario.base_dir)
    world, device = cluster.devices, cluster.device_specs[0]
    # torchtitan 0.3.0 is written for a torch nightly (set_timeout is one of its APIs): on an older torch its
    # default backend stops in fully_shard on every mesh of several ranks (measured on torch 2.13)
    if config.parallelism.spmd_backend == "spmd_types" and world > 1 and not hasattr(dist, "set_timeout"):
        raise ScenarioError(f"torchtitan's arguments: parallelism.spmd_backend: spmd_types (0.3.0's default) stops in "
                            f"FSDP2's fully_shard with torch {torch.__version__} (\"all parameters must be DTensors on "
                            f"the full SPMD mesh\") on a mesh of several ranks; pass --parallelism.spmd_backend "
                            f"partial_dtensor")
    runs: dict[int, RankRun] = {}

    def rank(rank: int, world: int) -> dict:
        runs[rank] = train(arguments, numerics, log_metrics)
        return runs[rank].throughput_figures()

    with simulated_machine(), rank_zero_logs():
        result = spawn(rank, scenario=scenario, numerics=numerics, timeout_s=None,
                       representatives=None if numerics else representatives(config, world))
    return TitanRun(arguments=list(arguments), step_s=runs[0].step_s, losses=runs[max(runs)].losses, **result[0],
                    device_name=device.name, peak_flops=device.peak_flops["bf16"], result=result)


@contextlib.contextmanager
def rank_zero_logs():
    """torchtitan's log (its `init_logger`, as `torchtitan.train` calls it), rank 0's lines only (as torchtitan's
    run script has torchrun filter them: `--local-ranks-filter 0`)."""
    from torchtitan.tools.logging import init_logger, logger
    init_logger()
    only_rank_zero = logging.Filter()
    only_rank_zero.filter = lambda record: current_rank() in (None, 0)
    logger.addFilter(only_rank_zero)
    try:
        yield
    finally:
        logger.removeFilter(only_rank_zero)


def _timed(train_step, seconds: list[float]):
    """`train_step`, each call's seconds on the rank's clock appended to `seconds`."""
    def step(data_iterator):
        start = SimulatedClock.perf_counter()
        train_step(data_iterator)
        seconds.append(SimulatedClock.perf_counter() - start)

    return step
