"""When each built-in scheme runs a scenario: predicates on the scenario's `parallel` section alone (no torch).

The registry (schemes/__init__.py) names a scenario's scheme with them without
importing the schemes (which import torch), so `simtrain validate` names it for
free; each scheme's `applies` is the same function.

    step_engine(scenario.parallel)      # True where the one step engine (model_parallel.py) runs the job
"""


def model_parallel(parallel) -> bool:
    return parallel.model_parallel  # the model itself or its sequence is split: pp, tp or cp above 1


def asynchronous(parallel) -> bool:
    return parallel.mode == "async"


def sharded(parallel) -> bool:
    return parallel.mode == "sync" and parallel.sharding.stage > 0 and not parallel.model_parallel


def expert_parallel(parallel) -> bool:
    """Data parallelism alone with model.moe's experts sharded over ep ranks: the step engine's pp = tp = cp = 1
    case with experts (strategies/expert_model_parallel.py)."""
    return parallel.mode == "sync" and parallel.ep > 1 and not parallel.model_parallel


def data_parallel(parallel) -> bool:
    """Data parallelism alone, replicated (DDP): the step engine's pp = tp = cp = 1 case."""
    return parallel.mode == "sync" and not (sharded(parallel) or expert_parallel(parallel))


def step_engine(parallel) -> bool:
    """Whether the one step engine (model_parallel.py) runs the job: every synchronous layout."""
    return parallel.mode == "sync"
