"""A ring all-reduce done for the whole group at once: its program, and its arithmetic.

When a group's links carry nothing but its ring all-reduce, the network times
every rank's transfers at once (`Network.time_ring`, hw/ring_timing.py) instead
of moving 2N(N-1) flows one by one. This module holds the two pieces of it that
know about tensors and programs.

On real tensors the arithmetic is done for the whole group at once too
(`reduce_as_ring`): chunk c is summed in the ring's order, x[c] then x[c+1]
and on round the ring, one vectorized addition per step for all chunks
together instead of one per chunk per rank, so the sums are the ring's to
the last bit; every rank then gets all of them (the all-gather). The ranks'
buffers are read where they lie when they are the rows of one tensor, as a
job's replicas keep their gradients (train/replica.py), and stacked first
otherwise.

`RingAllReduce` is ring.py's program with what the group schedule needs
attached; `SimCommunicator(exclusive=True)` times it this way when every rank
has posted it. `RingPhase` is the same for a ring reduce-scatter or all-gather
alone (the distributed optimizer's, as representatives time it), timed as a
group on meta tensors (numerics off), where nothing is summed: its first N-1
steps, or its last.

    reduce_as_ring([buffers[rank] for rank in order], average=True)
    RingPhase("reduce_scatter", rank, order, buf)        # order: the group's ranks in ring order
"""
import torch

from .ops import WrappedProgram
from .ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter


class RingAllReduce(WrappedProgram):
    """One rank's ring all-reduce program (ring.py), and the group schedule it belongs to.

    It runs as the generator it wraps (ops.WrappedProgram)."""

    __slots__ = ("rank", "world", "buf", "average", "ring", "tag")

    def __init__(self, rank: int, world: int, buf, average: bool = False, *, ring=None, tag: int = 0):
        self.program = ring_all_reduce(rank, world, buf, average, ring=ring, tag=tag)
        self.rank, self.world, self.buf, self.average, self.ring, self.tag = rank, world, buf, average, ring, tag

    def group(self) -> tuple:
        """What every rank of one all-reduce shares: the group size and ring order (None: rank order)."""
        return self.world, None if self.ring is None else tuple(self.ring)

    def order(self) -> tuple[int, ...]:
        """The group ranks in ring order."""
        return tuple(self.ring) if self.ring is not None else tuple(range(self.world))

    def chunk_bytes(self) -> list[int]:
        """Bytes of each of the N chunks the buffer is cut into (tensor_split: the first numel % N chunks
        hold one element more)."""
        return _chunk_bytes(self.buf, self.world)

    @property
    def steps(self) -> int:
        """Steps of the ring's schedule: N-1 reduce-scatter steps, then N-1 all-gather steps."""
        return 2 * (self.world - 1)

    @property
    def reducing(self) -> int:
        """Its first steps, whose received chunk is summed (held in a staging buffer meanwhile)."""
        return self.world - 1


class RingPhase(WrappedProgram):
    """One rank's ring reduce-scatter or all-gather alone (ring.py) over the group ranks `order` in ring order,
    and the group schedule it belongs to. It runs as the generator it wraps (ops.WrappedProgram)."""

    __slots__ = ("kind", "world", "buf", "ring")

    def __init__(self, kind: str, rank: int, order: tuple[int, ...], buf):
        self.kind, self.world, self.buf, self.ring = kind, len(order), buf, tuple(order)
        position = self.ring.index(rank)
        right, left = self.ring[(position + 1) % self.world], self.ring[position - 1]
        self.program = _phase(kind, position, right, left, buf, self.world)

    def group(self) -> tuple:
        """What every rank of one collective shares: its kind, the group size and ring order."""
        return self.kind, self.world, self.ring

    def order(self) -> tuple[int, ...]:
        """The group ranks in ring order."""
        return self.ring

    def chunk_bytes(self) -> list[int]:
        """Bytes of the chunk position p sends first, by p (a reduce-scatter sends chunk p first, an all-gather
        the chunk p+1 it holds summed): the recurrence's chunk sizes (hw/ring_timing.py)."""
        sizes = _chunk_bytes(self.buf, self.world)
        return sizes if self.kind == "reduce_scatter" else sizes[1:] + sizes[:1]

    @property
    def steps(self) -> int:
        return self.world - 1

    @property
    def reducing(self) -> int:
        """Steps whose received chunk is summed: a reduce-scatter's all, an all-gather's none."""
        return self.world - 1 if self.kind == "reduce_scatter" else 0


def _phase(kind: str, position: int, right: int, left: int, buf, world: int):
    """The phase's program (ring.py), its buffer cut into chunks when it first runs: a phase timed as a group
    never does (on meta tensors, 128 chunks cost a millisecond)."""
    phase = ring_reduce_scatter if kind == "reduce_scatter" else ring_all_gather
    return (yield from phase(position, right, left, buf.tensor_split(world)))


def _chunk_bytes(buf, world: int) -> list[int]:
    """Bytes of each of the `world` chunks `buf` is cut into (tensor_split: the first numel % world chunks hold
    one element more)."""
    narrow, wide = divmod(buf.numel(), world)
    element = buf.element_size()
    return [(narrow + 1) * element] * wide + [narrow * element] * (world - wide)


def reduce_as_ring(buffers: list[torch.Tensor], average: bool) -> None:
    """The ring all-reduce's arithmetic on the buffers of ring positions 0..N-1, in place: bit for bit
    what ring.py's reduce-scatter and all-gather leave in each (then / N if `average`)."""
    world, numel = len(buffers), buffers[0].numel()
    rows = _as_rows(buffers)  # positions x elements
    stacked = rows if rows is not None else torch.stack([buffer.reshape(-1) for buffer in buffers])
    row_stride, origin = stacked.stride(0), stacked.storage_offset()
    # tensor_split: the first `wide` chunks have `width` elements, the others one fewer
    width, wide = -(-numel // world), numel % world or world
    result = stacked.new_empty(numel)  # the sums, chunk after chunk: the two regions' totals are views of it
    totals = [result[:wide * width].view(wide, width), result[wide * width:].view(world - wide, width - 1)]
    for step in range(world):  # chunk c gathers position c's, then c+1's, ... round the ring
        for region, first, chunks, size, offset in _runs(step, world, width, wide, row_stride):
            # position c+step's chunk c, for each c of the run
            terms = stacked.as_strided((chunks, size), (row_stride + size, 1), origin + offset)
            if step == 0:
                totals[region][first:first + chunks] = terms
            else:  # the receiver's own chunk plus the partial sum: addition commutes exactly
                totals[region][first:first + chunks].add_(terms)
    if average:
        result = result.div_(world)
    if rows is not None:
        rows.copy_(result.expand(world, numel))
    else:
        for buffer in buffers:
            buffer.copy_(result.view_as(buffer))


def _as_rows(buffers: list[torch.Tensor]) -> torch.Tensor | None:
    """The buffers as the rows of one (positions x elements) view when they lie in one storage, flat, of one
    dtype, equally spaced in position order without overlapping (a job's gradient rows: train/replica.py's
    share_gradient_rows, or the same bucket of each); else None."""
    first = buffers[0]
    numel, origin = first.numel(), first.storage_offset()
    spacing = buffers[1].storage_offset() - origin if len(buffers) > 1 else numel
    storage = first.untyped_storage().data_ptr()
    if spacing < numel or any(
            buffer.dim() != 1 or buffer.stride(0) != 1 or buffer.dtype != first.dtype
            or buffer.untyped_storage().data_ptr() != storage or buffer.storage_offset() != origin + position * spacing
            for position, buffer in enumerate(buffers)):
        return None
    return first.as_strided((len(buffers), numel), (spacing, 1), origin)


def _runs(step: int, world: int, width: int, wide: int, row_stride: int):
    """(region, first chunk in it, chunks, chunk size, offset of the first term from the first position's
    start) for each run of chunks whose terms at `step` lie on one diagonal of the positions' rows (`row_stride`
    elements apart): same size, no wrap."""
    for region, (begin, end, size) in enumerate(((0, wide, width), (wide, world, width - 1))):
        for low, high in ((begin, min(end, world - step)), (max(begin, world - step), end)):
            if low < high:
                position = (low + step) % world
                start = low * width if region == 0 else wide * width + (low - wide) * size
                yield region, low - begin, high - low, size, position * row_stride + start
