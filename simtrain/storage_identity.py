"""Which tensors share a storage, told the same way in every run: serial numbers, never addresses.

Several measurements need to know whether two tensors view one storage: the
saved-activation tracker (cost.py), the GEMMs beside tp collectives
(strategies/tp_overlap.py), the saved sequence shards (strategies/saved_shards.py),
and the meter of users' ranks (torchdist/op_meter.py). A storage's address
(`untyped_storage()._cdata`) is no identity: once a storage is freed, the
allocator hands its address to the next one, and a measurement that kept the
old address then takes a new, unrelated tensor for the old one. Whether that
happens depends on the host's allocator, so the same scenario gave different
results from run to run.

`StorageIds` numbers storages in the order it first sees them, holding each
weakly (torch keeps one Python object per live storage, hashed by identity),
so a number is never handed to another storage, and a freed storage's entry
goes with it. Numbers depend only on the order of the calls, which is the
program's.

    ids = StorageIds()
    x = torch.empty(4, 4)
    ids.of(x) == ids.of(x.t())      # True: a view shares its storage
    ids.of(x) == ids.of(x.clone())  # False
"""
from __future__ import annotations

import weakref

import torch


class StorageIds:
    """A serial number for each storage, the same for every view of it and never reused."""

    def __init__(self):
        self._numbers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage -> its number
        self._next = 0

    def of(self, tensor: torch.Tensor) -> int:
        """The number of the storage under `tensor`."""
        storage = tensor.untyped_storage()
        number = self._numbers.get(storage)
        if number is None:
            number = self._numbers[storage] = self._next
            self._next += 1
        return number

    def known(self, storage) -> int | None:
        """The number of `storage` (an UntypedStorage), or None if no tensor on it has been asked about."""
        return self._numbers.get(storage)
