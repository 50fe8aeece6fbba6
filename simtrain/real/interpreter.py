"""A rank's step program run for real, its spans timed by the host clock.

The schemes describe a rank's training once, as a step program
(simtrain/step_ops.py): a generator that does its torch numerics itself and
yields operations. The simulator charges each operation on a virtual clock;
this interpreter runs the same program in a process of a real
torch.distributed group, through the driver loop they share (step_ops.drive):

- `Collective`: its comm program runs on its communicator (the job's, or a
  sub-group's: comm/gloo.py GlooCommunicator, each its own process group; with
  `--collective native` an all-reduce is one `dist.all_reduce`, real/backend.py).
  Its host-clock span is the rank's communication, of which the part before
  the slowest rank arrived is idle (split across ranks afterwards, real/launch.py);
- `Post` / `Await` (a pipeline's activations and gradients): the program's
  first isend / irecv are issued at the Post, and the Await completes it; the
  Await's host-clock span is communication. Posted programs the step program
  never awaited (a stage's own sends) are completed when it ends;
- `PostCollective` (a gradient bucket's all-reduce, `parallel.overlap`): run
  there and then, like a `Collective`. A program posts its buckets once its
  real backward is done (schemes/local_work.py: the backward is computed in
  one piece, and charged in pieces only on the simulated clock), so a real
  run has nothing left to overlap them with; `WaitCollectives` has then
  nothing to wait for;
- `Compute`, `MemoryBound`, `Busy`: what they charge in a simulation was just
  computed for real by the program (each follows the numerics it stands for:
  the forward, the backward, the optimizer step, the sampler), so each closes
  a host-clock span, of its kind and name, from the previous boundary;
- `Alloc`, `Free`: the device ledger keeps the same accounts as in a
  simulation (what the program holds; not a measurement);
- `Transfer` and `Wait` belong to schemes that move bytes or wait outside a
  communicator (a shared-memory store): not in the table, refused by drive.

Host work between boundaries that no operation names (bookkeeping between a
backward and the all-reduce) is left out of every span: it counts as idle,
and the report gives its total. `time.perf_counter` is the clock: this is a
measured run, not a simulated one.

    meter = Meter()
    run_program(program, comm=GlooCommunicator(range(world)), ledger=device.memory, meter=meter)
"""
import time
from typing import NamedTuple

from ..step_ops import (Alloc, Await, Busy, Collective, Compute, Free, MemoryBound, Post, PostCollective,
                        WaitCollectives, drive, immediate)


class MeasuredSpan(NamedTuple):
    kind: str  # compute, optimizer, sampling, communication
    name: str  # forward, backward, optimizer step, all_reduce, ...
    start: float  # host seconds since the meter's origin
    end: float
    nbytes: float
    flops: float


class Meter:
    """One rank's measured spans: recorded from `start_recording()` on, relative to that moment."""

    def __init__(self):
        self.spans: list[MeasuredSpan] = []
        self.recording = False
        self.origin = time.perf_counter()
        self.mark = 0.0  # the end of the last boundary, relative to the origin

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def start_recording(self) -> None:
        """From here on spans are kept, and times count from here."""
        self.origin = time.perf_counter()
        self.mark = 0.0
        self.recording = True

    def boundary(self) -> None:
        """Host work up to now belongs to no span (a step starts)."""
        self.mark = self.now()

    def close(self, kind: str, name: str, nbytes: float = 0, flops: float = 0) -> float:
        """The span from the last boundary to now is `kind`; returns its seconds."""
        end = self.now()
        if self.recording:
            self.spans.append(MeasuredSpan(kind, name, self.mark, end, nbytes, flops))
        seconds, self.mark = end - self.mark, end
        return seconds


def run_program(program, comm, ledger, meter: Meter):
    """Drive `program` to its end for real, its collectives without a communicator on `comm` (the job's);
    returns its value."""
    posted = []  # handles of programs posted and not awaited yet

    def span(op):  # a Compute, MemoryBound or Busy: the work it stands for was just done
        meter.close(op.kind, op.name, nbytes=getattr(op, "nbytes", 0), flops=getattr(op, "flops", 0))

    def collective(op):
        meter.boundary()
        group = comm if op.comm is None else op.comm
        handle = group.post(op.rank, op.program, op.label)
        group.wait(handle)
        return meter.close("communication", op.label, nbytes=handle.sent)

    def post_collective(op: PostCollective):
        meter.boundary()
        group = comm if op.comm is None else op.comm
        handle = group.post(op.rank, op.program, op.label)
        group.wait(handle)
        meter.close("communication", op.label, nbytes=handle.sent)

    def post(op: Post):
        handle = (comm if op.comm is None else op.comm).post(op.rank, op.program, op.label)
        posted.append(handle)
        return handle

    def await_(op: Await):
        meter.boundary()
        posted.remove(op.handle)
        value = op.handle.comm.wait(op.handle, op.idle)
        op.handle.charged_s = meter.close("communication", op.handle.label, nbytes=op.handle.sent)
        return value

    handlers = {Compute: immediate(span), MemoryBound: immediate(span), Busy: immediate(span),
                Alloc: immediate(lambda op: ledger.alloc(op.category, op.nbytes)),
                Free: immediate(lambda op: ledger.free(op.category, op.nbytes)), Collective: immediate(collective),
                PostCollective: immediate(post_collective), WaitCollectives: immediate(lambda op: None),
                Post: immediate(post), Await: immediate(await_)}
    driver = drive(program, handlers)
    try:
        next(driver)
    except StopIteration as stop:
        value = stop.value
    else:
        raise RuntimeError("a real handler yielded: it must not wait on a simulated clock")
    for handle in posted:  # a stage's own sends: the peer has received them, or will
        handle.comm.wait(handle)
    return value
