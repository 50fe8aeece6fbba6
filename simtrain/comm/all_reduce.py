"""All-reduce algorithms by name, and the factory that fits one to a topology and its channels.

`ALL_REDUCE[name]` are the topology-free programs, `fn(rank, world, buf,
average=False) -> program`, on one channel in rank order: `naive`, `ring`,
`tree` (FireCaffe), `dbtree` (double binary tree). `build_all_reduce` returns a
function with that same signature for any algorithm, laid out on the group's
hosts and rails (channels.py) and split over channels:

    all_reduce = build_all_reduce("ring", topology, [d.node for d in devices])   # NCCL's default channels
    all_reduce = build_all_reduce("dbtree", topology, nodes, channels=4)
    yield comm.run(rank, all_reduce(rank, world, grads, average=True))

With K channels the buffer is cut into K nearly equal parts and channel c runs
the algorithm on part c in the ring order of `channel_order(layout, c)`, with
its own tags, all K side by side (`Concurrently`): a channel slowed by a busy
link never holds the others back. One channel runs the program directly, so
on a single host or a single-path topology `ring` is exactly `ALL_REDUCE["ring"]`.
`hierarchical` needs hosts of equal size; `naive` and `tree` run on one channel.
`nccl` is NCCL's own choice per call (comm/nccl.py: the algorithm and protocol
its tuning model picks for the buffer's size, on its own channels).
"""
from ..errors import ScenarioError
from ..hw.topology import Topology
from .channels import ONE_CHANNEL, channel_order, check_channels, default_channels, layout_of
from .dbtree import dbtree_all_reduce
from .hierarchical import hierarchical_all_reduce
from .naive import naive_all_reduce
from .nccl import nccl_all_reduce
from .ops import Concurrently
from .ring import ring_all_reduce
from .ring_schedule import RingAllReduce
from .tree import tree_all_reduce

ALL_REDUCE = {"naive": naive_all_reduce, "ring": ring_all_reduce, "tree": tree_all_reduce,
              "dbtree": dbtree_all_reduce}
ALGORITHMS = ("naive", "ring", "tree", "hierarchical", "dbtree", "nccl")


def build_all_reduce(algorithm: str, topology: Topology, nodes: list[str], channels: int | None = None,
                     algorithm_field: str = "algorithm", channels_field: str = "channels"):
    """fn(rank, world, buf, average=False) -> program for the group whose rank r is on nodes[r].

    `channels` None takes the topology's default (channels.default_channels). A bad
    algorithm or channel count raises ScenarioError naming the field it came from.
    """
    layout = layout_of(topology, nodes)
    channels = _channel_count(algorithm, layout, channels, algorithm_field, channels_field)
    if algorithm == "hierarchical" and len({len(ranks) for ranks in layout.hosts}) > 1:
        sizes = ", ".join(str(len(ranks)) for ranks in layout.hosts)
        raise ScenarioError(f"{algorithm_field}: hierarchical needs the same number of ranks on every host, "
                            f"got {sizes}")
    if algorithm in ONE_CHANNEL:
        return ALL_REDUCE[algorithm]
    if algorithm == "nccl":
        return nccl_all_reduce(topology, nodes)
    world = len(nodes)
    orders = [channel_order(layout, c) for c in range(channels)]
    hosts_per_channel = []
    for order in orders:
        hosts, start = [], 0
        for ranks in layout.hosts:
            hosts.append(order[start:start + len(ranks)])
            start += len(ranks)
        hosts_per_channel.append(hosts)
    identity = list(range(world))
    rings = [None if order == identity else order for order in orders]  # compared once, not per rank

    def channel_program(channel: int, rank: int, part, average: bool):
        order = orders[channel]
        if algorithm == "ring":
            return RingAllReduce(rank, world, part, average, ring=rings[channel], tag=channel)
        if algorithm == "dbtree":
            return dbtree_all_reduce(rank, world, part, average, order=order, tags=(2 * channel, 2 * channel + 1))
        return hierarchical_all_reduce(rank, world, part, average, hosts=hosts_per_channel[channel], tag=channel)

    def all_reduce_over_channels(rank: int, buf, average: bool):  # its name names its collective (a span's op)
        parts = buf.tensor_split(channels)
        yield Concurrently([channel_program(c, rank, part, False) for c, part in enumerate(parts)])
        if average:
            buf.div_(world)
        return buf

    def all_reduce(rank: int, world_: int, buf, average: bool = False):
        if world_ != world:
            raise ValueError(f"all-reduce built for {world} ranks, called with world {world_}")
        if channels == 1:  # the algorithm's own program, with no wrapper on the per-step path
            return channel_program(0, rank, buf, average)
        return all_reduce_over_channels(rank, buf, average)

    return all_reduce


def channel_count(algorithm: str, topology: Topology, nodes: list[str], channels: int | None = None,
                  algorithm_field: str = "algorithm", channels_field: str = "channels") -> int:
    """The channels `build_all_reduce` runs `algorithm` on: `channels`, or the topology's default."""
    return _channel_count(algorithm, layout_of(topology, nodes), channels, algorithm_field, channels_field)


def _channel_count(algorithm: str, layout, channels, algorithm_field: str, channels_field: str) -> int:
    if algorithm not in ALGORITHMS:
        raise ScenarioError(f"{algorithm_field}: unknown all-reduce algorithm {algorithm!r}; "
                            f"known: {', '.join(ALGORITHMS)}")
    if channels is None:
        return 1 if algorithm in ONE_CHANNEL else default_channels(layout, algorithm)
    check_channels(algorithm, channels, channels_field)
    return channels
