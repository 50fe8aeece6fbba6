"""When each built-in scheme runs a scenario: predicates on the scenario's `parallel` section alone (no torch).

The registry (schemes/__init__.py) names a scenario's scheme with them without
importing the schemes (which import torch), so `simtrain validate` names it for
free; each scheme's `applies` is the same function.

    model_parallel(scenario.parallel)   # True when pp or tp is above 1
"""


def model_parallel(parallel) -> bool:
    return parallel.model_parallel  # the model itself is split: pp or tp above 1


def asynchronous(parallel) -> bool:
    return parallel.mode == "async"


def sharded(parallel) -> bool:
    return parallel.mode == "sync" and parallel.sharding.stage > 0 and not parallel.model_parallel


def expert_parallel(parallel) -> bool:
    return parallel.mode == "sync" and parallel.ep > 1 and not parallel.model_parallel


def data_parallel(parallel) -> bool:
    return parallel.mode == "sync"  # the registry's last entry: every layout the others do not take
