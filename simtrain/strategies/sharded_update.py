"""The sharded optimizer step of the distributed optimizer (distributed_optimizer.py: ZeRO 1/2/3, FSDP and HSDP,
in every layout), and the `sharding` report section.

Once its gradient has been reduce-scattered, a rank (a ShardedReplica,
sharded_replica.py) holds its shard's gradient summed over the data-parallel
ranks. `sharded_update` averages it over them and unscales it into the fp32
master shard, votes on an fp16 overflow with every rank that shares the loss
scale (each saw only its shard), steps the optimizer on the shard alone,
rounds the shard into the rank's owned chunks of the parameters and charges
the update's HBM traffic (or, offloaded, runs the host's step: offload.py).

    vote = partial(overflow_vote, comm, index, all_reduce)          # fp16; else None
    yield from sharded_update(shard, replicas=dp, step_bytes=nbytes, vote=vote)
"""
from pydantic import Field

from ..report.sections import ReportSection, register_section
from ..step_ops import MemoryBound
from .offload import NO_OFFLOAD, OffloadSection

# The labels of sharded data parallelism's collectives, by kind
LABELS = {"all_gather": "all_gather", "reduce_scatter": "reduce_scatter", "all_reduce": "hsdp_all_reduce"}


def sharded_update(shard, replicas: int, step_bytes: int, vote=None, charge=None, kernels: int = 0):
    """Step program: average the reduced shard over `replicas` ranks, unscale it, step the shard's optimizer
    unless an overflow was found (`vote(found_inf)`, a step program, decides it across the ranks that share the
    loss scale), round the shard into its chunks; `step_bytes` of HBM traffic in `kernels` operators (a calibrated
    host's kernel_overhead) charged, or `charge` run (a step program: the host's step under offload,
    strategies/offload.py)."""
    found_inf = shard.take_gradient(replicas)
    if vote is not None:
        found_inf = yield from vote(found_inf)
    shard.apply_update(shard.precision.settle(found_inf))
    if charge is None:
        yield MemoryBound(step_bytes, "optimizer step", kind="optimizer", kernels=kernels, updates=1)
    else:
        yield from charge


def bytes_by_kind(log, devices) -> dict[str, int]:
    """The bytes `devices` sent in each kind of sharded collective (their event log's communication, by label)."""
    moved = dict.fromkeys(LABELS, 0)
    for device in devices:
        by_label = log.bytes_by_label(device.rank, "communication")
        for kind, label in LABELS.items():
            moved[kind] += int(by_label.get(label, 0))
    return moved


def sharding_section(optimizer, layout) -> dict:
    """report.json's `sharding` of a distributed optimizer (distributed_optimizer.py), `layout` its first rank's
    shard layout."""
    job, offload = optimizer.scheme.job, optimizer.offload
    return {"stage": optimizer.stage, "degree": optimizer.degree, "replicate": optimizer.replicate,
            "reduce_dtype": optimizer.reduce_dtype,
            "reshard_after_forward": optimizer.stage == 3 and optimizer.reshard_after_forward,
            "units": len(layout.units), "shard_elements": layout.shard_numel,
            "padded_elements": layout.padded_numel, "bytes_by_kind": bytes_by_kind(job.cluster.log, job.devices),
            "offload": NO_OFFLOAD if offload is None else offload.report(optimizer.offload_what)}


class ShardingBytes(ReportSection):
    all_gather: int = Field(description="bytes the parameter all-gathers sent, every rank's")
    reduce_scatter: int = Field(description="bytes the gradient reduce-scatters sent, every rank's")
    all_reduce: int = Field(description="bytes the HSDP all-reduces of reduced shards across replicas sent")


class ShardingSection(ReportSection):
    stage: int = Field(description="the ZeRO stage: 1 optimizer state, 2 and gradients, 3 (FSDP) and parameters")
    degree: int = Field(description="ranks a shard group holds one copy of the state across")
    replicate: int = Field(description="shard groups that replicate each other (HSDP when above 1)")
    reshard_after_forward: bool = Field(description="stage 3: whether a unit is gathered again for its backward")
    reduce_dtype: str = Field(description="the dtype gradients were reduced in: fp32, bf16 or fp16")
    units: int = Field(description="units the parameters are gathered and their gradients reduced in")
    shard_elements: int = Field(description="parameters in one rank's shard (each unit padded to the degree)")
    padded_elements: int = Field(description="parameters of the model, each unit padded to a multiple of the "
                                             "degree")
    bytes_by_kind: ShardingBytes = Field(description="bytes each kind of collective sent")
    offload: OffloadSection = Field(OffloadSection(**NO_OFFLOAD), description="ZeRO-Offload: what lives in host "
                                                                            "memory, the bytes copied each way")


register_section("sharding", ShardingSection, "sharded data parallelism: the stage, the groups and the bytes "
                                              "each collective moved (strategies/distributed_optimizer.py)")

