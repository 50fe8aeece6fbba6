"""Chakra execution traces in: read and checked (trace_file.py), then replayed on a simulated cluster (engine.py).

    from simtrain.replay import read_traces, replay
    result = replay(read_traces(["runs/quickstart/chakra"]), load_scenario("scenarios/quickstart.yaml"))
    result.data["step_time_s"]

`simtrain replay` (cli_replay.py) is the command; report/chakra.py writes the traces a run makes.
"""
from .engine import ReplayResult, replay
from .trace_file import TraceNode, Traces, read_traces

__all__ = ["ReplayResult", "TraceNode", "Traces", "read_traces", "replay"]
