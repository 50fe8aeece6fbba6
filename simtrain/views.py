"""The terminal views of simtrain's results: the run summary, faults, a population, calibration fits.

    from simtrain.views import print_summary
    print_summary(json.loads(Path("runs/quickstart/report.json").read_text()))

On a terminal a table fits its width (folding long cells); piped or redirected, the standard output is
`PIPED_WIDTH` columns wide, so no table is cut to a terminal's width ("w… 2… G…").

Each view reads report.json's dict (or a command's summary dict) and prints
rich tables on the standard output. A table that shows one figure per rank
shows one column per group of ranks whose figures are all the same
(`same_figures`), as `simtrain memory` and the run summary do.
"""
import sys

from rich.console import Console
from rich.table import Table

from .units import format_bytes, format_seconds, noise_free

PIPED_WIDTH = 1_000  # columns: wider than any table simtrain draws
console = Console() if sys.stdout is not None and sys.stdout.isatty() else Console(width=PIPED_WIDTH)


def _error_bar(data: dict) -> str:
    """The step time's error bar as the summary shows it after the time (" ± 29.2 ms (3.5%: ...)"), where
    report.json gives one; else nothing."""
    error = data.get("step_time_error")
    if error is None:
        return ""
    return (f" ± {format_seconds(error['seconds'])} ({error['relative']:.1%}: the {error['generation']} "
            f"calibration's error over {error['rows']} published rows)")


def print_summary(data: dict) -> None:
    """The terminal view of report.json."""
    table = Table(title=f"{data['name']}: {scheme_title(data)}, {data['all_reduce']} on {data['devices_count']} "
                        "devices", show_header=False)
    step, throughput, scaling = data["step_time_s"], data["throughput_samples_per_s"], data["scaling_efficiency"]
    steps = "updates" if "async" in data else "steps"  # async: every worker's push is one update
    no_time = "n/a (no step ran)" if not data["steps"] else "n/a (no simulated time)"
    for label, value in _layout_rows(data):
        table.add_row(label, value)
    table.add_row("precision", _precision_line(data.get("amp")))
    if data.get("measured"):
        table.add_row("measured time", f"{format_seconds(data['sim_time_s'])} over {data['steps']} {steps} "
                                       f"(after {data['measurement']['warmup_steps']} warm-up steps)")
    else:
        table.add_row("simulated time", f"{format_seconds(data['sim_time_s'])} over {data['steps']} {steps}")
    table.add_row(f"{steps[:-1]} time", no_time if step is None else format_seconds(step) + _error_bar(data))
    for kind, seconds in data["breakdown_s"].items():
        seconds = noise_free(seconds, step)
        table.add_row(f"  {kind}", "n/a" if seconds is None else
                      format_seconds(seconds) + (f" ({seconds / step:.1%})" if step else ""))
    table.add_row("throughput", no_time if throughput is None else f"{three_figures(throughput)} samples/s")
    tokens = data.get("throughput_tokens_per_s_per_device")
    if tokens is not None:
        table.add_row("tokens/s per device", three_figures(tokens))
    table.add_row("scaling efficiency", _no_scaling_reason(data) if scaling is None else f"{scaling:.1%} (weak scaling)")
    flops = data["flops"]
    if flops["tflops_per_device"] is not None:
        table.add_row("model TFLOP/s per device", f"{flops['tflops_per_device']:.3g} "
                                                  f"(of {flops['peak_tflops_per_device']:.3g} peak)")
        table.add_row("MFU", f"{flops['mfu']:.1%}" + _hardware_flops(flops))
    if data["final_loss"] is None:
        table.add_row("final loss, accuracy", "none: numerics off")
    else:
        table.add_row("final loss (train set)", f"{data['final_loss']:.4f}")
        table.add_row("final accuracy (test set)", f"{data['final_accuracy']:.2%}")
    if "time_to_target_s" in data:
        target = data["time_to_target_s"]
        table.add_row("time to target loss", "never" if target is None else format_seconds(target))
    if "moe" in data:
        table.add_row("experts", _experts_line(data["moe"]))
    if "async" in data:
        section = data["async"]
        table.add_row("staleness mean / max", f"{section['staleness_mean']:.2f} / {section['staleness_max']}")
        table.add_row("lock wait (all workers)", format_seconds(section['lock_wait_s']))
    console.print(table)
    if "faults" in data:
        print_faults(data["faults"])
    if "pbt" in data:
        print_population(data["pbt"])
    if "fleet" in data:
        print_fleet(data["fleet"])
    console.print(_peak_memory_table(data["devices"]))


def _hardware_flops(flops: dict) -> str:
    """Beside MFU, the share of peak the devices ran where it differs: their kernels' own FLOPs (a fused causal
    attention's half, say), with the recomputed forwards where the run recomputed (report/flops.py)."""
    if flops["device_flops_utilization"] == flops["mfu"]:
        return ""
    recomputation = flops["recomputation"]
    included = "their kernels' FLOPs" if recomputation == "none" else f"{recomputation} recomputation included"
    return f" (devices ran {flops['device_flops_utilization']:.1%} of peak, {included})"


# report.json's `scheme` in words; a sharded optimizer is named by its ZeRO stage (scheme_title)
SCHEME_WORDS = {"data_parallel": "data parallel", "model_parallel": "model parallel",
                "expert_parallel": "expert parallel", "async": "asynchronous", "sharded": "data parallel"}
ZERO_WORDS = {1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3 (FSDP)"}


def scheme_title(data: dict) -> str:
    """The scheme as users name it: "ZeRO-3 (FSDP)", "HSDP (ZeRO-3)", "model parallel + ZeRO-1"..., from
    report.json's `scheme` and `sharding` sections."""
    words = SCHEME_WORDS.get(data["scheme"], data["scheme"])
    sharding = data.get("sharding")
    if not sharding or not sharding.get("stage"):
        return words
    zero = ZERO_WORDS[sharding["stage"]]
    if sharding.get("replicate", 1) > 1:
        zero = f"HSDP (ZeRO-{sharding['stage']})"  # the layout's sharding row says its groups
    return zero if data["scheme"] == "sharded" else f"{words} + {zero}"


def three_figures(value: float) -> str:
    """A rate to 3 significant figures, or to the unit above 100 (0.593, 12.3, 150,818)."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _layout_rows(data: dict) -> list[tuple[str, str]]:
    """The layout's rows: dp × pp × tp × cp and ep (which borrows dp × cp's ranks, so no factor of the world),
    then the pipeline schedule or the accumulation steps and the ZeRO stage's shard groups, as report.json's
    parallel, moe and sharding sections (or async's) say."""
    if "async" in data:
        return [("layout", f"{data['devices_count']} asynchronous workers, {data['async']['consistency']} updates")]
    parallel = data.get("parallel")
    if parallel is None:  # a measured run (simtrain launch): data parallel on every rank
        return [("layout", f"dp {data['devices_count']}")]
    expert_parallel = data["moe"]["ep"] if "moe" in data else 1
    rows = [("layout", f"dp {parallel['dp']} × pp {parallel['pp']} × tp {parallel['tp']} × cp "
                       f"{parallel.get('cp') or 1}, ep {expert_parallel}")]
    if parallel["pp"] > 1:
        rows.append(("  pipeline", f"{parallel['schedule']}, {parallel['microbatches']} microbatches"))
    elif parallel.get("microbatches", 1) > 1:
        rows.append(("  gradient accumulation", f"{parallel['microbatches']} micro-batches"))
    sharding = data.get("sharding")
    if sharding and sharding.get("stage"):
        shards = f"ZeRO-{sharding['stage']} over {sharding['degree']} ranks"
        if sharding.get("replicate", 1) > 1:
            shards += f" × {sharding['replicate']} replicas (HSDP)"
        rows.append(("  sharding", shards))
    return rows


def _experts_line(moe: dict) -> str:
    """The MoE layers' routing over the run: the worst step's imbalance, the tokens dropped, the all-to-all bytes
    and exposed time a step (its mean), as report.json's moe section has them."""
    steps = len(moe["imbalance"])
    if not steps:
        return "no step ran"
    line = (f"routing {moe['routing']}: imbalance max/mean {max(moe['imbalance']):.2f}, "
            f"{sum(moe['dropped_tokens']):,} assignments dropped, all-to-all "
            f"{format_bytes(sum(moe['all_to_all_bytes']) / steps)} a step")
    if moe["all_to_all_time_s"] is not None:
        line += f", {format_seconds(sum(moe['all_to_all_time_s']) / steps)} of it exposed"
    return line


def attention_note(scenario) -> str | None:
    """The note `run` and `validate` print for a gpt or llama whose attention is eager by default, not by choice."""
    if not scenario.model.eager_by_default:
        return None
    return (f"note: model.attention: eager by default (the s x s scores written out and kept, as the Megatron-LM "
            f"papers ran); frameworks today run fused attention: --set model.attention=fused, or set it in "
            f"the scenario to keep eager and silence this")


def batch_line(scenario, world: int) -> str:
    """The batch in the words users have, derived from data.batch_size (each replica's samples per step),
    parallel.pipeline.microbatches and dp: the global batch, the micro-batch size, the accumulation steps."""
    from .parallel import Layout

    data_parallel, count = Layout.of(scenario.parallel, world).dp, scenario.parallel.microbatches
    per_replica = scenario.data.batch_size
    what = "pipeline microbatches" if scenario.parallel.pp > 1 else "accumulation steps"
    return (f"global batch {per_replica * data_parallel} = data.batch_size {per_replica} x dp {data_parallel}, "
            f"micro-batch {per_replica // count} x {count} {what}")


def preset_line(scenario) -> str | None:
    """What model.preset filled in (scenario/model_presets.py), as the scenario resolved it (a field the user
    gave shows the user's value); None without a preset."""
    from .scenario.model_presets import MODEL_PRESETS

    name = scenario.model.preset
    if name is None:
        return None
    preset, model = MODEL_PRESETS[name], scenario.model.model_dump(mode="json")
    model["hidden"] = scenario.model.width

    def shown(value, given) -> str:  # a section's fields the preset gives
        if isinstance(value, dict) and isinstance(given, dict):
            return "{" + ", ".join(f"{key}: {shown(value[key], None)}" for key in given) + "}"
        return f"{value:g}" if isinstance(value, float) else str(value)

    fields = [f"{key} {shown(model[key], given)}" for key, given in preset["model"].items()]
    fields += [f"data.{key} {getattr(scenario.data, key)}" for key in preset["data"]]
    return f"model.preset {name}: " + ", ".join(fields)


def _precision_line(amp: dict | None) -> str:
    """The precision and, under fp16, the loss scale it ended at and the steps an overflow skipped."""
    if amp is None:
        return "fp32"
    if amp["loss_scale_final"] is None:
        return f"{amp['precision']} (no loss scaling)"
    return f"{amp['precision']}, final loss scale {amp['loss_scale_final']:g}, {amp['skipped_steps']} skipped steps"


def _no_scaling_reason(data: dict) -> str:
    """Why a run has no scaling efficiency."""
    parallel = data.get("parallel") or {}
    if parallel.get("pp", 1) > 1 or parallel.get("tp", 1) > 1:
        return "n/a (model split: no one-device baseline)"
    return "n/a (no step ran)" if not data["steps"] else "n/a (no one-device baseline)"


def _peak_memory_table(devices: list[dict]) -> Table:
    """Peak memory by category, one column per group of ranks whose figures are all the same (as `simtrain
    memory` shows them): 80 columns hold it."""
    groups = same_figures((device["rank"], (device.get("device"), device["peak_memory_bytes"],
                                              tuple(device["peak_memory_bytes_by_category"].items())))
                           for device in devices)
    table = Table(title="peak memory per device")
    table.add_column("")
    for ranks in groups.values():
        table.add_column(ranks_header(ranks), justify="right")
    columns = [dict(zip(("device", "peak", "by_category"), key)) for key in groups]
    for category in dict.fromkeys(c for device in devices for c in device["peak_memory_bytes_by_category"]):
        table.add_row(category, *(format_bytes(dict(column["by_category"]).get(category, 0)) for column in columns))
    table.add_row("peak", *(format_bytes(column["peak"]) for column in columns))
    return table


def print_faults(section: dict) -> None:
    """Every fault and what it did, then the checkpoints, the time lost and goodput."""
    goodput = "n/a" if section["goodput"] is None else f"{section['goodput']:.1%}"
    table = Table(title=f"faults: goodput {goodput} (fault-free "
                        f"{format_seconds(section['fault_free_time_s'])}), {section['restarts']} restart(s), "
                        f"{section['steps_redone']} step(s) redone, time lost {format_seconds(section['time_lost_s'])}",
                  show_header=True)
    for header in ("at", "source", "fault", "what it did"):
        table.add_column(header, justify="right" if header == "at" else "left", overflow="fold")
    for event in section["events"]:
        kind, how = event["kind"].split("_")
        what = f"link {'-'.join(event['link'])}" if kind == "link" else f"device {event['device']}"
        detail = {key: value for key, value in event.items() if key not in ("at_s", "source", "kind", "link", "device")}
        table.add_row(format_seconds(event["at_s"]), event["source"], f"{what} {how}",
                      ", ".join(f"{key} {format_seconds(value) if key.endswith('_s') else value}"
                                for key, value in detail.items()) or "-")
    console.print(table)
    console.print(f"checkpoints: {section['checkpoints_committed']} committed, "
                  f"{format_bytes(section['checkpoint_bytes_per_rank'])} per rank, "
                  f"{format_seconds(section['checkpoint_time_s'])} writing per rank")


def print_fleet(section: dict) -> None:
    """A fleet run: effective training time, interruptions and time lost by cause and by phase."""
    effective = "n/a" if section["effective_training_time"] is None else f"{section['effective_training_time']:.1%}"
    table = Table(title=f"fleet: {section['gpus']:,} GPUs for {format_seconds(section['elapsed_s'])}, effective "
                        f"training time {effective}, {section['interruptions']} interruption(s)", show_header=True)
    for header in ("cause or phase", "interruptions", "time lost"):
        table.add_column(header, justify="left" if header == "cause or phase" else "right")
    for cause, seconds in section["time_lost_by_cause_s"].items():
        table.add_row(cause, str(section["interruptions_by_cause"].get(cause, 0)), format_seconds(seconds))
    for phase, seconds in section["time_lost_by_phase_s"].items():
        table.add_row(f"  {phase}", "", format_seconds(seconds))
    console.print(table)


def print_population(section: dict) -> None:
    """The population: each member's devices, final metric, hyperparameters now and exploits received."""
    metric = section["metric"]
    table = Table(title=f"population ({metric['name']}, {metric['mode']}; best: member {section['best']}, "
                        f"copying took {format_seconds(section['copy_time_s'])} of member time)")
    names = list(section["members"][0]["schedule"][-1][2])
    for header in ("member", "ranks", "steps", f"final {metric['name']}", *names, "copied from (step)"):
        table.add_column(header, justify="right")
    for member in section["members"]:
        copies = [f"{event['from']} ({event['step']})" for event in section["events"] if event["to"] == member["id"]]
        values = member["schedule"][-1][2]
        table.add_row(("* " if member["id"] == section["best"] else "") + str(member["id"]),
                      rank_list(member["ranks"]), str(member["steps"]), f"{member['final_metric']:.4f}",
                      *(f"{values[name]:.4g}" for name in names), ", ".join(copies) or "-")
    console.print(table)


def print_calibration(summary: dict) -> None:
    """`simtrain calibrate`'s tables: the point-to-point fits, the all-reduce measured and predicted, compute."""
    fits = Table(title=f"point to point, α-β fit ({summary['ranks']} ranks, {summary['backend']})")
    for header in ("pair", "latency α", "bandwidth β", "largest |residual|", "residuals by size"):
        fits.add_column(header, justify="right")
    for pair, fit in summary["pingpong"].items():
        bound = "" if fit["bandwidth_resolved"] else " (at least: not resolved)"
        fits.add_row(pair, format_seconds(fit["latency_s"]), f"{fit['bandwidth_Bps'] / 1e9:.3f} GB/s{bound}",
                     f"{max(abs(r) for r in fit['residuals']):.1%}", " ".join(f"{r:+.0%}" for r in fit["residuals"]))
    for kind, fit in summary["link_classes"].items():
        bound = "" if fit["bandwidth_resolved"] else " (at least: not resolved)"
        fits.add_row(kind, format_seconds(fit["latency_s"]), f"{fit['bandwidth_Bps'] / 1e9:.3f} GB/s{bound}",
                     f"{fit['max_abs_residual']:.1%}", "(written to topology.yaml)")
    console.print(fits)
    table = Table(title="ring all-reduce (simtrain's program): measured, and predicted on topology.yaml")
    for header in ("bytes", "time", "busbw", "predicted", "error"):
        table.add_column(header, justify="right")
    for row in summary["all_reduce"]:
        table.add_row(str(row["bytes"]), format_seconds(row["time_s"]), f"{row['busbw_GBps']:.3f} GB/s",
                      format_seconds(row["predicted_time_s"]), f"{row['error']:+.1%}")
    console.print(table)
    compute = Table(title=f"compute per rank, all ranks at once ({summary['model_of'] or 'Linear layers'}): "
                          "t = overhead + FLOPs / rate a pass")
    for header in ("dtype", "rate (device.yaml)", "overhead per pass", "largest |residual|"):
        compute.add_column(header, justify="right")
    for dtype, fit in summary["compute"].items():
        compute.add_row(dtype, f"{fit['flops_per_s'] / 1e9:.2f} GFLOP/s", format_seconds(fit["pass_overhead_s"]),
                        f"{fit['max_abs_residual']:.1%}")
    console.print(compute)
    exchange, optimizer = summary["all_reduce_exchange"], summary["optimizer"]
    console.print(f"ring exchange in training steps: α {format_seconds(exchange['latency_s'])}, β "
                  f"{exchange['bandwidth_Bps'] / 1e9:.3f} GB/s (largest |residual| "
                  f"{exchange['max_abs_residual']:.1%}); "
                  f"beyond the {exchange['wire']} wire {format_seconds(exchange['software_latency_s'])} a message, "
                  f"{exchange['software_s_per_byte'] * 1e9:.3f} ns a byte")
    bound = "" if optimizer["bandwidth_resolved"] else " (at least: not resolved)"
    console.print(f"optimizer step: {format_seconds(optimizer['overhead_s'])} fixed and memory bandwidth "
                  f"{optimizer['bandwidth_Bps'] / 1e9:.2f} GB/s{bound} (largest "
                  f"|residual| {optimizer['max_abs_residual']:.1%}); waiting at the all-reduce "
                  + ", ".join(format_seconds(seconds) for seconds in summary["idle_s"].values())
                  + f": compute jitter σ {summary['compute_jitter']:.3f} and "
                  + f"{format_seconds(summary['compute_jitter_fixed_s'])} fixed (largest |residual| "
                  + f"{max(map(abs, summary['idle_residuals'])):.1%})")
    if summary["pooled"]:
        console.print("pooled calibrations, one step of each case as measured: " + ", ".join(
            f"{format_seconds(one['measured_step_s'])} ({one['date']})" for one in summary["pooled"]))
    if summary["load"]["warning"]:
        console.print(summary["load"]["warning"], markup=False, highlight=False, soft_wrap=True)


def print_comparison(rows: list[dict]) -> None:
    """`simtrain compare`'s table: one row per run (compare.py's rows), sync steps and async updates side by
    side in the units they share (samples, simulated time, time per sample, time to target)."""
    table = Table(title=f"{len(rows)} runs")
    for header in ("run", "scheme", "trained", "sim time", "step time", "time/sample", "to target", "MFU",
                   "final loss", "accuracy", "idle", "peak memory", "bytes moved", "staleness mean/max"):
        table.add_column(header, justify="left" if header in ("run", "scheme") else "right", overflow="fold",
                         no_wrap=header not in ("run", "bytes moved"), min_width=28 if header == "bytes moved" else None)
    for row in rows:
        target, kinds = row["time_to_target_s"], row["bytes_by_kind"]
        staleness = "-" if row["staleness_mean"] is None else f"{row['staleness_mean']:.2f}/{row['staleness_max']}"
        ok = row["status"] == "ok"
        table.add_row(row["label"], row["scheme"],
                      f"{row['steps']:,} {row['steps_are']}, {row['samples']:,} samples" if ok
                      else row["status"].replace("_", " "),
                      format_seconds(row["sim_time_s"]),
                      "-" if row["step_time_s"] is None else format_seconds(row["step_time_s"]),
                      "-" if row["time_per_sample_s"] is None else format_seconds(row["time_per_sample_s"]),
                      "-" if target is None else format_seconds(target),
                      "-" if row["mfu"] is None else f"{row['mfu']:.1%}",
                      "-" if row["final_loss"] is None else f"{row['final_loss']:.4f}",
                      "-" if row["final_accuracy"] is None else f"{row['final_accuracy']:.2%}",
                      "-" if row["idle_share"] is None else f"{row['idle_share']:.1%}",
                      format_bytes(row["peak_memory_bytes"]),
                      "-" if kinds is None else _bytes_moved(kinds),
                      staleness)
    console.print(table)
    console.print("time/sample: simulated time over the samples trained (a sync step trains every device's batch, "
                  "an async update one worker's)")


# compare.py's kinds of bytes, as the comparison's table names them
BYTE_KIND_WORDS = {"dp_allreduce": "dp", "pp_p2p": "pp", "tp_allreduce": "tp", "overflow_vote": "vote",
                   "cp_ring": "cp", "sharded": "sharded", "expert": "expert"}


def _bytes_moved(kinds: dict) -> str:
    """The kinds that moved bytes, "sharded 72.2 MiB, dp 1.0 MiB" (largest first), or "0 B"."""
    moved = sorted(((nbytes, kind) for kind, nbytes in kinds.items() if nbytes), key=lambda pair: -pair[0])
    return ", ".join(f"{BYTE_KIND_WORDS.get(kind, kind)} {format_bytes(nbytes)}" for nbytes, kind in moved) or "0 B"


SWEEP_TABLE_ROWS = 100  # a longer sweep's table would take seconds to draw and scroll past the terminal


def print_sweep(rows: list[dict], grid_paths: list[str], grid_texts: list[list[str]]) -> None:
    """`simtrain sweep`'s table: one row per point (the first SWEEP_TABLE_ROWS), its grid values as written
    (`grid_texts`) first."""
    table = Table(title=f"{len(rows)} runs", caption=None if len(rows) <= SWEEP_TABLE_ROWS else
                  f"the first {SWEEP_TABLE_ROWS} of {len(rows):,} rows; sweep.csv holds every row")
    for header in (*grid_paths, "status", "step time", "throughput", "efficiency",
                   "communication", "peak memory", "final loss"):
        table.add_column(header, justify="left" if header == "status" else "right", overflow="fold")
    for row, texts in zip(rows[:SWEEP_TABLE_ROWS], grid_texts):
        ok = row["step_time_s"] is not None
        table.add_row(*texts,
                      row["status"].replace("_", " ") if row["status"] == "ok" else
                      f"{row['status'].replace('_', ' ')}: {row['error']}",
                      format_seconds(row["step_time_s"]) if ok else "-",
                      f"{three_figures(row['throughput_samples_per_s'])}/s" if ok else "-",
                      "-" if row["scaling_efficiency"] is None else f"{row['scaling_efficiency']:.1%}",
                      format_seconds(row["communication_s"]) if ok else "-",
                      "-" if row["peak_memory_bytes"] is None else format_bytes(row["peak_memory_bytes"]),
                      "-" if row["final_loss"] is None else f"{row['final_loss']:.4f}")
    console.print(table)


def same_figures(ranks_and_figures) -> dict[tuple, list[int]]:
    """Ranks grouped by their figures, in rank order: a table shows one column per group (usually one)."""
    groups: dict[tuple, list[int]] = {}
    for rank, figures in ranks_and_figures:
        groups.setdefault(figures, []).append(rank)
    return groups


def ranks_header(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_list(ranks)}"


def rank_list(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs, start = [], ranks[0]
    for index, rank in enumerate(ranks):
        following = ranks[index + 1] if index + 1 < len(ranks) else None
        if following != rank + 1:
            runs.append(str(start) if start == rank else f"{start}-{rank}")
            start = following
    return ",".join(runs)


def print_memory_plans(scenario, plans: list, search: bool = True) -> None:
    """`simtrain memory`'s table: each group of ranks with the same figures a column (memory_plan.py's plans):
    device, capacity, bytes by category, peak and, with `search`, the largest batch that fits."""
    train = scenario.train
    checkpointing = train.checkpointing if isinstance(train.checkpointing, str) else \
        f"{train.checkpointing.segments} segments"
    table = Table(title=f"{scenario.name}: peak memory of one step, batch {scenario.data.batch_size} per device, "
                        f"{train.precision}, checkpointing {checkpointing}")
    groups = same_figures((plan.rank, (plan.device, plan.capacity_bytes, plan.peak_bytes,
                                        tuple(plan.by_category.items()), plan.largest_batch if search else None))
                          for plan in plans)
    table.add_column("")
    for ranks in groups.values():
        table.add_column(ranks_header(ranks), justify="right")
    columns = [plans[ranks[0]] for ranks in groups.values()]
    table.add_row("device", *(plan.device for plan in columns))
    table.add_row("capacity", *(format_bytes(plan.capacity_bytes) for plan in columns))
    for category in dict.fromkeys(c for plan in plans for c in plan.by_category):
        table.add_row(f"  {category}", *(format_bytes(plan.by_category.get(category, 0)) for plan in columns))
    table.add_row("peak", *(format_bytes(plan.peak_bytes) + ("" if plan.fits else "  DOES NOT FIT")
                            for plan in columns))
    if search:
        table.add_row("largest batch that fits", *(str(plan.largest_batch) for plan in columns))
    console.print(table)
