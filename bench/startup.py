"""Start-up: how long the command line takes before it does anything, against importing torch alone.

Each command runs in a fresh process `--repeats` times; the median CPU time (user + system, of the process
and its children: robust to a loaded machine) and the median wall time are printed. `python -c "import
torch"` is the floor of any command that builds a model: `simtrain validate` builds one on meta tensors.
Target (issue 30): `simtrain --help` and `simtrain validate` under 1 s.

    .venv/bin/python bench/startup.py --repeats 5
"""
import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = {
    "python (nothing)": [sys.executable, "-c", "pass"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "simtrain --help": [sys.executable, "-m", "simtrain", "--help"],
    "simtrain validate quickstart": [sys.executable, "-m", "simtrain", "validate", "scenarios/quickstart.yaml"],
}


def timed(command: list[str]) -> tuple[float, float]:
    """(CPU seconds of the child, wall seconds) of one run."""
    before = os.times()
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = os.times()
    return (after.children_user - before.children_user) + (after.children_system - before.children_system), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{'command':<32} {'CPU (s)':>8} {'wall (s)':>9}   (medians of {args.repeats}; load {os.getloadavg()[0]:.1f})")
    for name, command in COMMANDS.items():
        runs = [timed(command) for _ in range(args.repeats)]
        print(f"{name:<32} {statistics.median(cpu for cpu, _ in runs):>8.2f} "
              f"{statistics.median(wall for _, wall in runs):>9.2f}")


if __name__ == "__main__":
    main()
