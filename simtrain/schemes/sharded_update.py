"""The sharded optimizer step: what a rank of sharded data parallelism does between its gradient's reduce-scatter
and its parameters' all-gather.

Shared by sharded data parallelism (sharded.py: ZeRO 1/2/3 and HSDP) and
Megatron-Core's distributed optimizer under pipeline and tensor parallelism
(distributed_optimizer.py). Once its gradient has been reduce-scattered, a
rank (a ShardedReplica, sharded_replica.py) holds its shard's gradient
summed over the data-parallel ranks. `sharded_update` averages it over
them and unscales it into the fp32 master shard, votes on an fp16 overflow
with every rank that shares the loss scale (each saw only its shard), steps
the optimizer on the shard alone, rounds the shard into the rank's owned
chunks of the parameters and charges the update's HBM traffic.
`gather_parameters` then all-gathers the updated parameters, every program
side by side (stages 1 and 2; under stage 3 each unit is gathered where it
is used).

    vote = partial(overflow_vote, comm, index, all_reduce)          # fp16; else None
    yield from sharded_update(shard, replicas=dp, step_bytes=nbytes, vote=vote)
    yield from gather_parameters([shard.gather(unit, group, tag) for unit in units], comm, index)
"""
from ..step_ops import Await, MemoryBound, Post

# The labels of sharded data parallelism's collectives, by kind
LABELS = {"all_gather": "all_gather", "reduce_scatter": "reduce_scatter", "all_reduce": "hsdp_all_reduce"}


def sharded_update(shard, replicas: int, step_bytes: int, vote=None, charge=None, kernels: int = 0):
    """Step program: average the reduced shard over `replicas` ranks, unscale it, step the shard's optimizer
    unless an overflow was found (`vote(found_inf)`, a step program, decides it across the ranks that share the
    loss scale), round the shard into its chunks; `step_bytes` of HBM traffic in `kernels` operators (a calibrated
    host's kernel_overhead) charged, or `charge` run (a step program: the host's step under offload,
    schemes/offload.py)."""
    found_inf = shard.take_gradient(replicas)
    if vote is not None:
        found_inf = yield from vote(found_inf)
    shard.apply_update(shard.precision.settle(found_inf))
    if charge is None:
        yield MemoryBound(step_bytes, "optimizer step", kind="optimizer", kernels=kernels, updates=1)
    else:
        yield from charge


def gather_parameters(programs: list, comm=None, index: int | None = None):
    """Step program: the all-gather `programs` posted side by side (on a sub-group's `comm`, as its rank
    `index`; None: the job's own communicator), then awaited."""
    handles = []
    for program in programs:
        handles.append((yield Post(program, LABELS["all_gather"], comm, index)))
    for handle in handles:
        yield Await(handle)


def bytes_by_kind(log, devices) -> dict[str, int]:
    """The bytes `devices` sent in each kind of sharded collective (their event log's communication, by label)."""
    moved = dict.fromkeys(LABELS, 0)
    for device in devices:
        by_label = log.bytes_by_label(device.rank, "communication")
        for kind, label in LABELS.items():
            moved[kind] += int(by_label.get(label, 0))
    return moved
