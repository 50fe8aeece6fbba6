"""NCCL's tuning model: the latency and bandwidth it predicts per algorithm and protocol, and its choice.

Before every collective NCCL picks an (algorithm, protocol) pair by the least
predicted time `latency + bytes / bandwidth` (NCCL 2.30.7, src/graph/tuning.cc,
`ncclTopoTuneModel` and `ncclTopoGetAlgoTime`; read with the search tools, the
figures below are its tables, the code is ours). This module keeps that model
as plain data and pure functions:

- `Fabric`: what NCCL's topology search hands its tuner: ranks, nodes, the GPU
  generation, the channels, and each GPU's bandwidth inside its node and its
  node's network bandwidth per GPU (GB/s), plus whether an NVSwitch can reduce
  (NVLS). `fabric_of(topology)` reads it from a simtrain topology.
- `tune(fabric)` -> `Tuning`: `latency_us[(collective, algorithm, protocol)]`
  and `bandwidth_GBps[...]` (algorithm bandwidth; 0 where NCCL disables the pair).
- `Tuning.time_us(collective, algorithm, protocol, nbytes)` and
  `Tuning.choose(collective, nbytes)`: the pair NCCL runs.

    tuning = tune(fabric_of(topology))
    algorithm, protocol = tuning.choose("all_reduce", 1 << 20)

What it models, per algorithm (NCCL's names in lower case): `ring`; `tree` (a
double binary tree between nodes, a chain inside each); `nvls` (NVLink
SHARP: the NVSwitch reduces and multicasts; Hopper and later, one node here,
since NCCL needs CollNet for NVLS across nodes); `nvls_tree` (NVLS inside
each node, a tree between nodes; two nodes or more); `pat` (all-gather and
reduce-scatter, one GPU per node only). Protocols: `LL` (8 bytes of data and
a flag per 16-byte store: half the bandwidth, the least latency), `LL128` (120
of every 128 bytes) and `Simple` (bulk copies with fences: full bandwidth,
the most latency). CollNet (in-network reduction by InfiniBand SHARP switches)
is left out: no shipped topology has such switches. Each algorithm NCCL may
choose here has a program (nccl.py; `pat` in pat.py).

Simplifications, each a fact NCCL's search would supply: the channel count
(16, NCCL's usual figure on NVSwitch systems; it only caps LL128 and tree
bandwidth per channel, far above these systems' links), the CPU (Intel: 1 us
network overhead per step; x86, so Blackwell's NVLS-tree all-reduce takes the
tree's correction of its bandwidth, as NCCL's ncclTopoGetAlgoTime does for
minCompCap >= 100 on x86), the tree pattern (balanced, no 0.85), and
`latencyInter` 0: NCCL adds the network plugin's reported latency to each
network step (twice for Simple), and its InfiniBand and socket transports
report 0 ("Not set", src/transport/net_ib/init.cc, net_socket.cc). So
NVLS-tree's latency is NCCL's: its intra-node NVLink figure, then two network
steps per tree level, 25 + 2 x log2(nodes) x 20.9 us (66.8 us on two nodes).
"""
import math
from dataclasses import dataclass

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
ALGORITHMS = ("tree", "ring", "nvls", "nvls_tree", "pat")  # NCCL's order, CollNet left out
PROTOCOLS = ("LL", "LL128", "Simple")
GENERATIONS = ("volta", "ampere", "hopper", "blackwell")

# us of latency before the first byte, per algorithm and protocol (LL, LL128, Simple): baseLatencies.
BASE_LATENCY_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0),
                   "pat": (8.0, 8.0, 8.0)}
# us per step over a link type, per algorithm and protocol: hwLatencies.
HW_LATENCY_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "nvls": (0, 0, 25), "nvls_tree": (0, 0, 25),
               "pat": (0, 0, 4.0)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "nvls": (0, 0, 0), "nvls_tree": (0, 0, 0),
            "pat": (0, 0, 4.0)},
    "net": {"tree": (5.0, 8.5, 14), "ring": (2.7, 4.0, 14.0), "nvls": (0, 0, 18), "nvls_tree": (0, 0, 20.9),
            "pat": (0, 0, 14)},
}
# GB/s caps. LL's on one node by GPU generation; across nodes by CPU (Intel's, for 2 and more nodes).
LL_MAX_ONE_NODE_GBPS = {"volta": 39.0, "ampere": 87.7, "hopper": 141.0, "blackwell": 282.0}
LL_MAX_INTEL_GBPS = (None, 39.0, 20.4)  # by nodes: 1 (unused), 2, more
# Per channel, by generation, for 1, 2 and more nodes.
RING_LL128_PER_CHANNEL_GBPS = {"volta": (20.0,) * 3, "ampere": (20.0,) * 3, "hopper": (36.7,) * 3,
                               "blackwell": (40.0,) * 3}
TREE_LL128_PER_CHANNEL_GBPS = {"volta": (20.0,) * 3, "ampere": (20.0,) * 3, "hopper": (36.7, 36.7, 29.0),
                               "blackwell": (55.6, 31.67, 20.0)}
TREE_PER_CHANNEL_GBPS = {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8), "hopper": (38.7, 41.4, 36.0),
                         "blackwell": (70.0, 42.8, 24.0)}
NVLS_TREE_PER_CHANNEL_GBPS = {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8), "hopper": (0.0, 57.7, 45.5),
                              "blackwell": (0.0, 96.0, 80.0)}
NVLS_EFFICIENCY = {"volta": 0.0, "ampere": 0.0, "hopper": 0.85, "blackwell": 0.74}
PAT_EFFICIENCY = 0.75  # NCCL's figure for the part of the bandwidth PAT achieves
NET_OVERHEAD_US = 1.0  # per network step, Intel CPUs; three times that for Simple
# Tree all-reduce's correction of its bandwidth for medium sizes, by protocol, sizes 64 B * 2^i.
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
}
CHANNELS = 16


@dataclass(frozen=True)
class Fabric:
    """What NCCL's topology search tells its tuner about a communicator."""

    ranks: int
    nodes: int
    generation: str  # one of GENERATIONS
    intra_GBps: float  # each GPU's bandwidth inside its node, all channels together
    inter_GBps: float  # its node's network bandwidth, all NICs together; on one node, as NCCL's graph: intra_GBps
    nvls: bool = False  # the node's NVSwitch reduces (NVLink SHARP)
    intra_link: str = "nvlink"  # nvlink or pci
    channels: int = CHANNELS


@dataclass(frozen=True)
class Tuning:
    """NCCL's predictions: latency (us) and algorithm bandwidth (GB/s) per (collective, algorithm, protocol)."""

    latency_us: dict
    bandwidth_GBps: dict
    ranks: int
    nodes: int
    channels: int
    generation: str  # the GPUs' (minCompCap): Blackwell's NVLS-tree and Volta's ring plateau differ

    def time_us(self, collective: str, algorithm: str, protocol: str, nbytes: int) -> float:
        """Predicted time of one call; inf where NCCL would not run the pair."""
        key = (collective, algorithm, protocol)
        bandwidth = self.bandwidth_GBps.get(key, 0.0)
        if bandwidth == 0:
            return math.inf
        log_size = _log2i(nbytes >> 6)
        if algorithm == "tree" and collective == "all_reduce" and 0 <= log_size < 23:
            bandwidth *= TREE_CORRECTION[protocol][log_size]
        if algorithm == "nvls_tree" and collective == "all_reduce" and self.generation == "blackwell" and \
                0 <= log_size < 24:  # NCCL: minCompCap >= 100 on an x86 CPU (Intel's, here)
            bandwidth *= TREE_CORRECTION[protocol][log_size]
        latency = self.latency_us[key]
        if algorithm == "ring" and protocol == "Simple" and self.nodes > 1 and collective == "all_reduce" and \
                nbytes / (self.channels * self.ranks) >= 64:
            latency *= 1.9 if self.generation == "volta" else 1.4  # "plateau effect of ring": 1.4 from Ampere
        return latency + nbytes / (1000 * bandwidth)

    def choose(self, collective: str, nbytes: int) -> tuple[str, str]:
        """The (algorithm, protocol) of least predicted time, first in NCCL's order on a tie."""
        times = {(a, p): self.time_us(collective, a, p, nbytes) for a in ALGORITHMS for p in PROTOCOLS}
        best = min(times, key=times.get)
        if times[best] == math.inf:
            raise ValueError(f"no algorithm for {collective}")
        return best


def tune(fabric: Fabric) -> Tuning:
    """NCCL's latency and bandwidth tables for the communicator `fabric` describes."""
    if fabric.generation not in GENERATIONS:
        raise ValueError(f"unknown GPU generation {fabric.generation!r}")
    ranks, nodes = fabric.ranks, fabric.nodes
    index = min(nodes, 3) - 1
    ppn = ranks / nodes
    per_channel_intra = fabric.intra_GBps / fabric.channels
    per_channel_inter = fabric.inter_GBps / fabric.channels
    latency, bandwidth = {}, {}
    for coll in COLLECTIVES:
        steps = 2 * (ranks - 1) if coll == "all_reduce" else ranks - 1 if coll in ("all_gather", "reduce_scatter") \
            else ranks
        for algo in ALGORITHMS:
            if not _runs(coll, algo, fabric):
                continue
            for proto in PROTOCOLS:
                if algo in ("nvls", "nvls_tree", "pat") and proto != "Simple":
                    continue
                bus = _bus_bandwidth(coll, algo, proto, fabric, per_channel_intra, per_channel_inter, ppn, index)
                if not (algo != "ring" and coll in ("all_gather", "reduce_scatter")):
                    bus *= ranks / steps if algo in ("ring", "nvls", "nvls_tree") else 0.5
                bandwidth[coll, algo, proto] = bus
                latency[coll, algo, proto] = call_latency_us(coll, algo, proto, fabric, steps, ppn)
    return Tuning(latency, bandwidth, ranks, nodes, fabric.channels, fabric.generation)


def _runs(coll: str, algo: str, fabric: Fabric) -> bool:
    """Whether NCCL considers `algo` for `coll` on this fabric at all."""
    if coll in ("broadcast", "reduce"):
        return algo == "ring"
    if coll in ("all_gather", "reduce_scatter"):
        if algo == "nvls":
            return fabric.nvls and fabric.nodes == 1  # across nodes it needs CollNet
        if algo == "pat":
            return fabric.nodes == fabric.ranks  # one GPU per node
        return algo == "ring"
    if algo == "pat":
        return False
    if algo == "nvls":
        return fabric.nvls and fabric.nodes == 1 and NVLS_EFFICIENCY[fabric.generation] > 0
    if algo == "nvls_tree":
        return fabric.nvls and fabric.nodes > 1 and NVLS_EFFICIENCY[fabric.generation] > 0
    return True


def _bus_bandwidth(coll, algo, proto, fabric: Fabric, per_channel_intra, per_channel_inter, ppn, index) -> float:
    """NCCL's bus bandwidth of all channels, before its conversion to algorithm bandwidth."""
    gen, channels = fabric.generation, fabric.channels
    per_channel = per_channel_intra if fabric.nodes <= 2 else per_channel_inter
    if algo in ("nvls", "nvls_tree"):
        intra = per_channel_intra * NVLS_EFFICIENCY[gen] * (channels - 1) / channels
        intra *= 2.0 if coll == "all_reduce" else (ppn - 1) / ppn  # all-reduce pipelines two operations
        inter = per_channel_inter * (2 if fabric.nodes <= 2 and algo == "nvls_tree" else 1)
        per_channel = min(intra, inter, NVLS_TREE_PER_CHANNEL_GBPS[gen][index] if algo == "nvls_tree" else math.inf)
    bus = channels * per_channel
    ll_max = LL_MAX_ONE_NODE_GBPS[gen] if fabric.nodes == 1 else LL_MAX_INTEL_GBPS[index]
    if algo == "ring" and proto == "LL":
        bus = min(ll_max, bus * 0.5)
    if algo == "ring" and proto == "LL128":
        bus = min(bus * 0.92, channels * RING_LL128_PER_CHANNEL_GBPS[gen][index])
    if algo == "tree" and coll == "all_reduce":
        bus = min(bus * 0.92, channels * TREE_PER_CHANNEL_GBPS[gen][index])
    if algo == "tree" and proto == "LL":
        bus = min(bus / 3.8, ll_max)
    if algo == "tree" and proto == "LL128":
        bus = min(bus * (7.0 / 9.0 if fabric.nodes == 1 else 120.0 / 128.0),
                  channels * TREE_LL128_PER_CHANNEL_GBPS[gen][index])
    if algo == "pat":
        bus *= PAT_EFFICIENCY
    return bus


def call_latency_us(coll: str, algo: str, proto: str, fabric: Fabric, steps: int, ppn: float) -> float:
    """NCCL's latency (us) of one call: `steps` of the collective, `ppn` ranks per node."""
    p = PROTOCOLS.index(proto)
    nodes, ranks = fabric.nodes, fabric.ranks
    intra = HW_LATENCY_US[fabric.intra_link][algo][p]
    inter = HW_LATENCY_US["net"]["tree" if ppn == 1 else algo][p]
    base = BASE_LATENCY_US[algo][p]
    if algo == "ring":
        if coll in ("broadcast", "reduce"):
            return base + HW_LATENCY_US[fabric.intra_link if nodes == 1 else "net"]["ring"][p]  # one ring, same channels
        overhead = (NET_OVERHEAD_US * (3 if proto == "Simple" else 1)) if nodes > 1 else 0.0
        intra = max(intra, overhead)
        inter_steps = 0 if nodes == 1 else 2 * (nodes - 1) if coll == "all_reduce" else nodes - 1
        return base + (steps - inter_steps) * intra + inter_steps * inter
    if algo == "tree":
        return base + (2 * ((ranks // nodes - 1) * intra + _log2i(nodes) * inter) if coll == "all_reduce" else 0)
    if algo == "nvls":
        return intra + (inter if nodes > 1 else 0)
    if algo == "nvls_tree":
        return base + intra + 2 * _log2i(nodes) * inter
    return base + _log2i(nodes) * inter / 3.5 + ranks * 2.8  # pat


def _log2i(n: int) -> int:
    """floor(log2 n), -1 for n < 1 (NCCL's log2i)."""
    return n.bit_length() - 1 if n >= 1 else -1
