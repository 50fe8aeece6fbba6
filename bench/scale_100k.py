"""The simulator's own cost at the largest clusters: a Llama 3 405B step on 16,384 and 100,096 H100s and on
100,224 GB200s in NVL72 racks, numerics off, representatives (issue 55, item 4).

Targets: the 16,384-GPU step within 10 s of CPU, each 100,000-GPU step within 60 s, host memory within 4 GiB.
Each scenario runs in a fresh process, so that its CPU time and peak resident memory are its own: CPU time
from loading the scenario to the report built (`simtrain.run`; the imports and writing report.json are not in
it, the command line's `simtrain run` adds them), and the peak resident memory of the whole process. The
simulated step (the second: the all-gathers the first leaves run beside it) is printed beside.

    .venv/bin/python bench/scale_100k.py
    .venv/bin/python bench/scale_100k.py --scenario llama3-405b-100k
"""
import argparse
import json
import resource
import time
from pathlib import Path

from fresh_process import print_measured_table

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("llama3-405b-16k", "llama3-405b-100k", "llama3-405b-gb200-100k")
CPU_TARGET_S = {"llama3-405b-16k": 10, "llama3-405b-100k": 60, "llama3-405b-gb200-100k": 60}
MEMORY_TARGET_BYTES = 4 * 2**30


def one(name: str) -> dict:
    """Simulate one scenario in this process: its devices, step time, CPU and wall seconds, peak RSS."""
    import simtrain
    from simtrain.scenario import load_scenario

    started, cpu_started = time.perf_counter(), time.process_time()
    scenario = load_scenario(ROOT / "scenarios" / f"{name}.yaml")
    report = simtrain.run(scenario)
    ends = [end for end, _ in report.data["loss_curve"]]
    return {"devices": scenario.cluster.devices, "status": report.data["status"],
            "step_time_s": ends[-1] - ends[-2] if len(ends) > 1 else None,
            "cpu_s": time.process_time() - cpu_started, "wall_s": time.perf_counter() - started,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", nargs="*", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    print_measured_table(__file__, args.scenario,
                         ["scenario", "GPUs", "step (s)", "CPU time", "target", "wall", "peak RSS", "target"],
                         lambda name, row: [name, f"{row['devices']:,}",
                                            f"{row['step_time_s']:.2f}" if row["status"] == "ok" else row["status"],
                                            f"{row['cpu_s']:.1f} s", f"{CPU_TARGET_S[name]} s",
                                            f"{row['wall_s']:.1f} s",
                                            f"{row['peak_rss_bytes'] / 2**30:.2f} GiB",
                                            f"{MEMORY_TARGET_BYTES / 2**30:.0f} GiB"])

if __name__ == "__main__":
    main()
