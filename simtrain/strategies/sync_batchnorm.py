"""SyncBN in the step engine: every BatchNorm layer's batch statistics summed over the data-parallel group, in the
forward and in the backward (`parallel.sync_batchnorm`).

train/syncbn.py runs a model's forward and backward as one generator that stops
at each exchange (a BN layer's [sum x, sum x^2, count] in the forward, its
[sum dy, sum dy*xhat] in the backward) with a StatsAllReduce request. Here
each request is served as a `sync_batchnorm` Collective on the rank's dp
(x cp) group, the one its gradients are all-reduced over (`scheme.comms.dp_cp`),
with `parallel.all_reduce`'s algorithm summing the buffer in place: the
statistics travel the simulated network (or real gloo), their bytes and time
charged.

The forward and backward interleave with the exchanges in one host pass, so a
microbatch's forward action runs both (schemes/pipeline.py), before its
activations are held; the chunk's measured forward and backward compute are
then charged as with numerics off (stage_execution.py replay_forward and
replay_backward). On the trace a step's exchanges come before its compute
spans instead of between them; each blocks the device either way, so the
step takes as long (train/syncbn.py). With numerics off the generator runs on
meta tensors: the same requests, of the same sizes.

It runs with data parallelism alone and one microbatch (parallel/support.py
refuses the rest): a rank's one chunk is the whole model, which must be an
nn.Sequential with its BatchNorm layers as direct children.

    synced = SyncedBatchNorm(scheme)     # ScenarioError (parallel.sync_batchnorm: ...) for a model it cannot run
    loss = yield from synced.forward_backward(rank, chunk, x, y)
"""
from ..errors import ScenarioError
from ..step_ops import Collective
from ..train.syncbn import sync_batchnorm_forward_backward, synced_batchnorms


class SyncedBatchNorm:
    """SyncBN's statistics exchanges, each an all-reduce over the rank's data-parallel group."""

    def __init__(self, scheme):
        self.scheme = scheme
        try:
            synced_batchnorms(scheme.job.model)
        except ValueError as error:
            raise ScenarioError(f"parallel.sync_batchnorm: {error}") from None

    def forward_backward(self, rank: int, chunk, x, y):
        """Step program: job rank `rank`'s forward and backward of `chunk` on (x, y) with its loader's loss, every
        BatchNorm's statistics summed over the rank's dp group on the way (the parameter gradients land in its
        gradient bucket); returns the loss, detached."""
        requests = sync_batchnorm_forward_backward(chunk, x, y, self.scheme.replicas[rank].loader.batch_loss)
        comm, index, all_reduce = self.scheme.comms.dp_cp[rank]
        try:
            request = next(requests)
            while True:
                yield Collective(all_reduce(index, comm.world, request.buffer), "sync_batchnorm", comm, index)
                request = requests.send(None)
        except StopIteration as stop:
            return stop.value
