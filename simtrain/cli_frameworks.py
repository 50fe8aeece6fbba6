"""`simtrain torchtitan` and `simtrain megatron`: the frameworks' own training, unmodified, on a simulated cluster
(simtrain/frameworks/). cli.py adds them to the command line.

    simtrain torchtitan --cluster scenarios/quickstart.yaml --ranks 8 -- --module llama3 --config llama3_8b
    simtrain megatron --cluster scenarios/quickstart.yaml --ranks 4 -- train_gpt.py --tp 2

What follows `--` is torchtitan's own command line, as `torchrun -m torchtitan.train` takes it, or the Megatron-Core
script and its arguments, as `torchrun` takes them. The cluster is a scenario file's `cluster` section, or a file
holding that section alone; `--ranks` sets its device count unless its topology is a file of its own. A run writes
report.json (the step times and what each rank computed, sent and held) and trace.json (Perfetto) to `--out`.
"""
import importlib.util
import json
import warnings

import click
from rich.table import Table

from .errors import ScenarioError
from .scenario import load_cluster
from .units import format_bytes, format_seconds
from .user_files import output_folder
from .views import console

# What Megatron-Core (Transformer Engine, Apex) and torch (NCCL) warn is missing on a CPU machine
_CPU_WARNINGS = "(Transformer Engine and Apex are not installed|Apex is not installed|Attempted to get default timeout for nccl)"


def framework_options(name: str):
    """The options both commands take: the cluster, its ranks and overrides, numerics, the output folder."""
    def options(f):
        f = click.argument("arguments", nargs=-1, type=click.UNPROCESSED)(f)
        f = click.option("--out", "out_dir", default=f"runs/{name}", show_default=True, help="Output folder.")(f)
        f = click.option("--numerics", is_flag=True,
                         help="Compute values (default: fake tensors, shapes only; no loss).")(f)
        f = click.option("--set", "overrides", multiple=True, metavar="PATH=VALUE",
                         help="Override a field of the scenario (value parsed as YAML).")(f)
        f = click.option("--ranks", type=click.IntRange(min=1), default=None,
                         help="The number of ranks (the cluster's devices; default: the file's).")(f)
        f = click.option("--cluster", "cluster_file", required=True, metavar="YAML",
                         help="A scenario, or a file of its cluster section alone: the devices and links to train "
                              "on.")(f)
        return click.command(name, context_settings={"ignore_unknown_options": True})(f)
    return options


@framework_options("torchtitan")
def torchtitan(cluster_file, ranks, overrides, numerics, out_dir, arguments):
    """Run torchtitan's Trainer, configured by its own arguments (after --), on every rank of a simulated cluster:
    torchtitan's log (rank 0's), then simtrain's step times, memory and bytes."""
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        raise ScenarioError("simtrain torchtitan: torchtitan is not installed (pip install -e \".[titan]\": "
                            "torchtitan 0.3.0)") from None
    from .frameworks.torchtitan import run_torchtitan

    out = output_folder(out_dir, "--out")
    scenario = load_cluster(cluster_file, overrides, ranks)
    run = run_torchtitan(list(arguments), scenario, numerics)
    data = {"framework": "torchtitan", "arguments": run.arguments, "numerics": numerics,
            **steps(run), "losses": run.losses,
            "tokens_per_s_per_gpu": run.tokens_per_s_per_gpu,
            "tflops_per_gpu": run.flops_per_token * run.tokens_per_s_per_gpu / 1e12, "mfu": run.mfu,
            **ranks_figures(run.result.report.data)}
    console.print(f"torchtitan on {data['ranks']} simulated {data['device']} "
                  f"({'numerics on' if numerics else 'numerics off'}): {step_line(data)}, "
                  f"{data['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, {data['tflops_per_gpu']:,.1f} TFLOP/s per GPU, "
                  f"MFU {100 * data['mfu']:.1f}% (torchtitan's count of FLOPs per token)", soft_wrap=True)
    write(out, data, run.result.report.trace)


@framework_options("megatron")
def megatron(cluster_file, ranks, overrides, numerics, out_dir, arguments):
    """Run a Megatron-Core training script with its arguments (after --), as torchrun launches it, on every rank of
    a simulated cluster: its output, then simtrain's step times (between its optimizer steps), memory and
    bytes."""
    if not arguments:
        raise ScenarioError("simtrain megatron: no script given: simtrain megatron --cluster C.yaml -- SCRIPT [ARGS]")
    out = output_folder(out_dir, "--out")
    scenario = load_cluster(cluster_file, overrides, ranks)
    with warnings.catch_warnings():
        # Megatron-Core warns, module by module, that Transformer Engine and Apex (CUDA-only) are missing, and torch
        # that NCCL is not compiled in, which the simulated groups do not need: one line below says so instead
        warnings.filterwarnings("ignore", message=_CPU_WARNINGS)
        try:
            import megatron.core  # noqa: F401
        except ImportError:
            raise ScenarioError("simtrain megatron: Megatron-Core is not installed (pip install -e \".[megatron]\": "
                                "megatron-core 0.16.1)") from None
        from .frameworks.megatron import run_megatron
        run = run_megatron(arguments[0], list(arguments[1:]), scenario, numerics)
    if importlib.util.find_spec("transformer_engine") is None:
        console.print("Megatron-Core ran without Transformer Engine and Apex (CUDA-only; neither installs here): "
                      "their modules as Megatron's local implementations, charged for what those compute",
                      soft_wrap=True)
    if not run.step_s:
        raise ScenarioError(f"simtrain megatron: {arguments[0]}: no optimizer step ran on rank 0, so there is no "
                            f"step to time")
    data = {"framework": "megatron", "arguments": run.argv, "numerics": numerics,
            **steps(run), **ranks_figures(run.result.report.data)}
    console.print(f"Megatron-Core on {data['ranks']} simulated {data['device']} "
                  f"({'numerics on' if numerics else 'numerics off'}): {step_line(data)}", soft_wrap=True)
    write(out, data, run.result.report.trace)


def steps(run) -> dict:
    """report.json's step figures: the last step's time and each step's (rank 0's), the ranks and their device."""
    return {"ranks": len(run.result.report.data["devices"]), "device": run.device_name,
            "step_time_s": run.step_s[-1], "steps_s": run.step_s}


def ranks_figures(report: dict) -> dict:
    """report.json's rank figures: rank 0's peak memory, the simulated time, each rank's compute, communication,
    bytes and memory, and the links'."""
    return {"peak_memory_bytes": report["devices"][0]["peak_memory_bytes"], "sim_time_s": report["sim_time_s"],
            "devices": report["devices"], "links": report["links"]}


def step_line(data: dict) -> str:
    return f"step time {format_seconds(data['step_time_s'])} (step {len(data['steps_s'])})"


def write(out, data: dict, trace: dict) -> None:
    """report.json and trace.json written to `out`, each whole or not at all; the ranks' table printed."""
    from .report import write_atomic
    out.mkdir(parents=True, exist_ok=True)
    written = [write_atomic(out / "report.json", lambda f: f.write(json.dumps(data, indent=1).encode())),
               write_atomic(out / "trace.json", lambda f: f.write(json.dumps(trace).encode()))]
    print_ranks(data)
    console.print(f"wrote {out}/" + ", ".join(path.name for path in written), soft_wrap=True)


def print_ranks(data: dict) -> None:
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
