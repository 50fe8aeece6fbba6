"""`simtrain replay`: Chakra execution traces run again on a simulated cluster (simtrain/replay/). cli.py adds it
to the command line.

    simtrain run scenarios/quickstart.yaml --set report.chakra=true --set train.steps=2 --out runs/qs
    simtrain replay runs/qs/chakra --cluster scenarios/quickstart.yaml

The cluster is a scenario file's `cluster` section, or a file holding that section alone; its device count is the
traces' ranks unless its topology is a file of its own. `parallel.all_reduce` and `train.precision`, when the file
is a scenario, choose the all-reduce algorithm and the FLOP rate of nodes without a duration.
"""
import json
from pathlib import Path

import click
from rich.table import Table

from .errors import ScenarioError
from .scenario import load_cluster
from .units import format_bytes, format_seconds
from .user_files import load_yaml_file, user_path
from .views import console


@click.command("replay")
@click.argument("traces", nargs=-1, required=True)
@click.option("--cluster", "cluster_file", required=True, metavar="YAML",
              help="A scenario, or a file of its cluster section alone: the devices and links to replay on.")
@click.option("--set", "overrides", multiple=True, metavar="PATH=VALUE",
              help="Override a field of the scenario (value parsed as YAML).")
@click.option("--json", "as_json", is_flag=True, help="The figures as one JSON object.")
def replay(traces, cluster_file, overrides, as_json):
    """Replay Chakra execution traces (files <prefix>.<rank>.et, or folders of them with comm_group.json) on a
    simulated cluster: step time, each rank's compute, communication and idle, beside the trace's own times."""
    from .replay import read_traces, replay as replay_traces
    from .report import finite_or_none

    loaded = read_traces(list(traces))
    result = replay_traces(loaded, load_cluster(cluster_file, overrides, loaded.world))
    data = result.data
    if as_json:
        click.echo(json.dumps(finite_or_none(data), allow_nan=False))
        return
    ours, theirs = data["step_time_s"], data["trace_step_time_s"]
    console.print(f"{data['ranks']} ranks, {data['nodes']} nodes, {data['steps']} step(s) on {cluster_file}")
    console.print(f"step time {format_seconds(ours)}" + (
        f" (the trace's own: {format_seconds(theirs)}, {100 * data['difference']:+.3g}%)" if theirs else
        " (the trace carries no times of its own)"))
    kinds = list(data["breakdown_s"])
    table = Table("rank", *kinds, "trace compute", "bytes sent", title=f"each rank, {data['steps']} step(s)")
    for device in data["devices"]:
        table.add_row(str(device["rank"]), *(format_seconds(device["breakdown_s"][kind]) for kind in kinds),
                      format_seconds(device["trace_compute_s"]),
                      format_bytes(sum(device["bytes_sent_by_label"].values())))
    console.print(table)
