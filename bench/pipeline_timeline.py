"""Draw one training step of a pipeline scenario as a timeline: forward, backward, bubble and communication per device.

    python bench/pipeline_timeline.py scenarios/pipeline.yaml docs/pipeline_1f1b.png [--set KEY=VALUE ...]

Runs the scenario for one step (simtrain's own event log, the spans trace.json shows) and draws
every device's spans of that step, each forward and backward labelled with its microbatch.
"""
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from simtrain import load_scenario  # noqa: E402
from simtrain.hw.cluster import build_cluster, run_to_end  # noqa: E402
from simtrain.job import Job  # noqa: E402

COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "bubble": "#d0d0d0", "communication": "#55a868",
           "optimizer": "#8172b3"}


def main(scenario_path: str, out: str, overrides: list[str]) -> None:
    scenario = load_scenario(scenario_path, [*overrides, "train.steps=1"])
    cluster = build_cluster(scenario.cluster, scenario.base_dir, record=True, seed=scenario.seed)
    job = Job(scenario, cluster, range(cluster.size))
    job.start()
    run_to_end(cluster.env)
    figure, axes = plt.subplots(figsize=(12, 1 + 0.6 * cluster.size), dpi=120)
    counters: dict[tuple[int, str], int] = {}
    for span in cluster.log.spans:
        kind = span.name if span.name in ("forward", "backward") else span.kind
        if kind not in COLOURS:
            continue
        axes.barh(span.rank, (span.end - span.start) * 1e6, left=span.start * 1e6, height=0.8,
                  color=COLOURS[kind], edgecolor="white", linewidth=0.3)
        if kind in ("forward", "backward"):
            number = counters.get((span.rank, kind), 0)
            counters[span.rank, kind] = number + 1
            axes.text((span.start + span.end) / 2 * 1e6, span.rank, str(number), ha="center", va="center",
                      fontsize=6, color="white")
    axes.set_yticks(range(cluster.size), [f"stage {rank}" for rank in range(cluster.size)])
    axes.invert_yaxis()
    axes.set_xlabel("simulated time (µs)")
    parallel = scenario.parallel
    axes.set_title(loc="left", label=f"{scenario.name}: {parallel.pipeline.schedule}, pp {parallel.pp}, "
                   f"{parallel.pipeline.microbatches} microbatches, one step")
    axes.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()], labels=list(COLOURS),
                loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncols=len(COLOURS), frameon=False)
    figure.tight_layout()
    figure.savefig(out, metadata={"Software": None})


if __name__ == "__main__":
    arguments = sys.argv[1:]
    sets = [arguments[i + 1] for i, a in enumerate(arguments) if a == "--set"]
    plain = [a for i, a in enumerate(arguments) if a != "--set" and (i == 0 or arguments[i - 1] != "--set")]
    main(plain[0], plain[1], sets)
