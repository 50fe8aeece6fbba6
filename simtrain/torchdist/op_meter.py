"""What a rank's torch ops cost on its simulated device: FLOPs, and the memory of the tensors they make.

An `OpMeter` is the operator recorder (op_cost.py) entered in the rank's thread:
it sees every aten op the rank runs, autograd's backward included (on CPU
backward runs in the calling thread).

- **FLOPs and operators.** The recorder's: the same operators and formulas
  as simtrain's step costs (cost.py), so a model costs the same under
  `simtrain run` and under `simtrain.dist`; and torch's CPU fused attention
  (`F.scaled_dot_product_attention` here), which torch gives no formula,
  charged as `model.attention: fused` is (FlashAttention-2's count). They
  wait until the rank posts a communication or ends (`take_flops` and
  `take`), and are then charged as one compute span of those operators,
  each at its operands' rate, under the cluster's compute model (run.py).
- **Memory.** A storage that an op returns and none of its inputs had is held on
  the device's memory ledger from that op until the last tensor the rank was
  given on it is freed (each storage counted once, however many views), under
  a category (memory_categories.py tells them apart from module and optimizer
  hooks): `weights` (a module's parameters, from their registration; held from
  there if their storage was made outside an op, as `nn.Parameter` does),
  `gradients` (their `.grad`), `optimizer_state` (an optimizer's state after
  its step), `activations` (the rest made during a module's forward) and
  `tensors` (the rest). Not counted: tensors made outside the rank (passed in
  by closure), storages torch keeps without returning them (allocator caches,
  autograd's internal buffers), and the backend's own buffers (the meter is
  `paused` while the backend works; a reducing receive's staging is
  `comm_buffers`).
- **DTensor.** A DTensor's operator is charged as the operators it runs on the
  rank's local tensors (op_cost.py), and the operator it runs on fake tensors of
  the global shapes to work out the result's shape (torch's
  `ShardingPropagator`, once per operator schema in a process) is not the
  rank's: `sharding_propagation_unmetered` runs it outside the rank's modes.

    meter = OpMeter(device.memory)
    with meter:
        model(x).sum().backward()
    meter.take_flops()           # {torch.float32: 2.1e6}
    device.memory.peak["activations"]
"""
import re
import weakref
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from torch.utils.flop_counter import register_flop_formula

from ..errors import OutOfMemory, SimtrainError
from ..hw.device import MemoryLedger
from ..op_cost import OperatorRecorder
from ..storage_identity import StorageIds
from ..train.fused_attention import backward_flops, forward_flops
from ..units import format_bytes
from .scheduler import current_rank

# What torch's CPU allocator raises when the host has not the bytes (c10/core/impl/alloc_cpu.cpp).
_ALLOCATION_FAILED = re.compile(r"DefaultCPUAllocator: can't allocate memory: you tried to allocate (\d+) bytes")


@register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
def _cpu_attention_flops(q_shape, k_shape, v_shape, dropout_p=0.0, is_causal=False, *args, **kwargs) -> int:
    """torch's fused attention on CPU (what `F.scaled_dot_product_attention` runs on CPU and fake tensors) has no
    formula of torch's: charged as a GPU's fused attention is (train/fused_attention.py)."""
    return forward_flops(q_shape, k_shape, v_shape, is_causal)


@register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)
def _cpu_attention_backward_flops(grad_shape, q_shape, k_shape, v_shape, kept_out_shape, lse_shape, dropout_p,
                                  is_causal, *args, **kwargs) -> int:
    return backward_flops(q_shape, k_shape, v_shape, is_causal)


class OpMeter(OperatorRecorder):
    """Records the ops run under it (FLOPs per result dtype) and holds their new storages on `ledger`."""

    def __init__(self, ledger: MemoryLedger):
        super().__init__()
        self.ledger = ledger
        self.is_paused = False
        self.forward_depth = 0  # modules whose forward is running (memory_categories.py)
        self.allocated_bytes = 0  # of every storage held so far, freed or not
        self._storage_ids = StorageIds()
        self._live: dict[int, list] = {}  # storage number -> [tensors the rank holds on it, bytes, category]
        self._held: set[int] = set()  # id() of those tensors (an in-place op returns one again)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.is_paused:
            return func(*args, **(kwargs or {}))
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except RuntimeError as error:
            nbytes = _host_allocation_failed(error)
            if nbytes is None:
                raise
            raise self._out_of_memory(func, nbytes) from None

    def _out_of_memory(self, func, nbytes: int) -> SimtrainError:
        """The host could not allocate `nbytes` for `func`'s result: the device's OutOfMemory where the device
        could not hold it either (its ledger raises it), else one line saying the host is what is short."""
        ledger = self.ledger
        if ledger.total + nbytes > ledger.capacity_bytes:
            try:
                ledger.alloc("activations" if self.forward_depth else "tensors", nbytes)
            except OutOfMemory as error:
                return error
        return SimtrainError(f"{func} needs {format_bytes(nbytes)}, more than this host can allocate (the device, "
                             f"{ledger.device}, would hold it): run numerics=False, where tensors hold no values")

    def _record(self, func, args, kwargs, out) -> None:
        super()._record(func, args, kwargs, out)
        inputs = {self._storage_ids.of(t) for t in tree_leaves((args, kwargs)) if _is_dense(t)}
        for tensor in tree_leaves(out):
            if _is_dense(tensor):
                self._hold(tensor, inputs)

    def take_flops(self) -> dict[torch.dtype, float]:
        """The FLOPs recorded since the last take, by dtype, in the order the dtypes first appeared."""
        pending, self.flops_by_dtype = self.flops_by_dtype, {}
        return pending

    @contextmanager
    def paused(self):
        """Ops run in the block are the backend's: neither FLOPs nor `tensors`."""
        was, self.is_paused = self.is_paused, True
        try:
            yield
        finally:
            self.is_paused = was

    def categorize(self, tensor, category: str) -> None:
        """`tensor`'s storage is held under `category` from now (held from now if it was not)."""
        tensor = getattr(tensor, "_local_tensor", tensor)  # a DTensor: this rank's shard
        if not _is_dense(tensor):
            return
        held = self._live.get(self._storage_ids.of(tensor))
        if held is not None and held[2] != category:
            self.ledger.free(held[2], held[1])
            held[2] = category
            self.ledger.alloc(category, held[1])
        self._hold(tensor, set(), category)

    def _hold(self, tensor: torch.Tensor, inputs: set, category: str | None = None) -> None:
        if id(tensor) in self._held:
            return
        storage = self._storage_ids.of(tensor)
        held = self._live.get(storage)
        if held is None:
            if storage in inputs:  # a view of a storage made outside the rank
                return
            nbytes = tensor.untyped_storage().nbytes()
            category = category or ("activations" if self.forward_depth else "tensors")
            held = self._live[storage] = [0, nbytes, category]
            self.ledger.alloc(category, nbytes)
            self.allocated_bytes += nbytes
        held[0] += 1
        self._held.add(id(tensor))
        weakref.finalize(tensor, self._release, id(tensor), storage)

    def resized(self, storage, nbytes: int) -> None:
        """`storage` (an UntypedStorage) now holds `nbytes`: its ledger entry follows, if the rank holds it (FSDP2
        frees an unsharded parameter's storage by resizing it to 0 and brings it back by resizing it again)."""
        held = self._live.get(self._storage_ids.known(storage))
        if held is None or held[1] == nbytes:
            return
        self.ledger.free(held[2], held[1])
        held[1] = nbytes
        self.ledger.alloc(held[2], nbytes)

    def _release(self, tensor: int, storage: int) -> None:
        self._held.discard(tensor)
        held = self._live[storage]
        held[0] -= 1
        if held[0] == 0:
            del self._live[storage]
            self.ledger.free(held[2], held[1])


@contextmanager
def storage_resizes_metered(meter_of_rank):
    """While it is entered, a storage resized in a rank (`UntypedStorage.resize_`, which no dispatched operator
    does: FSDP2's `free_storage` and `alloc_storage`) is resized on that rank's meter, `meter_of_rank(rank)`, as a
    GPU's allocator sees the memory go and come back."""
    resize = torch.UntypedStorage.resize_

    def resized(storage, nbytes):
        result = resize(storage, nbytes)
        rank = current_rank()
        if rank is not None:
            meter_of_rank(rank).resized(storage, storage.nbytes())
        return result

    torch.UntypedStorage.resize_ = resized
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = resize


@contextmanager
def sharding_propagation_unmetered():
    """While it is entered, DTensor's shape propagation runs outside the rank's modes (its meter, and numerics
    off's fake floats): through the lock torch takes around it (`ShardingPropagator._fake_mode_lock`, a no-op by
    default), which then takes the modes off the stack and puts them back."""
    class Lock:
        def __enter__(self):
            self.block = _disable_current_modes()
            self.block.__enter__()

        def __exit__(self, *exc):
            return self.block.__exit__(*exc)

    was, ShardingPropagator._fake_mode_lock = ShardingPropagator._fake_mode_lock, Lock()
    try:
        yield
    finally:
        ShardingPropagator._fake_mode_lock = was


def _host_allocation_failed(error: RuntimeError) -> int | None:
    """The bytes torch's CPU allocator could not get, where `error` is its failure; else None."""
    found = _ALLOCATION_FAILED.search(str(error))
    return int(found.group(1)) if found else None


def _is_dense(value) -> bool:
    """A plain tensor (or parameter, or a fake one: numerics off) with a storage of its own: not meta, sparse or a
    wrapper subclass. Its device read, not `is_meta`: a fake tensor answers `is_meta` through a dispatch of
    `prim.device` down every mode (3 us), its device in Python (0.1 us)."""
    return (type(value) in (torch.Tensor, torch.nn.Parameter, FakeTensor) and value.layout == torch.strided
            and value.device.type != "meta")

