"""What a population found, read back from its report: a member's lineage as a schedule, and the plot.

A member's weights have a history through the members it copied: its own
hyperparameters since its last exploit, before that its donor's up to the
donor's checkpoint, and so on back to step 0. `lineage` follows that chain in
report.json's `pbt` section (`events` and each member's `schedule`) and
writes it as a `train.schedule` ([{step, hyperparameter: value, ...}], in
steps of the weights' history: with `synch: false` a recipient may copy a
checkpoint older or newer than its own step count, and its later entries
shift by the difference). `replay_scenario` turns it into a single run: the
population's resolved scenario without `pbt`, on one member's devices, with
that schedule and as many steps as the lineage trained.

    simtrain pbt replay runs/pbt/report.json --member best --out replay.yaml

`plot_population` draws pbt.png (the best member drawn thick): each member's metric against simulated time
with its exploits marked, and each hyperparameter's trajectory.
"""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the Agg backend)

from ..errors import ScenarioError  # noqa: E402


def lineage(section: dict, member: int) -> tuple[list[dict], int]:
    """(the schedule member `member`'s final weights were trained with, the steps they were trained for)."""
    members = {entry["id"]: entry for entry in section["members"]}
    segments = []  # (entries of one member, newest first), each [(own step, values)] and its shift
    current, end = member, members[member]["steps"]
    while True:
        copies = [event for event in section["events"] if event["to"] == current and event["step"] < end]
        start = copies[-1]["step"] if copies else 0
        own = [(step, values) for step, _, values in members[current]["schedule"] if start <= step < end]
        segments.append((own, copies[-1] if copies else None, end))
        if not copies:
            break
        current, end = copies[-1]["from"], copies[-1]["from_step"]
    schedule, shift, steps = [], 0, 0
    for own, copy, end in reversed(segments):  # oldest first; a copy's step is the recipient's own count
        if copy is not None:
            shift += copy["from_step"] - copy["step"]
        for step, values in own:
            if not schedule or values != {key: schedule[-1][key] for key in values}:
                schedule.append({"step": step + shift, **values})
        steps = end + shift
    return schedule, steps


def pick_member(section: dict, which: str) -> int:
    """`best` or a member id, as --member gives it."""
    if which == "best":
        return section["best"]
    ids = [entry["id"] for entry in section["members"]]
    if not which.isdigit() or int(which) not in ids:
        raise ScenarioError(f"--member: best or a member id ({ids[0]} to {ids[-1]}), got {which!r}")
    return int(which)


def replay_scenario(resolved: dict, section: dict, member: int) -> dict:
    """The resolved population scenario as a single run of `member`'s lineage on one member's devices."""
    schedule, steps = lineage(section, member)
    scenario = {key: value for key, value in resolved.items() if key != "pbt"}
    devices = len(section["members"][member]["ranks"])
    cluster = dict(scenario["cluster"])
    if cluster.get("devices") is not None:  # a builder topology: one member's group
        cluster["devices"] = devices
    return {**scenario, "name": f"{resolved['name']}-replay-{member}", "cluster": cluster,
            "train": {**scenario["train"], "steps": steps, "schedule": schedule}}


def plot_population(section: dict, path) -> None:
    """pbt.png: metric against simulated time per member, exploits marked; one panel per hyperparameter."""
    members = section["members"]
    names = list(members[0]["schedule"][0][2])
    figure, axes = plt.subplots(1 + len(names), 1, figsize=(9, 3.2 * (1 + len(names))), dpi=110, sharex=True)
    colors = plt.get_cmap("tab10" if len(members) <= 10 else "tab20")
    end_s = max(entry["metrics"][-1][1] for entry in members)
    for entry in members:
        color = colors(entry["id"] % colors.N)
        best = entry["id"] == section["best"]  # drawn thick, on top; the others lighter
        style = {"color": color, "linewidth": 3.0 if best else 1.2, "alpha": 1.0 if best else 0.55,
                 "zorder": 3 if best else 2}
        axes[0].plot([t * 1e3 for _, t, _ in entry["metrics"]], [m for _, _, m in entry["metrics"]], marker=".",
                     label=f"member {entry['id']}" + (" (best)" if best else ""), **style)
        times = [t for _, t, _ in entry["schedule"]] + [end_s]
        for row, name in enumerate(names, start=1):
            values = [values[name] for _, _, values in entry["schedule"]]
            axes[row].step([t * 1e3 for t in times], values + values[-1:], where="post", **style)
    for event in section["events"]:
        metric = next(m for step, _, m in members[event["to"]]["metrics"] if step == event["step"])
        axes[0].plot(event["sim_time_s"] * 1e3, metric, marker="x", color="black", markersize=8,
                     linestyle="none", label="exploit (recipient's metric before it)" if event is
                     section["events"][0] else None)
    metric = section["metric"]
    axes[0].set_ylabel(f"{metric['name']} ({metric['mode']})")
    if metric["name"].endswith("loss"):
        axes[0].set_yscale("log")
    axes[0].set_title(f"population of {len(members)}: best member {section['best']}; "
                      f"{len(section['events'])} exploits")
    axes[0].legend(fontsize=7, ncol=2)
    for row, name in enumerate(names, start=1):
        axes[row].set_ylabel(name)
        values = [values[name] for entry in members for _, _, values in entry["schedule"]]
        if min(values) > 0 and max(values) > 10 * min(values):
            axes[row].set_yscale("log")
    axes[-1].set_xlabel("simulated time (ms)")
    for axis in axes:
        axis.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, metadata={"Software": None})
    plt.close(figure)
