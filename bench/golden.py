"""Golden runs: every shipped scenario (and a few layouts no scenario ships) run and kept, so a refactor can
prove that no simulated figure moved.

    python bench/golden.py runs/golden-before            # run them all, keep each report.json
    python bench/golden.py runs/golden-after --compare runs/golden-before

Each case is `simtrain run` in a fresh process; its report.json is kept less `wall_time_s` (the host's clock,
the one field that is not simulated). `--compare` names every case whose report differs from the other
folder's, with the first fields that differ, and exits 1 if any did. `--only` takes a substring of the case
names. Cases are run in turn, so a folder's runs never share a process.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The shipped scenarios too large for a golden run of every step: run with fewer steps (their figures per
# step are the same code paths).
SHORTENED = {"quickstart": 5, "pbt": None, "fleet": None}
EXTRA = {  # layouts no shipped scenario has, each a scenario and its overrides
    "llama-tp-overlap-fp8": ("scenarios/llama_small.yaml", [
        "numerics=false", "cluster.devices=8", "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
        "parallel.tp_comm_overlap=true", "train.steps=2"]),
    "llama-tp-overlap-bf16": ("scenarios/llama_small.yaml", [
        "numerics=false", "cluster.devices=8", "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
        "parallel.tp_comm_overlap=true", "train.precision=bf16", "train.steps=2"]),
    "gpt-zero3-no-numerics": ("scenarios/zero3.yaml", ["numerics=false", "train.steps=2"]),
    "moe-no-numerics": ("scenarios/moe_expert_parallel.yaml", ["numerics=false", "train.steps=2"]),
    "llama-tp-pp-bf16": ("scenarios/llama_small.yaml", [
        "cluster.devices=8", "parallel.tp=2", "parallel.pp=2", "train.precision=bf16", "train.steps=3"]),
}


def cases() -> dict[str, tuple[str, list[str]]]:
    """Case name -> (scenario path, --set overrides)."""
    found = {}
    for path in sorted((ROOT / "scenarios").rglob("*.yaml")):
        name = str(path.relative_to(ROOT / "scenarios").with_suffix("")).replace("/", "-")
        if name in SHORTENED and SHORTENED[name] is None:
            continue  # a study, not one run
        overrides = [f"train.steps={SHORTENED[name]}"] if name in SHORTENED else []
        found[name] = (str(path.relative_to(ROOT)), overrides)
    found.update(EXTRA)
    return found


def run_case(name: str, scenario: str, overrides: list[str], out: Path) -> dict | str:
    """The case's report (less wall_time_s), or the last line of its error (the output folder named <out>)."""
    folder = out / name
    command = [sys.executable, "-m", "simtrain", "run", scenario, "--out", str(folder), "--quiet"]
    for override in overrides:
        command += ["--set", override]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return f"exit {done.returncode}: {lines[-1] if lines else ''}".replace(str(out), "<out>")
    report = json.loads((folder / "report.json").read_text())
    report.pop("wall_time_s", None)
    return report


def differences(before, after, path: str = "") -> list[str]:
    """The paths at which two JSON values differ."""
    if isinstance(before, dict) and isinstance(after, dict):
        found = []
        for key in sorted(set(before) | set(after)):
            found += differences(before.get(key), after.get(key), f"{path}.{key}")
        return found
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        found = []
        for index, (one, other) in enumerate(zip(before, after)):
            found += differences(one, other, f"{path}[{index}]")
        return found
    return [] if before == after else [f"{path or '.'}: {json.dumps(before)[:80]} -> {json.dumps(after)[:80]}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--compare", type=Path, help="a folder of earlier golden runs")
    parser.add_argument("--only", default="", help="run the cases whose names contain this")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    moved = 0
    for name, (scenario, overrides) in cases().items():
        if args.only not in name:
            continue
        result = run_case(name, scenario, overrides, args.out)
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        line = name if isinstance(result, dict) else f"{name}: {result}"
        if args.compare is not None:
            earlier = args.compare / f"{name}.json"
            found = differences(json.loads(earlier.read_text()), result) if earlier.exists() else ["no earlier run"]
            moved += bool(found)
            line += "  identical" if not found else "  MOVED " + "; ".join(found[:4])
        print(line, flush=True)
    return 1 if moved else 0


if __name__ == "__main__":
    sys.exit(main())
