"""How a job's devices cooperate each step: the one registry of schemes, keyed by scheme name.

A scenario's scheme follows from its layout and mode (`parallel.pp`,
`parallel.tp`, `parallel.mode`): the first entry of SCHEMES whose `applies`
accepts the scenario's `parallel` section. A built-in entry is `Registered`:
its predicate (selection.py, which its class's `applies` is too) and where its
class is, imported only when a job builds it, so naming the scheme imports no
torch (`simtrain validate`). `scheme_name(parallel)` names it
(report.json's `scheme`), `scheme_class(parallel)` is its class and
`build_scheme(job)` builds it for a job; the runner, the memory plan, recovery
and population-based training all find their scheme this way. What a scheme
provides, and the hooks it may override, are scheme.py's `Scheme` protocol.

- `model_parallel` (model_parallel.py): pipeline and tensor parallelism, mixed
  with data parallelism (any `parallel.pp` or `parallel.tp` above 1);
- `async` (asynchronous.py): workers that pull and push through a
  shared-memory store (`parallel.mode: async`);
- `sharded` (model_parallel.py, the step engine's pp = tp = cp = 1 case with
  distributed_optimizer.py's FSDP units): ZeRO stages 1-3 (FSDP) and HSDP
  under data parallelism alone (`parallel.sharding.stage` above 0);
- `expert_parallel` (model_parallel.py, the step engine's pp = tp = cp = 1
  case with experts: expert_model_parallel.py): data parallelism with
  model.moe's experts sharded over groups of `parallel.ep` ranks, tokens
  moved by all-to-all (`parallel.ep` above 1);
- `data_parallel` (model_parallel.py, the step engine's pp = tp = cp = 1
  case): a gradient all-reduce every step, with `parallel.all_reduce`'s
  algorithm (simtrain.comm.ALGORITHMS), in DDP's buckets beside the backward
  (replicated_update.py).

    scheme = build_scheme(job, on_step=None)
    job.start(); run_to_end(job.cluster.env)
    scheme.stuck() or scheme.report_sections()

Every program runs `yield from job.before_step(rank, step)` before each step
and ends there if it returns False: the one place a job changes hyperparameters
or pauses a rank between steps (job.py).

A new scheme is one file (a class subclassing `Scheme`, with an `applies`
classmethod) and one line in SCHEMES naming the class, before the entries it
is more specific than (docs/concepts/schemes.md).
"""
import importlib
from typing import Callable, NamedTuple

from . import selection


class Registered(NamedTuple):
    """A built-in scheme in the registry: when it applies (selection.py, on the `parallel` section alone) and
    where its class is, imported when a job builds it (the schemes import torch; naming one does not)."""

    module: str  # the module of simtrain.schemes that defines it
    name: str  # its class
    applies: Callable  # (parallel) -> bool: the class's own `applies`

    def load(self) -> type:
        return getattr(importlib.import_module(f"{__name__}.{self.module}"), self.name)


# Scheme name -> scheme, most specific first: the first whose `applies(parallel)` holds runs the scenario. A scheme
# is Registered (built in) or its class.
SCHEMES: dict = {
    "model_parallel": Registered("model_parallel", "ModelParallel", selection.model_parallel),
    "async": Registered("asynchronous", "AsynchronousSGD", selection.asynchronous),
    # sharding and data parallelism alone: the step engine's distributed optimizer with FSDP's units
    "sharded": Registered("model_parallel", "ModelParallel", selection.sharded),
    # ep with data parallelism alone: the step engine's pp = tp = cp = 1 case with experts
    "expert_parallel": Registered("model_parallel", "ModelParallel", selection.expert_parallel),
    # data parallelism alone is the step engine's pp = tp = cp = 1 case (report.json names its layout)
    "data_parallel": Registered("model_parallel", "ModelParallel", selection.data_parallel),
}
_CLASSES = {"Scheme": "scheme", **{entry.name: entry.module for entry in SCHEMES.values()}}


def __getattr__(name: str):
    """The scheme classes, imported on first use (PEP 562): `from simtrain.schemes import ModelParallel`."""
    if name in _CLASSES:
        return getattr(importlib.import_module(f"{__name__}.{_CLASSES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def scheme_name(parallel) -> str:
    """The name of the scheme a scenario's `parallel` section (scenario.ParallelSpec) asks for."""
    return next(name for name, scheme in SCHEMES.items() if scheme.applies(parallel))


def scheme_class(parallel) -> type:
    """The class of the scheme a scenario's `parallel` section asks for."""
    scheme = SCHEMES[scheme_name(parallel)]
    return scheme.load() if isinstance(scheme, Registered) else scheme


def load_schemes() -> list[type]:
    """Every built-in scheme's class, imported: each registers the report sections it writes (a job, which
    imports torch anyway, loads them all, so that every report and its schema know them)."""
    return [scheme.load() for scheme in SCHEMES.values() if isinstance(scheme, Registered)]


def build_scheme(job, on_step=None):
    """The scheme `job.scenario.parallel` asks for, built for this job."""
    return scheme_class(job.scenario.parallel)(job, on_step)


__all__ = ["SCHEMES", "AsynchronousSGD", "ModelParallel", "Registered", "Scheme",
           "build_scheme", "load_schemes", "scheme_class",
           "scheme_name"]
