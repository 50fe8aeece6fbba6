"""One rank's share of sharded data parallelism: flat parameters and gradients, its fp32 shard and optimizer.

`ShardedReplica` takes over a job's `Replica` (train/replica.py: the model
copy, the loader, the precision) and lays its trainable parameters and their
gradients out as views into two padded flat buffers in the compute dtype
(strategies/shard_layout.py). What the rank owns is its chunk of every unit:

- `master`: the fp32 master weights of its shard (under fp32 training, the
  fp32 weights of its chunks), the one tensor its optimizer steps, with
  `master.grad` the averaged, unscaled fp32 gradient of the shard;
- its optimizer's state, for `master` alone (Adam's moments, momentum);
- under stage 3, nothing else: the other ranks' chunks of `param_flat` hold
  NaN between a unit's uses, so a step that forgot a gather computes NaN.

The collectives that move its chunks are programs over its shard group
(job ranks, on the job's communicator): a ring all-gather of a unit's
parameters, a ring reduce-scatter of a unit's gradient (run the other way
round the ring, so that on full-duplex ring links it never shares a link
with the gathers running beside it) and, under HSDP, a ring all-reduce of
the reduced chunk across the replicate group. Gradients are reduced in the
reduce dtype (`parallel.sharding.reduce_dtype`): the compute dtype in place,
or a copy cast into `reduced` as the unit's reduce-scatter starts.

Its training state (checkpoints, PBT) is its shard: the fp32 master shard,
the optimizer's state of it, the loss scale and the model's buffers. Loaded,
the chunks it does not own are NaN until they are gathered again.

`held_bytes` is what the rank's ledger holds for the whole run, by category:
the ZeRO paper's terms (Rajbhandari et al. 2020), in simtrain's categories, as
the implementations keep them: Megatron-Core's fp32 main gradients under stage
1 (train/replica.py `main_grads_of`), FSDP2's fp32 shard alone under stage 3
(its chunk of `param_flat` is the compute dtype's copy that a gather sends,
which FSDP2 casts as it gathers).

    shard = ShardedReplica(replica, layout, position, stage, optimizer_spec)
    program = shard.gather(unit, group, tag)          # a collective program
"""
import copy

import torch

from ..comm.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from ..op_cost import OperatorRecorder
from ..scenario import OptimizerSpec
from ..train.optim import build_optimizer, optimizer_state_bytes, optimizer_step_bytes
from ..train.precision import DTYPES
from ..train.replica import Replica, main_grads_of
from ..train.training_state import TrainingState, packed, unpacked
from .shard_layout import ShardLayout

_FP32_BYTES = 4


class ShardedReplica(Replica):
    """A Replica whose parameters, gradients and optimizer state are laid out for sharding."""

    def __init__(self, replica: Replica, layout: ShardLayout, position: int | tuple[int, ...], stage: int,
                 optimizer: OptimizerSpec, reduce_dtype: str | None = None):
        self.__dict__.update(replica.__dict__)  # the model, loader and precision it takes over
        self.layout, self.stage = layout, stage
        units = range(len(layout.units))
        # the rank's place in each unit's shard group (one for all, or one per unit), and the chunk it owns there
        self.positions = (position,) * len(units) if isinstance(position, int) else tuple(position)
        self.owned = tuple(layout.owned(unit, self.positions[unit]) for unit in units)
        self.stale = False  # the chunks it does not own must be gathered before the next step (after a load)
        self._kept = False  # master.grad holds this step's earlier micro-batches' reduced gradient
        self._assembled = None  # the copy `assembled` writes into
        self._gathered_master = None  # the whole fp32 parameters `gather_master` gathers (a launched rank's)
        device = self.params[0].device
        self.param_flat = torch.zeros(layout.padded_numel, dtype=self.precision.dtype, device=device)
        self.main_grads = main_grads_of(stage, self.precision.mixed, reduce_dtype)
        self._main_slices = {}
        # the gradient buffer: the compute dtype's, or Megatron-Core's fp32 main gradients (Replica.main_grads)
        self.grad_buffer = torch.zeros(layout.padded_numel, dtype=torch.float32 if self.main_grads
                                       else self.precision.dtype, device=device)
        # what the gradient is reduced in: the gradient buffer itself, or its copy in the reduce dtype
        reduce = DTYPES[reduce_dtype] if reduce_dtype is not None else self.precision.dtype
        self.reduced = (self.grad_buffer if reduce == self.grad_buffer.dtype
                        else torch.zeros(layout.padded_numel, dtype=reduce, device=device))
        full = torch.zeros(layout.padded_numel, dtype=torch.float32, device=device)
        masters = self.precision.master_params  # fp32: the parameters themselves
        with torch.no_grad():
            for index, (param, master) in enumerate(zip(self.params, masters)):
                where = layout.param_slice(index)
                full[where].copy_(master.reshape(-1))
                view = self.param_flat[where].view_as(param)
                view.copy_(param)
                param.data = view
                if self.main_grads:  # autograd's gradient is the compute dtype's, added into the buffer as it lands
                    param.grad, self._main_slices[id(param)] = None, where
                    param.register_post_accumulate_grad_hook(self._into_main_grads)
                else:
                    param.grad = self.grad_buffer[where].view_as(param)
        self.master = torch.cat([layout.chunk(full, unit, self.owned[unit]) for unit in units])
        self.master.requires_grad_()
        self.master.grad = torch.zeros_like(self.master)
        if self.precision.mixed:  # the whole fp32 copies are gone: the shard is all the rank keeps
            self.precision.master_params, self.precision.master_grads = None, None
        self.optimizer = build_optimizer([self.master], optimizer)
        if stage == 3:
            self.reshard_all()

    # ---- the collective programs of a unit ----

    def gather(self, unit: int, group: list[int], tag: int):
        """Ring all-gather of unit `unit`'s parameters over `group` (job ranks, this rank at `position`)."""
        n, position = len(group), self.positions[unit]
        return ring_all_gather(position, group[(position + 1) % n], group[position - 1],
                               self.layout.chunks(self.param_flat, unit), tag)

    def reduce_scatter(self, unit: int, group: list[int], tag: int):
        """Ring reduce-scatter (sum) of unit `unit`'s gradient over `group`, in the reduce dtype (a copy cast when
        the program starts, if it is not the compute dtype), the ring run backwards: reversed, this rank sits at
        N-1-position and ends holding chunk `owned`, as the forward ring would leave it."""
        n, position = len(group), self.positions[unit]
        if self.reduced is not self.grad_buffer:  # cast into the reduce dtype when the program starts
            self.reduced[self.layout.unit_slice(unit)].copy_(self.grad_buffer[self.layout.unit_slice(unit)])
        chunks = self.layout.chunks(self.reduced, unit)
        reordered = [chunks[(n - index + 1) % n] for index in range(n)]
        yield from ring_reduce_scatter(n - 1 - position, group[position - 1], group[(position + 1) % n],
                                       reordered, tag)

    def all_reduce(self, unit: int, rank: int, replicas: list[int], tag: int):
        """HSDP: ring all-reduce (sum) of the reduced chunk of unit `unit` across `replicas` (job ranks)."""
        chunk = self.layout.chunk(self.reduced, unit, self.owned[unit])
        return ring_all_reduce(rank, len(replicas), chunk, ring=replicas, tag=tag)

    def gather_master(self, unit: int, group: list[int], tag: int):
        """Ring all-gather of unit `unit`'s fp32 master chunks over `group` into the whole fp32 parameters that
        `publish()` then writes: at the end of a launched run, whose process holds no other rank's shard."""
        layout = self.layout
        if self._gathered_master is None:
            self._gathered_master = torch.zeros(layout.padded_numel, dtype=torch.float32, device=self.master.device)
        layout.chunk(self._gathered_master, unit, self.owned[unit]).copy_(self.master.detach()[layout.shard_slice(unit)])
        n, position = len(group), self.positions[unit]
        return ring_all_gather(position, group[(position + 1) % n], group[position - 1],
                               layout.chunks(self._gathered_master, unit), tag)

    # ---- the numerics of a step ----

    def forward_backward(self, share: float = 1.0, accumulate: bool = False) -> torch.Tensor:
        """Forward and backward of the last batch (a micro-batch: `share` of the step's batch, its loss weighted
        by it) on the parameters as they stand; returns the loss. With `accumulate` its gradient is added to
        what the gradient buffer holds (stage 1 between reductions), else the buffer is zeroed first."""
        x, y = self.last_batch
        if not accumulate:
            self.grad_buffer.zero_()
        replayed = self.replayed_loss()  # numerics off: run once per batch shape (Replica)
        return self.backward(replayed if replayed is not None else self.run_forward(x, y), share)

    @torch.no_grad()
    def keep_reduced(self, replicas: int) -> None:
        """The reduced chunks, averaged over the `replicas` data-parallel ranks, added into master.grad (copied,
        the step's first): a micro-batch's reduced gradient, kept before the next one's backward."""
        for unit in range(len(self.layout.units)):
            chunk = self.layout.chunk(self.reduced, unit, self.owned[unit])
            chunk.div_(replicas)
            where = self.master.grad[self.layout.shard_slice(unit)]
            if self._kept:
                where.add_(chunk)
            else:
                where.copy_(chunk)
        self._kept = True

    def take_gradient(self, replicas: int) -> bool:
        """The reduced chunks, averaged over the `replicas` data-parallel ranks, into master.grad (added to what
        the step's earlier micro-batches kept there), unscaled; True iff they hold an inf or NaN."""
        self.keep_reduced(replicas)
        self._kept = False
        scaler = self.precision.scaler
        if scaler is not None:
            return scaler.unscale_(self.master.grad)
        return not self.master.is_meta and not bool(torch.isfinite(self.master.grad).all())

    @torch.no_grad()
    def apply_update(self, update: bool) -> None:
        """Step the shard's optimizer if `update` (on meta tensors the first time only: Replica), then round
        the master shard into the owned chunks."""
        if update and not self._meta_stepped:
            self.optimizer.step()
            self._meta_stepped = self._meta_losses is not None
        for unit in range(len(self.layout.units)):
            owned = self.layout.chunk(self.param_flat, unit, self.owned[unit])
            owned.copy_(self.master[self.layout.shard_slice(unit)])

    def step_kernels(self) -> int:
        """Torch operators one update (`take_gradient`, then `apply_update`) dispatches, counted on a copy of what
        it touches (the reduced gradient, the master shard and its optimizer, the loss scale, the flat parameters):
        the second of two updates (the first creates the optimizer's state)."""
        shard = copy.copy(self)
        shard.precision, shard.optimizer, shard.master, shard.reduced, shard.param_flat = copy.deepcopy(
            (self.precision, self.optimizer, self.master, self.reduced, self.param_flat))
        shard.master.grad = self.master.grad.clone()  # a tensor's deepcopy leaves its .grad behind
        shard._meta_losses, shard._kept = None, False  # the copy's optimizer steps each time, numerics off too

        def update():
            shard.apply_update(shard.precision.settle(shard.take_gradient(1)))
        update()
        with OperatorRecorder() as recorder:
            update()
        return recorder.kernels

    @torch.no_grad()
    def reshard(self, unit: int) -> None:
        """Drop the chunks of unit `unit` this rank does not own (NaN until gathered again): the unit's region
        before its owned chunk and after it, two fills however many chunks."""
        size, owned = self.layout.chunk_numel(unit), self.owned[unit]
        region = self.param_flat[self.layout.unit_slice(unit)]
        region[:size * owned].fill_(float("nan"))
        region[size * (owned + 1):].fill_(float("nan"))

    def reshard_all(self) -> None:
        for unit in range(len(self.layout.units)):
            self.reshard(unit)

    # ---- the sharded training state ----

    def training_state(self) -> TrainingState:
        """This rank's shard, packed: fp32 master shard, optimizer state, loss scale, the model's buffers."""
        pieces = [("master", self.master)]
        pieces += [(f"optimizer.{key}", value) for key, value in sorted(self.optimizer.state.get(self.master,
                                                                                                   {}).items())]
        if self.precision.scaler is not None:
            pieces.append(("scaler", self.precision.scaler.scale))
        pieces += [(f"buffer.{name}", buffer) for name, buffer in self.model.named_buffers()]
        layout = [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in pieces]
        scaler = self.precision.scaler
        return TrainingState(packed(pieces), layout, None if scaler is None else scaler.clean_steps)

    @torch.no_grad()
    def load_training_state(self, state: TrainingState, flat: torch.Tensor) -> None:
        """Go on from `flat`, a received copy of a shard's `state.flat`, bit for bit; the chunks it does not
        own are dropped, to be gathered before the next step."""
        buffers = dict(self.model.named_buffers())
        optimizer_state, offset = {}, 0
        for name, dtype, shape in state.layout:
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            value = flat[offset:offset + nbytes].clone().view(dtype).reshape(shape)
            offset += nbytes
            kind, _, rest = name.partition(".")
            if kind == "master":
                self.master.copy_(value)
            elif kind == "optimizer":
                optimizer_state[rest] = unpacked(value, self.optimizer.state.get(self.master, {}).get(rest))
            elif kind == "scaler":
                self.precision.scaler.scale = unpacked(value, self.precision.scaler.scale)
            else:
                buffers[rest].copy_(value)
        self.optimizer.state.clear()
        if optimizer_state:
            self.optimizer.state[self.master] = optimizer_state
        if self.precision.scaler is not None:
            self.precision.scaler.clean_steps = state.clean_steps
        self.apply_update(False)
        self.reshard_all()
        self.stale, self._kept = self.stage < 3, False

    @torch.no_grad()
    def assembled(self, groups: list[list["ShardedReplica"]]) -> torch.nn.Module:
        """A copy of the model (compute dtype) holding the parameters as the shards of `groups` (each unit's shard
        group, by position: `groups_of`) own them now: what the training-loss monitor evaluates while a stage 3
        rank holds only its chunks."""
        if self._assembled is None:
            self._assembled = copy.deepcopy(self.model)
            for param in self._assembled.parameters():
                param.data = param.data.clone()
        layout, whole = self.layout, torch.empty_like(self.param_flat)
        for unit, group in enumerate(groups):
            for shard in group:
                owned = shard.owned[unit]
                layout.chunk(whole, unit, owned).copy_(layout.chunk(shard.param_flat, unit, owned))
        # the copy's parameters in the layout's order (experts laid out last, expert_groups.py: not the model's)
        where = {id(param): index for index, param in enumerate(p for p in self.model.parameters() if p.requires_grad)}
        copies = [param for param in self._assembled.parameters() if param.requires_grad]
        for index, param in enumerate(self.params):
            copies[where[id(param)]].copy_(whole[layout.param_slice(index)].view_as(param))
        return self._assembled

    def publish(self, groups: list[list["ShardedReplica"]] | None = None) -> None:
        """Write the whole fp32 model, from the owned chunks of the shards of `groups` (each unit's shard group, by
        position: `groups_of`; None: what `gather_master` gathered), into this replica's model: what the run
        reports as trained (Job.finish turns it into fp32)."""
        layout = self.layout
        full = self._gathered_master
        if groups is not None:
            full = torch.zeros(layout.padded_numel, dtype=torch.float32, device=self.master.device)
            for unit, group in enumerate(groups):
                for shard in group:
                    layout.chunk(full, unit, shard.owned[unit]).copy_(shard.master.detach()[layout.shard_slice(unit)])
        views = [full[layout.param_slice(index)].view_as(param) for index, param in enumerate(self.params)]
        if self.precision.mixed:
            self.precision.master_params = views  # Job.finish copies them into the fp32 model
        else:
            with torch.no_grad():
                for param, view in zip(self.params, views):
                    param.copy_(view)


def groups_of(layout: ShardLayout, group: list[ShardedReplica]) -> list[list[ShardedReplica]]:
    """Every unit's shard group, by position, where one group shards every unit (what `publish` and `assembled`
    take)."""
    return [group] * len(layout.units)


def held_bytes(layout: ShardLayout, stage: int, precision: str, optimizer: OptimizerSpec,
               main: bool = False) -> dict[str, int]:
    """Bytes a rank holds for the whole run, by category; P = the padded parameter count, S = P / N its shard's,
    e = the compute dtype's bytes:

    - weights: P e (stages 1, 2); stage 3 the fp32 shard 4 S alone, as FSDP2 keeps its sharded parameters in
      their own dtype and casts them to the compute dtype only into a gather's input (torch's
      distributed/fsdp/_fully_shard/_fsdp_param.py, `all_gather_inputs`): no 16-bit shard is kept;
    - master_weights: 4 S under mixed precision below stage 3 (the fp32 master shard); none in fp32 and under
      stage 3 (the weights are it);
    - gradients: stage 1 the whole gradient P e, plus under mixed precision the shard's fp32 master gradient 4 S
      (with `main` gradients, train/replica.py's `main_grads_of`: the whole fp32 gradient 4 P alone); stages 2
      and 3 the shard's fp32 gradient 4 S alone;
    - optimizer_state: the optimizer's state of the fp32 shard (Adam: 8 S)."""
    element = torch.empty((), dtype=DTYPES[precision]).element_size()
    padded, shard = layout.padded_numel, layout.shard_numel
    mixed = precision != "fp32"
    held = {"weights": shard * _FP32_BYTES if stage == 3 else padded * element}
    if mixed and stage < 3:
        held["master_weights"] = shard * _FP32_BYTES
    if stage == 1:
        held["gradients"] = padded * _FP32_BYTES if main else padded * element + (shard * _FP32_BYTES if mixed else 0)
    else:
        held["gradients"] = shard * _FP32_BYTES
    held["optimizer_state"] = optimizer_state_bytes(optimizer, shard * _FP32_BYTES)
    return held


def shard_update_bytes(layout: ShardLayout, precision: str, optimizer: OptimizerSpec, main: bool = False) -> int:
    """HBM bytes read and written by one update of a shard: the optimizer's on the fp32 shard, and under mixed
    precision unscaling the reduced chunks into it (with `main` gradients, in place) and rounding
    it back into the owned chunks."""
    return chunk_update_bytes(layout.shard_numel, precision, optimizer, main)


def chunk_update_bytes(numel: int, precision: str, optimizer: OptimizerSpec, main: bool = False) -> int:
    """Bytes read and written by the update of `numel` elements of a shard (shard_update_bytes' terms)."""
    element = torch.empty((), dtype=DTYPES[precision]).element_size()
    touched = optimizer_step_bytes(optimizer, numel * _FP32_BYTES)
    if precision != "fp32":
        reduced = _FP32_BYTES if main else element  # the gradient read: the main gradients' fp32, else 16-bit
        touched += (numel * reduced + numel * _FP32_BYTES) + (numel * _FP32_BYTES + numel * element)
    return touched
