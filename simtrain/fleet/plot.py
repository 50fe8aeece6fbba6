"""fleet.png: a fleet run day by day, the training it kept against the time it took, and its interruptions.

    plot_fleet(report.data["fleet"], out / "fleet.png")
"""
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the Agg backend)

DAY_S = 86400.0


def plot_fleet(fleet: dict, path: Path) -> None:
    """Days of training kept (steps x step time) against days elapsed, with the interruptions of each day."""
    days = [0] + [min(entry["day"] * DAY_S, fleet["elapsed_s"]) / DAY_S for entry in fleet["daily"]]
    kept = [0.0] + [entry["steps"] * fleet["step_time_s"] / DAY_S for entry in fleet["daily"]]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), dpi=120, sharex=True,
                                         gridspec_kw={"height_ratios": [3, 1]})
    top.plot(days, days, linestyle="--", color="grey", linewidth=1, label="no failures")
    top.plot(days, kept, marker="o", markersize=3, linewidth=1.6,
             label=f"kept (effective training time {fleet['effective_training_time']:.1%})")
    top.set_ylabel("days of training kept")
    top.set_title(f"{fleet['gpus']:,} GPUs: {fleet['interruptions']} interruptions in {days[-1]:.3g} days")
    top.grid(True, alpha=0.3)
    top.legend(fontsize=8)
    bottom.bar([entry["day"] - 0.5 for entry in fleet["daily"]], [entry["interruptions"] for entry in fleet["daily"]],
               width=0.8, color="tab:red")
    bottom.set_ylabel("interruptions")
    bottom.set_xlabel("days elapsed")
    figure.tight_layout()
    figure.savefig(path, metadata={"Software": None})
    plt.close(figure)
