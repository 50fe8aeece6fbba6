"""What schemes whose every rank trains its own Replica share: live hyperparameters and the training state.

In the synchronous schemes (the step engine, model_parallel.py; sharded and
expert parallelism alone) job rank r trains `self.replicas[r]` (train/replica.py):
its own optimizer, loader and parameters (a whole model, or its share of one).
Setting hyperparameters and taking or restoring the training state are then
the same per-rank operations, given here once.

    class ModelParallel(RankReplicas, Scheme): ...
    scheme.set_hyperparameters(rank, {"train.optimizer.lr": 0.01})
    state = scheme.training_state(rank); other.load_training_state(rank, state, state.flat.clone())
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
