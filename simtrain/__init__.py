"""simtrain: real torch numerics on simulated GPUs, links and clocks.

    import simtrain
    scenario = simtrain.load_scenario("scenarios/quickstart.yaml", ["cluster.devices=8"])
    report = simtrain.run(scenario)
    report.data["step_time_s"], report.final_model
    simtrain.plan_memory(scenario)          # peak memory per device, without training

Public API: load_scenario, run, plan_memory, Scenario, Report, SimtrainError
(and its subclasses ScenarioError, TopologyError, OutOfMemory).
"""
__version__ = "0.1.0"

from .errors import OutOfMemory, ScenarioError, SimtrainError, TopologyError
from .memory_plan import plan_memory
from .report import Report
from .runner import run
from .scenario import Scenario, load_scenario

__all__ = ["load_scenario", "run", "plan_memory", "Scenario", "Report", "SimtrainError", "ScenarioError",
           "TopologyError", "OutOfMemory", "__version__"]
