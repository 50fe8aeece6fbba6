"""A rank's step program run for real, its spans timed by the host clock.

The schemes describe a rank's training once, as a step program
(schemes/program.py): a generator that does its torch numerics itself and
yields operations. The simulator charges each operation on a virtual clock;
this interpreter runs the same program in a process of a real
torch.distributed group:

- `Collective`: its comm program runs over the group's point-to-point calls
  (comm/gloo.py run_program; with `--collective native` the program is one
  `dist.all_reduce`, real/launch.py). Its host-clock span is the rank's
  communication, of which the part before the slowest rank arrived is idle
  (split across ranks afterwards, real/launch.py);
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
- `Transfer`, `PostTransfer`, `Wait` belong to schemes that move bytes outside
  a collective (a shared-memory store, pipeline messages): refused.

Host work between boundaries that no operation names (bookkeeping between a
backward and the all-reduce) is left out of every span: it counts as idle,
and the report gives its total. `time.perf_counter` is the clock: this is a
measured run, not a simulated one.

    meter = Meter()
    run_program(program, collective=gloo.run_program, ledger=device.memory, meter=meter)
"""
import time
from typing import NamedTuple

from ..schemes.program import Alloc, Busy, Collective, Compute, Free, MemoryBound, PostCollective, WaitCollectives


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


def run_program(program, collective, ledger, meter: Meter):
    """Drive `program` to its end for real; `collective(comm_program)` runs a collective's program."""
    value = None
    while True:
        try:
            op = program.send(value)
        except StopIteration as stop:
            return stop.value
        kind = type(op)
        value = None
        if kind is Compute:
            meter.close(op.kind, op.name, flops=op.flops)
        elif kind is MemoryBound:
            meter.close(op.kind, op.name, nbytes=op.nbytes)
        elif kind is Busy:
            meter.close(op.kind, op.name, nbytes=op.nbytes)
        elif kind is Alloc:
            ledger.alloc(op.category, op.nbytes)
        elif kind is Free:
            ledger.free(op.category, op.nbytes)
        elif kind is Collective or kind is PostCollective:
            if kind is Collective and op.comm is not None:
                raise TypeError(f"collective {op.label!r} on a sub-group: only the simulated interpreter runs it")
            meter.boundary()
            collective(op.program)
            seconds = meter.close("communication", op.label)
            value = seconds if kind is Collective else None
        elif kind is WaitCollectives:
            pass  # every posted collective has run
        else:
            raise TypeError(f"a step program yielded {op!r}, which only the simulated interpreter runs")
