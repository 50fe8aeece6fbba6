"""FLOPs a rank's torch ops perform, counted as they run, to be charged on its simulated device.

A TorchDispatchMode sees every aten op the rank's thread runs, autograd's
backward included (on CPU it runs in the calling thread). Ops in torch's own
`torch.utils.flop_counter.flop_registry` (matrix multiplies, convolutions,
attention; 2 FLOPs per multiply-add) add their count under the dtype of their
result; every other op (element-wise, reductions, copies) counts 0, as in
simtrain's step costs (cost.py). The counts wait in `pending` until the rank
posts a communication or ends; then they are charged as one compute span per
dtype (run.py).

    counter = FlopCounter()
    with counter:
        model(x).sum().backward()
    counter.take()      # {torch.float32: 2.1e6}
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

# The catalog's dtype name for a result's torch dtype; any other dtype is charged at the fp32 rate.
DEVICE_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16"}


class FlopCounter(TorchDispatchMode):
    """Counts the FLOPs of the ops run under it, per result dtype, until taken."""

    def __init__(self):
        super().__init__()
        self.pending: dict[torch.dtype, float] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            result = out[0] if isinstance(out, (tuple, list)) else out
            self.pending[result.dtype] = self.pending.get(result.dtype, 0.0) + count(*args, **kwargs, out_val=out)
        return out

    def take(self) -> dict[torch.dtype, float]:
        """The FLOPs counted since the last take, by dtype, in the order the dtypes first appeared."""
        pending, self.pending = self.pending, {}
        return pending
