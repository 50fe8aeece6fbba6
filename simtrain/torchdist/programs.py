"""The collective programs of the `simtrain` backend that simtrain/comm does not have.

Per-rank programs over Send/Recv (simtrain/comm/ops.py), run by the simulated
interpreter like every other collective. All ranks of a group are in rank order
on one ring; chunk i of a list is the same shape on every rank, so chunks may
differ in size from one another (uneven all-gathers and reduce-scatters).

- `ring_reduce_scatter(rank, world, chunks, combine)`: N-1 steps; rank r ends
  with chunk (r+1) mod N combined over all ranks by `combine(into, landed)`
  (sum, product, max, min). Each rank sends (N-1)/N of the buffer.
- `ring_all_reduce_with(rank, world, buf, combine)`: that reduce-scatter then
  comm.ring's all-gather: 2(N-1)/N of the buffer per rank, the ring's cost, for
  the reductions that are not sums.
- `all_gather(rank, world, chunks)`: rank r holds chunks[r]; afterwards every
  rank holds all of them (comm.ring's all-gather).
- `reduce_scatter(rank, world, chunks, combine)`: chunks[r] of every rank,
  combined, lands in chunks[r] of rank r.
- `all_to_all(rank, world, outputs, inputs)`: inputs[j] goes to rank j's
  outputs[r]; all pairs at once, as NCCL runs it.
- `reduce(rank, world, buf, root, combine)`: a binomial tree, the reverse of
  comm.broadcast's: ceil(log2 N) rounds, the whole buffer per message.
- `gather(rank, world, root, chunks)` and `scatter(rank, world, root, chunks)`:
  the root receives from, or sends to, every rank at once.

    program = reduce_scatter(rank, world, list(buf.tensor_split(world)), COMBINE["max"])
"""
import torch

from ..comm.ops import Recv, Send
from ..comm.ring import ring_all_gather

COMBINE = {
    "sum": lambda into, landed: into.add_(landed),
    "product": lambda into, landed: into.mul_(landed),
    "max": lambda into, landed: torch.maximum(into, landed, out=into),
    "min": lambda into, landed: torch.minimum(into, landed, out=into),
}


def ring_reduce_scatter(rank: int, world: int, chunks: list, combine):
    """Per-rank program: afterwards this rank holds chunks[(rank + 1) % world] combined over all ranks."""
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        into = chunks[(rank - step - 1) % world]
        landing = into if into.is_meta else torch.empty_like(into)  # on meta nothing lands
        yield [Send(right, chunks[(rank - step) % world]), Recv(left, landing)]
        if not into.is_meta:
            combine(into, landing)


def ring_all_reduce_with(rank: int, world: int, buf: torch.Tensor, combine):
    """Per-rank program: `buf` combined elementwise over all ranks, in place."""
    chunks = list(buf.view(-1).tensor_split(world))
    yield from ring_reduce_scatter(rank, world, chunks, combine)
    yield from ring_all_gather(rank, (rank + 1) % world, (rank - 1) % world, chunks)
    return buf


def all_gather(rank: int, world: int, chunks: list):
    """Per-rank program: every rank ends with every chunks[r] as rank r holds it."""
    # comm.ring's all-gather starts from chunk position+1 at each position.
    yield from ring_all_gather(rank, (rank + 1) % world, (rank - 1) % world, _shifted(chunks))
    return chunks


def reduce_scatter(rank: int, world: int, chunks: list, combine):
    """Per-rank program: chunks[rank] ends combined over all ranks (the other chunks are scratch)."""
    yield from ring_reduce_scatter(rank, world, _shifted(chunks), combine)
    return chunks[rank]


def all_to_all(rank: int, world: int, outputs: list, inputs: list):
    """Per-rank program: outputs[j] receives rank j's inputs[rank]."""
    outputs[rank].copy_(inputs[rank])
    peers = [peer for peer in range(world) if peer != rank]
    if peers:
        yield [*(Send(peer, inputs[peer]) for peer in peers), *(Recv(peer, outputs[peer]) for peer in peers)]
    return outputs


def reduce(rank: int, world: int, buf: torch.Tensor, root: int, combine):
    """Per-rank program: the root's `buf` ends combined over all ranks (others' `buf` are scratch)."""
    relative, mask = (rank - root) % world, 1
    while mask < world:
        if relative & mask:
            yield Send((rank - mask) % world, buf)
            return buf
        if relative + mask < world:
            landing = buf if buf.is_meta else torch.empty_like(buf)
            yield Recv((rank + mask) % world, landing)
            if not buf.is_meta:
                combine(buf, landing)
        mask *= 2
    return buf


def gather(rank: int, world: int, root: int, chunks: list):
    """Per-rank program: the root ends with every rank's chunks[rank] (only the root's list is complete)."""
    if rank == root:
        yield [Recv(peer, chunks[peer]) for peer in range(world) if peer != root]
    else:
        yield Send(root, chunks[rank])
    return chunks


def scatter(rank: int, world: int, root: int, chunks: list):
    """Per-rank program: every rank ends with the root's chunks[rank]."""
    if rank == root:
        yield [Send(peer, chunks[peer]) for peer in range(world) if peer != root]
    else:
        yield Recv(root, chunks[rank])
    return chunks[rank]


def _shifted(chunks: list) -> list:
    """The list whose entry p + 1 is chunks[p]: the ring's chunk order for data that starts at its own rank."""
    return [chunks[(i - 1) % len(chunks)] for i in range(len(chunks))]
