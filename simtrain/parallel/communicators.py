"""The communicators a job's groups run on, as one typed record a scheme reads by kind.

The layout (layout.py) says which ranks form each group; a scheme builds a
communicator over each group it uses, on the job's devices as they are now
(again after a spare took a lost device's place), and keeps them in a
`GroupCommunicators`: for each kind of group the job has, every rank's
`Membership` (the group's communicator, the rank's index there and the group's
all-reduce program, if the group all-reduces). Kinds the job does not
communicate in are None. Under representatives (strategies/representatives.py) the
same record holds mirrored communicators; with experts (schemes/
expert_model_parallel.py) `ep` holds each rank's EpGroup, which carries its
communicator and index too.

    comms = GroupCommunicators(dp_cp=memberships(layout.groups("dp_cp"), job.communicator, job.all_reduce),
                               tp=memberships(layout.groups("tp"), job.communicator, job.all_reduce))
    comm, index, all_reduce = comms.tp[rank]
    yield Collective(all_reduce(index, comm.world, buffer), "tp_allreduce", comm, index)
"""
from dataclasses import dataclass, fields
from typing import Callable, Iterator, NamedTuple


class Membership(NamedTuple):
    """A rank's place in one group: the group's communicator, the rank's index there, and the group's all-reduce
    (fn(rank, world, buf, average=False) -> program; None where the group only sends and receives, or is one
    rank)."""

    comm: object
    index: int
    all_reduce: Callable | None


def memberships(groups: list[tuple[int, ...]], communicator: Callable, all_reduce: Callable | None = None
                ) -> dict[int, Membership]:
    """Job rank -> its Membership, one communicator per group of `groups` (communicator(ranks) builds it;
    all_reduce(ranks), if given, the group's all-reduce, for groups of more than one rank)."""
    by_rank = {}
    for group in groups:
        ranks = list(group)
        comm = communicator(ranks)
        program = all_reduce(ranks) if all_reduce is not None and len(ranks) > 1 else None
        for index, rank in enumerate(ranks):
            by_rank[rank] = Membership(comm, index, program)
    return by_rank


@dataclass
class GroupCommunicators:
    """Job rank -> its membership, for each kind of group a model-parallel job communicates in (layout.py's
    names); None where the job has no such group."""

    dp_cp: dict[int, Membership]  # the gradient's all-reduce (Megatron-Core's dp-cp group)
    tp: dict[int, Membership]  # the layers' tensor-parallel collectives
    cp: dict[int, Membership] | None = None  # ring attention's key/value blocks (Send/Recv)
    pp: dict[int, Membership] | None = None  # the pipeline's activations and gradients (Send/Recv)
    model: dict[int, Membership] | None = None  # fp16's overflow vote (sharded: the whole job)
    dp_shard: dict[int, Membership] | None = None  # HSDP's shard groups
    dp_replicate: dict[int, Membership] | None = None  # HSDP's replicate groups
    ep: dict | None = None  # rank -> its EpGroup (strategies/expert_groups.py): the experts' token exchanges
    expert_dp: dict[int, Membership] | None = None  # the experts' gradient all-reduce, over their holders

    def places(self) -> Iterator[tuple[int, object, int]]:
        """(job rank, communicator, the rank's index there) of every group held, kind by kind."""
        for kind in fields(self):
            for rank, place in (getattr(self, kind.name) or {}).items():
                yield rank, place.comm, place.index
