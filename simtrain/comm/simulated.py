"""Runs per-rank collective programs on the simulated network.

    comm = SimCommunicator(network, nodes=["gpu0", "gpu1"], log=log)
    done = comm.run(rank, ring_all_reduce(rank, 2, grads, average=True))
    yield done          # inside the rank's simpy process

Each yield of a program posts its operations. A Send and its matching Recv
start a flow on the network once both are posted (rendezvous); when the flow
ends the data is delivered (copied, or summed for a reducing Recv) and, once
all operations of the yield are done, the program resumes at that simulated
instant. A `Concurrently` yield starts each sub-program as a child of the
rank's program; children advance on their own and the parent resumes when the
last one ends. Operations match per (src, dst, tag). Programs are stepped from
the network's completion callbacks, so a collective costs no simpy event per
rank per step: this is what lets a ring all-reduce over thousands of devices
run in seconds.

On meta tensors (numerics off) nothing is copied or summed; the timing is the
same. Time a rank spends with a transfer of its own in flight is counted as
"communication"; time it waits for a peer to post is left as idle. The trace
shows each rank's collective as one span, from its first transfer to its last.

This is the one mailbox: collective programs, a pipeline's activations and
gradients (schemes/pipeline.py) and the `simtrain` torch.distributed backend's
send and recv (torchdist/process_group.py) all match here. `run` is a
blocking call (the rank's time is charged from its start); `post` starts a
program beside the rank's own (torch's isend / irecv) and returns a handle,
charged nothing until `wait(handle, idle)`: from then on, time with one of
its transfers in flight is communication, and time waiting for a peer to
post is idle, logged as a span of kind `idle` when it is named ("bubble").
Its span carries the bytes of the transfers that ended while it was awaited,
and the handle's `charged_s` the communication seconds it was credited.

    handle = comm.post(0, send_program, "pp_p2p")     # the flow starts once the peer posted its Recv
    yield comm.wait(other_handle, idle="bubble")       # the program's value, when it has ended

A communicator built `exclusive` is promised that its links carry nothing but
its own collectives. There, a ring all-reduce whose ring routes share no
directed link is timed by the network (`Network.time_ring`), and its sums done
(ring_schedule.py), for the whole group at once when its last rank posts it:
the same times, spans, bytes, link figures, staging peaks and sums as flow by
flow, with no per-transfer Python.
On real tensors that holds for chunks up to GROUP_MAX_CHUNK elements (group_rings.py), past
which moving them one by one is the quicker way to the same sums. A ring
reduce-scatter or all-gather alone (ring_schedule.py's `RingPhase`) is timed
the same way on meta tensors.

An `NcclCall` (nccl.py: a rank's part of a collective as NCCL runs it) starts
after its launch latency, a span of the rank's communication named by NCCL's
choice ("nccl ring/LL 4096 B"); its transfers move on its protocol's wire (a
flow of its bytes divided by the protocol's fraction of the route's rate,
rounded up to a whole byte: what the links count; after the route's latency
plus the protocol's), and where its algorithm
reduces in a switch, the switch's program runs as one more rank of the
communicator (a helper: no device, no span, no ledger), started by the first
rank that posts the call, once the previous call's switch programs ended.

On a host whose ranks share its CPU cores (`host`: hw/host_cores.py's
HostMessages, `cluster.host_message_work`), each message's software work runs
on a core before its flow starts.
"""
import math
from collections import deque
from functools import partial

import simpy

from ..errors import CollectiveMismatch
from ..hw.device import MemoryLedger
from ..hw.eventlog import EventLog, Message
from ..hw.network import Network
from .nccl import NcclCall
from .ops import Concurrently, Send
from .group_rings import GroupRings
from .ring_schedule import RingAllReduce, RingPhase


_GROUP_TIMED = (RingAllReduce, RingPhase)  # the programs a group's ring schedule can time at once


class _RankProgram:
    """One rank's program (or a sub-program of it) in flight and the bookkeeping of its current yield.

    The rank's communication span is kept on `owner`, the rank's top-level program."""

    __slots__ = ("rank", "program", "done", "label", "parent", "index", "owner", "results", "single",
                 "outstanding", "in_flight", "span_start", "span_end", "span_bytes", "shown", "comm", "posted",
                 "charged", "charged_s", "idle", "idle_from", "wire", "op", "posted_bytes", "first_s")

    def __init__(self, rank, program, done, label, parent=None, index=0):
        self.rank = rank
        self.program = program
        self.done = done
        self.label = label
        self.parent = parent  # the program that yielded Concurrently, for a sub-program
        self.index = index  # its place among the parent's sub-programs
        self.owner = self if parent is None else parent.owner
        self.results = None
        self.single = False
        self.outstanding = 0  # operations of the current yield not done yet
        self.in_flight = 0  # transfers of this rank moving now
        self.span_start = None  # start of the current run of communication
        self.span_end = None  # when that run last had nothing in flight
        self.span_bytes = 0
        self.shown = None  # [first start, last end, bytes] of the collective's runs of communication so far
        self.comm = None  # for a posted program (a handle): its communicator
        self.posted = False  # started by `post`: runs beside the rank's program
        self.charged = True  # its time is the rank's: a `run`, or a posted program being awaited
        self.charged_s = 0.0  # the communication seconds credited to the rank for it
        self.idle = None  # an awaited program's span kind for waiting on a peer (None: not logged)
        self.idle_from = None  # since when an awaited program waits with nothing in flight
        self.wire = None  # an NcclCall's protocol (nccl.Wire), on the top-level program; None: the links as they are
        self.op = program_name(program) if parent is None else ""  # what the rank's span names (program_name)
        self.posted_bytes = 0  # a posted program's bytes, counted as sent: its span shows them (not again counted)
        self.first_s = None  # a posted program's first transfer began then (its span shows the awaited part)


def program_name(program) -> str:
    """The collective a rank's program runs, as its span names it: an NCCL call's collective, a ring phase's
    kind, a wrapped program's class, a generator's function ("ring_all_reduce", "pairwise_all_to_all")."""
    if type(program) is NcclCall:
        return program.collective
    if type(program) is RingPhase:
        return program.kind
    return getattr(program, "__name__", type(program).__name__)


class _Mailbox:
    """Posted, not yet matched operations from one rank to another with one tag, in posting order."""

    __slots__ = ("sends", "recvs")

    def __init__(self):
        self.sends = deque()  # (program, Send)
        self.recvs = deque()  # (program, index in its yield, Recv)


class _Helpers:
    """The switches' programs of a communicator's NcclCalls, as ranks after its own (the module docstring): one
    call's at a time, in the order the calls were posted, each started by the call's first rank to post it."""

    __slots__ = ("comm", "calls", "due", "started", "running")

    def __init__(self, comm: "SimCommunicator"):
        self.comm = comm
        self.calls = [0] * comm.world  # calls with helpers each rank posted
        self.due = deque()  # calls whose helpers wait for the previous call's to end
        self.started = 0  # calls whose helpers have started
        self.running = 0  # helper programs of the current call not ended yet

    def posted(self, rank: int, call: NcclCall, at: float) -> None:
        """Rank `rank` posted `call`, whose program starts at `at`."""
        self.calls[rank] += 1
        if self.calls[rank] > self.started + len(self.due):  # the first rank to post it
            self.due.append(call)
            if self.running == 0 and len(self.due) == 1:
                self.comm.network.at(at, self._start)

    def ended(self) -> None:
        """A helper program ended: once all of the call's have, the next call's start."""
        self.running -= 1
        if self.running == 0 and self.due:
            self._start()

    def _start(self) -> None:
        comm = self.comm
        call = self.due.popleft()
        self.started += 1
        nodes, programs = call.helpers()
        if comm.nodes[comm.world:] != nodes:
            self._add(nodes)
        self.running = len(programs)
        for index, program in enumerate(programs):
            state = _RankProgram(comm.world + index, program, comm.env.event(), "helper")
            state.charged, state.wire = False, call.wire
            comm._advance(state, None)

    def _add(self, nodes: list[str]) -> None:
        """Network nodes `nodes` become ranks world, world + 1, ...: the mailboxes' keys are renumbered."""
        comm = self.comm
        if len(comm.nodes) > comm.world:
            raise RuntimeError(f"helpers {nodes} differ from this communicator's {comm.nodes[comm.world:]}")
        old = comm._stride
        comm.nodes.extend(nodes)
        new = comm._stride = len(comm.nodes)
        renumbered = {}
        for key, mailbox in comm._mailboxes.items():
            tag, pair = divmod(key, old * old)
            src, dst = divmod(pair, old)
            renumbered[(tag * new + src) * new + dst] = mailbox
        comm._mailboxes = renumbered


class SimCommunicator:
    """A group of ranks on network nodes that run collective programs together."""

    def __init__(self, network: Network, nodes: list[str], log: EventLog | None = None,
                 ledgers: list[MemoryLedger] | None = None, global_ranks: list[int] | None = None,
                 exclusive: bool = False, copies: int = 1, host=None):
        self.network = network
        self.env: simpy.Environment = network.env
        self.nodes = list(nodes)
        self.world = len(self.nodes)
        self._stride = self.world  # ranks in the mailbox keys: the world, and the helpers (switches) once added
        self.log = log
        self.ledgers = ledgers
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(self.world))
        self.group = tuple(self.global_ranks)  # what its spans name as their group (one tuple, shared)
        self._mailboxes: dict[int, _Mailbox] = {}  # key (tag * world + src) * world + dst
        self._running: dict[int, _RankProgram] = {}
        self._posted: dict[int, list[_RankProgram]] = {}  # rank -> its posted programs not ended yet
        self.bytes_by_label: dict[str, int] = {}  # bytes sent by the group's programs, by their label
        # The host's messages (hw/host_cores.py HostMessages): each Send's software work on the host's cores
        # before its flow; None: none. Then nothing is timed as a group.
        self.host = host
        self.exclusive = exclusive and host is None
        # Each of its ranks stands for `copies` ranks (strategies/representatives.py): the bytes it logs count
        # that many times.
        self.copies = copies
        self._group_rings = GroupRings(self)  # its ring all-reduces timed as a group, when exclusive
        self._helpers = _Helpers(self)  # the switches' programs of its NcclCalls

    def run(self, rank: int, program, label: str = "all_reduce") -> simpy.Event:
        """Start `program` for group rank `rank` now; the event fires with its return value."""
        if rank in self._running:
            raise RuntimeError(f"rank {rank} is already running a collective in this group")
        state = _RankProgram(rank, program, self.env.event(), label)
        self._running[rank] = state
        if type(program) is NcclCall:
            self._call(state, program)
        elif self.exclusive and type(program) in _GROUP_TIMED and self._group_rings.timed_as_group(program):
            self._group_rings.post(state)
        else:
            self._advance(state, None)
        return state.done

    def post(self, rank: int, program, label: str) -> _RankProgram:
        """Start `program` for group rank `rank` beside the rank's own; returns its handle for `wait`."""
        state = _RankProgram(rank, program, self.env.event(), label)
        state.comm, state.posted, state.charged = self, True, False
        self._posted.setdefault(rank, []).append(state)
        if type(program) is NcclCall:
            self._call(state, program)
        else:
            self._advance(state, None)
        return state

    def wait(self, handle: _RankProgram, idle: str | None = None) -> simpy.Event:
        """The rank waits on a posted program from now; the event fires with its value once it has ended."""
        if not handle.done.triggered:
            handle.charged, handle.idle = True, idle
            if handle.in_flight:
                handle.span_start = self.network.now
            else:
                handle.idle_from = self.network.now
        return handle.done

    def _call(self, state: _RankProgram, call: NcclCall) -> None:
        """Start an NcclCall: its launch latency (a span named by NCCL's choice), then its program on its wire;
        its switches' programs once per call (the module docstring)."""
        state.program, state.wire = call.program, call.wire
        now = self.network.now
        end = now + call.launch_s
        if self.log is not None:
            if state.charged:
                self.log.count(self.global_ranks[state.rank], "communication", now, end, call.name)
                state.charged_s += end - now
            self.log.show(self.global_ranks[state.rank], "communication", call.name, now, end, group=self.group,
                          op=f"{call.collective} launch")
        if call.helpers is not None:
            self._helpers.posted(state.rank, call, end)
        self.network.at(end, lambda: self._advance(state, None))

    def abandon(self, rank: int) -> None:
        """Rank `rank` is gone (its device was lost): its posted operations that no peer has matched are
        dropped, so none of them ever starts a transfer; peers waiting on it wait on."""
        for mailbox in self._mailboxes.values():
            mailbox.sends = deque(entry for entry in mailbox.sends if entry[0].rank != rank)
            mailbox.recvs = deque(entry for entry in mailbox.recvs if entry[0].rank != rank)
        state = self._running.pop(rank, None)
        if state is not None:
            self._show(state)  # the part it did
        self._posted.pop(rank, None)

    def stuck(self) -> list[int]:
        """Ranks whose programs wait for a peer that never posted (a deadlock when the clock has stopped): a
        program run, or a posted one awaited, that has not ended."""
        return sorted({*self._running, *(rank for rank, posted in self._posted.items()
                                         if any(state.charged for state in posted))})

    def _advance(self, state: _RankProgram, value) -> None:
        try:
            ops = state.program.send(value)
        except StopIteration as stop:
            parent = state.parent
            if parent is None:
                self._close_span(state)
                self._show(state)
                if state.rank >= self.world:
                    self._helpers.ended()
                elif state.posted:
                    self._posted[state.rank].remove(state)
                else:
                    del self._running[state.rank]
                state.done.succeed(stop.value)
                state.owner = state.results = None  # no cycle holds its buffers until the next collection
            else:
                parent.results[state.index] = stop.value
                parent.outstanding -= 1
                if parent.outstanding == 0:
                    self._advance(parent, parent.results)
            return
        if type(ops) is Concurrently:
            self._fork(state, ops.programs)
            return
        state.single = type(ops) is not list
        if state.single:
            ops = (ops,)
        state.results = [None] * len(ops)
        state.outstanding = len(ops)
        rank, world, mailboxes = state.rank, self._stride, self._mailboxes
        for index, op in enumerate(ops):
            # The mailbox of (src, dst, tag), looked up inline: this loop runs once per operation.
            if type(op) is Send:
                key = (op.tag * world + rank) * world + op.dst
                mailbox = mailboxes.get(key)
                if mailbox is None:
                    mailbox = mailboxes[key] = _Mailbox()
                if mailbox.recvs:
                    self._start(state, op, *mailbox.recvs.popleft())
                else:
                    mailbox.sends.append((state, op))
            else:
                key = (op.tag * world + op.src) * world + rank
                mailbox = mailboxes.get(key)
                if mailbox is None:
                    mailbox = mailboxes[key] = _Mailbox()
                if mailbox.sends:
                    self._start(*mailbox.sends.popleft(), state, index, op)
                else:
                    mailbox.recvs.append((state, index, op))
        if not ops:
            self._advance(state, [])

    def _fork(self, state: _RankProgram, programs) -> None:
        """Start `programs` as children of `state`; it resumes with their values when all have ended."""
        programs = list(programs)
        state.single = False
        state.results = [None] * len(programs)
        state.outstanding = len(programs)
        if not programs:
            self._advance(state, [])
        for index, program in enumerate(programs):
            self._advance(_RankProgram(state.rank, program, None, state.label, state, index), None)

    def _start(self, sender: _RankProgram, send: Send, receiver: _RankProgram, recv_index: int, recv) -> None:
        payload, out = send.tensor, recv.out
        nbytes = payload.nbytes
        if nbytes != out.nbytes:
            raise CollectiveMismatch(f"rank {self.global_ranks[sender.rank]} sends {nbytes} B to rank "
                                     f"{self.global_ranks[receiver.rank]} (tag {send.tag}), which receives "
                                     f"{out.nbytes} B")
        now = self.network.now
        owner = sender.owner
        self._transfer_begins(owner, now)
        self._transfer_begins(receiver.owner, now)
        if owner.posted:  # a posted send (a pipeline's) is counted when sent: its sender never awaits it
            self.bytes_by_label[owner.label] = self.bytes_by_label.get(owner.label, 0) + nbytes
            owner.posted_bytes += nbytes
            if self.log is not None:
                self.log.count_bytes(self.global_ranks[sender.rank], "communication", owner.label,
                                     nbytes * self.copies)
        else:
            owner.span_bytes += nbytes
        staging = (self.ledgers[receiver.rank] if recv.reduce and self.ledgers is not None
                   and receiver.rank < self.world else None)
        if staging is not None:
            staging.alloc("comm_buffers", nbytes)

        # a posted message's ends, for a Chakra trace's sends and receives (hw/eventlog.py keep_messages)
        keep = owner.posted and self.log is not None and self.log.messages is not None
        if keep:
            message = (self.global_ranks[sender.rank], self.global_ranks[receiver.rank], send.tag, nbytes, now)

        def delivered(flow):
            if keep:
                self.log.message(Message(*message, flow.end, owner.label, owner.op))
            if not out.is_meta:
                if recv.reduce:
                    out.add_(payload)
                else:
                    out.copy_(payload)
            if staging is not None:
                staging.free("comm_buffers", nbytes)
            receiver.results[recv_index] = out
            now = flow.end
            self._transfer_ends(sender, now)
            self._transfer_ends(receiver, now)

        src, dst, wire = self.nodes[sender.rank], self.nodes[receiver.rank], owner.wire
        if wire is None:
            if self.host is not None:  # the sender's CPU does the message's software work first
                self.host.send(nbytes, partial(self.network.start_flow, src, dst, nbytes, on_done=delivered,
                                               label=sender.label))
                return
            self.network.start_flow(src, dst, nbytes, on_done=delivered, label=sender.label)
            return
        fraction, extra_s = wire.of(self.network.route(src, dst).path)
        flow_bytes = nbytes if fraction == 1.0 else math.ceil(nbytes / fraction)  # the bytes on the wire
        start = partial(self.network.start_flow, src, dst, flow_bytes, on_done=delivered, label=sender.label)
        if extra_s:
            self.network.at(now + extra_s, start)
        else:
            start()

    def _transfer_begins(self, state: _RankProgram, now: float) -> None:
        if state.posted and state.first_s is None:
            state.first_s = now
        if state.idle_from is not None:  # an awaited program's wait for its peer ends
            if state.idle is not None and now > state.idle_from and self.log is not None:
                self.log.span(self.global_ranks[state.rank], state.idle, state.idle, state.idle_from, now)
            state.idle_from = None
        if state.in_flight == 0 and state.charged:
            if state.span_start is not None and state.span_end < now:
                self._close_span(state)
            if state.span_start is None:
                state.span_start = now
        state.in_flight += 1

    def _transfer_ends(self, state: _RankProgram, now: float) -> None:
        owner = state.owner
        owner.in_flight -= 1
        if owner.in_flight == 0:
            owner.span_end = now
            if owner.posted and owner.charged:
                owner.idle_from = now
        state.outstanding -= 1
        if state.outstanding == 0:
            self._advance(state, state.results[0] if state.single else state.results)

    def _close_span(self, state: _RankProgram) -> None:
        if state.span_start is not None:
            if not state.posted:
                self.bytes_by_label[state.label] = self.bytes_by_label.get(state.label, 0) + state.span_bytes
            state.charged_s += state.span_end - state.span_start
            if self.log is not None:
                self.log.count(self.global_ranks[state.rank], "communication", state.span_start, state.span_end,
                               state.label)
            self._shown_grows(state, state.span_start, state.span_end, state.span_bytes)
        state.span_start = state.span_end = None
        state.span_bytes = 0

    @staticmethod
    def _shown_grows(state: _RankProgram, start: float, end: float, nbytes: int) -> None:
        if state.shown is None:
            state.shown = [start, end, nbytes]
        else:
            state.shown[1:] = end, state.shown[2] + nbytes

    def _show(self, state: _RankProgram) -> None:
        """The rank's collective, one span in the trace: its first transfer to its last, waits included."""
        if state.shown is not None and self.log is not None:
            start, end, nbytes = state.shown
            self.log.show(self.global_ranks[state.rank], "communication", state.label, start, end,
                          nbytes=nbytes * self.copies, group=self.group, op=state.op,
                          counted_bytes=state.posted_bytes * self.copies, posted_s=state.first_s)
            state.posted_bytes, state.first_s = 0, None
        state.shown = None
