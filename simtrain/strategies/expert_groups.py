"""An ep group's token exchanges, and a replica's gradients cut into the replicated part and its experts'.

Under expert parallelism (`parallel.ep`) ep rank i of an ep group holds the
i-th run of experts/ep of every MoE layer (train/moe.py keep_experts_); the
step engine runs each MoE layer as regions of its chunk's work with the ep
group's exchanges as boundaries (train/moe_exchange.py). `EpGroup` is a rank's
place in its ep group: the communicator, the rank's index, and the
all-to-all program the group's dispatches and combines run
(`group_all_to_all`: `parallel.moe_dispatch` pairwise, every rank to every
peer at once as NCCL's all-to-all; hierarchical, inside each host first
and then between hosts along the rails, PXN's order; or deepep, DeepEP's
internode path (`NodeDispatch`): the dispatch and the combine's backward,
bound for the experts, over the network first to the relay on the sender's
rail and then inside the host, the dispatch sending each token to a host
once (comm/node_dispatch.py), and the combine and the dispatch's backward,
bound home, the same two hops back, inside the host first (PXN's order,
every row: the outputs are weighted at home, not summed on the way); the
last two run over the hosts the topology puts the group's ranks on, which
must hold equal shares of it).
"moe counts" (every rank's assignments per expert) and "moe notify" (with
deepep and a capacity, its tokens reaching each host after the drops) are
ring all-gathers.

A rank's experts are data parallel over their holders (one rank of the same
ep index in every ep group), the rest of the model over every data-parallel
rank: `experts_last` re-points a replica's gradients into one buffer,
replicated parameters first, so each part is all-reduced over its own group
(strategies/expert_model_parallel.py's ExpertUpdate; the distributed optimizer's
shards, distributed_optimizer.py).

    groups = {rank: EpGroup(comm, index, ranks, group_all_to_all(job, ranks)) for index, rank in enumerate(ranks)}
    collective, received = groups[rank].exchange(kind, tensor)    # kind: an ExpertExchange
    dense = experts_last(replica)            # replica.grad_buffer[:dense] replicated, [dense:] its experts'
    units, shards, positions = dense_and_expert_units(replica, None, (8, 3), (2, 1))   # the distributed optimizer's
"""
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from ..comm.all_to_all import hierarchical_all_to_all, pairwise_all_to_all
from ..comm.channels import layout_of
from ..comm.node_dispatch import node_dispatch
from ..comm.ring import ring_all_gather
from ..errors import ScenarioError
from ..step_ops import Collective
from ..train.grad_bucket import flat_grad_buffer
from ..train.moe import MoE


@dataclass(frozen=True)
class CountsAllToAll:
    """An exchange run as one all-to-all program of its counts (comm/all_to_all.py's)."""

    program: Callable  # fn(rank, world, send, recv, counts) -> program

    def __call__(self, rank: int, world: int, send: torch.Tensor, recv: torch.Tensor, kind):
        return self.program(rank, world, send, recv, kind.counts)


@dataclass(frozen=True)
class NodeDispatch:
    """`parallel.moe_dispatch: deepep` over `hosts` (each host's ranks, group positions): toward the experts over
    the network first, the dispatch each token once to a host (comm/node_dispatch.py); home inside the host
    first (comm/all_to_all.py's hierarchical order)."""

    hosts: tuple[tuple[int, ...], ...]

    def __call__(self, rank: int, world: int, send: torch.Tensor, recv: torch.Tensor, kind):
        hosts = [list(ranks) for ranks in self.hosts]
        if kind.label in ("moe dispatch", "moe combine backward"):
            return node_dispatch(rank, world, send, recv, kind.counts, hosts=hosts,
                                 node_rows=kind.node_rows or None, token_ids=kind.token_ids)
        return hierarchical_all_to_all(rank, world, send, recv, kind.counts, hosts=hosts)

    @property
    def rank_hosts(self) -> tuple[int, ...]:
        """The host of each group position (0, 1, ...: the hosts' order)."""
        return tuple(host for position in range(sum(map(len, self.hosts)))
                     for host, ranks in enumerate(self.hosts) if position in ranks)


@dataclass(frozen=True)
class EpGroup:
    """A rank's ep group: its communicator, the rank's place in it, the job ranks in it and its all-to-all
    (fn(rank, world, send, recv, kind) -> program, kind a train/moe_exchange.py ExpertExchange)."""

    comm: object
    index: int
    ranks: tuple[int, ...]
    all_to_all: Callable = CountsAllToAll(pairwise_all_to_all)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def exchange(self, kind, tensor: torch.Tensor):
        """(the Collective of exchange `kind` (train/moe_exchange.py's ExpertExchange) of `tensor` over the group,
        the tensor that holds what arrives once it has run): "moe counts" and "moe notify" all-gather each rank's
        (1, n) counts into (ranks, n), rank order; an all-to-all sends `kind.counts[index]` rows to each rank."""
        if kind.gathers:
            gathered = tensor.new_zeros((self.size, tensor.shape[1]))
            gathered[self.index].copy_(tensor[0])
            # the ring starts with rank r's counts at position r + 1: chunk p is row p - 1
            program = ring_all_gather(self.index, (self.index + 1) % self.size, (self.index - 1) % self.size,
                                      [gathered[(position - 1) % self.size] for position in range(self.size)])
        else:
            tensor, gathered = kind.sent(tensor, self.index)
            program = self.all_to_all(self.index, self.size, tensor, gathered, kind)
        return Collective(program, kind.label, comm=self.comm, rank=self.index), gathered


def group_all_to_all(job, ranks) -> Callable:
    """The all-to-all of the ep group of job ranks `ranks` (EpGroup's): `parallel.moe_dispatch`'s, the hierarchical
    one and deepep's over the hosts the topology puts them on."""
    return all_to_all_over(job.scenario.parallel.moe_dispatch, job.cluster.topology,
                           [job.devices[rank].node for rank in ranks], list(ranks))


def all_to_all_over(dispatch: str, topology, nodes: list[str], ranks: list) -> Callable:
    """The all-to-all `dispatch` (a parallel.moe_dispatch) of a group whose rank r runs on network node nodes[r]
    (`ranks`: what an error calls them)."""
    if dispatch == "pairwise":
        return CountsAllToAll(pairwise_all_to_all)
    hosts = [list(host) for host in layout_of(topology, nodes).hosts]
    if len({len(host) for host in hosts}) > 1:
        raise ScenarioError(f"parallel.moe_dispatch: {dispatch} needs the ep group's ranks {ranks} spread "
                            f"evenly over hosts, got {', '.join(str(len(host)) for host in hosts)} a host")
    if dispatch == "hierarchical":
        return CountsAllToAll(functools.partial(hierarchical_all_to_all, hosts=hosts))
    return NodeDispatch(tuple(map(tuple, hosts)))


def expert_flags(replica) -> list[bool]:
    """For each of the replica's trainable parameters, in its order, whether it belongs to an MoE layer's experts."""
    expert_ids = {id(p) for layer in replica.model.modules() if isinstance(layer, MoE)
                  for p in layer.experts.parameters()}
    return [id(p) in expert_ids for p in replica.params]


def first_expert(replica) -> int:
    """The index of the replica's first expert parameter once `experts_last` has laid them out (its parameter count
    on a stage without MoE layers)."""
    return expert_flags(replica).count(False)


def dense_and_expert_units(replica, buckets: list | None, shard: tuple[int, int], holders: tuple[int, int]):
    """(units, each unit's shard count, the rank's position in each unit's group) of a replica laid out by
    `experts_last`, as Megatron-Core's distributed optimizer keeps dense and expert buffers apart: `buckets`
    (overlap_grad_reduce: those of its dense and expert buffers, bucket_overlap.py), else one unit of the dense
    parameters and one of the experts' (none on a stage without MoE layers). A dense unit is sharded over the shard
    group, an expert unit over the experts' holders: `shard` and `holders` are (the group's ranks, the rank's
    position there)."""
    first, total = first_expert(replica), len(replica.params)
    units = buckets or [list(range(first)), list(range(first, total))][:2 if first < total else 1]
    groups = [holders if unit[0] >= first else shard for unit in units]
    return units, tuple(size for size, _ in groups), tuple(position for _, position in groups)


def experts_last(replica) -> int:
    """Re-point the replica's gradients into one buffer, replicated parameters first, then its experts'
    (each part all-reduced over its own group), the fp32 masters' in the same order (mixed precision: the
    averaged buffer is copied onto them); returns the replicated part's elements."""
    flags = expert_flags(replica)
    dense = sum(p.numel() for p, is_expert in zip(replica.params, flags) if not is_expert)
    order = sorted(range(len(replica.params)), key=lambda i: flags[i])  # stable
    replica.params = [replica.params[i] for i in order]
    precision = replica.precision
    precision.model_params = [precision.model_params[i] for i in order]
    if precision.mixed:
        precision.master_params = [precision.master_params[i] for i in order]
        precision.master_grads = flat_grad_buffer(precision.master_params)  # with main gradients: the bucket's own
    else:  # fp32: the parameters are their own masters
        precision.master_params = precision.model_params
    replica.lay_out_gradients()
    return dense
