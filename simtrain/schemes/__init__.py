"""How a job's devices cooperate each step: the one registry of schemes, keyed by scheme name.

A scenario's scheme follows from its layout and mode (`parallel.pp`,
`parallel.tp`, `parallel.mode`): the first entry of SCHEMES whose `applies`
accepts the scenario's `parallel` section. `scheme_name(parallel)` names it
(report.json's `scheme`), `scheme_class(parallel)` is its class and
`build_scheme(job)` builds it for a job; the runner, the memory plan, recovery
and population-based training all find their scheme this way. What a scheme
provides, and the hooks it may override, are scheme.py's `Scheme` protocol.

- `model_parallel` (model_parallel.py): pipeline and tensor parallelism, mixed
  with data parallelism (any `parallel.pp` or `parallel.tp` above 1);
- `async` (asynchronous.py): workers that pull and push through a
  shared-memory store (`parallel.mode: async`);
- `sharded` (sharded.py): ZeRO stages 1-3 (FSDP) and HSDP
  (`parallel.sharding.stage` above 0);
- `expert_parallel` (expert_parallel.py): data parallelism with model.moe's
  experts sharded over groups of `parallel.ep` ranks, tokens moved by
  all-to-all (`parallel.ep` above 1);
- `data_parallel` (sync.py): a gradient all-reduce every step, with
  `parallel.all_reduce`'s algorithm (simtrain.comm.ALGORITHMS).

    scheme = build_scheme(job, on_step=None)
    job.start(); run_to_end(job.cluster.env)
    scheme.stuck() or scheme.report_sections()

Every program runs `yield from job.before_step(rank, step)` before each step
and ends there if it returns False: the one place a job changes hyperparameters
or pauses a rank between steps (job.py).

A new scheme is one file (a class subclassing `Scheme`, with an `applies`
classmethod) and one line in SCHEMES, before the entries it is more specific
than (docs/concepts/schemes.md).
"""
from .asynchronous import AsynchronousSGD
from .expert_parallel import ExpertParallel
from .model_parallel import ModelParallel
from .scheme import Scheme
from .sharded import ShardedDataParallel
from .sync import SyncDataParallel

# Scheme name -> class, most specific first: the first whose `applies(parallel)` holds runs the scenario.
SCHEMES: dict[str, type[Scheme]] = {
    "model_parallel": ModelParallel,
    "async": AsynchronousSGD,
    "sharded": ShardedDataParallel,
    "expert_parallel": ExpertParallel,
    "data_parallel": SyncDataParallel,
}


def scheme_name(parallel) -> str:
    """The name of the scheme a scenario's `parallel` section (scenario.ParallelSpec) asks for."""
    return next(name for name, scheme in SCHEMES.items() if scheme.applies(parallel))


def scheme_class(parallel) -> type[Scheme]:
    """The class of the scheme a scenario's `parallel` section asks for."""
    return SCHEMES[scheme_name(parallel)]


def build_scheme(job, on_step=None) -> Scheme:
    """The scheme `job.scenario.parallel` asks for, built for this job."""
    return scheme_class(job.scenario.parallel)(job, on_step)


__all__ = ["SCHEMES", "Scheme", "ShardedDataParallel", "build_scheme", "scheme_class", "scheme_name"]
