"""DeepSeek-V3 on 2,048 H800s against its technical report: the step time, its bubble and exposed all-to-all.

DeepSeek-AI 2024 ("DeepSeek-V3 Technical Report", arXiv 2412.19437, section 1)
reports 180K H800 GPU hours a trillion training tokens on its 2,048 GPUs:
3.16M tokens/s (the report rounds it to 3.7 days a trillion), so a step of
15,360 sequences of 4,096 tokens every 19.9 s. This runs scenarios/deepseek-v3.yaml (numerics off,
representatives) in a fresh process, so that its CPU time, wall time and peak
resident memory are its own, and prints the simulated step with its bubble and
exposed all-to-all (what DualPipe's overlapped pairs leave uncovered) beside
the report's figure; `--schedule 1f1b` runs the same job on 1F1B (one part a
rank, no pairs: each pass waits on its own all-to-alls). The issue's target:
at most 5 minutes of CPU.

    .venv/bin/python bench/deepseek_v3.py
    .venv/bin/python bench/deepseek_v3.py --schedule dualpipev 1f1b
"""
import argparse
import json
import resource
import time
from pathlib import Path

from fresh_process import print_measured_table

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "scenarios" / "deepseek-v3.yaml"
GPU_HOURS_PER_TRILLION = 180e3  # section 1: 180K H800 GPU hours a trillion tokens, on 2,048 GPUs


def published_step_s(scenario) -> float:
    """The report's step: the tokens of one step at the rate its GPU hours a trillion tokens give."""
    gpus, data = scenario.cluster.devices, scenario.data
    tokens = data.batch_size * gpus // scenario.parallel.pp * data.seq_len
    tokens_per_s = 1e12 / (GPU_HOURS_PER_TRILLION * 3600 / gpus)
    return tokens / tokens_per_s


def one(schedule: str) -> dict:
    """Simulate the scenario under `schedule` in this process: its figures, wall and CPU seconds, peak RSS."""
    import simtrain
    from simtrain.scenario import load_scenario

    started, cpu_started = time.perf_counter(), time.process_time()
    scenario = load_scenario(SCENARIO)
    pipeline = scenario.parallel.pipeline.model_copy(update={"schedule": schedule,
                                                             "virtual_stages": 2 if schedule == "dualpipev" else 1})
    scenario = scenario.model_copy(update={"parallel": scenario.parallel.model_copy(update={"pipeline": pipeline})})
    report = simtrain.run(scenario).data
    return {"status": report["status"], "step_s": report["sim_time_s"], "published_s": published_step_s(scenario),
            "bubble_s": report["breakdown_s"]["bubble"], "all_to_all_exposed_s": report["moe"]["all_to_all_time_s"][0],
            "peak_bytes": max(device["peak_memory_bytes"] for device in report["devices"]),
            "wall_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu_started,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", nargs="*", choices=["dualpipev", "1f1b"], default=["dualpipev"])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    print_measured_table(__file__, args.schedule,
                         ["schedule", "step (s)", "report's step (s)", "bubble (s)", "exposed all-to-all (s)",
                          "peak memory (GiB)", "simulated in (wall)", "CPU time", "peak RSS"],
                         lambda schedule, row: [schedule, f"{row['step_s']:.1f}", f"{row['published_s']:.1f}",
                                                f"{row['bubble_s']:.2f}", f"{row['all_to_all_exposed_s']:.2f}",
                                                f"{row['peak_bytes'] / 2**30:.1f}", f"{row['wall_s']:.0f} s",
                                                f"{row['cpu_s']:.0f} s", f"{row['peak_rss_bytes'] / 2**30:.1f} GiB"])

if __name__ == "__main__":
    main()
