"""moe.png: routing imbalance, step time and all-to-all time against the training step, from report.json's `moe`.

`simtrain run` draws it for every run with expert parallelism (the `moe`
section, strategies/moe_report.py): the upper panel is the imbalance factor
(most tokens an expert took over the mean, 1 when balanced), the lower the
step's simulated time and a rank's mean all-to-all time in it (not under
pp / tp, where the report leaves it null).

    plot_moe(report.data["moe"], Path("runs/x/moe.png"))
"""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the Agg backend)


def plot_moe(section: dict, path: Path) -> None:
    """Imbalance (upper) and step and all-to-all time in µs (lower) per step."""
    steps = range(1, len(section["imbalance"]) + 1)
    figure, (balance, times) = plt.subplots(2, 1, figsize=(9, 6), dpi=110, sharex=True)
    balance.plot(steps, section["imbalance"], marker=".", color="tab:red")
    balance.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    balance.set_ylabel("imbalance (max / mean tokens per expert)")
    balance.set_title(f"{section['experts']} experts, ep {section['ep']}, routing: {section['routing']}")
    times.plot(steps, [t * 1e6 for t in section["step_time_s"]], marker=".", label="step")
    if section["all_to_all_time_s"] is not None:  # null in a report written before the step engine timed it
        times.plot(steps, [t * 1e6 for t in section["all_to_all_time_s"]], marker=".", label="all-to-all (rank mean)")
    times.set_xlabel("step")
    times.set_ylabel("simulated time (µs)")
    times.set_ylim(bottom=0)
    times.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
