"""What schemes whose every rank trains its own Replica share: live hyperparameters and the training state.

In the synchronous schemes (the step engine, model_parallel.py; sharded and
expert parallelism alone) job rank r trains `self.replicas[r]` (train/replica.py):
its own optimizer, loader and parameters (a whole model, or its share of one).
Setting hyperparameters, taking or restoring the training state and counting
the operators of an update (what a calibrated host charges its kernel_overhead
on: hw/device.py `fixed_time`) are then the same per-rank operations, given
here once.

    class ModelParallel(RankReplicas, Scheme): ...
    scheme.set_hyperparameters(rank, {"train.optimizer.lr": 0.01})
    state = scheme.training_state(rank); other.load_training_state(rank, state, state.flat.clone())
    kernels = scheme.update_kernels(scheme.running)        # {rank: operators of its optimizer step}
"""
from ..train.hyperparameters import set_live
from ..train.training_state import TrainingState


class RankReplicas:
    """Mixin: a scheme with `self.replicas`, one Replica per job rank."""

    def set_hyperparameters(self, rank: int, values: dict) -> None:
        replica = self.replicas[rank]
        set_live(replica.optimizer, [replica.loader], values)

    def training_state(self, rank: int) -> TrainingState:
        return self.replicas[rank].training_state()

    def load_training_state(self, rank: int, state: TrainingState, flat) -> None:
        self.replicas[rank].load_training_state(state, flat)

    def update_kernels(self, ranks) -> dict[int, int]:
        """rank -> the torch operators an update of its replica dispatches (`step_kernels`), for `ranks`, where a
        device of the job charges a fixed cost per kernel (a calibrated host); 0 elsewhere. Replicas whose
        parameters and optimized tensors are shaped alike (data-parallel replicas of one share) are counted once."""
        if not any(device.spec.kernel_overhead_s for device in self.job.devices):
            return dict.fromkeys(ranks, 0)
        counted, kernels = {}, {}
        for rank in ranks:
            replica = self.replicas[rank]
            optimized = [p for group in replica.optimizer.param_groups for p in group["params"]]
            key = (type(replica), tuple((p.shape, p.dtype) for p in replica.params),
                   tuple((p.shape, p.dtype) for p in optimized))
            if key not in counted:
                counted[key] = replica.step_kernels()
            kernels[rank] = counted[key]
        return kernels
