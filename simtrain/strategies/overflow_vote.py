"""The fp16 overflow vote: the ranks that share one model skip a step together, or step together.

Under fp16 loss scaling, a step is skipped if any share of the model
overflowed, as Megatron-LM all-reduces found_inf across its model-parallel
group. Before stepping, the pp x tp ranks of each replica sum their 0/1
overflow flags (one fp32 each) in an all-reduce on the replica's communicator
("overflow_vote"); every rank then skips (and backs off its loss scale) or
steps together, so their loss scalers stay identical. The replicas need no
vote: after the dp all-reduce they hold the same gradients. Where they hold
different shares of it they do: sharded (each rank its chunk) or with
experts (each rank the experts of its ep rank, which the other replicas of
its ep group do not hold), the whole job votes, and a step is skipped where
one device's gradient on the global batch would overflow anywhere.

With representatives the communicator is a mirrored one
(representatives.py): the representatives wait for each other, then take the
time of their replica's vote; numerics are off there, so no rank overflows.

    voters = vote_groups(job.scenario.parallel, job.layout)    # the groups that vote, each apart
    found_inf = yield from overflow_vote(comm, index, all_reduce, found_inf)
"""
import torch

from ..step_ops import Collective


def vote_groups(parallel, layout) -> list[tuple[int, ...]]:
    """The groups of job ranks that vote together: each replica's model-parallel group, or the whole job where the
    replicas hold different shares of the gradient (sharded, or with experts)."""
    if parallel.sharding.stage or layout.ep > 1:
        return [tuple(range(layout.world))]
    return layout.groups("model")


def overflow_vote(comm, index: int, all_reduce, found_inf: bool):
    """Step program: whether any rank of the group of `comm` (this rank its rank `index`, `all_reduce` its
    program) found an overflow; a group of one rank (no program) has only its own finding."""
    if all_reduce is None:
        return found_inf
    flag = torch.tensor([float(found_inf)])
    yield Collective(all_reduce(index, comm.world, flag), "overflow_vote", comm, index)
    return bool(flag.item() > 0)
