"""Collectives as per-rank programs over Send/Recv, and interpreters that run them.

The all-reduce names below are imported on first use (PEP 562): the collectives
import torch, and a torch-free module of this package (channels.py) may be
imported without them.
"""
import importlib

__all__ = ["ALGORITHMS", "ALL_REDUCE", "build_all_reduce", "channel_count"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module(f"{__name__}.all_reduce"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
