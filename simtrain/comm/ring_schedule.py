"""A ring all-reduce timed as a whole group: the recurrence of its chunk schedule.

Stepping N rank programs through 2(N-1) steps each and moving 2N(N-1) flows
through the network costs microseconds of Python per transfer: seconds for a
1,024-device all-reduce, hours for 8,192. Yet when the group's links carry
nothing but this ring, what the flow model computes for it has a closed
recurrence. The rank at ring position p sends chunk (p - k) mod N to position
p+1 at step k (ring.py: both phases send that chunk), over its path of latency
L[p] and bottleneck rate R[p], alone on its links (the ring's paths are
checked to share no directed link), so with T[p, k] the time position p posts
step k:

    S[p, k] = max(T[p, k], T[p+1, k])           the Send meets its Recv
    E[p, k] = (S[p, k] + L[p]) + bytes / R[p]    latency, then the bytes (network.py)
    T[p, k+1] = max(E[p, k], E[p-1, k])         its send and its receive are done

which numpy evaluates for all positions at once, step by step: O(N) work per
step, O(N) memory. The floating-point operations are the network's own, in its
order, so the times are the flow model's to the last bit. What the flow model
leaves behind is derived from the same arrays: each rank's communication spans
(time with a transfer of its own in flight) and bytes sent, each link's bytes
and busy time, the largest staging buffer a reducing receive holds, and the
transfer records when the network keeps them.

`RingAllReduce` is ring.py's program with what the group schedule needs
attached; `SimCommunicator(exclusive=True)` times it this way when every rank
has posted it on meta tensors (numerics off: no arithmetic to do).

    times = ring_times(posts, latency, rate, chunk_bytes)    # numpy arrays, by ring position
"""
from typing import NamedTuple

import numpy as np

from .ring import ring_all_reduce


class RingAllReduce:
    """One rank's ring all-reduce program (ring.py), and the group schedule it belongs to.

    It runs as the generator it wraps: `send`, `throw`, `close` and iteration are the generator's."""

    __slots__ = ("program", "rank", "world", "buf", "ring", "tag")

    def __init__(self, rank: int, world: int, buf, average: bool = False, *, ring=None, tag: int = 0):
        self.program = ring_all_reduce(rank, world, buf, average, ring=ring, tag=tag)
        self.rank, self.world, self.buf, self.ring, self.tag = rank, world, buf, ring, tag

    def send(self, value):
        return self.program.send(value)

    def throw(self, *args):
        return self.program.throw(*args)

    def close(self):
        return self.program.close()

    def __iter__(self):
        return self

    def __next__(self):
        return self.program.send(None)

    def order(self) -> tuple[int, ...]:
        """The group ranks in ring order."""
        return tuple(self.ring) if self.ring is not None else tuple(range(self.world))

    def chunk_bytes(self) -> np.ndarray:
        """Bytes of each of the N chunks the buffer is cut into (tensor_split: sizes differ by one element)."""
        numel, world = self.buf.numel(), self.world
        sizes = np.full(world, numel // world, dtype=np.int64)
        sizes[:numel % world] += 1
        return sizes * self.buf.element_size()


class RingTimes(NamedTuple):
    """Everything a ring all-reduce did, by ring position p (arrays of length N unless said)."""

    end: np.ndarray  # when position p's program ends
    spans: list[tuple[int, float, float, int]]  # (position, start, end, bytes sent): communication spans
    link_busy_s: np.ndarray  # busy time of position p's path's links after its transfers
    sent_bytes: np.ndarray  # bytes position p sent (over each link of its path)
    staging_bytes: np.ndarray  # the largest chunk position p received to reduce
    transfers: list[tuple[int, float, float, int]]  # (sender position, start, end, bytes); only if asked


def ring_times(posts: np.ndarray, latency: np.ndarray, rate: np.ndarray, chunk_bytes: np.ndarray,
               busy_before: np.ndarray, keep_transfers: bool = False) -> RingTimes:
    """The ring all-reduce's timing when position p posts it at posts[p], over a path of total
    latency latency[p] and bottleneck rate rate[p] to position p+1, alone on its links, which
    were busy busy_before[p] seconds before."""
    world = len(posts)
    positions = np.arange(world)
    posted = np.asarray(posts, dtype=np.float64)
    span_start = np.full(world, np.nan)
    span_end = np.full(world, -np.inf)
    span_bytes = np.zeros(world, dtype=np.int64)
    busy = np.array(busy_before, dtype=np.float64)
    sent = np.zeros(world, dtype=np.int64)
    staging = np.zeros(world, dtype=np.int64)
    spans, transfers = [], []
    for step in range(2 * (world - 1)):
        nbytes = chunk_bytes[(positions - step) % world]
        start = np.maximum(posted, np.roll(posted, -1))
        active = start + latency
        end = np.where(nbytes > 0, active + nbytes / rate, active)  # an empty transfer ends when it activates
        moving = nbytes > 0
        busy = np.where(moving, busy + (end - active), busy)
        sent += nbytes
        if step < world - 1:  # reduce-scatter: the chunk from the left lands in a staging buffer
            staging = np.maximum(staging, np.roll(nbytes, 1))
        if keep_transfers:
            transfers.extend(zip(positions.tolist(), start.tolist(), end.tolist(), nbytes.tolist()))
        # This step's two transfers of each position (its send, its receive) start after all its
        # earlier ones ended: merge them into its open span, or close it at a gap.
        send, receive = (start, end), (np.roll(start, 1), np.roll(end, 1))
        send_first = send[0] <= receive[0]
        first = [np.where(send_first, s, r) for s, r in zip(send, receive)]
        second = [np.where(send_first, r, s) for s, r in zip(send, receive)]
        for (begin, finish), carries_send in ((first, send_first), (second, ~send_first)):
            gap = begin > span_end
            opened = gap & ~np.isnan(span_start)
            for position in np.flatnonzero(opened).tolist():
                spans.append((position, float(span_start[position]), float(span_end[position]),
                              int(span_bytes[position])))
            span_start = np.where(gap, begin, span_start)
            span_bytes = np.where(gap, 0, span_bytes)
            span_end = np.maximum(span_end, finish)
            span_bytes = span_bytes + np.where(carries_send, nbytes, 0)
        posted = np.maximum(end, np.roll(end, 1))
    spans.extend((position, start, stop, int(count)) for position, (start, stop, count) in
                 enumerate(zip(span_start.tolist(), span_end.tolist(), span_bytes.tolist())))
    return RingTimes(posted, spans, busy, sent, staging, transfers)
