"""Shared by the tests of the parallel schemes: a job run to its end, the bytes each label of communication
moved over all its ranks (hw/eventlog.py), a micro-batch's measured cost, and a model's parameters in one flat
fp32 vector."""
import torch

from simtrain.cost import measure_step_cost
from simtrain.hw.cluster import build_cluster, run_to_end
from simtrain.job import Job


def one_step(spec):
    """The scenario's job on all of its cluster's devices, run to its end (no rank left waiting), with its event
    log recorded; on meta tensors when the scenario's numerics are off."""
    cluster = build_cluster(spec.cluster, record=True, seed=spec.seed)
    job = Job(spec, cluster, range(cluster.size), numerics=spec.numerics)
    job.start()
    run_to_end(cluster.env)
    assert not job.scheme.stuck()
    return job


def microbatch_cost(job, microbatches: int):
    """What one micro-batch's forward and backward on rank 0 costs (cost.py StepCost), measured on the whole model
    as one device runs it: the step engine's rank holds it as its one model part."""
    replica = job.scheme.replicas[0]
    if not job.scheme.holds_shares:
        return replica.step_cost()
    x, y = (batch.chunk(microbatches)[0] for batch in replica.last_batch)
    return measure_step_cost(replica.model.chunks[0], x, y)


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter of `model`, flattened in order, in fp32."""
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def bytes_by_label(job) -> dict[str, int]:
    """Communication label -> bytes its transfers moved, summed over the job's ranks."""
    moved = {}
    for rank in range(job.world):
        for label, nbytes in job.cluster.log.bytes_by_label(rank, "communication").items():
            moved[label] = moved.get(label, 0) + nbytes
    return moved
