"""`simtrain torchtitan`: torchtitan's own training, unmodified, on a simulated cluster (simtrain/frameworks/). cli.py
adds it to the command line.

    simtrain torchtitan --cluster scenarios/quickstart.yaml --ranks 8 -- --module llama3 --config llama3_8b

What follows `--` is torchtitan's own command line, as `torchrun -m torchtitan.train` takes it. The cluster is a
scenario file's `cluster` section, or a file holding that section alone; `--ranks` sets its device count unless its
topology is a file of its own. The run writes report.json (the step times and what each rank computed, sent and
held) and trace.json (Perfetto) to `--out`.
"""
import json

import click
from rich.table import Table

from .errors import ScenarioError
from .scenario import load_cluster
from .units import format_bytes, format_seconds
from .user_files import output_folder
from .views import console


@click.command("torchtitan", context_settings={"ignore_unknown_options": True})
@click.option("--cluster", "cluster_file", required=True, metavar="YAML",
              help="A scenario, or a file of its cluster section alone: the devices and links to train on.")
@click.option("--ranks", type=click.IntRange(min=1), default=None,
              help="The number of ranks (the cluster's devices; default: the file's).")
@click.option("--set", "overrides", multiple=True, metavar="PATH=VALUE",
              help="Override a field of the scenario (value parsed as YAML).")
@click.option("--numerics", is_flag=True, help="Compute values (default: fake tensors, shapes only; no loss).")
@click.option("--out", "out_dir", default="runs/torchtitan", show_default=True, help="Output folder.")
@click.argument("arguments", nargs=-1, type=click.UNPROCESSED)
def torchtitan(cluster_file, ranks, overrides, numerics, out_dir, arguments):
    """Run torchtitan's Trainer, configured by its own arguments (after --), on every rank of a simulated cluster:
    torchtitan's log (rank 0's), then simtrain's step times, memory and bytes."""
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        raise ScenarioError("simtrain torchtitan: torchtitan is not installed (pip install -e \".[titan]\": "
                            "torchtitan 0.3.0)") from None
    from .frameworks.torchtitan import run_torchtitan
    from .report import write_atomic

    out = output_folder(out_dir, "--out")
    scenario = load_cluster(cluster_file, overrides, ranks)
    run = run_torchtitan(list(arguments), scenario, numerics)
    data = summary(run, numerics)
    out.mkdir(parents=True, exist_ok=True)
    written = [write_atomic(out / "report.json", lambda f: f.write(json.dumps(data, indent=1).encode())),
               write_atomic(out / "trace.json", lambda f: f.write(json.dumps(run.result.report.trace).encode()))]
    print_summary(data)
    console.print(f"wrote {out}/" + ", ".join(path.name for path in written), soft_wrap=True)


def summary(run, numerics: bool) -> dict:
    """report.json's figures: the run's steps (rank 0's), their throughput as torchtitan counts it, the losses it
    logged (numerics on), and each rank's compute, communication, bytes and memory."""
    report = run.result.report.data
    return {
        "framework": "torchtitan", "arguments": run.arguments, "numerics": numerics,
        "ranks": len(report["devices"]), "device": run.device_name,
        "step_time_s": run.step_s[-1], "steps_s": run.step_s, "losses": run.losses,
        "tokens_per_s_per_gpu": run.tokens_per_s_per_gpu,
        "tflops_per_gpu": run.flops_per_token * run.tokens_per_s_per_gpu / 1e12, "mfu": run.mfu,
        "peak_memory_bytes": report["devices"][0]["peak_memory_bytes"],
        "sim_time_s": report["sim_time_s"], "devices": report["devices"], "links": report["links"],
    }


def print_summary(data: dict) -> None:
    console.print(f"torchtitan on {data['ranks']} simulated {data['device']} "
                  f"({'numerics on' if data['numerics'] else 'numerics off'}): step time "
                  f"{format_seconds(data['step_time_s'])} (step {len(data['steps_s'])}), "
                  f"{data['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, {data['tflops_per_gpu']:,.1f} TFLOP/s per GPU, "
                  f"MFU {100 * data['mfu']:.1f}% (torchtitan's count of FLOPs per token)", soft_wrap=True)
    table = Table("rank", "compute", "communication", "bytes sent", "peak memory", title="each rank, the whole run")
    devices = data["devices"]
    shown = devices if len(devices) <= 8 else [*devices[:4], *devices[-4:]]
    for device in shown:
        table.add_row(str(device["rank"]), format_seconds(device["compute_s"]),
                      format_seconds(device["communication_s"]), format_bytes(device["bytes_sent"]),
                      format_bytes(device["peak_memory_bytes"]))
    console.print(table)
    categories = devices[0]["peak_memory_bytes_by_category"]
    console.print("rank 0 at its peak: " + ", ".join(f"{name} {format_bytes(size)}" for name, size in
                                                     categories.items() if size), soft_wrap=True)
