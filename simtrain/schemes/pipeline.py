"""One pipeline stage's step: the schedule walk, with activations and gradients as Send/Recv programs.

Each step the device batch is cut into m microbatches, and each stage runs its
forwards and backwards in the order of the schedule
(schemes/pipeline_schedule.py: gpipe, 1f1b, interleaved); a rank with v
chunks runs model parts s, s + pp, ... Each chunk's forward and backward run
region by region with their tensor-parallel all-reduces
(schemes/stage_execution.py), or, with numerics off, are replayed from their
measured costs.

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
  deadlock on its sends, and a transfer hides behind the sender's compute;
- a receive is an `Await(handle, idle="bubble")`: the wait before the peer
  sent is the communicator's idle, logged as the pipeline bubble; the wait
  while the tensor moves is communication.

Each stage holds a microbatch's measured activation bytes from its forward
to its backward (GPipe holds m, 1F1B at most pp - s on stage s); under full
recomputation (train.checkpointing: full) only the input of each of the chunk's
units, and its backward runs each unit's forward again, with its all-reduces,
just before that unit's backward (schemes/layer_recompute.py).

    stage = PipelineStage(scheme, rank, comm, index, boundaries)
    receives = yield from stage.post_receives(0)
    losses = yield from stage.walk(step, xs, ys, loss_weight, receives, tp_collective)
"""
import torch

from ..comm.ops import Recv, Send
from ..step_ops import Alloc, Await, Free, Post
from .pipeline_schedule import pipeline_schedule
from .layer_recompute import kept_bytes, layers_backward, layers_forward
from .stage_execution import chunk_backward, chunk_forward, replay_backward, replay_forward


class PipelineStage:
    """Job rank `rank`'s stage of its pipeline (group rank `index` of the pipeline's communicator `comm`)."""

    def __init__(self, scheme, rank: int, comm, index: int, boundaries: list):
        self.scheme, self.rank = scheme, rank
        self.replica = scheme.replicas[rank]
        layout = scheme.layout
        self.pp, self.stage = layout.pp, layout.coordinates(rank)["pp"]
        self.chunks = len(self.replica.model.chunks)
        self.parts = self.pp * self.chunks
        self.microbatches = scheme.microbatches
        self.schedule = pipeline_schedule(scheme.pipeline.schedule, self.pp, self.stage, self.microbatches,
                                          self.chunks)
        self.comm, self.index, self.boundaries = comm, index, boundaries
        self.numerics = scheme.job.numerics
        self.recompute = scheme.recompute

    def walk(self, step: int, xs, ys, loss_weight, receives: dict, tp_collective):
        """Step program: the forwards and backwards of step `step`'s microbatches `xs` (targets `ys`) in
        schedule order; returns the losses this stage computed (the last stage's, one per microbatch)."""
        replica, dtype = self.replica, self.replica.precision.name
        pending, losses = {}, []
        sharded = self.scheme.data_parallel  # its hooks: parameters gathered, gradients reduced, around the work
        for action in self.schedule:
            part = action.chunk * self.pp + self.stage
            ops = replica.model.ops[action.chunk]
            yield from sharded.before(self.rank, action)
            if action.kind == "forward":
                last = part == self.parts - 1
                if part == 0:
                    inputs = (xs[action.microbatch],)
                else:
                    received = yield Await(receives.pop((step, 0, action.microbatch, part)), idle="bubble")
                    inputs = (received.requires_grad_(),)
                target = ys[action.microbatch] if last else None
                if self.recompute:  # each unit's input kept, its forward run again in the backward
                    cost = self.scheme.layer_costs(replica, action.chunk, part, inputs, target)
                    held = kept_bytes(cost, inputs)
                    yield Alloc("activations", sum(held))
                    tape, output, loss = yield from sharded.during(self.rank, action, cost, layers_forward(
                        replica.model.layers[action.chunk], cost, inputs, tp_collective, dtype, target, loss_weight,
                        self.numerics))
                else:
                    cost = self.scheme.cost(replica, action.chunk, part, inputs, target)
                    held = cost.activation_bytes
                    yield Alloc("activations", held)
                    if self.numerics:
                        outputs, tape, loss = yield from sharded.during(self.rank, action, cost, chunk_forward(
                            ops, inputs, tp_collective, cost, dtype, target, loss_weight))
                        output = outputs[0].detach()
                    else:
                        tape, loss = None, None
                        output = yield from sharded.during(self.rank, action, cost,
                                                           replay_forward(cost, tp_collective, dtype))
                pending[action.microbatch, action.chunk] = (target, tape, cost, held)
                if last:
                    losses.append(loss)
                else:
                    yield self.send(step, 0, action.microbatch, part + 1, output)
            else:
                target, tape, cost, held = pending.pop((action.microbatch, action.chunk))
                grads = None
                if part < self.parts - 1:
                    grads = ((yield Await(receives.pop((step, 1, action.microbatch, part)), idle="bubble")),)
                if self.recompute:
                    input_grad = yield from sharded.during(self.rank, action, cost, layers_backward(
                        replica.model.layers[action.chunk], cost, tape, grads, tp_collective, dtype, target,
                        loss_weight, self.numerics, held))
                else:
                    if self.numerics:
                        input_grad = (yield from sharded.during(self.rank, action, cost, chunk_backward(
                            tape, grads, tp_collective, cost, dtype)))[0]
                    else:
                        input_grad = yield from sharded.during(self.rank, action, cost,
                                                               replay_backward(cost, tp_collective, dtype))
                    yield Free("activations", held)
                if part > 0:
                    yield self.send(step, 1, action.microbatch, part - 1, input_grad)
            yield from sharded.after(self.rank, action)
        return losses

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
        for action in self.schedule:
            part = action.chunk * self.pp + self.stage
            direction, peer_part = (0, part - 1) if action.kind == "forward" else (1, part + 1)
            if not 0 <= peer_part < self.parts:
                continue
            like = self.boundaries[min(part, peer_part)]  # an activation, or the gradient that comes back for it
            out = torch.empty(like.shape, dtype=like.dtype, device="cpu" if self.numerics else "meta")
            handles[step, direction, action.microbatch, part] = yield Post(
                _receive(peer_part % self.pp, out, self.tag(step, direction, action.microbatch, part)), "pp_p2p",
                self.comm, self.index)
        return handles

    def send(self, step: int, direction: int, microbatch: int, part: int, tensor: torch.Tensor) -> Post:
        """Step-program operation: send `tensor` to model part `part` without waiting (torch's isend)."""
        return Post(_send(part % self.pp, tensor, self.tag(step, direction, microbatch, part)), "pp_p2p",
                    self.comm, self.index)


def _send(peer: int, tensor: torch.Tensor, tag: int):
    """A stage's point-to-point program: send `tensor` to pipeline rank `peer`."""
    yield Send(peer, tensor, tag)


def _receive(peer: int, out: torch.Tensor, tag: int):
    """A stage's point-to-point program: receive into `out` from pipeline rank `peer`; returns it."""
    return (yield Recv(peer, out, tag=tag))
