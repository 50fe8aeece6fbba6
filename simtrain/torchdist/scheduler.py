"""Ranks as threads that take turns on the simulated clock: exactly one runs at a time.

Each rank's Python code runs in a thread of its own, and each thread is a simpy
process on the cluster's clock. The main thread runs the clock; it hands control
to a rank by resuming its thread and waits until the rank gives it back, which it
does only when it needs the clock: to wait for an event (its compute, a
collective's end). The rank's process then yields that event, and when it fires
the clock hands control back to the rank, at that simulated instant. Between two
waits a rank takes no simulated time. So the interleaving is the simpy event order,
a function of the simulation alone, never of the host's thread scheduler.

    turns = Turns(env)
    turns.start(rank, lambda: user_code(rank))   # one per rank, in rank order
    turns.run(run_to_end)  # the clock, until it runs dry or a rank raised
    turns.close()          # the ranks' values in rank order, or RankFailed or Deadlock

    turns.wait(event, "all_reduce #2 of group [0, 1]")   # inside a rank's thread

If a rank raises, the run stops there (`RankFailed`). If the clock runs dry while
ranks still wait, nothing can ever wake them (`Deadlock`, naming what each waits
on and the line of the user's code where it waits: `user_line`). Either way
every waiting thread is then resumed with `Aborted` raised at its wait, so no
thread is left behind.

Each rank draws from torch's CPU generator of its own, as a process of its own
would: the generator's state is the rank's while it runs (saved when it hands
control back, put back when it resumes) and starts as a fresh process's (torch's
default seed), and the state the spawn began with is put back at its end. So
`torch.rand` in a rank, and a seed drawn from the generator (torchtitan's), do
not depend on what other ranks drew before. The module globals of packages made
per rank (module_state.py: Megatron-Core's process groups) are swapped the same way.

A watchdog guards the host, not the simulation (the one use of wall time): a
rank that holds its turn for `timeout_s` seconds of wall time while its thread
uses almost no CPU (under 1% of that time) blocks on something outside the
scheduler, which no simulated event can release (a Python lock, `time.sleep`,
a blocking queue): the run stops with `RankBlocked`, naming the rank and the
line it blocks on, instead of hanging. That thread is left behind (a daemon: it
cannot be interrupted). A rank that computes for long is not stopped.
"""
import os
import sys
import sysconfig
import threading
import time
from pathlib import Path

import simpy
import torch

from ..errors import Deadlock, RankBlocked, RankFailed, first_line
from .module_state import registered

BLOCKED_CPU_FRACTION = 0.01  # a thread that used less CPU than this share of the watchdog's time is blocked
FRESH_GENERATOR = torch.Generator().get_state()  # a fresh process's CPU generator: torch's default seed


class Aborted(BaseException):
    """Raised at a waiting rank's wait when the run ends without it (not an Exception: user code
    that catches Exception does not swallow it)."""


_current = threading.local()  # .rank in a rank's thread


def current_rank() -> int | None:
    """The rank whose thread this is, or None outside a rank's thread."""
    return getattr(_current, "rank", None)


class _Rank:
    __slots__ = ("rank", "thread", "resume", "event", "value", "waiting_on", "ended", "result", "error", "abort",
                 "blocked", "generator", "modules")

    def __init__(self, rank: int, modules: list):
        self.rank = rank
        self.thread = None
        self.resume = threading.Semaphore(0)
        self.event = None  # what the rank waits on now
        self.value = None  # what its wait returns
        self.waiting_on = ""
        self.ended = False
        self.result = None
        self.error = None
        self.abort = False
        self.blocked = False  # the watchdog found it blocked outside the scheduler: left behind
        self.generator = FRESH_GENERATOR  # torch's CPU generator's state while the rank runs (above)
        self.modules = [state.fresh() for state in modules]  # its own module globals (module_state.py)


class Turns:
    """Rank threads that run one at a time, each as a simpy process of `env`."""

    def __init__(self, env: simpy.Environment, timeout_s: float | None = None):
        self.env = env
        self.timeout_s = timeout_s  # the watchdog's wall time (None: no watchdog)
        self._ranks: dict[int, _Rank] = {}
        self._clock = threading.Semaphore(0)  # released when the running rank hands control back
        self._clock_error = None
        self._generator = torch.get_rng_state()  # the spawn's own, put back at its end
        self._modules = registered()  # packages whose globals each rank keeps its own of (module_state.py)
        self._modules_before = [state.save() for state in self._modules]  # the spawn's own, put back at its end

    def start(self, rank: int, body) -> None:
        """Run `body()` as rank `rank`; it first runs at the current simulated instant."""
        state = _Rank(rank, self._modules)
        state.thread = threading.Thread(target=self._thread, args=(state, body), name=f"simtrain rank {rank}",
                                        daemon=True)
        self._ranks[rank] = state
        state.thread.start()
        self.env.process(self._process(state))

    def wait(self, event: simpy.Event, what):
        """In a rank's thread: hand control to the clock until `event` fires; its value. `str(what)`
        says what the rank waits on, should the run deadlock there."""
        state = self._ranks[_current.rank]
        if state.abort:
            raise Aborted()
        state.event, state.waiting_on = event, what
        state.generator = torch.get_rng_state()
        state.modules = [modules.save() for modules in self._modules]
        self._clock.release()
        state.resume.acquire()
        if state.abort:
            raise Aborted()
        self._resumed(state)
        return state.value

    def _resumed(self, state: _Rank) -> None:
        """The rank's own generator state and module globals, as it left them."""
        torch.set_rng_state(state.generator)
        for modules, values in zip(self._modules, state.modules):
            modules.load(values)

    def run(self, runner) -> None:
        """`runner(env)` runs the clock (hw.cluster.run_to_end); it stops early when a rank raises."""
        try:
            runner(self.env)
        except _Stop:
            pass
        except BaseException as error:  # raised again by close(), once no rank thread is left waiting
            self._clock_error = error

    def waiting(self) -> dict[int, str]:
        """What each rank that has not ended waits on, and where in the user's code, by rank."""
        frames = sys._current_frames()  # a waiting rank's thread stands at its wait: its stack says where
        waiting = {}
        for rank, state in sorted(self._ranks.items()):
            if not state.ended:
                where = user_line(frames.get(state.thread.ident))
                waiting[rank] = f"{state.waiting_on}" + (f" (at {where})" if where else "")
        return waiting

    def close(self) -> list:
        """After the clock stopped: the ranks' return values in rank order, or RankFailed / Deadlock."""
        failed = [s for s in self._ranks.values() if s.error is not None]
        waiting = self.waiting()
        for state in self._ranks.values():
            if not state.ended and not state.blocked:
                state.abort = True
                state.resume.release()
                self._clock.acquire()
        for state in self._ranks.values():  # each has handed control back for the last time; let it exit
            if not state.blocked:
                state.thread.join()
        torch.set_rng_state(self._generator)
        for modules, values in zip(self._modules, self._modules_before):
            modules.load(values)
        if self._clock_error is not None:
            raise self._clock_error
        if failed:
            first = min(failed, key=lambda s: s.rank)
            error, first.error = first.error, None  # no cycle through the rank's frames: freed at once
            raise RankFailed(f"rank {first.rank} raised {type(error).__name__}: {first_line(error)}") from error
        if waiting:
            at = f"{self.env.now * 1e6:.6g} us"
            what = "; ".join(f"rank {rank} waits on {on}" for rank, on in waiting.items())
            raise Deadlock(f"deadlock at {at} of simulated time: {what}")
        return [self._ranks[rank].result for rank in sorted(self._ranks)]

    def _thread(self, state: _Rank, body) -> None:
        _current.rank = state.rank
        state.resume.acquire()
        try:
            if not state.abort:
                self._resumed(state)
                state.result = body()
        except Aborted:
            pass
        except BaseException as error:  # reported by close(), in the main thread
            state.error = error
        state.ended = True
        state.event = None
        self._clock.release()

    def _process(self, state: _Rank):
        while True:
            state.resume.release()
            self._await(state)
            if state.ended:
                if state.error is not None:
                    raise _Stop()
                return
            state.value = yield state.event


    def _await(self, state: _Rank) -> None:
        """Wait until the running rank hands control back; RankBlocked if the watchdog finds it blocked."""
        if self.timeout_s is None:
            self._clock.acquire()
            return
        cpu_s = _cpu_seconds(state.thread)
        while not self._clock.acquire(timeout=self.timeout_s):
            now_s = _cpu_seconds(state.thread)
            if now_s - cpu_s < BLOCKED_CPU_FRACTION * self.timeout_s:
                state.blocked = True
                where = user_line(sys._current_frames().get(state.thread.ident))
                raise RankBlocked(f"rank {state.rank} blocked outside simtrain for {self.timeout_s:g} s of wall time "
                                  f"(spawn timeout_s){f' at {where}' if where else ''}: a lock, time.sleep or a "
                                  f"queue that no simulated event releases")
            cpu_s = now_s


def _cpu_seconds(thread: threading.Thread) -> float:
    """CPU time `thread` has used so far."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def user_line(frame) -> str | None:
    """'file:line in function': the innermost frame of the user's code in the stack that `frame` (None: no
    stack) ends, outside Python's standard library, simtrain and torch; the file relative to the working folder
    when it lies inside it. Read only to word an error."""
    libraries = {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"], str(Path(__file__).parents[1])}
    if "torch" in sys.modules:
        libraries.add(os.path.dirname(sys.modules["torch"].__file__))
    prefixes = tuple(os.path.join(folder, "") for folder in libraries)
    while frame is not None and frame.f_code.co_filename.startswith(prefixes):
        frame = frame.f_back
    if frame is None:
        return None
    path = frame.f_code.co_filename
    inside = os.path.relpath(path) if path.startswith(os.path.join(os.getcwd(), "")) else path
    return f"{inside}:{frame.f_lineno} in {frame.f_code.co_name}"


class _Stop(Exception):
    """Ends the clock's run when a rank raised."""
