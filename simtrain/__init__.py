"""simtrain: real torch numerics on simulated GPUs, links and clocks.

    import simtrain
    scenario = simtrain.load_scenario("scenarios/quickstart.yaml", ["cluster.devices=8"])
    report = simtrain.run(scenario)
    report.data["step_time_s"], report.final_model
    simtrain.plan_memory(scenario)          # peak memory per device, without training
    simtrain.run_population(simtrain.load_scenario("scenarios/pbt.yaml"))   # population-based training

Public API: load_scenario, run, run_population, plan_memory, Scenario, Report, SimtrainError
(and its subclasses ScenarioError, TopologyError, OutOfMemory).
"""
from .errors import OutOfMemory, ScenarioError, SimtrainError, TopologyError
from .memory_plan import plan_memory
from .report import Report
from .runner import run
from .scenario import Scenario, load_scenario
from .studies.pbt import run_population
from .version import __version__

__all__ = ["load_scenario", "run", "run_population", "plan_memory", "Scenario", "Report", "SimtrainError", "ScenarioError",
           "TopologyError", "OutOfMemory", "__version__"]
