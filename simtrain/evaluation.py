"""Measuring a model while it trains, at no simulated cost.

`evaluate` is a model's mean cross entropy and accuracy over a data set.
`TrainLossMonitor` records the model's loss over the whole training set every
`every` steps (and after the last): report.json's `train_loss_curve`, the
curve every scheme and sampling kind can be compared on, and the one
`time_to_target_s` reads. A step's own batch loss is not comparable: an async
update's is one batch, a prioritized batch's is importance-weighted over hard
samples.

    monitor = TrainLossMonitor(job.scheme.trained_model, job.data.train, every=10, steps=200)
    ... the scheme calls monitor.on_step(step, sim_time_s, loss) after every step
"""
import torch
from torch.utils.data import TensorDataset

from .loss import cross_entropy


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset, batch_size: int = 1024) -> tuple[float, float]:
    """Mean cross entropy and accuracy of `model` over `dataset`."""
    was_training = model.training
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    parameter = next(model.parameters(), None)
    for start in range(0, len(dataset), batch_size):
        x, y = _rows(dataset, start, min(start + batch_size, len(dataset)))
        if parameter is not None and x.is_floating_point():  # a mixed-precision model mid-training
            x = x.to(parameter.dtype)
        logits = model(x)
        total_loss += cross_entropy(logits, y, reduction="sum").item()
        correct += int((logits.argmax(dim=-1) == y).sum())
        count += y.numel()  # a sequence model predicts every position
    model.train(was_training)
    return total_loss / count, correct / count


def _rows(dataset, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples start..end-1 of `dataset` as one (x, y) batch (sliced directly from a TensorDataset)."""
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        return dataset.tensors[0][start:end], dataset.tensors[1][start:end]
    items = [dataset[i] for i in range(start, end)]
    return torch.stack([item[0] for item in items]), torch.stack([torch.as_tensor(item[1]) for item in items])


class TrainLossMonitor:
    """Training-set loss of the current model every `every` steps: [[step, sim_time_s, loss]]."""

    def __init__(self, current_model, dataset, every: int, steps: int, then=None):
        self.current_model = current_model  # () -> the model being trained (rank 0's, or the shared one)
        self.dataset = dataset  # None: numerics off, nothing to evaluate
        self.every = every
        self.steps = steps
        self.then = then  # the caller's own on_step(step, sim_time_s, loss)
        self.curve: list[list[float]] = []

    def on_step(self, step: int, sim_time_s: float, loss: float) -> None:
        """Called after step `step` (0-based) ends at `sim_time_s` with its batch loss."""
        done = step + 1
        if self.dataset is not None and (done % self.every == 0 or done == self.steps):
            self.curve.append([done, sim_time_s, evaluate(self.current_model(), self.dataset)[0]])
        if self.then is not None:
            self.then(step, sim_time_s, loss)

    def rewind(self, step: int) -> None:
        """Forget the points after step `step`: the job restarts there (recovery.py)."""
        self.curve = [point for point in self.curve if point[0] <= step]

    def time_to(self, target: float) -> float | None:
        """The first simulated time at which the training-set loss was at or below `target`; None if never."""
        return next((sim_time for _, sim_time, loss in self.curve if loss <= target), None)
