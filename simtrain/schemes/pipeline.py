"""One pipeline stage's step: any schedule's actions, with activations and gradients as Send/Recv programs.

Each step the device batch is cut into m microbatches, and each stage runs its
actions in the order its schedule lists them (simtrain/parallel/schedules:
gpipe, 1f1b, interleaved, zero_bubble, dualpipev, a file), on the model parts
the schedule places on it (`Schedule.placement`: looped, or the V). Each
chunk's forward and backward run region by region with their tensor-parallel
all-reduces (schemes/stage_execution.py), or, with numerics off, are replayed
from their measured costs (unless hooks on the model read every pass: K-FAC's,
train/replica.py `run_every_step`). With SyncBN (data parallelism alone) a
forward action runs the forward's and the backward's numerics together,
exchanging BatchNorm statistics on the way (strategies/sync_batchnorm.py), and
both passes replay their measured compute. The actions:

- F: the chunk's forward; its output is sent on to the next part;
- B: its whole backward; its input gradient is sent back to the part before;
- I: the backward for the input gradient. The numerics of the whole backward
  run here (parameter gradients accumulate in the rank's bucket, as autograd
  would; they are only read at the update), but the clock charges only the
  input-gradient work: each region less its measured weight-gradient
  operators (schemes/weight_grads.py). The input gradient is sent at once;
- W: the weight-gradient work, charged now as one compute span. The
  data-parallel hooks (`before`, `during`, `after`) count a chunk's gradient
  as ready only after its W (or B), never after an I;
- an overlapped pair (DualPipe's F&B): as DualPipe runs it, both its inputs
  are received first, then the two passes run interleaved at their waits
  (`interleaved`): each runs until it waits on a communication it posted (an
  expert all-to-all, a tensor-parallel collective, a data-parallel hook's),
  and the other runs meanwhile. One device computes one kernel stream at a
  time, so what the pair buys is one pass's communication in flight behind
  the other's compute, which is what DualPipe's F&B overlap is for
  (DeepSeek-V3 report, section 3.2.1); the waits it leaves are the exposed
  communication.

Activations go forward, and their gradients back, as point-to-point programs
on the pipeline's communicator (comm/ops.py Send and Recv, matched in the one
mailbox per (src, dst, tag)):

- a stage posts every receive of a step at the start of the step before
  (`Post` of a Recv program into a buffer the size of the cut:
  model_parts.boundary_activations), as Megatron-LM posts its irecvs ahead;
- a send is a `Post` of a Send program: its bytes start to move at once (the
  receive is waiting) and the stage carries on (NCCL moves them on its own
  stream while the stage computes). The stage never awaits its own sends;
  its receiver does, and the interpreter completes them. So no schedule can
  deadlock on its sends, and a transfer hides behind the sender's compute.
  That is why sends and receives are no actions of a schedule: an explicit
  order could only delay a transfer;
- a receive is an `Await(handle, idle="bubble")`: the wait before the peer
  sent is the communicator's idle, logged as the pipeline bubble; the wait
  while the tensor moves is communication.

Each stage holds a microbatch's measured activation bytes from its forward
to its backward (GPipe holds m, 1F1B at most pp - s on stage s); split, the
part W reads (`ChunkCost.weight_held_bytes`) stays from I until W, and so do
the inputs I gathered again for W under sequence parallelism
(`weight_regathered_bytes`: schemes/weight_grads.py). Under full
recomputation (train.checkpointing: full, and sqrt or segments under tp, cp or
with MoE layers) only the input of each of the chunk's segments, and its
backward runs each segment's forward again, with its collectives, just before
that segment's backward (schemes/layer_recompute.py).

    stage = PipelineStage(scheme, rank, comm, index, boundaries)
    receives = yield from stage.post_receives(0)
    losses = yield from stage.walk(step, xs, ys, loss_weight, receives, tp_collective)
"""
from typing import NamedTuple

import torch

from ..comm.ops import Recv, Send
from ..parallel.schedules.actions import Overlapped, computations
from ..step_ops import Alloc, Await, Collective, Free, Post
from .layer_recompute import kept_bytes, layers_backward, layers_forward, weight_pass
from .stage_execution import chunk_backward, chunk_forward, held_whole, replay_backward, replay_forward
from .weight_grads import input_gradient_part, kept_for_weights, weight_gradient_compute

HOOK_KINDS = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}


class Work(NamedTuple):
    """A schedule action as the data-parallel hooks see it: its kind (forward, backward, backward_input,
    backward_weight), its microbatch and the rank's chunk it runs."""

    kind: str
    microbatch: int
    chunk: int


class PipelineStage:
    """Job rank `rank`'s stage of its pipeline (group rank `index` of the pipeline's communicator `comm`)."""

    def __init__(self, scheme, rank: int, comm, index: int, boundaries: list):
        self.scheme, self.rank = scheme, rank
        self.replica = scheme.replicas[rank]
        layout = scheme.layout
        self.pp, self.stage = layout.pp, layout.coordinates(rank)["pp"]
        self.schedule = scheme.schedule
        self.held = self.schedule.placement[self.stage]  # its parts, chunk by chunk
        self.actions = [action for step in self.schedule.actions[self.stage] for action in computations(step)]
        self.parts = self.schedule.parts
        self.microbatches = scheme.microbatches
        self.comm, self.index, self.boundaries = comm, index, boundaries
        self.numerics = not self.replica.replays  # the ops run: numerics on, or hooks read every pass (K-FAC's)
        self.recompute = self.replica.model.segmented  # recomputed segment by segment (layer_recompute.py)
        self.recompute_last = self.replica.model.recompute_last
        self.synced_batchnorm = scheme.synced_batchnorm  # SyncBN's exchanges (sync_batchnorm.py), or None
        self.handed: dict[tuple, torch.Tensor] = {}  # what a part hands a part of the same rank (the V's turn)

    def walk(self, step: int, xs, ys, loss_weight, receives: dict, tp_collective):
        """Step program: the actions of step `step`'s microbatches `xs` (targets `ys`) in schedule order;
        returns the losses this stage computed (the last part's, one per microbatch)."""
        pending, weights, losses = {}, {}, []
        run = (step, xs, ys, loss_weight, receives, tp_collective, pending, weights, losses)
        for entry in self.schedule.actions[self.stage]:
            if type(entry) is Overlapped:
                for action in entry:  # DualPipe receives both inputs, then computes the pair
                    yield from self._receive_ahead(step, action, receives)
                yield from interleaved(self._act(entry.forward, *run), self._act(entry.backward, *run))
            else:
                yield from self._act(entry, *run)
        return losses

    def _act(self, action, step, xs, ys, loss_weight, receives, tp_collective, pending, weights, losses):
        """Step program: one action, between the data-parallel hooks (parameters gathered, gradients reduced)."""
        sharded = self.scheme.data_parallel
        chunk = self.held.index(action.part)
        work = Work(HOOK_KINDS[action.kind], action.microbatch, chunk)
        yield from sharded.before(self.rank, work)
        if action.kind == "F":
            pending[action.microbatch, chunk] = yield from self._forward(step, work, action.part, xs, ys,
                                                                         loss_weight, receives, tp_collective,
                                                                         losses)
        elif action.kind == "W":
            cost = weights.pop((action.microbatch, chunk))
            yield from sharded.during(self.rank, work, cost, self._weight(cost))
        else:
            kept = yield from self._backward(step, work, action.part, pending.pop((action.microbatch, chunk)),
                                             loss_weight, receives, tp_collective)
            if action.kind == "I":
                weights[action.microbatch, chunk] = kept
        yield from sharded.after(self.rank, work)

    def _forward(self, step, work: Work, part: int, xs, ys, loss_weight, receives, tp_collective, losses):
        """Step program: a chunk's forward of a microbatch, its output sent on; returns what its backward needs."""
        replica, dtype, sharded = self.replica, self.replica.precision.name, self.scheme.data_parallel
        ops = replica.model.ops[work.chunk]
        last = part == self.parts - 1
        if part == 0:
            inputs = (xs[work.microbatch],)
        else:
            received = yield from self.receive(step, 0, work.microbatch, part, receives)
            inputs = (received.requires_grad_(),)
        target = ys[work.microbatch] if last else None
        loss = None
        if self.synced_batchnorm is not None:  # SyncBN: forward and backward run now, exchanging statistics
            loss = yield from self.synced_batchnorm.forward_backward(self.rank, replica.model.chunks[work.chunk],
                                                                     *inputs, target)
        if self.recompute:  # each segment's input kept, its forward run again in the backward
            cost = self.scheme.layer_costs(replica, work.chunk, part, inputs, target)
            held = kept_bytes(cost, inputs, self.recompute_last)
            yield Alloc("activations", sum(held))
            tape, output, loss = yield from sharded.during(self.rank, work, cost, layers_forward(
                replica.model.layers[work.chunk], cost, inputs, tp_collective, dtype, target, loss_weight,
                self.numerics, self.recompute_last))
        else:
            cost = self.scheme.cost(replica, work.chunk, part, inputs, target)
            held = held_whole(cost)  # an MoE layer's experts hold theirs apart, by the tokens they received
            yield Alloc("activations", held)
            if self.numerics and self.synced_batchnorm is None:
                outputs, tape, loss = yield from sharded.during(self.rank, work, cost, chunk_forward(
                    ops, inputs, tp_collective, cost, dtype, target, loss_weight))
                output = outputs[0].detach()
            else:  # its compute replayed: numerics off, or run already (SyncBN)
                tape = None
                output = yield from sharded.during(self.rank, work, cost, replay_forward(cost, tp_collective, dtype))
        if last:
            losses.append(loss)
        else:
            yield from self.send(step, 0, work.microbatch, part + 1, output)
        return target, tape, cost, held

    def _backward(self, step, work: Work, part: int, forward, loss_weight, receives, tp_collective):
        """Step program: a chunk's backward of a microbatch (B; or I, charging only its input-gradient work), its
        input gradient sent back; returns, for an I, the cost its W charges."""
        replica, dtype, sharded = self.replica, self.replica.precision.name, self.scheme.data_parallel
        target, tape, cost, held = forward
        grads = None
        if part < self.parts - 1:
            grads = ((yield from self.receive(step, 1, work.microbatch, part, receives)),)
        if self.recompute:
            input_grad = yield from sharded.during(self.rank, work, cost, layers_backward(
                replica.model.layers[work.chunk], cost, tape, grads, tp_collective, dtype, target,
                loss_weight, self.numerics, held, self.recompute_last, work.kind == "backward_input"))
        else:
            charged = input_gradient_part(cost) if work.kind == "backward_input" else cost
            if tape is not None:
                input_grad = (yield from sharded.during(self.rank, work, cost, chunk_backward(
                    tape, grads, tp_collective, charged, dtype)))[0]
            else:
                input_grad = yield from sharded.during(self.rank, work, cost,
                                                       replay_backward(charged, tp_collective, dtype))
            if work.kind == "backward_input" and cost.weight_regathered_bytes:  # the inputs it gathered, for W
                yield Alloc("activations", cost.weight_regathered_bytes)
            yield Free("activations", held - cost.weight_held_bytes if work.kind == "backward_input" else held)
        if part > 0:
            yield from self.send(step, 1, work.microbatch, part - 1, input_grad)
        return cost

    def _weight(self, cost):
        """Step program: a W pass, the weight-gradient work its I left, and the activations only it read let go
        (a recomputed chunk: every segment's, layer_recompute.py)."""
        if isinstance(cost, list):
            yield from weight_pass(cost, self.replica.precision.name)
            return
        yield weight_gradient_compute(cost, self.replica.precision.name)
        yield Free("activations", kept_for_weights(cost))

    def tag(self, step: int, direction: int, microbatch: int, part: int) -> int:
        """A message's tag: its step's parity (a stage has two steps' receives posted), direction (0 forward,
        1 backward), microbatch and receiving model part."""
        return ((step % 2 * 2 + direction) * self.microbatches + microbatch) * self.parts + part

    def post_receives(self, step: int):
        """Step program: post every receive of step `step`; returns {(step, direction, microbatch, part):
        handle}. Posted a step ahead, before any peer can send them, a send never waits for its receiver."""
        handles = {}
        if self.pp == 1:
            return handles
        for action in self.actions:
            part = action.part
            if action.kind == "W":
                continue
            direction, peer_part = (0, part - 1) if action.kind == "F" else (1, part + 1)
            if not 0 <= peer_part < self.parts or self.schedule.rank_of(peer_part) == self.stage:
                continue
            like = self.boundaries[min(part, peer_part)]  # an activation, or the gradient that comes back for it
            out = torch.empty(like.shape, dtype=like.dtype, device="cpu" if self.scheme.job.numerics else "meta")
            handles[step, direction, action.microbatch, part] = yield Post(
                _receive(self.schedule.rank_of(peer_part), out, self.tag(step, direction, action.microbatch, part)),
                "pp_p2p", self.comm, self.index)
        return handles

    def send(self, step: int, direction: int, microbatch: int, part: int, tensor: torch.Tensor):
        """Step program: send `tensor` to model part `part` without waiting (torch's isend); to a part of this
        rank (the turn of a V), hand it over."""
        rank = self.schedule.rank_of(part)
        if rank == self.stage:
            self.handed[step, direction, microbatch, part] = tensor.detach()
            return
        yield Post(_send(rank, tensor, self.tag(step, direction, microbatch, part)), "pp_p2p", self.comm, self.index)

    def _receive_ahead(self, step: int, action, receives: dict):
        """Step program: what `action` receives from another rank, waited for now and handed to it."""
        direction = 0 if action.kind == "F" else 1
        if direction == 0 and action.part == 0 or direction == 1 and action.part == self.parts - 1:
            return
        key = (step, direction, action.microbatch, action.part)
        if key not in self.handed:
            self.handed[key] = yield from self.receive(step, direction, action.microbatch, action.part, receives)

    def receive(self, step: int, direction: int, microbatch: int, part: int, receives: dict):
        """Step program: what model part `part` receives (posted by post_receives, or handed over on this rank);
        the wait before the peer sent it is the bubble."""
        key = (step, direction, microbatch, part)
        if key in self.handed:
            return self.handed.pop(key)
        return (yield Await(receives.pop(key), idle="bubble"))


def _send(peer: int, tensor: torch.Tensor, tag: int):
    """A stage's point-to-point program: send `tensor` to pipeline rank `peer`."""
    yield Send(peer, tensor, tag)


def _receive(peer: int, out: torch.Tensor, tag: int):
    """A stage's point-to-point program: receive into `out` from pipeline rank `peer`; returns it."""
    return (yield Recv(peer, out, tag=tag))


def interleaved(first, second):
    """Step program: two step programs run as DualPipe runs a forward and a backward together. Each runs until it
    waits on a communication (an `Await` of what it posted, or a blocking `Collective`, posted here and then
    awaited); then the other runs, and the waits are taken in the order they were reached. The order of every
    post and wait follows from the two programs alone, never from the clock, so every rank of a group posts its
    collectives in one order."""
    programs, values = (first, second), [None, None]
    ready, parked = [0, 1], []  # programs free to run, the first next; (program, its wait, collective?) in order
    while ready or parked:
        if not ready:
            index, wait, blocking = parked.pop(0)
            values[index] = yield wait
            if blocking:  # what the collective's yield answers: its communication seconds
                values[index] = wait.handle.charged_s
            ready.append(index)
            continue
        index = ready[0]
        try:
            op = programs[index].send(values[index])
        except StopIteration:
            ready.pop(0)
            continue
        if type(op) is Collective:
            parked.append((index, Await((yield Post(*op))), True))
            ready.pop(0)
        elif type(op) is Await:
            parked.append((index, op, False))
            ready.pop(0)
        else:
            values[index] = yield op
