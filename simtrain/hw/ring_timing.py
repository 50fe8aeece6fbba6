"""A ring all-reduce's timing, for the whole group at once: the recurrence of its chunk schedule.

Stepping N rank programs through 2(N-1) steps each and moving 2N(N-1) flows
through the network costs microseconds of Python per transfer: seconds for a
1,024-device all-reduce, hours for 8,192. Yet when the group's links carry
nothing but this ring, what the flow model computes for it has a closed
recurrence. The rank at ring position p sends chunk (p - k) mod N to position
p+1 at step k (comm/ring.py: both phases send that chunk), over its route of
latency L[p] and bottleneck rate R[p], alone on its links (the ring's routes
share no directed link: `Network.ring` checks it), so with T[p, k] the time
position p posts step k:

    S[p, k] = max(T[p, k], T[p+1, k])           the Send meets its Recv
    E[p, k] = (S[p, k] + L[p]) + bytes / R[p]    latency, then the bytes (network.py)
    T[p, k+1] = max(E[p, k], E[p-1, k])         its send and its receive are done

which numpy evaluates for all positions at once, step by step: O(N) work per
step, O(N) memory. A small ring (up to SCALAR_MAX_WORLD positions, as a job of
a few devices all-reduces every step) is evaluated in Python floats instead
(`ring_times_in_scalars`): the same operations, so the same bits, without
numpy's cost per call. When every position is alike (the same post time, route,
chunk size and busy time: a homogeneous ring whose buffer splits evenly), all
compute the same numbers, and one position's recurrence, in scalars, is all
of theirs (`lockstep_ring_times`): O(N) work in all. A ring whose positions
differ is O(N^2) in all; past limits.MAX_RING_POSITION_STEPS it is refused in
one line (`PastLimit`).

A ring reduce-scatter or all-gather alone is the same schedule cut short:
its N-1 steps (`steps`), the chunk sizes rotated to what each position sends
first (comm/ring_schedule.py's `RingPhase`), a staging buffer only for the
steps that reduce what they receive (`reducing`: N-1 for an all-reduce's or a
reduce-scatter's first phase, none for an all-gather).

The floating-point operations are the network's own, in its order, so the
times are the flow model's to the last bit. What the flow model leaves behind
is derived from the same arrays: each rank's communication spans (time with a
transfer of its own in flight) and bytes sent, each link's bytes and busy time, the largest staging buffer a reducing receive holds, and the
transfer records when the network keeps them.

`Network.time_ring` is the way in; it feeds this module the ring's routes:

    times = ring_times(posts, latency, rate, chunk_bytes, busy_before)   # lists, by ring position
    times = ring_times(posts, latency, rate, chunk_bytes, busy_before, steps=N - 1, reducing=0)  # an all-gather

Inputs and results are plain lists of Python numbers: a job of a few devices times a ring every step,
and there numpy's cost per call (the more so with the caches cold from the step's own arithmetic) was
most of the work; numpy runs only the recurrence of a large ring.
"""
from math import inf
from operator import add
from typing import NamedTuple

import numpy as np

from ..errors import PastLimit
from ..limits import MAX_RING_POSITION_STEPS

# Rings up to this many positions are timed in Python floats (`ring_times_in_scalars`), where numpy's cost per
# call is most of a step's work. Measured on the 2-core machine (2026-12-02, a ring of uneven chunks): 8 positions
# 0.14 ms against 0.40 ms with numpy, 16: 0.47 against 0.91 ms, 32: about equal.
SCALAR_MAX_WORLD = 16


class RingTimes(NamedTuple):
    """Everything a ring all-reduce did, by ring position p (lists of length N unless said)."""

    end: list[float]  # when position p's program ends
    spans: list[tuple[int, float, float, int]]  # (position, start, end, bytes sent): communication spans
    link_busy_s: list[float]  # busy time of position p's path's links after its transfers
    sent_bytes: list[int]  # bytes position p sent (over each link of its path)
    # (position, time, bytes): when each size of chunk position p receives to reduce first lands in its
    # staging buffer (the buffer's largest moments: its other memory only shrinks while it waits)
    staging: list[tuple[int, float, int]]
    transfers: list[tuple[int, float, float, int]]  # (sender position, start, end, bytes); only if asked


def ring_times(posts: list[float], latency: list[float], rate: list[float], chunk_bytes: list[int],
               busy_before: list[float], keep_transfers: bool = False, steps: int | None = None,
               reducing: int | None = None) -> RingTimes:
    """The ring all-reduce's timing when position p posts it at posts[p], over a path of total
    latency latency[p] and bottleneck rate rate[p] to position p+1, alone on its links, which
    were busy busy_before[p] seconds before. With `steps` (default 2(N-1)) only that many steps of its
    schedule, the first `reducing` of them (default N-1) staging what they receive: a reduce-scatter or
    an all-gather alone."""
    world = len(posts)
    if not keep_transfers and world > 1 and all(
            values.count(values[0]) == world for values in (posts, latency, rate, chunk_bytes, busy_before)):
        return lockstep_ring_times(world, posts[0], latency[0], rate[0], chunk_bytes[0], busy_before[0], steps,
                                   reducing)
    if world <= SCALAR_MAX_WORLD:
        return ring_times_in_scalars(posts, latency, rate, chunk_bytes, busy_before, keep_transfers, steps, reducing)
    position_steps = world * (2 * (world - 1) if steps is None else steps)
    if position_steps > MAX_RING_POSITION_STEPS:
        raise PastLimit(f"a ring of {world:,} ranks whose positions differ ({_differing(chunk_bytes)}) is timed "
                        f"position by position: {position_steps:,} position-steps, past the "
                        f"{MAX_RING_POSITION_STEPS:,} simtrain times (limits.py): run fewer ranks in one ring")
    return ring_times_by_position(posts, latency, rate, chunk_bytes, busy_before, keep_transfers, steps, reducing)


def _differing(chunk_bytes: list[int]) -> str:
    """What makes a ring's positions differ, for a refusal: its chunks' sizes, or else their routes and times."""
    sizes = sorted(set(chunk_bytes))
    if len(sizes) > 1:
        return f"its buffer splits into chunks of {' and '.join(f'{size:,}' for size in sizes[:2])} bytes"
    return "their routes or start times"


def lockstep_ring_times(world: int, post: float, latency: float, rate: float, chunk: int, busy_before: float,
                        steps: int | None = None, reducing: int | None = None) -> RingTimes:
    """`ring_times` of a ring whose positions are all alike (the same post time, route latency and rate,
    chunk size and busy time before): every position then computes the same numbers with the same
    operations at every step, so one position's, in scalars, are all of theirs, to the bit. O(N) work
    instead of O(N^2): what times a 131,072-rank ring in seconds."""
    steps = 2 * (world - 1) if steps is None else steps
    reducing = world - 1 if reducing is None else reducing
    posted, busy, sent = post, busy_before, 0
    for _ in range(steps):
        active = posted + latency  # start = max(posted, the right neighbour's posted) = posted
        end = active + chunk / rate
        if chunk > 0:
            busy = busy + (end - active)
        sent += chunk
        posted = end  # max(its send's end, its receive's end), both `end`
    staging = [(position, post, chunk) for position in range(world)] if chunk > 0 and reducing else []
    # One span each, from the first step's start to the end: each step starts as the one before ends.
    spans = [(position, post, posted, sent) for position in range(world)]
    return RingTimes([posted] * world, spans, [busy] * world, [sent] * world, staging, [])


def ring_times_by_position(posts: list[float], latency: list[float], rate: list[float], chunk_bytes: list[int],
                           busy_before: list[float], keep_transfers: bool = False, steps: int | None = None,
                           reducing: int | None = None) -> RingTimes:
    """`ring_times` for any ring: every position's recurrence, step by step, in numpy (O(N) work per step)."""
    world = len(posts)
    steps = 2 * (world - 1) if steps is None else steps
    reducing = world - 1 if reducing is None else reducing
    positions = np.arange(world)
    right, left = (positions + 1) % world, (positions - 1) % world
    posted = np.array(posts, dtype=np.float64)
    latency, rate = np.array(latency, dtype=np.float64), np.array(rate, dtype=np.float64)
    chunk_bytes = np.array(chunk_bytes, dtype=np.int64)
    busy = np.array(busy_before, dtype=np.float64)
    sent = np.zeros(world, dtype=np.int64)
    sizes = sorted({int(size) for size in chunk_bytes if size > 0})  # at most two: tensor_split's
    first_landing = {size: np.full(world, np.inf) for size in sizes}
    spans = _Spans(world)
    transfers = []
    for step in range(steps):
        nbytes = chunk_bytes[(positions - step) % world]
        start = np.maximum(posted, posted[right])
        active = start + latency
        end = active + nbytes / rate  # an empty transfer ends when it activates (+ 0.0)
        busy = np.where(nbytes > 0, busy + (end - active), busy)
        sent += nbytes
        if step < reducing:  # reduce-scatter: the chunk from the left lands in a staging buffer
            for size, first in first_landing.items():
                np.minimum(first, np.where(nbytes[left] == size, start[left], np.inf), out=first)
        if keep_transfers:
            transfers.extend(zip(positions.tolist(), start.tolist(), end.tolist(), nbytes.tolist()))
        spans.add(start, end, start[left], end[left], nbytes)
        posted = np.maximum(end, end[left])
    staging = [(position, time, size) for size, first in first_landing.items()
               for position, time in enumerate(first.tolist()) if time != inf]
    return RingTimes(posted.tolist(), spans.close(), busy.tolist(), sent.tolist(), staging, transfers)


def ring_times_in_scalars(posts: list[float], latency: list[float], rate: list[float], chunk_bytes: list[int],
                          busy_before: list[float], keep_transfers: bool = False, steps: int | None = None,
                          reducing: int | None = None) -> RingTimes:
    """`ring_times_by_position` in Python floats, for small rings: the same operations on the same doubles
    (max, +, int / float), so the same numbers to the bit, in the same order, without numpy's cost per call,
    which for a few positions is most of the work."""
    world = len(posts)
    steps = 2 * (world - 1) if steps is None else steps
    reducing = world - 1 if reducing is None else reducing
    posted, chunks, busy = list(posts), list(chunk_bytes), list(busy_before)
    sent = [0] * world
    first_landing = {size: [inf] * world for size in sorted({size for size in chunks if size > 0})}
    span_start, span_end, span_bytes = [None] * world, [-inf] * world, [0] * world
    closed, transfers = [], []
    for step in range(steps):
        turn = world - step % world
        sizes = chunks[turn:] + chunks[:turn]  # position p sends chunk (p - step) mod N
        starts = list(map(max, posted, posted[1:] + posted[:1]))  # the Send meets its Recv
        actives = list(map(add, starts, latency))
        ends = [active + nbytes / bandwidth for active, nbytes, bandwidth in zip(actives, sizes, rate)]
        busy = [before + (end - active) if nbytes > 0 else before
                for before, end, active, nbytes in zip(busy, ends, actives, sizes)]
        sent = list(map(add, sent, sizes))
        received_starts, received_ends = starts[-1:] + starts[:-1], ends[-1:] + ends[:-1]  # from the left
        received_sizes = sizes[-1:] + sizes[:-1]
        if step < reducing:  # reduce-scatter: the chunk from the left lands in a staging buffer
            for position, (landing, size) in enumerate(zip(received_starts, received_sizes)):
                first = first_landing.get(size)
                if first is not None and landing < first[position]:
                    first[position] = landing
        if keep_transfers:
            transfers.extend(zip(range(world), starts, ends, sizes))
        # Each position's send and receive, the earlier-starting first: a span goes on across transfers that
        # touch and closes at a gap (as _Spans does, whose closing order, first transfers then second, is kept).
        closed_second = []
        for position, (send_start, send_end, receive_start, receive_end, nbytes) in enumerate(
                zip(starts, ends, received_starts, received_ends, sizes)):
            end = span_end[position]
            if send_start <= end and receive_start <= end:  # both go on the open span (the usual case)
                span_bytes[position] += nbytes
                span_end[position] = max(end, send_end, receive_end)
                continue
            if send_start <= receive_start:
                begin, finish, begin_next, finish_next, first_bytes, next_bytes = (
                    send_start, send_end, receive_start, receive_end, nbytes, 0)
            else:
                begin, finish, begin_next, finish_next, first_bytes, next_bytes = (
                    receive_start, receive_end, send_start, send_end, 0, nbytes)
            if begin > end:
                if span_start[position] is not None:
                    closed.append((position, span_start[position], end, span_bytes[position]))
                span_start[position], span_bytes[position] = begin, 0
            span_bytes[position] += first_bytes
            end = max(end, finish)
            if begin_next > end:
                closed_second.append((position, span_start[position], end, span_bytes[position]))
                span_start[position], span_bytes[position] = begin_next, 0
            span_bytes[position] += next_bytes
            span_end[position] = max(end, finish_next)
        closed.extend(closed_second)
        posted = list(map(max, ends, received_ends))  # its send and its receive are done
    staging = [(position, time, size) for size, first in first_landing.items()
               for position, time in enumerate(first) if time != inf]
    spans = closed + [(position, start, end, count) for position, (start, end, count) in
                      enumerate(zip(span_start, span_end, span_bytes))]
    return RingTimes(posted, spans, busy, sent, staging, transfers)


class _Spans:
    """Each position's communication spans, as the communicator keeps them: a span runs while a transfer
    of the rank's is in flight, goes on across transfers that touch, and closes at a gap."""

    def __init__(self, world: int):
        self.start = np.full(world, np.nan)
        self.end = np.full(world, -np.inf)
        self.bytes = np.zeros(world, dtype=np.int64)
        self.closed: list[tuple[int, float, float, int]] = []

    def add(self, send_start, send_end, receive_start, receive_end, send_bytes) -> None:
        """A step's send and receive of every position, which start after all its earlier ones ended."""
        send_first = send_start <= receive_start
        first_end = np.where(send_first, send_end, receive_end)
        if (np.minimum(send_start, receive_start) <= self.end).all() and (
                np.maximum(send_start, receive_start) <= np.maximum(self.end, first_end)).all():
            self.end = np.maximum(self.end, np.maximum(send_end, receive_end))  # no gap: the usual case
            self.bytes = self.bytes + send_bytes
            return
        first = (np.where(send_first, send_start, receive_start), first_end, send_first)
        second = (np.where(send_first, receive_start, send_start), np.where(send_first, receive_end, send_end),
                  ~send_first)
        for begin, finish, is_send in (first, second):
            gap = begin > self.end
            for position in np.flatnonzero(gap & ~np.isnan(self.start)).tolist():
                self.closed.append((position, float(self.start[position]), float(self.end[position]),
                                    int(self.bytes[position])))
            self.start = np.where(gap, begin, self.start)
            self.bytes = np.where(gap, 0, self.bytes) + np.where(is_send, send_bytes, 0)
            self.end = np.maximum(self.end, finish)

    def close(self) -> list[tuple[int, float, float, int]]:
        """Every span, each position's in time order: the closed ones, then the open ones at the program's end."""
        return self.closed + [(position, start, end, int(count)) for position, (start, end, count) in
                              enumerate(zip(self.start.tolist(), self.end.tolist(), self.bytes.tolist()))]
