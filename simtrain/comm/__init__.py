"""Collectives as per-rank programs over Send/Recv, and interpreters that run them."""
from .naive import naive_all_reduce
from .ring import ring_all_reduce
from .tree import tree_all_reduce

ALL_REDUCE = {"naive": naive_all_reduce, "ring": ring_all_reduce, "tree": tree_all_reduce}
