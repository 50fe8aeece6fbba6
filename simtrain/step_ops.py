"""The step-op vocabulary: the operations a rank's step program yields, and the driver loop its interpreters share.

A scheme describes each rank's training as one program: a generator that
yields the operations below and does its own torch numerics in between
(forward, backward, the optimizer step), like a training loop written
against a device and a process group. The operations are the only way a
step touches time, memory or another rank:

- `Compute(flops, dtype, name, kind, kernels, ops, sm_margin)`: work of `kernels` kernels on the
  device's compute stream; `ops`, its operators' (FLOPs, bytes, count, rate dtype, kernel) groups
  (op_cost.py), is what a device under `compute_model: roofline` or `kernels` charges (under every model, an
  operator of another rate dtype than `dtype` is charged at its own rate);
  `sm_margin`, the streaming multiprocessors a communication kernel beside it
  holds (the work runs on the device's others: hw/device.py);
- `MemoryBound(nbytes, name, kind, kernels)`: work bound by HBM bandwidth (an update);
- `Busy(seconds, name, kind, nbytes)`: the device waits a fixed time on its
  stream (a sampler's host bookkeeping, the store applying an update);
- `Alloc(category, nbytes)` / `Free(category, nbytes)`: the device's ledger;
- `Collective(program, label, comm=None, rank=None)`: a collective program
  (simtrain/comm) on the job's communicator, or on a sub-group's `comm` as
  its rank `rank` (a pipeline's, a tensor-parallel group's); the yield
  returns the communication seconds credited to this rank for it (time with
  a transfer of its own in flight);
- `Post(program, label, comm=None, rank=None)`: the same, without blocking
  (torch's isend / irecv): the program starts on the communicator and runs
  beside the rank's program, which is charged nothing for it; the yield
  returns a handle;
- `Await(handle, idle=None)`: the rank waits until the posted program has
  ended (torch's `work.wait()`); the yield returns the program's value, and
  the handle's `charged_s` then holds the communication seconds credited for
  it. Time with a transfer of the program in flight is communication; time
  waiting for a peer to post its side is idle, logged as a span of kind
  `idle` when named (a pipeline's "bubble");
- `PostCollective(program, label, comm=None, rank=None)`: a collective
  program (on the job's communicator, or on sub-group `comm` as rank `rank`)
  that runs on the rank's stream of that communicator while the program
  carries on (DDP's bucket all-reduce during the backward): the collectives
  posted on one communicator run one after another, in posting order, as
  NCCL's kernels do on a process group's stream; two communicators' run side
  by side;
- `WaitCollectives()`: the rank waits until every collective it posted has
  ended (DDP finalizing the backward);
- `Transfer(src, dst, nbytes, label)`: bytes between two network nodes that
  are not both ranks of the job (a worker and the shared-memory store); the
  yield returns its seconds, credited as communication;
- `Wait(event)`: a point of synchronization of the scheme itself (a lock, an
  update landing on the store).

An interpreter is a table from operation type to a handler; `drive(program,
handlers)` is the one loop every interpreter runs. A handler is a generator:
the simulated interpreter's yield simpy events (backend/interpreter.py), the real
one's never yield (simtrain/real/interpreter.py). An operation missing from
an interpreter's table is refused with `UnsupportedOperation`, naming it.

    def program(rank):
        yield Alloc("weights", 4096)
        handle = yield Post(send_program, "pp_p2p", comm, rank)
        yield Compute(2e9, "fp32", "forward")
        yield Await(handle)
"""
from typing import NamedTuple


class Compute(NamedTuple):
    flops: float
    dtype: str
    name: str
    kind: str = "compute"
    kernels: int = 0  # torch operators the work dispatches (a device's kernel_overhead is charged on each)
    ops: tuple | None = None  # its operators' OpCosts (op_cost.py); None: unmeasured, charged by FLOPs alone
    # streaming multiprocessors a communication kernel holds while it runs (Transformer Engine's num_sm with
    # set_sm_margin): the work runs on the device's others; 0: on all of them
    sm_margin: int = 0
    passes: int = 0  # passes over the model it starts: 1 on a forward, on a backward's first piece (pass_overhead)


class MemoryBound(NamedTuple):
    nbytes: float
    name: str
    kind: str
    kernels: int = 0  # torch operators the work dispatches (a device's kernel_overhead is charged on each)
    updates: int = 0  # optimizer steps it is: 1 on one (a device's update_overhead is charged on each)


class Busy(NamedTuple):
    seconds: float
    name: str
    kind: str
    nbytes: float = 0
    staging: int = 0  # bytes a collective's receive stages in comm_buffers for an instant (representatives.py)


class Alloc(NamedTuple):
    category: str
    nbytes: int


class Free(NamedTuple):
    category: str
    nbytes: int


class Collective(NamedTuple):
    program: object  # a per-rank collective program (simtrain/comm/ops.py)
    label: str
    comm: object = None  # the communicator of a sub-group of the job; None: the job's own
    rank: int | None = None  # the rank's index in that sub-group


class Post(NamedTuple):
    program: object  # a per-rank collective or point-to-point program (simtrain/comm/ops.py)
    label: str
    comm: object = None  # the communicator of a sub-group of the job; None: the job's own
    rank: int | None = None  # the rank's index in that sub-group


class Await(NamedTuple):
    handle: object  # what a Post returned
    idle: str | None = None  # the span kind of the wait for a peer to post ("bubble"); None: left idle


class PostCollective(NamedTuple):
    program: object
    label: str
    comm: object = None  # the communicator of a sub-group of the job; None: the job's own
    rank: int | None = None  # the rank's index in that sub-group


class WaitCollectives(NamedTuple):
    pass


class Transfer(NamedTuple):
    src: str
    dst: str
    nbytes: int
    label: str


class Wait(NamedTuple):
    event: object  # a simpy event


class UnsupportedOperation(TypeError):
    """A step program yielded an operation its interpreter does not run."""


def immediate(function):
    """A handler that does its work at once: `function(op)` is what the program's yield returns."""
    def handler(op):
        return function(op)
        yield  # a generator, as drive expects

    return handler


def drive(program, handlers: dict):
    """Generator: run `program` to its end, each operation by `handlers[type(op)]` (a generator whose return
    value is what the program's yield returns); returns the program's value."""
    value = None
    while True:
        try:
            op = program.send(value)
        except StopIteration as stop:
            return stop.value
        handler = handlers.get(type(op))
        if handler is None:
            raise UnsupportedOperation(f"a step program yielded {type(op).__name__}, which this interpreter does "
                                       f"not run (it runs {', '.join(kind.__name__ for kind in handlers)})")
        value = yield from handler(op)
