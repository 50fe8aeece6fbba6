"""A tensor that a collective is still writing: the first op that reads it waits for the collective.

`Work.get_future()` must return a future that is already complete: torch's C++
code (DDP's reducer) waits on futures where no Python runs, and a rank thread
blocked there could never hand its turn back to the clock. So the future is
completed at once, its value an `ArrivingTensor` over the collective's output.
A view of it is another `ArrivingTensor` (nothing is read); any other op on it
first waits for the collective, then runs on the real tensor. DDP's reducer
reads its buckets only at the end of backward (to copy them into the
gradients), so its bucket all-reduces overlap the rest of backward in simulated
time, as they do on a GPU.

    future.set_result([ArrivingTensor(bucket, work)])   # work.wait() hands the turn to the clock
    grad.copy_(future.value()[0])                        # waits here, then copies the reduced bucket
"""
import torch
from torch.utils._pytree import tree_leaves, tree_map


class ArrivingTensor(torch.Tensor):
    """`tensor`, to be read only once `work` has ended."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, work):
        arriving = torch.Tensor._make_wrapper_subclass(cls, tensor.size(), strides=tensor.stride(),
                                                       storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
                                                       device=tensor.device, layout=tensor.layout)
        arriving.tensor, arriving.work = tensor, work
        return arriving

    def __repr__(self) -> str:
        return f"ArrivingTensor({self.tensor.shape}, {self.tensor.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        arriving = [value for value in tree_leaves((args, kwargs)) if isinstance(value, ArrivingTensor)]
        args, kwargs = tree_map(_real, (args, kwargs))
        if func.is_view and len(arriving) == 1:
            return ArrivingTensor(func(*args, **kwargs), arriving[0].work)
        for value in arriving:
            value.work.wait()
        return func(*args, **kwargs)


def _real(value):
    return value.tensor if isinstance(value, ArrivingTensor) else value
