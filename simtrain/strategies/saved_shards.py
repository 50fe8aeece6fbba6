"""A column-parallel region's gathered input kept as its sequence shard, and gathered again for the backward.

Under sequence parallelism (Korthikanti et al. 2022, section 4.2.2) the
region after an all-gather ("g") starts from the whole sequence, gathered
from the tp ranks' shards, and its first operators are column-parallel
Linears, whose weight gradient needs that whole input. Megatron-Core's
ColumnParallelLinear (`LinearWithGradAccumulationAndAsyncCommunication`)
does not keep it: it keeps the rank's 1/t shard and all-gathers it again in
the backward, posted before the input-gradient GEMM and awaited before the
weight-gradient GEMM, which needs it; so the layer keeps 34sbh/t bytes, not
sbh(4 + 28/t) (the paper's Table 2).

`SavedShard` does the same to whatever autograd saves during such a
region's forward: a saved tensor that views the gathered input's storage is
packed as the shard (through the hooks active around it, so that the
activation measurement of cost.py counts the shard's bytes, once however
many Linears save views of it) and unpacked as the same view of the shard
gathered again (`regathered`, which the backward sets before it runs
autograd). The values are the gathered ones, so the numerics are unchanged.

The backward region is then charged in three pieces (`RegionSplit`, measured
on the meta copy by schemes/stage_execution.py: the operators before the
first unpack, and those from it on): the operators before the Linears'
backward; the gather posted, half of the rest (the Linears' input gradient:
a Linear's two backward GEMMs have equal FLOPs) beside it; the gather
awaited, the other half (the weight gradient). A split schedule's I pass
charges the rest's input-gradient operators, measured apart, all beside the
gather, and leaves the weight gradient to W (schemes/weight_grads.py).

    shard = SavedShard(part, gathered)          # in the forward, after the all-gather
    with shard.hooks():
        state = region(gathered)
    ...
    shard.regathered = gathered_again           # in the backward, before autograd runs the region
"""
from typing import NamedTuple

import torch

from ..storage_identity import StorageIds
from ..op_cost import OpCosts


class RegionSplit(NamedTuple):
    """A backward region whose input was kept as its sequence shard: the shard (a meta tensor, what the
    backward gathers again), and the region's compute before the first use of it and from it on."""

    shard: torch.Tensor
    before_flops: float
    before_ops: OpCosts
    after_flops: float
    after_ops: OpCosts
    # of the after piece, the weight-gradient operators' (FLOPs, OpCosts), where a split schedule measured them
    # (schemes/weight_grads.py)
    after_weight: tuple = (0.0, ())
    behind: float = 0.5  # the share of the after piece charged once the gather is awaited (the rest beside it)


class SavedShard:
    """The shard a region's gathered input came from, standing in for it among the tensors autograd saves."""

    def __init__(self, shard: torch.Tensor, gathered: torch.Tensor):
        self.shard = shard
        self._ids = StorageIds()
        self._gathered = self._ids.of(gathered)
        self.gathered_shape = gathered.shape
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._outer_pack, self._outer_unpack = outer if outer is not None else (lambda t: t, lambda t: t)
        self.packed = False  # whether some saved tensor viewed the gathered input
        self.regathered: torch.Tensor | None = None  # the shard gathered again, set by the backward
        self.at_unpack = None  # measuring: called once, at the first unpack of a stand-in

    def hooks(self):
        """The saved-tensor hooks to run the region's forward under."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        if self._ids.of(tensor) != self._gathered:
            return False, self._outer_pack(tensor)
        self.packed = True
        return True, (self._outer_pack(self.shard), tensor.size(), tensor.stride(), tensor.storage_offset())

    def _unpack(self, packed):
        stands_in, value = packed
        if not stands_in:
            return self._outer_unpack(value)
        if self.at_unpack is not None:
            self.at_unpack()
            self.at_unpack = None
        _, size, stride, offset = value
        return self.regathered.as_strided(size, stride, offset)
