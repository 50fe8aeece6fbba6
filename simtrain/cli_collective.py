"""The network's commands: `simtrain collective` (a collective micro-benchmark, nccl-tests style) and `simtrain
topo` (a topology's devices, switches and links). cli.py adds them to the command line.

    simtrain collective --algo ring --topology ring --devices 16 --bandwidth "100 GB/s" --sizes 1K:1G --no-numerics
    simtrain topo --topology topologies/dgx-a100-2node.yaml
"""
import json
from typing import get_args

import click
from rich.table import Table

from .cli_topology import build_cli_topology, topology_options
from .errors import SimtrainError
from .limits import MAX_COLLECTIVE_BYTES, MAX_SEED
from .scenario import ParallelSpec
from .units import format_bytes, parse_size
from .views import console

# The algorithms `simtrain collective --algo` offers, named without importing the collectives (torch):
# the scenario schema's all-reduce names, and comm/all_to_all.py's ALL_TO_ALL keys (a test keeps them equal).
ALL_REDUCE_ALGORITHMS = get_args(ParallelSpec.model_fields["all_reduce"].annotation)
SIMTRAIN_ALL_REDUCE_ALGORITHMS = tuple(name for name in ALL_REDUCE_ALGORITHMS if name != "nccl")  # nccl: --algo auto
ALL_TO_ALL_ALGORITHMS = ("pairwise", "hierarchical")
# NCCL's collectives and algorithms with a program (comm/nccl.py's PROGRAMS; a test keeps them equal).
NCCL_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
NCCL_ALGORITHMS = ("nvls", "nvls_tree", "nccl_tree", "pat")


@click.command()
@click.option("--op", type=click.Choice(NCCL_COLLECTIVES + ("all_to_all",)), default="all_reduce", show_default=True,
              help="The collective, sized as nccl-tests does (all_gather: the gathered buffer; reduce_scatter: the "
                   "buffer reduced; all_to_all: each rank's send buffer, one block per rank).")
@click.option("--algo", type=click.Choice(sorted({"auto", *NCCL_ALGORITHMS, *SIMTRAIN_ALL_REDUCE_ALGORITHMS,
                                                  *ALL_TO_ALL_ALGORITHMS})), default="auto", show_default=True,
              help=f"auto: NCCL's tuning model chooses algorithm and protocol per size (a scenario's "
                   f"parallel.all_reduce: nccl); {', '.join(NCCL_ALGORITHMS)}: NCCL's, protocol chosen; all_reduce "
                   f"also simtrain's {', '.join(SIMTRAIN_ALL_REDUCE_ALGORITHMS)}; "
                   f"all_to_all: {', '.join(ALL_TO_ALL_ALGORITHMS)} [auto: pairwise].")
@click.option("--protocol", type=click.Choice(("auto", "LL", "LL128", "Simple")), default="auto", show_default=True,
              help="NCCL's protocol, with --algo auto or one of NCCL's algorithms.")
@click.option("--channels", type=int, default=None,
              help="simtrain's all_reduce algorithms: buffer parts run side by side, one ring (or tree pair) each "
                   "[default: one per NIC rail across hosts, else 1].")
@topology_options
@click.option("--sizes", default="1K:64M", show_default=True, help="MIN:MAX bytes, doubling (K, M, G = 1024^n).")
@click.option("--numerics/--no-numerics", default=True, show_default=True, help="Move real tensors, or meta ones.")
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def collective(op, algo, protocol, channels, topology, devices, bandwidth, latency, gpus_per_node, inter_bandwidth,
               inter_latency, nodes_per_leaf, oversubscription, sizes, numerics, seed, as_json):
    """Collective micro-benchmark (nccl-tests style): time, algbw, busbw per size."""
    from .comm import channel_count
    from .comm.bench import benchmark_all_reduce, benchmark_all_to_all, benchmark_collective
    from .host_memory import require_host_memory
    from .report import finite_or_none

    topo = build_cli_topology(topology, devices, bandwidth, latency, gpus_per_node, inter_bandwidth, inter_latency,
                               nodes_per_leaf, oversubscription)
    low, sep, high = sizes.partition(":")
    low = parse_size(low, "--sizes")
    high = parse_size(high, "--sizes") if sep else low
    if low < 1 or high < low or high > MAX_COLLECTIVE_BYTES:
        raise SimtrainError(f"--sizes: need 1 <= MIN <= MAX <= {format_bytes(MAX_COLLECTIVE_BYTES)}, got {sizes!r}")
    if numerics:  # every rank's buffer, a float64 reference sum, and the chunks in flight
        require_host_memory(4 * topo.num_devices * high, f"--sizes {high} bytes on {topo.num_devices} --devices "
                                                         "with --numerics")
    size_list = []
    while low <= high:
        size_list.append(low)
        low *= 2
    nccl = algo == "auto" and op != "all_to_all" or algo in NCCL_ALGORITHMS or op not in ("all_reduce", "all_to_all")
    if protocol != "auto" and not nccl:
        raise SimtrainError(f"--protocol: {algo} is simtrain's {op} algorithm, without NCCL's protocols")
    if nccl:
        if channels is not None:
            raise SimtrainError("--channels: NCCL's algorithms run one channel per NIC rail across hosts")
        if algo == "nccl_tree" and op != "all_reduce":
            raise SimtrainError(f"--algo: nccl_tree runs all_reduce, not {op}")
        title, extra = f"{op.replace('_', '-')} {algo}/{protocol} (NCCL's tuning)", {"protocol": protocol}
        rows = benchmark_collective(topo, op, "tree" if algo == "nccl_tree" else algo, size_list, numerics, protocol,
                                    seed=seed)
    elif op == "all_to_all":
        algo = "pairwise" if algo == "auto" else algo
        if algo not in ALL_TO_ALL_ALGORITHMS:
            raise SimtrainError(f"--algo: {algo} is not an all_to_all algorithm; known: "
                                f"{', '.join(ALL_TO_ALL_ALGORITHMS)}")
        if channels is not None:
            raise SimtrainError("--channels: all_to_all runs one message per pair of ranks, without channels")
        title, extra = f"all-to-all {algo}", {}
        rows = benchmark_all_to_all(topo, algo, size_list, numerics, seed=seed)
    else:
        if algo not in SIMTRAIN_ALL_REDUCE_ALGORITHMS:
            raise SimtrainError(f"--algo: {algo} is not an all_reduce algorithm; known: auto, "
                                f"{', '.join(NCCL_ALGORITHMS + SIMTRAIN_ALL_REDUCE_ALGORITHMS)}")
        channels = channel_count(algo, topo, topo.devices, channels, "--algo", "--channels")
        title, extra = f"all-reduce {algo}", {"channels": channels}
        rows = benchmark_all_reduce(topo, algo, size_list, numerics, seed=seed, channels=channels)
    if not as_json:
        console.print(f"# {title} on {topo.name}, {topo.num_devices} devices, "
                      + (f"{channels} channel(s), " if "channels" in extra else "")
                      + f"numerics {'on' if numerics else 'off'}")
        console.print(f"{'size':>12} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13} {'#wrong':>7}"
                      + (f" {'algorithm':>16}" if nccl else ""))
    for row in rows:
        chosen = {"nccl_algorithm": row.algorithm, "protocol": row.protocol} if nccl else {}
        if as_json:
            click.echo(json.dumps(finite_or_none({**({"op": op} if op != "all_reduce" else {}), "algorithm": algo,
                                                  **extra, **chosen, "bytes": row.nbytes, "time_s": row.time_s,
                                                  "algbw_GBps": row.algbw_GBps, "busbw_GBps": row.busbw_GBps}),
                                  allow_nan=False))
        else:
            wrong = "n/a" if row.wrong is None else str(row.wrong)
            console.print(f"{row.nbytes:>12} {row.time_s * 1e6:>12.2f} {row.algbw_GBps:>13.3f} "
                          f"{row.busbw_GBps:>13.3f} {wrong:>7}"
                          + (f" {row.algorithm + '/' + row.protocol:>16}" if nccl else ""))


@click.command()
@topology_options
def topo(topology, devices, bandwidth, latency, gpus_per_node, inter_bandwidth, inter_latency, nodes_per_leaf,
         oversubscription):
    """Show a topology: its devices, switches and links."""
    topo_ = build_cli_topology(topology, devices, bandwidth, latency, gpus_per_node, inter_bandwidth, inter_latency,
                                nodes_per_leaf, oversubscription)
    graph = topo_.graph
    switches = [n for n in graph.nodes if n not in set(topo_.devices)]
    console.print(f"{topo_.name}: {topo_.num_devices} devices, {len(switches)} switches, {graph.number_of_edges()} links")
    table = Table("link", "bandwidth per direction", "efficiency", "latency")
    for a, b, attrs in graph.edges(data=True):
        table.add_row(f"{a} - {b}", f"{attrs['bandwidth'] / 1e9:g} GB/s", f"{attrs.get('efficiency', 1.0):g}",
                      f"{attrs['latency'] * 1e6:g} us")
    console.print(table)
