"""Goodput against the checkpoint interval under random device failures, against Young's approximation.

A synchronous job (4 x A100 on a 50 GB/s, 5 us switch, ring all-reduce, the
quickstart's MLP on digits, 1,000 steps) loses devices at random: each of
its devices fails after an exponential time of mean DEVICE_MTBF (so the job
loses one every DEVICE_MTBF / 4 on average); each loss is noticed after
DETECTION and a spare takes the lost rank's place, the job going back to its
last checkpoint. Checkpoints go to storage shared by the 4 ranks (1 GB/s,
100 us). For each interval k (steps between checkpoints) and each seed of the
fault draws, goodput = the fault-free time (no faults, no checkpoints) over
the time taken: report.json's `faults.goodput`.

Young (1974) gives the interval that minimizes the expected time lost,
sqrt(2 C M), with C the time one checkpoint costs and M the mean time between
the job's failures; here C = latency + 4 S / bandwidth (S: one rank's state
bytes, from the report) and M = DEVICE_MTBF / 4. The script prints a table
and draws docs/goodput_vs_checkpoint_interval.png.

    .venv/bin/python bench/goodput_vs_checkpoint.py
"""
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the Agg backend)

import simtrain  # noqa: E402
from simtrain.scenario import validate_scenario  # noqa: E402

DEVICES, SPARES, STEPS = 4, 250, 1000
DEVICE_MTBF_S, DETECTION_S = 12e-3, 200e-6
CHECKPOINT = {"to": "storage", "bandwidth": 1e9, "latency": 100e-6}
INTERVALS = (4, 8, 12, 18, 27, 40, 60, 90, 135)
SEEDS = (0, 1, 2)
OUT = Path(__file__).resolve().parent.parent / "docs" / "goodput_vs_checkpoint_interval.png"


def scenario(every: int, seed: int):
    return validate_scenario({
        "name": "goodput", "seed": 0,
        "cluster": {"topology": "switch", "devices": DEVICES + SPARES, "spares": SPARES,
                    "link": {"bandwidth": 50e9, "latency": 5e-6}, "fault_detection": DETECTION_S,
                    "random_faults": {"device_mtbf": DEVICE_MTBF_S, "seed": seed}},
        "model": {"name": "mlp", "hidden": [128, 128]}, "data": {"name": "digits", "batch_size": 32},
        "train": {"steps": STEPS, "checkpoint": {"every": every, **CHECKPOINT}},
        "parallel": {"all_reduce": "ring"}, "report": {"trace": False},
    })


def main() -> None:
    rows = {}
    for every in INTERVALS:
        for seed in SEEDS:
            data = simtrain.run(scenario(every, seed)).data
            assert data["status"] == "ok", data["failure"]
            rows[every, seed] = data
            section = data["faults"]
            print(f"every {every:>4} seed {seed}: goodput {section['goodput']:.4f}, {section['restarts']} restarts, "
                  f"{section['steps_redone']} steps redone, {section['checkpoints_committed']} checkpoints",
                  flush=True)
    sample = rows[INTERVALS[0], SEEDS[0]]
    step_s = sample["faults"]["fault_free_time_s"] / STEPS
    cost_s = CHECKPOINT["latency"] + DEVICES * sample["faults"]["checkpoint_bytes_per_rank"] / CHECKPOINT["bandwidth"]
    mtbf_s = DEVICE_MTBF_S / DEVICES
    young_s = math.sqrt(2 * cost_s * mtbf_s)
    means = {every: sum(rows[every, seed]["faults"]["goodput"] for seed in SEEDS) / len(SEEDS)
             for every in INTERVALS}
    best = max(means, key=means.get)
    print(f"\nfault-free step {step_s * 1e6:.2f} us; checkpoint cost C = {cost_s * 1e6:.1f} us "
          f"({cost_s / step_s:.1f} steps); job MTBF M = {mtbf_s * 1e3:.1f} ms")
    print(f"Young: sqrt(2 C M) = {young_s * 1e3:.3f} ms = {young_s / step_s:.1f} steps; "
          f"measured optimum (mean of {len(SEEDS)} seeds): every {best}, goodput {means[best]:.4f}\n")
    print("| every (steps) | " + " | ".join(f"goodput seed {seed}" for seed in SEEDS) + " | mean | restarts (mean) |")
    print("|---" * (len(SEEDS) + 3) + "|")
    for every in INTERVALS:
        restarts = sum(rows[every, seed]["faults"]["restarts"] for seed in SEEDS) / len(SEEDS)
        print(f"| {every} | " + " | ".join(f"{rows[every, seed]['faults']['goodput']:.4f}" for seed in SEEDS)
              + f" | {means[every]:.4f} | {restarts:.1f} |")
    figure, axes = plt.subplots(figsize=(8, 5), dpi=120)
    for seed in SEEDS:
        axes.plot(INTERVALS, [rows[every, seed]["faults"]["goodput"] for every in INTERVALS], marker=".",
                  linewidth=0.8, alpha=0.6, label=f"fault seed {seed}")
    axes.plot(INTERVALS, [means[every] for every in INTERVALS], marker="o", color="black", linewidth=2,
              label="mean")
    axes.axvline(young_s / step_s, color="tab:red", linestyle="--",
                 label=f"Young: sqrt(2CM) = {young_s / step_s:.0f} steps")
    axes.set_xscale("log")
    axes.set_xticks(INTERVALS, [str(every) for every in INTERVALS])
    axes.set_xlabel("checkpoint interval train.checkpoint.every (steps)")
    axes.set_ylabel("goodput (fault-free time / time taken)")
    axes.set_title(f"{DEVICES} devices, device MTBF {DEVICE_MTBF_S * 1e3:g} ms, checkpoint {cost_s * 1e6:.0f} us, "
                   f"{STEPS} steps")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(OUT, metadata={"Software": None})
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
