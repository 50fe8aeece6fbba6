"""One device's replica: its model copy, data shard, optimizer and gradient bucket.

Gradients live in one flat buffer per replica (every parameter's .grad is a
view into it, as in DDP's gradient_as_bucket_view), so a collective reduces
the whole gradient in place with no copies. The replicas of one model that a
process holds keep those buffers as the rows of one tensor
(`share_gradient_rows`): the ring all-reduce timed as a group sums the rows
where they lie (comm/ring_schedule.py) instead of stacking copies of them.

    replica = Replica(model, loader, scenario.train)
    loss = replica.backward(replica.forward())      # real torch, on this replica's next batch
    ... all-reduce replica.grad_buffer ...
    replica.step()

`training_state()` packs what training goes on from into one flat buffer, and
`load_training_state` takes another replica's (train/training_state.py): how
population-based training copies a member into another.

Mixed precision (`precision="fp16" | "bf16"`, simtrain/train/precision.py):
the model and the gradient bucket are in the compute dtype, the optimizer
steps fp32 master weights, and the loss is computed in fp32 from upcast logits.
With `main_grads` (Megatron-Core's fp32 main gradients: `main_grads_of`) the
bucket is fp32 instead, and is the master weights' gradient itself: no
parameter keeps a .grad between backward passes; each one's, once autograd
has accumulated it, is added into its slice of the bucket and dropped
(Megatron-Core's backward post-hook), so microbatches accumulate in fp32.

With numerics off the replica is on meta tensors: a forward and backward
computes no values, only shapes, and the same ones every step on a batch of
one shape, on every replica of one model. It runs once per batch shape (by
the first replica that meets it, when the job's replicas share
`meta_losses`), and a later forward on that shape returns the first one's
loss, detached, without running (`backward` then runs nothing); each replica's
optimizer steps once (creating its state) and not again. Run every step,
a small model's forward and backward on meta tensors took some 20 ms of
torch's Python meta kernels per replica: most of a numerics-off
data-parallel run's time (bench/data_parallel_meta.py).
"""
import copy

import torch

from ..cost import StepCost, measure_step_cost
from ..op_cost import OperatorRecorder
from ..scenario import TrainSpec
from .data import ShardLoader
from .grad_bucket import flat_grad_buffer
from .optim import build_optimizer
from .precision import MixedPrecision
from .training_state import TrainingState, capture, restore


class Replica:
    """A model replica that trains on its own shard with a flat gradient buffer."""

    def __init__(self, model: torch.nn.Module, loader: ShardLoader, train: TrainSpec,
                 meta_losses: dict[tuple, torch.Tensor] | None = None, main_grads: bool = False):
        self.model = model
        self.loader = loader
        self.precision = MixedPrecision(model, train.precision, train.amp)  # casts the model to the compute dtype
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.main_grads = main_grads  # job.py decides: main_grads_of
        self._main_slices: dict[int, slice] = {}  # id(parameter) -> its main gradient's slice of grad_buffer
        self.lay_out_gradients()
        if self.main_grads:
            for param in self.params:
                param.register_post_accumulate_grad_hook(self._into_main_grads)
        self.optimizer = build_optimizer(self.precision.master_params, train.optimizer)
        self.last_batch = None
        self._costs: dict[tuple, StepCost] = {}  # by input shape
        # numerics off: the (detached, meta) loss of the forward run once per input shape, by the
        # replicas of one model together (`meta_losses`, a job's; else this one's own)
        self._meta_losses = None
        if self.grad_buffer.is_meta:
            self._meta_losses = {} if meta_losses is None else meta_losses
        self._meta_stepped = False  # numerics off: the optimizer has stepped once (its state exists)

    @property
    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)

    def step_cost(self) -> StepCost:
        """FLOPs and activation bytes of a forward+backward on the last batch's shape, measured once
        per shape (measure_step_cost's own cache key costs tens of microseconds a call)."""
        x, y = self.last_batch
        cost = self._costs.get(tuple(x.shape))
        if cost is None:
            cost = self._costs[tuple(x.shape)] = measure_step_cost(self.model, x, y)
        return cost

    def forward(self, microbatch: tuple[torch.Tensor, torch.Tensor] | None = None,
                accumulate: bool = False) -> torch.Tensor:
        """The loader's loss of its next batch (mean cross entropy, or importance-weighted
        under prioritized sampling), with its graph: `backward(loss)` follows. Given a `microbatch`
        (one of `microbatches`), its loss instead; with `accumulate` the gradient buffer keeps what
        the micro-batches before it left there (gradient accumulation), else it is zeroed."""
        if microbatch is None:
            microbatch = self.microbatches(1)[0]
        x, y = microbatch
        self.last_batch = (x, y)
        if not accumulate:
            self.grad_buffer.zero_()
        replayed = self.replayed_loss()
        return replayed if replayed is not None else self.run_forward(x, y)

    def microbatches(self, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The loader's next batch in the compute dtype, cut into `count` equal micro-batches along the
        batch dimension, in order (the count divides the batch: scenario/root.py checks it)."""
        x, y = self.loader.next_batch()
        x = self.precision.cast_input(x)
        if count == 1:
            return [(x, y)]
        return list(zip(x.chunk(count), y.chunk(count)))

    def run_forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loader's loss of the model on (x, y), with its graph; numerics off, its detached copy is what
        later forwards on this shape replay."""
        loss = self.loader.batch_loss(self.model(x), y)
        if self._meta_losses is not None:
            self._meta_losses[tuple(x.shape)] = loss.detach()
        return loss

    def backward(self, loss: torch.Tensor, share: float = 1.0) -> torch.Tensor:
        """Backward of `forward`'s loss, weighted by `share` (a micro-batch's share of the batch, so that the
        accumulated gradient is the whole batch's): its gradient lands in (is added to) grad_buffer; returns
        the loss, detached and unweighted. A replayed loss (numerics off) runs nothing."""
        if loss is self.replayed_loss():
            return loss
        self.precision.backward(loss if share == 1.0 else loss * share)
        return loss.detach()

    def lay_out_gradients(self, buffer: torch.Tensor | None = None) -> None:
        """The gradient bucket over `params` in their order, zeroed: `buffer` (a row of a tensor the job's replicas
        share: `share_gradient_rows`) or a new one; each .grad a view into it, or with `main_grads` each parameter's
        fp32 slice of it, which the fp32 masters' .grad are views of (without them the masters' gradients are a
        bucket of their own: train/precision.py)."""
        if not self.main_grads:
            self.grad_buffer = flat_grad_buffer(self.params, buffer)
            return
        if buffer is None:
            buffer = torch.zeros(sum(p.numel() for p in self.params), device=self.params[0].device)
        self.grad_buffer = self.precision.master_grads = flat_grad_buffer(self.precision.master_params, buffer)
        offset = 0
        for param in self.params:
            param.grad = None
            self._main_slices[id(param)] = slice(offset, offset + param.numel())
            offset += param.numel()

    @torch.no_grad()
    def _into_main_grads(self, param: torch.Tensor) -> None:
        """A parameter's gradient, once autograd has accumulated it for a backward pass, added into its fp32 main
        gradient and dropped: Megatron-Core's backward post-hook (`param.main_grad.add_(param.grad)`)."""
        self.grad_buffer[self._main_slices[id(param)]].view_as(param).add_(param.grad)
        param.grad = None

    def gradients(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The accumulated gradients of `params` (some of the replica's), where the collectives reduce them: their
        .grad, views into grad_buffer; with `main_grads` (where no .grad outlives a backward) their main
        gradients' views."""
        if not self.main_grads:
            return [param.grad for param in params]
        return [self.grad_buffer[self._main_slices[id(param)]].view_as(param) for param in params]

    def run_every_step(self) -> None:
        """Run the forward, backward and update every step even with numerics off: hooks on the model read
        each one (K-FAC's, strategies/kfac_sync.py)."""
        self._meta_losses = None

    @property
    def replays(self) -> bool:
        """Numerics off and not `run_every_step`: a step's forward and backward may be replayed from their
        costs instead of run (on meta tensors they compute shapes alone, the same every step)."""
        return self._meta_losses is not None

    def replayed_loss(self) -> torch.Tensor | None:
        """Numerics off: the loss of a forward already run on a batch of the last batch's shape (run again,
        it and its backward would compute the same shapes and no values); else None."""
        if self._meta_losses is None:
            return None
        return self._meta_losses.get(tuple(self.last_batch[0].shape))

    def training_state(self) -> TrainingState:
        """A packed copy of what this replica trains on from (weights, fp32 masters, optimizer, loss scale)."""
        return capture(self.model, self._masters(), self.optimizer, self.precision.scaler)

    def load_training_state(self, state: TrainingState, flat: torch.Tensor) -> None:
        """Go on from `flat`, a received copy of `state.flat`, bit for bit."""
        restore(state, flat, self.model, self._masters(), self.optimizer, self.precision.scaler)

    def _masters(self) -> list | None:
        return self.precision.master_params if self.precision.mixed else None

    def step_kernels(self) -> int:
        """Torch operators one update (`step`) dispatches, counted on copies of the optimizer and precision
        state: the second of two steps (the first creates the optimizer's state)."""
        precision, optimizer, grads = copy.deepcopy((self.precision, self.optimizer, self.grad_buffer))
        originals = [p for group in self.optimizer.param_groups for p in group["params"]]
        copies = [p for group in optimizer.param_groups for p in group["params"]]
        for original, copied in zip(originals, copies):  # a Parameter's deepcopy leaves its .grad behind:
            if original.grad is not None:  # without it the optimizer would skip the parameter
                copied.grad = original.grad.clone()

        def step():
            if precision.unscale(grads):
                optimizer.step()
                precision.copy_master_to_model()
        step()
        with OperatorRecorder() as recorder:
            step()
        return recorder.kernels

    def step(self) -> None:
        """Update from the (averaged) gradient bucket: skipped if the loss scaler found an overflow."""
        self.apply_update(self.precision.unscale(self.grad_buffer))

    def use_grad_buffer(self, buffer: torch.Tensor) -> None:
        """Keep the gradient in `buffer` (flat, of grad_buffer's size and dtype), zeroed, from now on."""
        self.lay_out_gradients(buffer)

    def apply_update(self, update: bool) -> None:
        """The optimizer's update from the unscaled master gradients if `update`; else the step is skipped.
        On meta tensors only the first update runs (it creates the optimizer's state; the others would
        compute nothing)."""
        if update and not self._meta_stepped:
            self.optimizer.step()
            self.precision.copy_master_to_model()
            self._meta_stepped = self._meta_losses is not None


def main_grads_of(stage: int, mixed: bool, reduce_dtype: str | None) -> bool:
    """Whether a rank keeps Megatron-Core's fp32 main gradients (`Replica.main_grads`): DDP or the distributed
    optimizer (sharding stage 0 or 1) under mixed precision, reducing in fp32 (`--grad-reduce-in-fp32`,
    Megatron-LM's default under bf16). The buffer is reduced in place and is the optimizer's fp32 gradient (its
    chunk, under stage 1): no compute-dtype gradient outlives a backward and no separate master gradient is kept.
    Megatron-LM's README counts 18 bytes a parameter so, 6 + 12/d distributed ("Distributed Optimizer": bf16
    parameters, fp32 gradients), where a 16-bit gradient beside an fp32 master gradient keeps 20, 4 + 16/d (its
    fp16 row). Stages 2 and 3 (FSDP2's reduce_dtype) cast a copy for each reduction instead."""
    return stage <= 1 and mixed and reduce_dtype == "fp32"


def share_gradient_rows(replicas: list[Replica]) -> None:
    """Give replicas whose gradient buffers are alike (size, dtype, a real device: numerics on) the rows of one
    tensor as their buffers, in the list's order: a data-parallel group's gradients then lie side by side, as
    the group-timed ring all-reduce reads them (comm/ring_schedule.reduce_as_ring). Replicas that differ
    (model-parallel shares, expert shards) keep their own."""
    buffers = [replica.grad_buffer for replica in replicas]
    if len(buffers) < 2 or buffers[0].is_meta or any(
            (buffer.numel(), buffer.dtype) != (buffers[0].numel(), buffers[0].dtype) for buffer in buffers):
        return
    rows = buffers[0].new_zeros(len(buffers), buffers[0].numel())
    for replica, row in zip(replicas, rows):
        replica.use_grad_buffer(row)
