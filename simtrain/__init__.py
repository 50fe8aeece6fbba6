"""simtrain: real torch numerics on simulated GPUs, links and clocks.

    import simtrain
    scenario = simtrain.load_scenario("scenarios/quickstart.yaml", ["cluster.devices=8"])
    report = simtrain.run(scenario)
    report.data["step_time_s"], report.final_model
    simtrain.plan_memory(scenario)          # peak memory per device, without training
    simtrain.run_population(simtrain.load_scenario("scenarios/pbt.yaml"))   # population-based training

Public API: load_scenario, run, run_population, plan_memory, Scenario, Report, SimtrainError
(and its subclasses ScenarioError, TopologyError, OutOfMemory).

The API's entries are imported when first used (PEP 562): `import simtrain`, and the command line's
`simtrain --help`, import neither torch nor the simulator.
"""
from importlib import import_module

from .errors import OutOfMemory, ScenarioError, SimtrainError, TopologyError
from .version import __version__

# name -> the module that defines it, imported on first use
_LAZY = {"load_scenario": ".scenario", "Scenario": ".scenario", "run": ".runner", "run_population": ".studies.pbt",
         "plan_memory": ".memory_plan", "Report": ".report"}

__all__ = ["load_scenario", "run", "run_population", "plan_memory", "Scenario", "Report", "SimtrainError", "ScenarioError",
           "TopologyError", "OutOfMemory", "__version__"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'simtrain' has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
