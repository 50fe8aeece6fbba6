"""The operations a collective program is written with: Send, Recv and Concurrently.

A collective is a per-rank program: a generator that yields operations and does
any other tensor math itself, like code written against torch.distributed
point-to-point calls. A yield is either one operation or a list of them; the
list's operations run concurrently (like `batch_isend_irecv`) and the yield
returns when all are done, with the received tensors (None for a Send) in
order; a single operation returns its own result.

    def program(rank, world, buf):
        yield [Send((rank + 1) % world, buf), Recv((rank - 1) % world, tmp)]

Semantics, the same for every interpreter:
- a Send and the Recv that names it match in posting order per (src, dst, tag);
  the bytes start to move once both are posted (rendezvous). `tag` (default 0)
  keeps the operations of independent streams between the same two ranks apart,
  as NCCL's channels are (over gloo it is the isend/irecv tag);
- `Recv(src, out)` writes the received data into `out`; with `reduce=True` it
  adds it into `out` instead, as NCCL's receive-reduce primitive does (the data
  lands in a staging buffer, counted as comm_buffers, then is summed in);
- a program must not modify a tensor it is sending until that Send is done;
- `yield Concurrently([program, ...])`, alone, runs sub-programs of the same
  rank side by side, each advancing as its own operations complete (a slow one
  never holds a fast one back), and returns their return values in order once
  all have ended. Sub-programs that talk to the same peer must use different tags.

A program with something to tell its interpreter (`RingAllReduce`'s group
schedule, `NcclCall`'s choice) is a `WrappedProgram`: an object that runs as
the generator it holds.
"""
from typing import NamedTuple

import torch


class Send(NamedTuple):
    dst: int
    tensor: torch.Tensor
    tag: int = 0


class Recv(NamedTuple):
    src: int
    out: torch.Tensor
    reduce: bool = False
    tag: int = 0


class Concurrently(NamedTuple):
    programs: tuple  # generators of the same rank, run side by side


class WrappedProgram:
    """A collective program with attributes of its own: it runs as the generator `self.program` (`send`,
    `throw`, `close` and iteration are the generator's)."""

    __slots__ = ("program",)

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
