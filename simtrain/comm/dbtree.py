"""Double binary tree all-reduce (NCCL 2.4; Sanders, Speck and Träff 2009).

One binary tree makes its interior ranks send and receive twice what its
leaves do and leaves the leaves' links half idle. Two complementary trees, each
reducing half of the buffer, balance that: a rank that is a leaf in one tree is
interior in the other (all ranks for an even N; all but one for an odd N).

Tree one is the in-order binary tree over positions 0..N-1: a position whose
lowest set bit is b has children p - b/2 and p + b/2 (or, past the end, the
nearest p + b/4, p + b/8, ... inside it); position 0 is the root, with one
child, the largest power of two below N. Odd positions are its leaves. Tree two
is tree one mirrored (position p -> N-1-p) for an even N and shifted by one
(p -> p+1 mod N) for an odd N, so the leaves of one are the interior of the other.

Each tree reduces its half up to the root and broadcasts it back down,
pipelined in `pieces` pieces: at step i a rank adds piece i from its children
while it sends piece i-1 to its parent. Uncontended, with every tree link its
own, a tree of height D on half the buffer takes 2(P + D - 1)(alpha + S/(2PB)),
and the two trees run side by side. `order` places the ranks on positions (a
channel's ring order, channels.py); `tags` keep the two trees (and channels) apart.

    program = dbtree_all_reduce(rank, world, buf, average=True)
"""
import math

from .ops import Concurrently, Recv, Send

PIECE_BYTES = 1 << 20  # pipeline piece: 1 MiB ...
MAX_PIECES = 64  # ... but at most 64 per tree (fill and drain are then at most (D-1)/64 of the time)


def tree_children(size: int) -> list[list[int]]:
    """Children of each position of tree one (in-order binary tree, root 0)."""
    children = [[] for _ in range(size)]
    if size > 1:
        children[0].append(1 << (size - 1).bit_length() - 1)
    for position in range(1, size):
        half = (position & -position) // 2
        if half == 0:
            continue
        children[position].append(position - half)
        step = half
        while step and position + step >= size:
            step //= 2
        if step:
            children[position].append(position + step)
    return children


def double_trees(size: int) -> list[tuple[list[int | None], list[list[int]]]]:
    """(parent, children) per position for both trees, positions of tree one's numbering."""
    children = tree_children(size)
    if size % 2 == 0:
        moved = [size - 1 - p for p in range(size)]
    else:
        moved = [(p + 1) % size for p in range(size)]
    # Tree two: the rank at position p of tree one sits where tree one has position moved[p].
    at = {moved[p]: p for p in range(size)}
    trees = []
    for kids in (children, [[at[k] for k in children[moved[p]]] for p in range(size)]):
        parent = [None] * size
        for p, ks in enumerate(kids):
            for k in ks:
                parent[k] = p
        trees.append((parent, kids))
    return trees


def pieces_for(nbytes: int) -> int:
    """Pipeline pieces for one tree's half of the buffer."""
    return max(1, min(MAX_PIECES, math.ceil(nbytes / PIECE_BYTES)))


def dbtree_all_reduce(rank: int, world: int, buf, average: bool = False, *, order=None, tags=(0, 1),
                      pieces: int | None = None):
    """Per-rank program: sum (or mean) of `buf` over all ranks, each tree reducing one half."""
    if world > 1:
        order = list(range(world)) if order is None else order
        position = order.index(rank)
        halves = buf.tensor_split(2)
        programs = []
        for half, tag, (parent, children) in zip(halves, tags, double_trees(world)):
            up = None if parent[position] is None else order[parent[position]]
            down = [order[child] for child in children[position]]
            count = pieces if pieces is not None else pieces_for(half.nbytes)
            programs.append(pipelined_tree(up, down, half, count, tag))
        yield Concurrently(programs)
    if average:
        buf.div_(world)
    return buf


def pipelined_tree(parent: int | None, children: list[int], buf, pieces: int, tag: int):
    """Per-rank program: reduce `buf` up to the root, then broadcast it down, piece by piece."""
    chunks = buf.tensor_split(pieces)
    for i in range(pieces + 1):
        ops = [Recv(child, chunks[i], True, tag) for child in children] if i < pieces else []
        if i > 0 and parent is not None:
            ops.append(Send(parent, chunks[i - 1], tag))
        if ops:
            yield ops
    for i in range(pieces + 1):
        ops = [Recv(parent, chunks[i], False, tag)] if i < pieces and parent is not None else []
        if i > 0:
            ops.extend(Send(child, chunks[i - 1], tag) for child in children)
        if ops:
            yield ops
    return buf
