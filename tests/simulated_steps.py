"""Shared by the tests of sequence, context and llama parallelism: a job run to its end, and the bytes each
label of communication moved over all its ranks (hw/eventlog.py)."""
from simtrain.hw.cluster import build_cluster, run_to_end
from simtrain.job import Job


def one_step(spec):
    """The scenario's job on all of its cluster's devices, run to its end, with its event log recorded."""
    cluster = build_cluster(spec.cluster, record=True, seed=spec.seed)
    job = Job(spec, cluster, range(cluster.size))
    job.start()
    run_to_end(cluster.env)
    return job


def bytes_by_label(job) -> dict[str, int]:
    """Communication label -> bytes its transfers moved, summed over the job's ranks."""
    moved = {}
    for rank in range(job.world):
        for label, nbytes in job.cluster.log.bytes_by_label(rank, "communication").items():
            moved[label] = moved.get(label, 0) + nbytes
    return moved
