"""The topology options of `simtrain collective` and `simtrain topo`, and the topology they build.

The options are the scenario's `cluster` keys under command-line names (`--devices` for `cluster.devices`,
`--bandwidth` for `cluster.link.bandwidth`, ...), with the same defaults (ClusterSpec's), validated by the
same schema; an error names the option, not the key.

    @topology_options
    def topo(topology, devices, bandwidth, latency, gpus_per_node, inter_bandwidth, inter_latency, nodes_per_leaf,
             oversubscription): ...
    topology = build_cli_topology(topology, devices, bandwidth, latency, ...)
"""
import click
from pydantic import ValidationError

from .errors import SimtrainError
from .limits import MAX_DEVICES
from .scenario import TOPOLOGY_BUILDERS, ClusterSpec, LinkSpec
from .scenario.fields import first_error
from .units import format_seconds, parse_quantity


_CLUSTER = ClusterSpec()  # a scenario's cluster defaults: the one home of the topology options' defaults


def topology_options(f):
    f = click.option("--topology", default=_CLUSTER.topology, show_default=True,
                     help=f"Builder ({', '.join(TOPOLOGY_BUILDERS)}) or YAML file.")(f)
    f = click.option("--devices", type=click.IntRange(1, MAX_DEVICES), default=None,
                     help="Device count (builders).")(f)
    f = click.option("--bandwidth", default=None, help="Link bandwidth per direction [default: cluster.link's, "
                     f"{_CLUSTER.link.bandwidth / 1e9:g} GB/s].")(f)
    f = click.option("--latency", default=None, help="Link latency per hop [default: cluster.link's, "
                     f"{format_seconds(_CLUSTER.link.latency)}].")(f)
    f = click.option("--gpus-per-node", type=click.IntRange(1, MAX_DEVICES), default=None,
                     help="hierarchical, fat_tree: GPUs per node.")(f)
    f = click.option("--nodes-per-leaf", type=click.IntRange(1, MAX_DEVICES), default=_CLUSTER.nodes_per_leaf,
                     show_default=True, help="fat_tree: nodes whose same-rail NICs share a leaf switch.")(f)
    f = click.option("--oversubscription", type=click.FloatRange(1, MAX_DEVICES), default=_CLUSTER.oversubscription,
                     show_default=True, help="fat_tree: a leaf's downlink to uplink bandwidth.")(f)
    f = click.option("--inter-bandwidth", default=None, help="hierarchical, fat_tree: each GPU's NIC bandwidth.")(f)
    f = click.option("--inter-latency", default=None,
                     help="hierarchical, fat_tree: NIC hop latency [default: the --latency].")(f)
    return f


def _option(value, kind: str, option: str, default: float) -> float:
    """A quantity option's value in SI units: as given, else the scenario spec's default."""
    return default if value is None else parse_quantity(value, kind, option)


def _link_options(bandwidth, latency, default: tuple, names: tuple[str, str]) -> LinkSpec:
    """A link the options describe: bandwidth and latency as given, else the spec's `default` pair."""
    rate = _option(bandwidth, "bandwidth", names[0], default[0])
    if rate <= 0:
        raise SimtrainError(f"{names[0]}: must be positive")
    return LinkSpec(bandwidth=rate, latency=_option(latency, "time", names[1], default[1]))


def build_cli_topology(topology, devices, bandwidth, latency, gpus_per_node, inter_bandwidth, inter_latency,
                        nodes_per_leaf, oversubscription):
    """The topology the options describe, built as a scenario's cluster section (ClusterSpec) is: an option
    not given keeps the section's default."""
    if devices is None and topology in TOPOLOGY_BUILDERS:
        raise SimtrainError(f"--devices: required by the {topology} builder")
    fields = {"topology": topology, "devices": devices, "gpus_per_node": gpus_per_node,
              "nodes_per_leaf": nodes_per_leaf, "oversubscription": oversubscription,
              "link": _link_options(bandwidth, latency, (_CLUSTER.link.bandwidth, _CLUSTER.link.latency),
                                    ("--bandwidth", "--latency"))}
    if inter_bandwidth is not None:  # a NIC link is given or absent; its hop at least the in-host link's
        fields["inter_node_link"] = _link_options(inter_bandwidth, inter_latency, (None, fields["link"].latency),
                                                  ("--inter-bandwidth", "--inter-latency"))
    from .hw.resolved_cluster import resolve_cluster

    try:
        spec = ClusterSpec.model_validate({key: value for key, value in fields.items() if value is not None})
        return resolve_cluster(spec).topology()
    except ValidationError as error:
        raise SimtrainError(_as_options(f"cluster.{first_error(error)}")) from None
    except SimtrainError as error:
        raise type(error)(_as_options(str(error))) from None


# The scenario keys the topology options set: their errors name the option.
_OPTION_OF_KEY = {"`cluster.devices: null` takes": "leaving out --devices takes", "cluster.devices": "--devices",
                  "cluster.topology": "--topology", "cluster.gpus_per_node": "--gpus-per-node",
                  "cluster.nodes_per_leaf": "--nodes-per-leaf", "cluster.oversubscription": "--oversubscription",
                  "cluster.link.bandwidth": "--bandwidth", "cluster.link.latency": "--latency",
                  "cluster.inter_node_link.bandwidth": "--inter-bandwidth",
                  "cluster.inter_node_link.latency": "--inter-latency", "cluster.link": "--bandwidth",
                  "cluster.inter_node_link": "--inter-bandwidth"}


def _as_options(message: str) -> str:
    """A cluster section's error as `simtrain topo` and `simtrain collective` word it: options, not keys."""
    for key, option in _OPTION_OF_KEY.items():
        message = message.replace(key, option)
    return message
