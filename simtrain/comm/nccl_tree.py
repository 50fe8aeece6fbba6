"""NCCL's tree all-reduce: a double binary tree between nodes, a chain inside each node.

NCCL does not build its trees over ranks (dbtree.py does that) but over nodes:
inside a node the GPUs form a chain, head first, and only the head of each node
joins the inter-node trees, through its NIC. Two complementary binary trees of
nodes (dbtree.double_trees) each reduce half of the buffer up to the root and
broadcast it back down, pipelined in pieces (dbtree.pipelined_tree); a rank's
parent is the GPU before it in its node's chain (the head's: the head of its
parent node), its children the GPU after it and, for a head, the heads of its
child nodes.

With several channels (one per NIC rail, channels.py) channel c chains each
node from its rail-c GPU, so every channel's head leaves through another NIC.
On one node the trees are a single chain: NCCL's tree on one node.

    program = nccl_tree_all_reduce(rank, 16, buf, hosts=[[0, ..., 7], [8, ..., 15]])
"""
from .dbtree import double_trees, pieces_for, pipelined_tree
from .ops import Concurrently


def tree_neighbours(hosts, rank: int) -> list[tuple[int | None, list[int]]]:
    """(parent, children) of `rank` in each of the two trees; `hosts` lists each node's chain, head first."""
    node = next(index for index, ranks in enumerate(hosts) if rank in ranks)
    chain = list(hosts[node])
    position = chain.index(rank)
    inside = [chain[position + 1]] if position + 1 < len(chain) else []
    result = []
    for parent, children in double_trees(len(hosts)):
        if position > 0:
            result.append((chain[position - 1], inside))
        else:
            up = None if parent[node] is None else hosts[parent[node]][0]
            result.append((up, inside + [hosts[child][0] for child in children[node]]))
    return result


def nccl_tree_all_reduce(rank: int, world: int, buf, average: bool = False, *, hosts, tags=(0, 1),
                         pieces: int | None = None):
    """Per-rank program: sum (or mean) of `buf` over the ranks of `hosts`, each tree reducing one half."""
    if world > 1:
        halves = buf.tensor_split(2)
        programs = []
        for half, tag, (parent, children) in zip(halves, tags, tree_neighbours(hosts, rank)):
            count = pieces if pieces is not None else pieces_for(half.nbytes)
            programs.append(pipelined_tree(parent, children, half, count, tag))
        yield Concurrently(programs)
    if average:
        buf.div_(world)
    return buf
