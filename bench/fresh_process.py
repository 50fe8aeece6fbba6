"""What the benches that time the simulator share: each measurement in a fresh process of its own, so that its
CPU time and peak resident memory are its own, printed as a Markdown table between the machine's load averages.

    print_measured_table(__file__, ["llama3-405b-16k"], ["scenario", "CPU time"],
                         lambda name, row: [name, f"{row['cpu_s']:.1f} s"])   # `python <script> --one <name>`
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


def print_measured_table(script: str, arguments: list, header: list[str], cells) -> None:
    """A Markdown table with `header`, a row `cells(argument, measurement)` for each of `arguments` measured in a
    fresh process (`measured_in_fresh_process`), printed as it comes, between the load averages."""
    print(f"load average at start: {load_average()}")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for argument in arguments:
        print("| " + " | ".join(cells(argument, measured_in_fresh_process(script, str(argument)))) + " |", flush=True)
    print(f"load average at end: {load_average()}")
