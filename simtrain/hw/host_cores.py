"""The CPU cores of one host that a calibrated run's ranks share, and the messages' software work on them.

`cluster.host_cores`: a calibrated run of this
host (real/calibrate.py) runs every rank as a process on the host's CPUs, and
when the ranks outnumber the cores their work contends for them. The OS
time-slices: Linux's scheduler (CFS, and EEVDF after it) models "an ideal,
precise multi-tasking CPU" that runs each of k runnable tasks at 1/k of its
speed (the kernel's sched-design-CFS.rst), time slices (a few ms) finer than
a step's work. So the cores are modelled by processor sharing, not a FIFO
queue: `HostCores(env, cores)` runs each piece of work given it (seconds of
one core) at min(1, cores / k) of a core while k pieces are running, so that
k ranks of compute c each on m < k cores all end at k c / m (a FIFO resource
would end m of them at c and the last at ceil(k / m) c: the same makespan
only when m divides k, and unlike the OS, which keeps every rank moving).
`HostDevice` is a simulated device whose stream's work (compute, memory-bound
work, busy time) runs on the cores its host's ranks share; its spans end when
their work has had its core time:

    cores = HostCores(env, cores=2)
    done = cores.run(1e-3)      # fires once 1 ms of one core's time has been given to it

The ranks' messages take the same cores (`cluster.host_message_work`): gloo's
software work of each message a rank sends (posting it, waking its threads,
the reduction's add: what calibration's exchange costs beyond the ping-pong's
wire, δ per message and 1/γ per byte) runs on a core before its bytes move on
the links, so that communication and compute threads contend as they do.
`HostMessages.send(nbytes, then)` runs it and then calls `then()`:

    messages = HostMessages(cores, latency_s=1.4e-3, s_per_byte=0.0)
    messages.send(4096, start_the_flow)
"""
import simpy

from .device import Device


_TIE_S = 1e-12  # pieces of work within a picosecond of core time of the first to end, end with it


class HostCores:
    """`cores` CPU cores shared by processor sharing among the work running on them (the module docstring)."""

    def __init__(self, env: simpy.Environment, cores: int):
        if cores < 1:
            raise ValueError(f"host cores must be at least 1, got {cores}")
        self.env = env
        self.cores = cores
        self._running: list[list] = []  # [core seconds left, event], in arrival order
        self._settled_at = 0.0  # when the seconds left were last brought up to date
        self._version = 0  # the completion timer scheduled last; an older one is stale

    def rate(self) -> float:
        """The fraction of a core each running piece of work gets now."""
        return min(1.0, self.cores / len(self._running)) if self._running else 1.0

    def run(self, seconds: float) -> simpy.Event:
        """Start `seconds` of one core's work now; the event fires when it has had them."""
        done = self.env.event()
        if seconds <= 0:
            return done.succeed()
        self._settle()
        self._running.append([seconds, done])
        self._schedule()
        return done

    def _settle(self) -> None:
        """Give every running piece its share of the cores since the last settlement."""
        now = self.env.now
        given = (now - self._settled_at) * self.rate()
        if given > 0:
            for work in self._running:
                work[0] -= given
        self._settled_at = now

    def _schedule(self) -> None:
        """A timer for the next piece to end at the current rate (the earlier timer becomes stale)."""
        self._version += 1
        if self._running:
            left = min(work[0] for work in self._running)
            version = self._version
            timer = self.env.timeout(max(0.0, left / self.rate()))
            timer.callbacks.append(lambda _: self._end(version))

    def _end(self, version: int) -> None:
        if version != self._version:
            return
        self._settle()
        least = min(work[0] for work in self._running)
        ending = [work for work in self._running if work[0] <= least + _TIE_S]
        self._running = [work for work in self._running if work[0] > least + _TIE_S]
        self._schedule()
        for _, done in ending:
            done.succeed()


class HostDevice(Device):
    """A simulated device that is one process on a host whose `cores` its ranks share: each piece of its
    stream's work runs, in order, on those cores (`HostCores`), and its span is logged when it ends."""

    def __init__(self, *args, cores: HostCores, **kwargs):
        super().__init__(*args, **kwargs)
        self.cores = cores
        self._stream_done: simpy.Event | None = None  # the last piece of work queued on the stream

    def run_for(self, seconds: float, name: str, kind: str, nbytes: float = 0, flops: float = 0) -> simpy.Event:
        """Queue `seconds` of one core's work on the stream; it runs once the work before it has ended."""
        self._stream_done = self.env.process(self._on_cores(self._stream_done, seconds, name, kind, nbytes, flops))
        return self._stream_done

    def _on_cores(self, previous, seconds: float, name: str, kind: str, nbytes: float, flops: float):
        if previous is not None:
            yield previous
        start = self.env.now
        yield self.cores.run(seconds)
        self.log.span(self.rank, kind, name, start, self.env.now, nbytes=nbytes, flops=flops)


class HostMessages:
    """The software work of each message a rank sends, on the host's cores: `latency_s` + bytes x `s_per_byte`
    of one core's time before the message moves (the module docstring)."""

    def __init__(self, cores: HostCores, latency_s: float, s_per_byte: float):
        self.cores = cores
        self.latency_s = latency_s
        self.s_per_byte = s_per_byte

    def send(self, nbytes: int, then) -> None:
        """Run the work of a message of `nbytes` on the cores; `then()` when it has run."""
        self.cores.run(self.latency_s + nbytes * self.s_per_byte).callbacks.append(lambda _: then())
