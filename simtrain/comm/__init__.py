"""Collectives as per-rank programs over Send/Recv, and interpreters that run them."""
from .all_reduce import ALGORITHMS, ALL_REDUCE, build_all_reduce, channel_count

__all__ = ["ALGORITHMS", "ALL_REDUCE", "build_all_reduce", "channel_count"]
