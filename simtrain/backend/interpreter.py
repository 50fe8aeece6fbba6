"""The simulated interpreter of step programs (simtrain/step_ops.py): each operation charged on the cluster.

`run_program(job, rank, program)` is a simpy process body that charges each
operation of job rank `rank`'s program on the cluster's clock, network and
ledgers: compute and memory-bound work on the device's stream, collective and
point-to-point programs on the job's communicators (comm/simulated.py: the
one mailbox), allocations on the device's ledger. It runs the loop every
interpreter shares (step_ops.drive) with a handler for every operation of the
vocabulary. Interrupting its process (a lost device, a job torn down for a
restart: recovery.py) closes the program where it stands. The simulated run
and the memory plan (memory_plan.py, the same programs on meta tensors with no
capacity limit) both run through it, so a step is described once.

    job.cluster.env.process(run_program(job, rank, scheme.program(rank)))
"""
import simpy
from simpy.core import URGENT

from ..step_ops import (Alloc, Await, Busy, Collective, Compute, Free, MemoryBound, Post, PostCollective, Transfer,
                        Wait, WaitCollectives, drive, immediate)


class _Simulated:
    """The handlers of one rank's program: every operation of the vocabulary, charged on the cluster."""

    def __init__(self, job, rank: int):
        self.job, self.rank = job, rank
        self.device = job.devices[rank]
        self.log, self.env = job.cluster.log, job.cluster.env
        # per communicator (a process group, with its own NCCL stream): the event of the last collective posted
        # on it; a group's collectives run one after another, two groups' side by side
        self.posted = {}
        self.handlers = {Compute: self.compute, Alloc: immediate(self.alloc), Free: immediate(self.free),
                         Collective: self.collective, Post: immediate(self.post), Await: self.await_,
                         PostCollective: immediate(self.post_collective), WaitCollectives: self.wait_collectives,
                         MemoryBound: self.memory_bound, Busy: self.busy, Transfer: self.transfer, Wait: self.wait}

    def compute(self, op: Compute):
        yield self.device.compute(op.flops, op.dtype, op.name, kind=op.kind, kernels=op.kernels, ops=op.ops,
                                  sm_margin=op.sm_margin, passes=op.passes)

    def alloc(self, op: Alloc):
        self.device.memory.alloc(op.category, op.nbytes)

    def free(self, op: Free):
        self.device.memory.free(op.category, op.nbytes)

    def _comm(self, op):
        """The communicator an operation names and the rank's index in it."""
        return (self.job.comm, self.rank) if op.comm is None else (op.comm, op.rank)

    def collective(self, op: Collective):
        before = self.log.total(self.device.rank, "communication")
        comm, index = self._comm(op)
        yield comm.run(index, op.program, label=op.label)
        return self.log.total(self.device.rank, "communication") - before

    def post(self, op: Post):
        comm, index = self._comm(op)
        return comm.post(index, op.program, label=op.label)

    def await_(self, op: Await):
        pending = op.handle.comm.wait(op.handle, op.idle)
        return None if pending is None else (yield pending)  # None: a mirrored collective that has ended

    def post_collective(self, op: PostCollective):
        if not self.posted:
            self.log.track_overlap(self.device.rank)
        comm, index = self._comm(op)
        self.posted[comm] = _after(self.env, self.posted.get(comm), comm, index, op)

    def wait_collectives(self, op: WaitCollectives):
        for ended in self.posted.values():  # in the order the streams were first posted to
            yield ended

    def memory_bound(self, op: MemoryBound):
        yield self.device.memory_bound(op.nbytes, op.name, kind=op.kind, kernels=op.kernels, updates=op.updates)

    def busy(self, op: Busy):
        if op.staging:
            self.device.memory.alloc("comm_buffers", op.staging)
            self.device.memory.free("comm_buffers", op.staging)
        yield self.device.run_for(op.seconds, op.name, kind=op.kind, nbytes=op.nbytes)

    def transfer(self, op: Transfer):
        started = self.env.now
        yield self.job.cluster.network.transfer(op.src, op.dst, op.nbytes, label=op.label)
        self.log.span(self.device.rank, "communication", op.label, started, self.env.now, nbytes=op.nbytes)
        return self.env.now - started

    def wait(self, op: Wait):
        return (yield op.event)


def run_program(job, rank: int, program):
    """Simpy process body: interpret `program`, job rank `rank`'s operations, on the job's cluster."""
    try:
        return (yield from drive(program, _Simulated(job, rank).handlers))
    except simpy.Interrupt:  # the device was lost, or its job torn down: the program ends where it stands
        program.close()


def _after(env: simpy.Environment, previous: simpy.Event | None, comm, rank: int, op: PostCollective) -> simpy.Event:
    """The communication stream: `op`'s collective starts once the one posted before it (`previous`, the event
    this returned for it) has ended; the event returned fires once `op`'s has ended.

    It is what a simpy process `yield previous; yield comm.run(...)` does, in plain callbacks (without the
    process, its generator and its two resumptions per collective per rank): the same events, scheduled at
    the same moments, so the clock's order is the same to the event (tests/test_overlap.py replays it
    against the process). A process starts in an urgent event
    now; it resumes when the event it waits on is processed; its own event fires (normal priority, now)
    once the collective's has been processed."""
    ended = simpy.Event(env)

    def start(_=None):
        comm.run(rank, op.program, label=op.label).callbacks.append(lambda _: ended.succeed())

    def begin(_):
        if previous is None or previous.callbacks is None:  # none posted before, or it has ended
            start()
        else:
            previous.callbacks.append(start)

    initialize = simpy.Event(env)
    initialize._ok, initialize._value = True, None
    initialize.callbacks.append(begin)
    env.schedule(initialize, URGENT)
    return ended
