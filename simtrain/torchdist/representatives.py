"""Ranks that run alike, run once: one representative per class, the others stood in for on the network.

With numerics off (numerics_off.py) a data-parallel rank of FSDP2 x tensor
parallelism runs the same operators on tensors of the same shapes, and issues
the same collectives, as every other data-parallel rank with its tensor-parallel
coordinate: only their token ids differ, and with fake tensors no value reaches
the control flow. So do the tensor-parallel ranks of one replica (the first is
`distribute_tensor`'s source: its scatters send what the others receive, the
same bytes and memory on each). The user declares which ranks those are, as a
mesh shape laid out row-major (as `init_device_mesh` lays it out) and the
dimensions along which ranks run alike:

    spawn(train, world=256, numerics=False, representatives=Representatives(mesh_shape=(32, 8), alike_dims=(0, 1)))

A class is the ranks that differ only in their coordinates along `alike_dims`;
its member at coordinate 0 is its representative and the only one whose
function runs. Whenever a representative posts a collective (or a send or a
recv), each member it represents posts its own part of it at that instant, on
the network, with a payload of the same shape (process_group.py), in the group
moved to the member's coordinates along the alike dimensions the group does not
span: the group itself where it spans them all (a "dp" group, the world), a
mirror of it elsewhere (the "tp" group of another data-parallel replica). A
group that spans an alike dimension in part is refused
(`RepresentativesUnsupported`), as are an all-to-all and a send or recv across
one. So the network carries every flow of the full run, at the times the full
run starts them, as long as every member ends each collective when its
representative does: on identical devices and a topology that treats mirrored
groups alike (a switch, nodes of one shape). A represented rank reports its
representative's compute time and memory, and its end time (or, if the
representative ended with its last collective, when its own part of that
ended); its bytes and communication time are its own flows'. Its return value
is its representative's.

One more member is a witness: rank 0's class member one further along every
alike dimension runs its function too, detached: its collectives complete at
once and move nothing (their real-tensor results are rank 0's values), and what
it does (each call with its group, kind, sizes and the bytes the rank has
allocated by then, the FLOPs between calls) is recorded beside rank 0's. A rank
whose control flow or shapes depend on its coordinate (`if dp_rank == 0: ...`)
makes the two records differ: `RepresentativesDiverge`, naming the first
difference. What it cannot see: a difference in another class only, one at
coordinates other than rank 0's and the witness's, or a rank that holds the same
allocations for longer (a view that keeps a larger tensor alive).

    classes = Classes(Representatives((2, 4), alike_dims=(0,)), world=8)
    classes.runs(5)                        # False: represented by rank 1
    classes.stand_ins([0, 1, 2, 3], 0)     # [(4, [4, 5, 6, 7], 0)]: member 4 posts in the mirror at index 0
"""
import itertools
import math
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_leaves

from ..errors import RepresentativesDiverge, RepresentativesUnsupported, ScenarioError


@dataclass(frozen=True)
class Representatives:
    """Ranks of a `mesh_shape` mesh (row-major, as init_device_mesh lays it out) that differ only in their
    coordinates along the dimensions `alike_dims` run alike: one of them runs for all."""

    mesh_shape: tuple[int, ...]
    alike_dims: tuple[int, ...] = (0,)


class Classes:
    """The classes of ranks alike along some dimensions of a mesh, and what their members post in a group."""

    def __init__(self, spec: Representatives, world: int):
        field = "simtrain.dist.spawn: representatives"
        if not isinstance(spec, Representatives):
            raise ScenarioError(f"{field}: expected simtrain.dist.Representatives(mesh_shape, alike_dims), "
                                f"got {spec!r}")
        shape = tuple(spec.mesh_shape)
        if not shape or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape):
            raise ScenarioError(f"{field}.mesh_shape: expected positive integers, got {spec.mesh_shape!r}")
        if math.prod(shape) != world:
            raise ScenarioError(f"{field}.mesh_shape: {shape} holds {math.prod(shape)} ranks, the world is {world}")
        dims = tuple(spec.alike_dims) if isinstance(spec.alike_dims, (tuple, list)) else None
        if (not dims or len(set(dims)) != len(dims)
                or any(isinstance(d, bool) or d not in range(len(shape)) for d in dims)):
            raise ScenarioError(f"{field}.alike_dims: expected distinct dimensions of {shape} (0 to "
                                f"{len(shape) - 1}), got {spec.alike_dims!r}")
        dims = sorted(dims)
        self.counts = [shape[d] for d in dims]  # members per class along each alike dimension
        self.strides = [math.prod(shape[d + 1:]) for d in dims]  # rank distance between neighbours along it
        self.offsets = list(itertools.product(*(range(count) for count in self.counts)))[1:]  # but (0, ..., 0)
        # rank 0's class member one further along every alike dimension: run detached
        self.witness = self.moved(0, tuple(min(1, count - 1) for count in self.counts)) if self.offsets else None

    def coordinates(self, rank: int) -> tuple[int, ...]:
        """The rank's coordinates along the alike dimensions: its place in its class."""
        return tuple(rank // stride % count for stride, count in zip(self.strides, self.counts))

    def moved(self, rank: int, by: tuple[int, ...]) -> int:
        """The member of `rank`'s class `by` coordinates further along each alike dimension (cyclically)."""
        for coordinate, step, stride, count in zip(self.coordinates(rank), by, self.strides, self.counts):
            rank += ((coordinate + step) % count - coordinate) * stride
        return rank

    def representative(self, rank: int) -> int:
        return self.moved(rank, tuple(-c for c in self.coordinates(rank)))

    def runs(self, rank: int) -> bool:
        """Whether the rank's function runs: a representative or the witness."""
        return not any(self.coordinates(rank)) or rank == self.witness

    def stand_ins(self, ranks: list[int], me: int, call: str = "") -> list[tuple[int, list[int], int]]:
        """For group `ranks` in which representative `ranks[me]` posts `call`: (member, the group it posts in,
        its index there) for each member the representative stands for."""
        members = set(ranks)
        spanned = []  # per alike dimension: whether the group holds whole classes along it
        for axis in range(len(self.counts)):
            step = tuple(int(a == axis) for a in range(len(self.counts)))
            varies = len({self.coordinates(rank)[axis] for rank in ranks}) > 1
            if varies and members != {self.moved(rank, step) for rank in ranks}:
                raise RepresentativesUnsupported(
                    f"representatives: group {ranks} spans part of an alike mesh dimension ({self.counts[axis]} "
                    f"ranks along it, {self.strides[axis]} apart): its ranks' classes cannot be represented")
            spanned.append(varies)
        if any(spanned) and call.startswith(("all_to_all", "send", "recv")):
            raise RepresentativesUnsupported(f"representatives: {call.partition(' ')[0]} across an alike mesh "
                                             f"dimension (group {ranks}) is not supported")
        stand_ins = []
        for offset in self.offsets:
            member = self.moved(ranks[me], offset)
            along = tuple(0 if span else step for span, step in zip(spanned, offset))  # to the group's mirror
            mirror = [self.moved(rank, along) for rank in ranks] if any(along) else list(ranks)
            stand_ins.append((member, mirror, mirror.index(member)))
        return stand_ins


class Witness:
    """What rank 0 and the witness did, in order, compared once both have ended: each call with its group and
    the bytes the rank has allocated by then, and the FLOPs (by dtype) computed between two calls."""

    def __init__(self, classes: Classes):
        self.classes = classes
        self.records: dict[int, list[tuple]] = {0: [], classes.witness: []}
        self._flops: dict[int, dict] = {0: {}, classes.witness: {}}  # computed since the rank's last call
        self._results: list[_Values] = []  # the values of rank 0's calls' real tensors, in order
        self._follow: dict[int, object] = {}  # the witness's call # -> what to do once rank 0 posts it
        self._calls = 0  # calls the witness has made

    def watches(self, rank: int) -> bool:
        return rank in self.records

    def computed(self, rank: int, flops: dict) -> None:
        for dtype, count in flops.items():
            self._flops[rank][dtype] = self._flops[rank].get(dtype, 0) + count

    def called(self, rank: int, ranks: list[int], call: str, allocated_bytes: int) -> None:
        """Rank `rank` called `call` in group `ranks` (the witness's moved back to rank 0's coordinate), having
        allocated `allocated_bytes` of tensors so far (freed or not: the same whenever its collectives end)."""
        self.ended(rank)
        back = tuple(-c for c in self.classes.coordinates(rank))
        self.records[rank].append(("call", sorted(self.classes.moved(r, back) for r in ranks),
                                   f"{call}, having allocated {allocated_bytes} B"))

    def posted(self, done, result) -> None:
        """Rank 0 posted a call: `done` fires when its `result` is in. Its real tensors' values are copied then,
        for the witness (holding the tensors themselves would keep them on rank 0's memory ledger)."""
        values = _Values()
        if any(_is_real(leaf) for leaf in tree_leaves(result)):
            def copy(_=None):
                with torch._C._DisableTorchDispatch():
                    values.set([leaf.clone() if _is_real(leaf) else None for leaf in tree_leaves(result)])

            if done.callbacks is None:  # processed already
                copy()
            else:
                done.callbacks.append(copy)
        else:
            values.set([])
        self._results.append(values)
        follow = self._follow.pop(len(self._results) - 1, None)
        if follow is not None:
            values.then(follow)

    def witness_done(self, env, result):
        """The witness's call: an event that has fired, moving nothing; where its result holds real tensors
        (integers of numerics off), one that fires once rank 0's call of the same number has ended, with rank 0's
        values copied in (the witness's, as an alike rank's, are rank 0's)."""
        done, index = env.event(), self._calls
        self._calls += 1
        if not any(_is_real(leaf) for leaf in tree_leaves(result)):
            return done.succeed(result)

        def copied(values: list) -> None:
            with torch._C._DisableTorchDispatch():
                for mine, theirs in zip(tree_leaves(result), values):
                    if _is_real(mine) and theirs is not None:
                        mine.copy_(theirs)
            done.succeed(result)

        if index < len(self._results):
            self._results[index].then(copied)
        else:
            self._follow[index] = copied
        return done

    def ended(self, rank: int) -> None:
        if self._flops[rank]:
            self.records[rank].append(("compute", None, self._flops[rank]))
            self._flops[rank] = {}

    def check(self) -> None:
        """RepresentativesDiverge at the first difference between the two records."""
        witness = self.classes.witness
        mine, theirs = self.records[0], self.records[witness]
        for index in range(max(len(mine), len(theirs))):
            ours = mine[index] if index < len(mine) else None
            its = theirs[index] if index < len(theirs) else None
            if ours != its:
                raise RepresentativesDiverge(
                    f"representatives: rank {witness}, which rank 0 represents, diverges from it at its operation "
                    f"#{index}: rank 0 {_said(ours)}, rank {witness} {_said(its)} (ranks alike along the mesh "
                    f"dimension must run the same operations on the same shapes)")


class _Values:
    """The values of a call's real tensors, once they are in; what to do with them then."""

    def __init__(self):
        self.values, self._then = None, []

    def set(self, values: list) -> None:
        self.values = values
        for then in self._then:
            then(values)
        self._then = []

    def then(self, action) -> None:
        if self.values is None:
            self._then.append(action)
        else:
            action(self.values)


def _is_real(value) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor)


def _said(entry) -> str:
    if entry is None:
        return "had ended"
    kind, ranks, what = entry
    if kind == "compute":
        return "computed " + ", ".join(f"{flops:.6g} FLOP of {str(dtype).removeprefix('torch.')}"
                                       for dtype, flops in what.items())
    return f"called {what} on group {ranks}"
