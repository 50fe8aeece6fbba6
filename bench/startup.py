"""Start-up: how long the command line takes before it does anything, against importing torch alone.

Each command runs in a fresh process `--repeats` times; the median CPU time (user + system, of the process
and its children: robust to a loaded machine) and the median wall time are printed. `python -c "import
torch"` is the floor of any command that builds a model: `simtrain validate` builds one on meta tensors.
With `--all`, `simtrain validate` of every shipped scenario (scenarios/**/*.yaml), each `--repeats` times,
and the largest and the median of their medians (with the scenario that takes longest).
`simtrain run` of the quickstart (200 steps on the digits, into runs/startup-bench) is the whole of the smallest
run: start-up, simulation and report. Target (issue 30): `simtrain --help` and `simtrain validate` under 1 s.

    .venv/bin/python bench/startup.py --repeats 5
    .venv/bin/python bench/startup.py --repeats 3 --all
"""
import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIMTRAIN = [sys.executable, "-m", "simtrain"]
COMMANDS = {
    "python (nothing)": [sys.executable, "-c", "pass"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "simtrain --help": [*SIMTRAIN, "--help"],
    "simtrain validate quickstart": [*SIMTRAIN, "validate", "scenarios/quickstart.yaml"],
    # the whole of the smallest run: 200 steps of 4 replicas on the digits, its report written
    "simtrain run quickstart": [*SIMTRAIN, "run", "scenarios/quickstart.yaml", "--out", "runs/startup-bench"],
}


def timed(command: list[str]) -> tuple[float, float]:
    """(CPU seconds of the child, wall seconds) of one run."""
    before = os.times()
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = os.times()
    return (after.children_user - before.children_user) + (after.children_system - before.children_system), wall


def medians(command: list[str], repeats: int) -> tuple[float, float]:
    """(median CPU seconds, median wall seconds) of `repeats` runs of `command`."""
    runs = [timed(command) for _ in range(repeats)]
    return statistics.median(cpu for cpu, _ in runs), statistics.median(wall for _, wall in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--all", action="store_true", help="also validate every shipped scenario")
    args = parser.parse_args()
    print(f"{'command':<32} {'CPU (s)':>8} {'wall (s)':>9}   (medians of {args.repeats}; load {os.getloadavg()[0]:.1f})")
    for name, command in COMMANDS.items():
        cpu, wall = medians(command, args.repeats)
        print(f"{name:<32} {cpu:>8.2f} {wall:>9.2f}")
    if not args.all:
        return
    scenarios = sorted(path.relative_to(ROOT) for path in (ROOT / "scenarios").glob("**/*.yaml"))
    figures = {str(path): medians([*SIMTRAIN, "validate", str(path)], args.repeats) for path in scenarios}
    longest = max(figures, key=lambda path: figures[path][0])
    print(f"simtrain validate, {len(figures)} shipped scenarios (load {os.getloadavg()[0]:.1f}):")
    print(f"{'  largest (' + longest + ')':<48} {figures[longest][0]:>8.2f} {figures[longest][1]:>9.2f}")
    print(f"{'  median':<48} {statistics.median(cpu for cpu, _ in figures.values()):>8.2f} "
          f"{statistics.median(wall for _, wall in figures.values()):>9.2f}")


if __name__ == "__main__":
    main()
