"""FSDP's units beside a rank's compute: each block gathered before its use, its gradient reduce-scattered after.

Under data parallelism alone (pp = tp = cp = 1, no ep) the distributed
optimizer (distributed_optimizer.py) cuts a rank's parameters as FSDP2 wraps
a model (torchtitan's `fully_shard` of each transformer block): into units,
an entry of the model's nn.Sequential with trainable parameters and the
parameterless ones after it (shard_units.py), so for a gpt the embedding,
each block and the head. The forward and the backward of each microbatch are
cut into a Compute per unit (shard_units.py: each unit's forward at the FLOPs
measured for it, each unit's backward from the completion of the gradients of
the unit after it to that of its own), and around each piece:

- **stage 3**: the unit's parameters are all-gathered into a unit-sized
  buffer before its forward and, unless `reshard_after_forward` is false,
  again before its backward; the gather of the next unit (forward order, then
  backward order) is posted once this one is awaited, a prefetch of one, so
  it runs beside this unit's compute. A buffer is freed after its unit's
  forward (resharding) and after its backward;
- **every stage**: once a unit's backward has run, the reduce-scatter of the
  unit before it is awaited (FSDP2's one reduce-scatter in flight: the
  compute stream waits for it, bounding the unsharded gradients held), then
  this unit's is posted; stages 2 and 3 hold a unit's unsharded gradient from
  its backward to the end of its reduce-scatter. The microbatch's last
  reduce-scatter is awaited after its backward (`after`), with the HSDP
  all-reduces its ends posted.

Stages 2 and 3 reduce every microbatch's gradient, as FSDP2 does by default
(torchtitan's train loop never turns gradient sync off) and DeepSpeed's
ZeRO-2: each reduced chunk is kept in the fp32 shard gradient before the next
microbatch's backward. Stage 1 keeps the whole gradient anyway and, as
DeepSpeed's ZeRO-1 and Megatron-Core's distributed optimizer, accumulates it
in place and reduce-scatters it in the last microbatch's backward.

The numerics of a microbatch's forward run once every unit's gather has
landed (a host computes the whole model at once: the pieces before the last
are charged while the gathers go on), those of its backward at its start
(the gathers before the backward's pieces are time and memory alone: the
values gathered in the forward are the same); a unit's chunks it does not own
are NaN again after its backward. A pass of several regions (an MoE layer's
exchanges cut it; under full recomputation each layer is one:
schemes/layer_recompute.py) is not cut: every unit is gathered before it and,
after the backward, reduce-scattered.

    overlap = UnitOverlap(optimizer, rank, UnitCosts(job.model))
    output = yield from overlap.during(action, cost, program)    # a schedule action's forward or backward
    yield from overlap.after(action)
"""
from typing import NamedTuple

from ..step_ops import Alloc, Await, Compute, Free
from .shard_units import UnitCosts


class _Pass(NamedTuple):
    """A microbatch's forward and backward as one region each, what UnitCosts cuts (cost.py's StepCost fields)."""

    forward_flops: float
    forward_kernels: int
    forward_ops: object
    backward_flops: float
    backward_kernels: int
    backward_ops: object
    grad_ready_flops: tuple


class UnitOverlap:
    """One rank's units, gathered and reduce-scattered beside the forward and backward of its one chunk."""

    def __init__(self, optimizer, rank: int, costs: UnitCosts):
        self.optimizer, self.rank, self.costs = optimizer, rank, costs
        self.units = len(costs.param_units)
        self.gathered = optimizer.stage == 3
        self.regather = self.gathered and optimizer.reshard_after_forward  # gathered again for the backward
        self.microbatches = optimizer.microbatches
        self._backwards = 0  # backwards run this step
        self._gather = None  # the posted gather the next unit's compute awaits
        self._reducing = None  # (unit, handle): the reduce-scatter in flight

    def new_step(self) -> None:
        """A new step (what a step cut short by a lost device left went with that device)."""
        self._backwards, self._gather, self._reducing = 0, None, None

    def during(self, action, cost, program):
        """Step program: `program`, the forward or backward of schedule action `action` (its chunk's measured
        `cost`: a ChunkCost, or under recomputation a list of them), with the units' collectives woven in."""
        if isinstance(cost, list) or len(cost.forward_flops) > 1 or not cost.grad_ready_flops:
            return (yield from self._whole(action, program))
        whole = _Pass(cost.forward_flops[0], cost.forward_kernels[0], cost.forward_ops[0], cost.backward_flops[0],
                      cost.backward_kernels[0], cost.backward_ops[0], cost.grad_ready_flops)
        if action.kind == "forward":
            return (yield from self._forward(action, whole, program))
        return (yield from self._backward(whole, program))

    def after(self, action):
        """Step program, after a backward: the microbatch's last reduce-scatter and its HSDP all-reduces awaited;
        stages 2 and 3 keep the reduced chunks before the next microbatch's backward."""
        if action.kind != "backward" or self._reducing is None:
            return
        yield from self._reduced(*self._reducing)
        self._reducing = None
        optimizer = self.optimizer
        for handle in optimizer.replicating(self.rank):
            yield Await(handle)
        if self._backwards < self.microbatches:  # stages 2 and 3: not the step's last microbatch
            shard = optimizer.scheme.replicas[self.rank]
            shard.keep_reduced(optimizer.dp)
            shard.grad_buffer.zero_()

    # ---- the pieces ----

    def _forward(self, action, whole: _Pass, program):
        """Step program: the forward unit by unit, each gathered first under stage 3; the numerics run once the
        last unit's gather has landed."""
        shard = self.optimizer.scheme.replicas[self.rank]
        x = shard.last_batch[0].chunk(self.microbatches)[action.microbatch]
        pieces = self.costs.forward(x, whole, shard.precision.name)
        if self.gathered:
            self._gather = yield from self.optimizer.post_gather(self.rank, 0)
        for unit, piece in enumerate(pieces):
            if self.gathered:
                yield Await(self._gather)
                following = unit + 1 if unit + 1 < self.units else (unit if self.regather else None)
                self._gather = None if following is None else (
                    yield from self.optimizer.post_gather(self.rank, following))
            if unit == self.units - 1:
                _expect(program.send(None), "forward")  # every unit whole: the numerics
            yield piece
            if self.regather:
                yield Free("comm_buffers", self.optimizer.unit_bytes(self.rank, unit))
        return _end(program)

    def _backward(self, whole: _Pass, program):
        """Step program: the backward unit by unit, last unit first (gathered again first under
        reshard_after_forward), each unit's reduce-scatter posted once the one before it has ended."""
        optimizer, rank = self.optimizer, self.rank
        self._backwards += 1
        reduce = self._backwards == self.microbatches or optimizer.stage >= 2
        shard = optimizer.scheme.replicas[rank]
        _expect(program.send(None), "backward")  # the numerics, on the parameters the forward gathered
        for position, piece in enumerate(self.costs.backward(whole, shard.precision.name)):
            unit = self.units - 1 - position
            if self.regather:
                yield Await(self._gather)
                self._gather = (yield from optimizer.post_gather(rank, unit - 1)) if unit > 0 else None
            if optimizer.stage >= 2:
                yield Alloc("comm_buffers", optimizer.unit_bytes(rank, unit, shard.grad_buffer))
            yield piece
            if self.gathered:
                shard.reshard(unit)
                yield Free("comm_buffers", optimizer.unit_bytes(rank, unit))
            if reduce:
                yield from self._post_reduce(unit)
        return _end(program)

    def _whole(self, action, program):
        """Step program (a pass of several regions): every unit gathered before the pass (the backward's only under
        reshard_after_forward) and, after the backward, every unit's gradient reduce-scattered."""
        optimizer, rank = self.optimizer, self.rank
        shard = optimizer.scheme.replicas[rank]
        backward = action.kind == "backward"
        gather = self.gathered and (self.regather or not backward)
        for unit in range(self.units) if gather else ():
            yield Await((yield from optimizer.post_gather(rank, unit)))
        value = yield from program
        for unit in range(self.units) if self.regather or (self.gathered and backward) else ():
            if backward:
                shard.reshard(unit)
            yield Free("comm_buffers", optimizer.unit_bytes(rank, unit))
        if backward:
            self._backwards += 1
            if self._backwards == self.microbatches or optimizer.stage >= 2:
                for unit in reversed(range(self.units)):
                    if optimizer.stage >= 2:
                        yield Alloc("comm_buffers", optimizer.unit_bytes(rank, unit, shard.grad_buffer))
                    yield from self._post_reduce(unit)
        return value

    # ---- the reduce-scatters ----

    def _post_reduce(self, unit: int):
        """Step program: the reduce-scatter before this one awaited (one in flight), unit `unit`'s posted."""
        if self._reducing is not None:
            yield from self._reduced(*self._reducing)
        self._reducing = (unit, (yield from self.optimizer.post_reduce(self.rank, unit)))

    def _reduced(self, unit: int, handle):
        """Step program: unit `unit`'s reduce-scatter awaited; what its end lets go (distributed_optimizer.py)."""
        yield Await(handle)
        yield from self.optimizer.reduced(self.rank, unit)


def _expect(op, name: str) -> None:
    """The one Compute a one-region chunk's pass yields (its numerics have run): the pieces stand for it."""
    if type(op) is not Compute or op.name != name:
        raise RuntimeError(f"a unit-cut {name} expects its chunk's one Compute, got {op!r}")


def _end(program):
    """The value of a pass whose one Compute has been taken: it has nothing left to yield."""
    try:
        op = program.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError(f"a unit-cut pass yielded {op!r} after its one Compute")
