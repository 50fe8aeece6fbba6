"""Megatron-Core's own training, unmodified, on the CPU and on simtrain's simulated ranks.

    from simtrain.frameworks.megatron import simulated_machine
    with simulated_machine():
        results = simtrain.dist.spawn(train, world=4, scenario="scenarios/quickstart.yaml")

`train(rank, world)` is a Megatron-Core job as its users write it (tests/megatron_ranks.py):
`parallel_state.initialize_model_parallel`, `GPTModel`, Megatron's `DistributedDataParallel`, its optimizer and
pipeline schedules. Megatron-Core is written for NVIDIA GPUs: with the config flags that keep it off its fused
kernels (`gradient_accumulation_fusion`, `masked_softmax_fusion`, `bias_activation_fusion`, `bias_dropout_fusion`,
`apply_rope_fusion`, `persist_layer_norm` off, `use_cpu_initialization` on) and its groups created without
gloo twins (`create_gloo_process_groups=False`), what it still asks of a GPU it asks of `torch.cuda`. `cpu_machine`
answers those calls for a machine whose one device is the CPU, and a real gloo run and a simulated run of the same
job go through the same stand-ins, so they compute the same thing:

- **the device**: `torch.cuda.current_device()`, which Megatron passes as the `device=` of the buffers it makes
  (its gradient and parameter buffers, its pipeline's receive buffers), is "cpu"; one device; its properties;
- **the device's generator** (`model_parallel_cuda_manual_seed` seeds it, the RNG tracker saves and restores it
  around its forks): a generator of its own per rank (thread); nothing on the CPU draws from it (CPU dropout draws
  from the CPU's), so a job with dropout would differ from a GPU run's masks, not from the reference's;
- **CUDA's lazy initialisation**: reported done, so the state Megatron sets on the generator is set at once
  (torch queues it until a first CUDA call, which a CPU never makes);
- **streams and events**: one stream, which runs each operation as it is called (the CPU's order), and events
  that are done when recorded; `synchronize` waits for nothing;
- **tensors on the device**: `Tensor.is_cuda` is true, so Megatron's MoE token dispatcher copies its split sizes
  "to the host" as numpy arrays, as on a GPU (left as tensors, torch's `all_to_all_single` refuses them);
- **Transformer Engine absent**: Megatron-Core 0.16.1's MoE router tests `te_general_gemm is not None`, a name it
  binds only when TE imports; bound to None, as without TE, its router takes its `torch.mm` path.

`simulated_machine` adds the simulated ranks' process groups: the CPU's default backend (gloo) is simtrain's for
the run, so the groups Megatron creates without naming a backend are simulated ones. With numerics off, MoE is
refused: its dropless routing sizes its all-to-alls by token counts per expert that come from the router's values
(the rank stops, in one line, where they are first needed: gathered over the expert-parallel group, process_group.py,
or, with one expert-parallel rank, a `masked_select` of the routed tokens, numerics_off.py).
"""
import contextlib
import importlib
import math
import os
import threading

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from ..errors import ScenarioError
from ..torchdist.module_state import ranks_own_module_state
from .stand_ins import attributes_set

# Megatron-Core's modules that a training job reaches, some with process state in their globals (parallel_state's
# groups, the RNG tracker, the micro-batch calculator): imported before a spawn (module_state.py).
_STATEFUL = ("megatron.core.parallel_state", "megatron.core.tensor_parallel", "megatron.core.models.gpt",
             "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.distributed", "megatron.core.optimizer",
             "megatron.core.pipeline_parallel", "megatron.core.pipeline_parallel.schedules",
             "megatron.core.num_microbatches_calculator", "megatron.core.transformer.moe.moe_layer",
             "megatron.core.transformer.moe.token_dispatcher", "megatron.core.rerun_state_machine")


class _DeviceGenerator:
    """The device's default generator, one per thread (a rank of a spawn is a thread; a gloo rank its process's
    only one)."""

    def __init__(self):
        self._local = threading.local()

    def _own(self) -> torch.Generator:
        generator = getattr(self._local, "generator", None)
        if generator is None:
            generator = self._local.generator = torch.Generator()
        return generator

    def get_state(self) -> torch.Tensor:
        return self._own().get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self._own().set_state(state)

    def manual_seed(self, seed: int) -> torch.Generator:
        return self._own().manual_seed(seed)

    def initial_seed(self) -> int:
        return self._own().initial_seed()

    def __getitem__(self, device) -> "_DeviceGenerator":
        """`torch.cuda.default_generators[device]`: the one device's, whatever its index ("cpu", see above)."""
        return self

    def __len__(self) -> int:
        return 1


class _Stream:
    """A CUDA stream on a machine that runs every operation when it is called: nothing to wait for."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device = torch.device("cpu")

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        event = event or _Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, _Stream)

    def __hash__(self) -> int:
        return 0


class _Event:
    """A CUDA event on that machine: done once recorded (what it follows has run)."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, external=False):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


_STREAM = _Stream()


@contextlib.contextmanager
def _stream_context(stream):
    """`torch.cuda.stream(s)`: the one stream stays current."""
    yield


def _node_devices() -> int:
    """The node's devices, as torchrun counts the ranks on it (`LOCAL_WORLD_SIZE`), one where it is not set."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def cpu_machine_changes() -> list:
    """The (object, attribute, stand-in) triples of `cpu_machine`, each with its reason."""
    generator = _DeviceGenerator()
    cuda, random = torch.cuda, torch.cuda.random
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    return [
        (cuda, "current_device", lambda: "cpu"),  # Megatron's buffers are made on device=current_device()
        (cuda, "device_count", _node_devices),
        (cuda, "set_device", lambda device: None),  # a rank's one device is current already
        (cuda, "is_initialized", lambda: True),  # so state set on the device's generator is set now, not queued
        (cuda, "default_generators", generator),  # the device's generator (see above)
        (cuda, "get_rng_state", lambda device="cuda": generator.get_state()),
        (random, "get_rng_state", lambda device="cuda": generator.get_state()),
        (cuda, "set_rng_state", lambda state, device="cuda": generator.set_state(state)),
        (cuda, "manual_seed", lambda seed: generator.manual_seed(int(seed))),
        (cuda, "Stream", _Stream),  # Megatron's side streams: the CPU runs in call order
        (cuda, "Event", _Event),
        (cuda, "current_stream", lambda device=None: _STREAM),
        (cuda, "default_stream", lambda device=None: _STREAM),
        (cuda, "stream", _stream_context),
        (cuda, "synchronize", lambda device=None: None),  # every operation has run when the call returns
        # Megatron-Core 0.16.1's router tests `te_general_gemm is not None` but binds the name only with Transformer
        # Engine installed: None, as without TE, takes its torch.mm path
        (moe_utils, "te_general_gemm", getattr(moe_utils, "te_general_gemm", None)),
    ]


class _CudaIsTheCpu(TorchFunctionMode):
    """The device Megatron names, "cuda" (a factory's `device="cuda"`, `Tensor.cuda()`, `.to("cuda")`), is the
    CPU; a tensor's type name (`Tensor.type()`, which Megatron's optimizers check) is the device's
    ("torch.cuda.FloatTensor"), and a tensor is on the device (`Tensor.is_cuda`: Megatron's MoE token dispatcher
    copies its split sizes to the host, as numpy arrays, only from the device)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]  # already on the device
        if getattr(func, "__self__", None) is _IS_CUDA:  # the property's getter
            return True
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # its type name, as on the device
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_IS_CUDA = torch.Tensor.is_cuda


def _is_cuda(device) -> bool:
    return (isinstance(device, str) and device.startswith("cuda")) or \
        (isinstance(device, torch.device) and device.type == "cuda") or \
        (isinstance(device, int) and not isinstance(device, bool))


_entered = {"count": 0, "stack": None}
_entering = threading.Lock()


@contextlib.contextmanager
def cpu_machine():
    """Megatron-Core's calls to `torch.cuda`, and the device "cuda" it names, answered for a machine whose device is
    the CPU, until the block ends (see above). Entered in each rank: the `torch.cuda` stand-ins are the process's
    (set by the first rank to enter, put back by the last to leave), the device named "cuda" the calling
    thread's."""
    with _entering:
        if _entered["count"] == 0:
            stack = contextlib.ExitStack()
            stack.enter_context(attributes_set(cpu_machine_changes()))
            _entered["stack"] = stack
        _entered["count"] += 1
    try:
        with _CudaIsTheCpu():
            yield
    finally:
        with _entering:
            _entered["count"] -= 1
            if _entered["count"] == 0:
                _entered.pop("stack").close()
                _entered["stack"] = None


def grad_norm_without_values(grads_for_norm, norm_type=2, grad_stats_parallel_group=None) -> float:
    """Megatron's `get_grad_norm_fp32` for fake gradients (numerics off): the same work (each gradient's 2-norm,
    their norm, its square summed over `grad_stats_parallel_group` by an all-reduce), and no value to read
    (Megatron reads it with `float()` and `.item()`): NaN, which leaves the gradients unclipped."""
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    if norm_type != 2:
        raise ScenarioError(f"Megatron-Core with numerics off: a gradient norm of type {norm_type} (simtrain stands "
                            f"in for the 2-norm only)")
    norms = [torch.linalg.vector_norm(grad) for grad in grads_for_norm]
    total = (torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())).reshape(1) ** 2
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=grad_stats_parallel_group)
    return math.nan


@contextlib.contextmanager
def simulated_machine(numerics: bool = True):
    """`cpu_machine`'s `torch.cuda` stand-ins, the groups Megatron-Core creates (with no backend named: the CPU's
    default, gloo) made simtrain's, and each rank's own Megatron-Core globals (its parallel state), until the block
    ends; with numerics off, its gradient norm without values (`grad_norm_without_values`)."""
    modules = [importlib.import_module(module) for module in _STATEFUL]  # before the spawn (module_state.py)
    changes = [(dist.Backend.default_device_backend_map, device, "simtrain") for device in ("cpu", "cuda")]
    if not numerics:
        changes += [(importlib.import_module(module), "get_grad_norm_fp32", grad_norm_without_values)
                    for module in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer")]
    with attributes_set(changes), ranks_own_module_state("megatron.core"):
        yield
    del modules


def run_megatron(script: str, arguments: list[str], scenario, numerics: bool = False):
    """A Megatron-Core training script with its `arguments`, as torchrun would launch it on every device of
    `scenario`'s cluster (frameworks/script.py), on `cpu_machine`'s and `simulated_machine`'s stand-ins."""
    from .script import run_script
    return run_script(script, arguments, scenario, numerics, machine=lambda: simulated_machine(numerics),
                      rank_machine=cpu_machine)
