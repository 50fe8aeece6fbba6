"""Step programs: what a rank does in training, as operations, and their interpreter on the cluster.

A scheme describes each rank's training as one program: a generator that
yields the operations below and does its own torch numerics in between
(forward, backward, the optimizer step), like a training loop written
against a device and a process group. The operations are the only way a
step touches time or memory:

- `Compute(flops, dtype, name, kind, kernels)`: work of `kernels` kernels on the
  device's compute stream;
- `MemoryBound(nbytes, name, kind, kernels)`: work bound by HBM bandwidth (an update);
- `Busy(seconds, name, kind, nbytes)`: the device waits a fixed time on its
  stream (a sampler's host bookkeeping, the store applying an update);
- `Alloc(category, nbytes)` / `Free(category, nbytes)`: the device's ledger;
- `Collective(program, label, comm=None, rank=None)`: a collective program
  (simtrain/comm) on the job's communicator, or on a sub-group's `comm` as
  its rank `rank` (a pipeline's, a tensor-parallel group's); the yield
  returns the communication seconds credited to this rank for it (time with
  a transfer of its own in flight);
- `PostCollective(program, label)`: a collective program on the job's
  communicator that runs on the rank's communication stream while the
  program carries on (DDP's bucket all-reduce during the backward): posted
  collectives run one after another, in posting order;
- `WaitCollectives()`: the rank waits until every collective it posted has
  ended (DDP finalizing the backward);
- `Transfer(src, dst, nbytes, label)`: bytes between two network nodes that
  are not both ranks of the job (a worker and the shared-memory store); the
  yield returns its seconds, credited as communication;
- `PostTransfer(src, dst, nbytes, label)`: bytes start to move between two
  network nodes and the program carries on (a non-blocking send); the yield
  returns the simpy event of their arrival;
- `Wait(event)`: a point of synchronization of the scheme itself (a lock, an
  update landing on the store, a pipeline message arriving).

`run_program(job, rank, program)` is the simulated interpreter: a simpy
process body that charges each operation on the cluster's clock, network and
ledgers. Interrupting its process (a lost device, a job torn down for a
restart: recovery.py) closes the program where it stands. The simulated run and the memory plan (memory_plan.py, the same
programs on meta tensors with no capacity limit) both run through it, so a
step is described once.

    job.cluster.env.process(run_program(job, rank, scheme.program(rank)))
"""
from typing import NamedTuple

import simpy


class Compute(NamedTuple):
    flops: float
    dtype: str
    name: str
    kind: str = "compute"
    kernels: int = 0  # torch operators the work dispatches (a device's kernel_overhead is charged on each)


class MemoryBound(NamedTuple):
    nbytes: float
    name: str
    kind: str
    kernels: int = 0  # torch operators the work dispatches (a device's kernel_overhead is charged on each)


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
    comm: object = None  # the SimCommunicator of a sub-group of the job; None: the job's own
    rank: int | None = None  # the rank's index in that sub-group


class PostCollective(NamedTuple):
    program: object
    label: str


class WaitCollectives(NamedTuple):
    pass


class Transfer(NamedTuple):
    src: str
    dst: str
    nbytes: int
    label: str


class PostTransfer(NamedTuple):
    src: str
    dst: str
    nbytes: int
    label: str


class Wait(NamedTuple):
    event: simpy.Event


def run_program(job, rank: int, program):
    """Simpy process body: interpret `program`, job rank `rank`'s operations, on the job's cluster."""
    device = job.devices[rank]
    memory, log, env = device.memory, job.cluster.log, job.cluster.env
    value = None
    posted = None  # the event of the last collective posted on the communication stream
    try:
        while True:
            try:
                op = program.send(value)
            except StopIteration as stop:
                return stop.value
            kind = type(op)
            value = None
            if kind is Compute:
                yield device.compute(op.flops, op.dtype, op.name, kind=op.kind, kernels=op.kernels)
            elif kind is Alloc:
                memory.alloc(op.category, op.nbytes)
            elif kind is Free:
                memory.free(op.category, op.nbytes)
            elif kind is Collective:
                before = log.total(device.rank, "communication")
                if op.comm is None:
                    yield job.comm.run(rank, op.program, label=op.label)
                else:
                    yield op.comm.run(op.rank, op.program, label=op.label)
                value = log.total(device.rank, "communication") - before
            elif kind is PostCollective:
                if posted is None:
                    log.track_overlap(device.rank)
                posted = env.process(_after(posted, job.comm, rank, op))
            elif kind is WaitCollectives:
                if posted is not None:
                    yield posted
            elif kind is MemoryBound:
                yield device.memory_bound(op.nbytes, op.name, kind=op.kind, kernels=op.kernels)
            elif kind is Busy:
                if op.staging:
                    memory.alloc("comm_buffers", op.staging)
                    memory.free("comm_buffers", op.staging)
                yield device.run_for(op.seconds, op.name, kind=op.kind, nbytes=op.nbytes)
            elif kind is Transfer:
                started = env.now
                yield job.cluster.network.transfer(op.src, op.dst, op.nbytes, label=op.label)
                value = env.now - started
                log.span(device.rank, "communication", op.label, started, env.now, nbytes=op.nbytes)
            elif kind is PostTransfer:
                value = job.cluster.network.transfer(op.src, op.dst, op.nbytes, label=op.label)
            elif kind is Wait:
                value = yield op.event
            else:
                raise TypeError(f"a step program yielded {op!r}, not an operation of schemes/program.py")
    except simpy.Interrupt:  # the device was lost, or its job torn down: the program ends where it stands
        program.close()


def _after(previous, comm, rank: int, op: PostCollective):
    """The communication stream: `op`'s collective starts once the one posted before it has ended."""
    if previous is not None:
        yield previous
    yield comm.run(rank, op.program, label=op.label)
