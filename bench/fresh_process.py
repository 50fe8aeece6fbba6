"""What the benches that time the simulator share: each measurement in a fresh process of its own, so that its
CPU time and peak resident memory are its own, and the machine's load average printed beside the figures.

    row = measured_in_fresh_process(__file__, "llama3-405b-16k")   # runs `python <script> --one <argument>`
    print(f"load average at start: {load_average()}")
"""
import json
import os
import subprocess
import sys


def measured_in_fresh_process(script: str, argument: str) -> dict:
    """The JSON object `python script --one argument` prints: a bench's one measurement, in a process of its own."""
    command = [sys.executable, script, "--one", argument]
    return json.loads(subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True).stdout)


def load_average() -> str:
    """The machine's load averages over 1, 5 and 15 minutes."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())
