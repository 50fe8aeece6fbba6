"""Ring all-reduces timed for a whole communicator group at once (simulated.py's fast path).

When every rank of a group posts the same ring all-reduce (or reduce-scatter,
all-gather: ring_schedule.py's programs) on ring routes that share no directed
link, the network times all of its steps in one call (`Network.time_ring`)
instead of flow by flow, and the sums are done for the group at once
(`reduce_as_ring`). SimCommunicator asks `timed_as_group` for each such post
and hands the eligible ones to `post`; the last rank's post times them all.

    rings = GroupRings(comm)
    if rings.timed_as_group(program):
        rings.post(state)
"""
from ..hw.network import Route
from .ring_schedule import RingAllReduce, RingPhase, reduce_as_ring

# Chunks (elements) up to which a ring all-reduce on real tensors is done as a group: its arithmetic stacks
# the group's buffers (one more copy of each) to add every chunk in one operation per step. Measured on this
# 2-core machine (2026-11-30): 8 ranks, 26 k floats 0.62 ms against 0.84 ms flow by flow; 1 M floats 13.4 ms
# against 8.4 ms.
GROUP_MAX_CHUNK = 16384


class GroupRings:
    """A communicator's ring all-reduces timed for the whole group at once: each held until every rank has posted
    it, then timed by the network, its sums done by ring_schedule.py. `comm` is the SimCommunicator; a post is a
    rank's program state (simulated.py's _RankProgram)."""

    __slots__ = ("comm", "posts", "count", "rings")

    def __init__(self, comm):
        self.comm = comm
        self.posts: dict[int, dict[int, tuple[float, object]]] = {}  # collective -> rank -> post
        self.count = [0] * comm.world  # ring collectives each rank posted to be timed as a group
        self.rings: dict[tuple, tuple[Route, ...] | None] = {}  # the program's group() -> Network.ring()

    def timed_as_group(self, program: RingAllReduce | RingPhase) -> bool:
        """Whether the network times it as a group: ring routes that share no directed link, and meta tensors
        or an all-reduce's chunks small enough that a transfer's Python costs more than copying its chunk once
        more (a reduce-scatter's or all-gather's numbers move flow by flow)."""
        if program.world < 2 or not program.buf.is_meta and (
                type(program) is RingPhase or program.buf.numel() > GROUP_MAX_CHUNK * program.world):
            return False
        group = program.group()  # cheap for every rank; the order is spelled out once per ring
        if group not in self.rings:
            comm = self.comm
            self.rings[group] = comm.network.ring([comm.nodes[rank] for rank in program.order()])
        return self.rings[group] is not None

    def post(self, state) -> None:
        """Hold the rank's ring all-reduce until every rank has posted its own; then time them all."""
        number = self.count[state.rank]
        self.count[state.rank] += 1
        posts = self.posts.setdefault(number, {})
        posts[state.rank] = (self.comm.network.now, state)
        if len(posts) == self.comm.world:
            del self.posts[number]
            self._time(posts)

    def _time(self, posts: dict[int, tuple[float, object]]) -> None:
        first = posts[0][1].program
        shape = (first.group(), first.buf.numel(), first.buf.element_size())
        for _, state in posts.values():
            program = state.program
            if (program.group(), program.buf.numel(), program.buf.element_size()) != shape:
                raise RuntimeError(f"rank {state.rank} posts a ring collective that does not match rank 0's")
        comm = self.comm
        order, network = first.order(), comm.network
        states = [posts[rank][1] for rank in order]
        times = network.time_ring(self.rings[shape[0]], [posts[rank][0] for rank in order], first.chunk_bytes(),
                                  [state.label for state in states], first.steps, first.reducing)
        if not first.buf.is_meta:
            reduce_as_ring([state.program.buf for state in states], first.average)
        if comm.ledgers is not None:
            for position, landing, nbytes in times.staging:
                # A landing before now (ranks that posted before the last) is counted now, when the rank's
                # other memory may have shrunk already: the one figure not the flow path's in that case.
                network.at(max(landing, network.now), lambda ledger=comm.ledgers[order[position]], nbytes=nbytes: (
                    ledger.alloc("comm_buffers", nbytes), ledger.free("comm_buffers", nbytes)))
        for position, start, end, nbytes in times.spans:
            state = states[position]
            comm.bytes_by_label[state.label] = comm.bytes_by_label.get(state.label, 0) + nbytes
            if comm.log is not None:
                comm.log.count(comm.global_ranks[state.rank], "communication", start, end, state.label)
            comm._shown_grows(state, start, end, nbytes)
        for state in states:
            comm._show(state)
        for state, end in zip(states, times.end):
            network.at(end, lambda state=state: self._end(state))

    def _end(self, state) -> None:
        del self.comm._running[state.rank]
        state.program.close()  # never stepped: its work was timed as a whole
        state.done.succeed(state.program.buf)
