"""Runs the same per-rank collective and point-to-point programs on a real torch.distributed backend.

Inside a process of an initialized process group (gloo here, any backend that
has isend/irecv), a `GlooCommunicator` over some of the world's ranks (its own
process group) runs a program's Send and Recv as real point-to-point calls,
their `tag` the calls' tag; a `Concurrently` yield runs each sub-program in its
own thread, so that each advances as its own transfers complete:

    dist.init_process_group("gloo", ...)
    comm = GlooCommunicator(range(dist.get_world_size()))       # every process builds every group, in order
    comm.run(dist.get_rank(), ring_all_reduce(dist.get_rank(), dist.get_world_size(), buf))

`post(rank, program)` starts a program without blocking: its first yield's
isend / irecv are issued there and then; `wait(handle)` completes it (torch's
`work.wait()`) and returns its value; `handle.sent` is then the bytes the
program's sends moved (a native collective, which sends nothing of its own,
counts none). That is the check that a simulated
collective or pipeline message is a real algorithm: the tests run every
program both ways and compare the numbers.
"""
import threading

import torch
import torch.distributed as dist

from .ops import Concurrently, Send


class GlooCommunicator:
    """Ranks `ranks` (global ranks, in group-rank order) of the torch.distributed world, as one group.

    Constructing it is a collective call of the whole world (torch's `new_group`): every process builds
    every communicator, in the same order, whether or not it is a member."""

    def __init__(self, ranks):
        self.ranks = list(ranks)
        self.world = len(self.ranks)
        # its own process group, even over the whole world: its tags never meet another group's
        self.group = dist.new_group(sorted(self.ranks))

    def run(self, rank: int, program, label: str = ""):
        """Drive `program`, group rank `rank`'s, to its end; return its value."""
        return self.wait(self.post(rank, program, label))

    def post(self, rank: int, program, label: str = "") -> "_Running":
        """Start `program` without blocking; `wait` on the handle returns its value."""
        return _Running(program, self, label)

    def wait(self, handle: "_Running", idle: str | None = None):
        return handle.finish()


def run_program(program, comm: GlooCommunicator | None = None):
    """Drive `program` to its end with torch.distributed isend/irecv (ranks of `comm`, or of the whole world
    when None); return its value."""
    return _Running(program, comm).finish()


class _Running:
    """A program in flight: the requests of its current yield are issued, not yet waited for."""

    def __init__(self, program, comm: GlooCommunicator | None, label: str = ""):
        self.program, self.comm, self.label = program, comm, label
        self.done, self.value = False, None
        self.sent = 0  # bytes its sends (and its sub-programs' sends) moved
        self.charged_s = 0.0  # awaited by a step program: the communication seconds credited for it
        self._pending = None  # (requests, landings, result count, single) of the current yield
        self._advance(None)

    def finish(self):
        """Wait for each yield's requests in turn, to the program's end; its value."""
        while not self.done:
            requests, landings, count, single = self._pending
            for request in requests:
                request.wait()
            results = [None] * count
            for index, op, landing in landings:
                if op.reduce:
                    op.out.add_(landing)
                else:
                    op.out.copy_(landing)
                results[index] = op.out
            self._advance(results[0] if single else results)
        return self.value

    def _advance(self, value) -> None:
        """Resume the program with `value`; issue the requests of its next yield (or record its value)."""
        while True:
            try:
                ops = self.program.send(value)
            except StopIteration as stop:
                self.done, self.value = True, stop.value
                return
            if type(ops) is not Concurrently:
                break
            value, sent = _run_concurrently(ops.programs, self.comm)
            self.sent += sent
        single = not isinstance(ops, list)
        if single:
            ops = [ops]
        ranks = self.comm.ranks if self.comm is not None else None
        group = self.comm.group if self.comm is not None else None
        requests, landings = [], []
        for index, op in enumerate(ops):
            if type(op) is Send:
                peer = ranks[op.dst] if ranks is not None else op.dst
                requests.append(dist.isend(op.tensor.contiguous(), peer, group=group, tag=op.tag))
                self.sent += op.tensor.nbytes
            else:
                peer = ranks[op.src] if ranks is not None else op.src
                landing = torch.empty_like(op.out)
                requests.append(dist.irecv(landing, peer, group=group, tag=op.tag))
                landings.append((index, op, landing))
        self._pending = (requests, landings, len(ops), single)


def _run_concurrently(programs, comm) -> tuple[list, int]:
    """Each program in its own thread; their values in order and the bytes they sent, or the first error
    raised again."""
    programs = list(programs)
    results, sent, errors = [None] * len(programs), [0] * len(programs), []

    def run(index, program):
        try:
            running = _Running(program, comm)
            results[index] = running.finish()
            sent[index] = running.sent
        except BaseException as error:  # re-raised in the calling thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i, p), daemon=True) for i, p in enumerate(programs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results, sum(sent)
