"""Llama 3 70B on 64 H100s: the longest sequence each long-sequence technique lets fit, and its step time.

The study of docs/guides/long-context-70b.md. scenarios/llama3-70b-long-context.yaml
(numerics off, representatives) is varied over the combinations of tensor
parallelism (tp 8 in every one: a host's NVLink), sequence parallelism,
selective and full activation recomputation and context parallelism (cp 2,
pp 4). For each, the longest sequence (a multiple of 2,048 tokens) whose
step fits every device's 80 GB is searched
with the memory planner (`plan_memory`, one replay per probe: doubling from
4,096, then bisection), and the step at that length is simulated (`run`): its
time and tokens per second. Every figure is the shipped code's.

    .venv/bin/python bench/long_context.py                       # the table, and the plot with --plot
    .venv/bin/python bench/long_context.py --plot docs/long_context_70b.png --measured 2026-12-07

A sequence is searched up to data.seq_len's limit (`simtrain.limits.MAX_SEQ_LEN`, 65,536): a combination that
fits there is reported at the limit ("at least").
"""
import argparse
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "scenarios" / "llama3-70b-long-context.yaml"
GRAIN = 2048  # sequence lengths tried: multiples of this (2 x cp x tp divides it in every combination)

# name -> (cp, sequence_parallel, checkpointing); tp 8 throughout, pp = 8 / cp
COMBINATIONS = {
    "tp": (1, False, "none"),
    "tp+sp": (1, True, "none"),
    "tp+sp+selective": (1, True, "selective"),
    "tp+sp+full": (1, True, "full"),
    "tp+sp+selective+cp2": (2, True, "selective"),
    "tp+sp+full+cp2": (2, True, "full"),
}


def scenario(cp: int, sequence_parallel: bool, checkpointing: str, seq_len: int):
    from simtrain.scenario import validate_scenario

    raw = yaml.safe_load(SCENARIO.read_text())
    raw["data"]["seq_len"] = seq_len
    raw["train"]["checkpointing"] = checkpointing
    raw["parallel"].update(cp=cp, pp=8 // cp, sequence_parallel=sequence_parallel)
    return validate_scenario(raw, str(SCENARIO), SCENARIO.parent)


def fits(spec) -> bool:
    from simtrain import plan_memory

    return all(plan.fits for plan in plan_memory(spec))


def longest(cp: int, sequence_parallel: bool, checkpointing: str) -> int:
    """The longest multiple of GRAIN that fits (0: not even GRAIN), at most MAX_SEQ_LEN (data.seq_len's limit):
    doubling from 2 x GRAIN, then bisection."""
    from simtrain.limits import MAX_SEQ_LEN

    probe = lambda length: fits(scenario(cp, sequence_parallel, checkpointing, length))  # noqa: E731
    if not probe(GRAIN):
        return 0
    good, bad = GRAIN, 2 * GRAIN
    while bad <= MAX_SEQ_LEN and probe(bad):
        good, bad = bad, 2 * bad
    if good == MAX_SEQ_LEN:
        return good  # the limit fits: the table says "at least"
    while bad - good > GRAIN:
        middle = (good + bad) // 2 // GRAIN * GRAIN
        good, bad = (middle, bad) if probe(middle) else (good, middle)
    return good


def main() -> None:
    from simtrain import run

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", type=Path, help="write the plot (PNG) here")
    parser.add_argument("--measured", default="", metavar="DATE", help="the date the plot's title says it was measured")
    parser.add_argument("--only", nargs="*", help="combinations to run (default: all)")
    args = parser.parse_args()
    rows = []
    print(f"{'combination':<22}{'longest sequence':>18}{'peak GiB':>10}{'step s':>10}{'tokens/s':>12}{'wall s':>8}")
    for name, (cp, sp, checkpointing) in COMBINATIONS.items():
        if args.only and name not in args.only:
            continue
        started = time.perf_counter()
        length = longest(cp, sp, checkpointing)
        step_s = peak = tokens_per_s = 0.0
        if length:
            spec = scenario(cp, sp, checkpointing, length)
            data = run(spec).data
            step_s = data["step_time_s"]
            peak = max(device["peak_memory_bytes"] for device in data["devices"]) / 2**30
            tokens_per_s = spec.data.batch_size * length / step_s
        rows.append((name, length, step_s))
        print(f"{name:<22}{length:>18,}{peak:>10.1f}{step_s:>10.2f}{tokens_per_s:>12,.0f}"
              f"{time.perf_counter() - started:>8.0f}", flush=True)
    if args.plot:
        plot(rows, args.plot, args.measured)


def plot(rows, path: Path, measured: str = "") -> None:
    """Longest sequence and step time per combination; a sequence at data.seq_len's limit is marked "at least"."""
    from simtrain.limits import MAX_SEQ_LEN

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, lengths, steps = zip(*rows)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    left.barh(names, [length / 1024 for length in lengths], color="tab:blue")
    for index, length in enumerate(lengths):
        if length == MAX_SEQ_LEN:
            left.text(length / 1024, index, " at least (the limit)", va="center", ha="right", color="white")
    left.set_xlabel("longest sequence that fits (K tokens)")
    right.barh(names, steps, color="tab:orange")
    right.set_xlabel("step time at that length (s, 8 sequences)")
    left.invert_yaxis()
    figure.suptitle("Llama 3 70B on 64 H100-80GB, fused attention: tp 8, pp = 8 / cp (simtrain, numerics off"
                    + (f", measured {measured})" if measured else ")"))
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
