"""Data-parallel what-ifs with numerics off: CPU time of a simulated step against the device count.

A data-parallel job has no representatives (they stand for pipeline and tensor-parallel ranks), so every
replica's step program runs: each holds a model on meta tensors. The scenarios: the quickstart's mlp on
digits (DDP, ring all-reduce) on 8 to 512 devices of a ring, and scenarios/zero3.yaml's gpt (FSDP, ZeRO
stage 3, bf16, Adam) on 8 and 64, `--steps` steps, each device count in a fresh process warmed up by a 2-device step
(the imports, and torch's meta kernels loaded at their first use). Printed: the CPU seconds of the run
(`time.process_time`) and per step, and the simulated step time.

    .venv/bin/python bench/data_parallel_meta.py [--steps 5] [--max-devices 512]
"""
import argparse
import json
import subprocess
import sys

# scenario -> (file, device counts); ZeRO-3 at 512 devices moves every unit's gathers and reduce-scatters as flows,
# 512 x 511 transfers of each: more than 13 minutes of CPU (2026-12-02), which is that path's cost, not this one's
SCENARIOS = {"ddp mlp": ("scenarios/quickstart.yaml", (8, 64, 512)), "zero3 gpt": ("scenarios/zero3.yaml", (8, 64))}


def one(path: str, devices: int, steps: int) -> dict:
    """Run `path` with numerics off on `devices` ring devices for `steps` steps, in this process."""
    import time

    import simtrain

    def scenario(devices: int, steps: int):
        return simtrain.load_scenario(path, [
            "numerics=false", f"cluster.devices={devices}", "cluster.topology=ring", f"train.steps={steps}",
            "report.trace=false"])

    simtrain.run(scenario(2, 1))  # warm up: the imports, torch's meta kernels' first use
    scenario = scenario(devices, steps)
    start = time.process_time()
    report = simtrain.run(scenario)
    return {"cpu_s": time.process_time() - start, "step_time_s": report.data["step_time_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--max-devices", type=int, default=512)
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # path devices steps: a child's run
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), int(args.one[2]))))
        return
    print(f"{'scenario':10} {'devices':>8} {'CPU':>9} {'CPU a step':>11} {'simulated step':>15}")
    for label, (path, counts) in SCENARIOS.items():
        for devices in (count for count in counts if count <= args.max_devices):
            child = subprocess.run([sys.executable, __file__, "--one", path, str(devices), str(args.steps)],
                                   check=True, capture_output=True, text=True)
            result = json.loads(child.stdout.splitlines()[-1])
            print(f"{label:10} {devices:8,} {result['cpu_s']:8.2f}s {result['cpu_s'] / args.steps:10.3f}s "
                  f"{result['step_time_s'] * 1e3:12.3f} ms", flush=True)


if __name__ == "__main__":
    main()
