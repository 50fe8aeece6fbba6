"""Numerics off for users' code: the floating-point tensors a rank makes are fake, shapes without values.

`spawn(..., numerics=False)` runs each rank under a `FakeFloats` mode (entered
below the rank's `OpMeter`, which sees every op first). Its rule:

- a factory (an op without tensor inputs: `torch.empty`, `randn`, `zeros`)
  that makes a floating-point tensor makes a fake one
  (torch._subclasses.FakeTensor: a shape, a dtype, a storage of the right size
  on the `meta` device, reporting the device it was asked for, `cpu`);
- an op with a fake input runs fake (torch's fake kernels: shapes and dtypes
  only), a real input beside it made fake first;
- everything else stays real: integer and boolean tensors the rank makes
  (token ids, masks, the rank tables of a DeviceMesh) and tensors given to the
  rank from outside. So a DeviceMesh, DTensor's placements and an embedding's
  indices hold real values, while weights, activations, gradients and
  optimizer state are fake.

So the rank's ops cost what they cost with numerics on (the meter's FLOPs and
bytes come from shapes), its tensors hold the same bytes on its device's
ledger (a fake storage has its real size), and its collectives move the same
bytes (their payloads are fake: timed and counted alike, nothing copied). One
`torch.Tensor` of the model costs no host memory, so hundreds of ranks of a
large model run in one process.

A library's custom operator (`torch.library.custom_op`) runs its own
implementation on fake tensors, not its fake kernel, so the collectives inside
it run (torch's context parallelism gathers keys and values in one); simtrain's
own fused kernels keep their fake kernels, which cost what the GPU's do.

An op that needs a fake tensor's values (`.item()`, `.tolist()`, `nonzero`, a
Python `if` on a tensor, `float(t)`) cannot run: `NumericsOffUnsupported`, one
line naming the op and the line of the user's code that asked for it. One
initialiser asks for values only to draw them again: `torch.nn.init.trunc_normal_`
redraws until no value lies outside its bounds. Under `initialisers_of_fakes()`
it leaves a fake tensor (or a DTensor whose shard is fake) as it is, as torch
leaves a meta tensor: there are no values to draw.

    fake_floats = FakeFloats()
    with fake_floats, meter:
        model = nn.Linear(4, 4)              # fake weight and bias
        model(torch.randn(2, 4)).sum()       # a fake result; the meter counts its FLOPs
"""
import sys
import threading
import weakref
from contextlib import contextmanager

import torch
from torch._library import custom_ops
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode, UnsupportedOperatorException)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..errors import NumericsOffUnsupported
from .fake_collectives import FUNCTIONAL, UNSUPPORTED
from .scheduler import user_line

_DEVICE = torch.ops.prim.device.default
# What torch raises when an op needs values a fake tensor does not have.
_NEEDS_VALUES = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)


class FakeFloats(TorchDispatchMode):
    """Floating-point tensors made under it are fake; ops on fake tensors run fake; the rest runs real."""

    def __init__(self):
        super().__init__()
        # one fake mode for every rank of a spawn: a collective copies one rank's fake tensor into another's
        self.fake_mode = _CollectivesOnTheGroup(allow_non_fake_inputs=True)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as OperatorRecorder's (op_cost.py): no torch._dynamo import inside a rank

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DEVICE:  # a fake tensor's device, asked in C++: the tensor answers
            return func(*args, **kwargs)
        tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        if tensors:  # with a fake input, FakeTensor's own dispatch runs it in the fake mode
            return func(*args, **kwargs)
        with self.fake_mode:
            fake = func(*args, **kwargs)
        if all(leaf.is_floating_point() or leaf.is_complex()
               for leaf in tree_leaves(fake) if isinstance(leaf, torch.Tensor)):
            return fake
        return func(*args, **kwargs)  # an integer or boolean tensor: made real


class _CollectivesOnTheGroup(FakeTensorMode):
    """torch's fake mode, but a functional collective is posted on its process group (fake_collectives.py) and an
    op that needs values is one line naming it. Reached from any depth: FakeTensor's dispatch enters its mode."""

    def __init__(self, **options):
        self._entered = threading.local()  # torch keeps one stack of entries per mode; the ranks enter it apart
        super().__init__(**options)
        # a posted functional collective's work by its output's storage (held weakly), until waited on
        self.works = weakref.WeakKeyDictionary()

    def __deepcopy__(self, memo):
        """The mode itself: a fake tensor deep-copied (`copy.deepcopy` of a model, as torchtitan's pipeline split
        does) stays in the spawn's one mode, whose per-thread entries cannot be copied."""
        return self

    @property
    def enter_stack(self) -> list:
        """The calling thread's entries (a rank may wait, and others run, while it is entered)."""
        if not hasattr(self._entered, "stack"):
            self._entered.stack = []
        return self._entered.stack

    @enter_stack.setter
    def enter_stack(self, value: list) -> None:
        self._entered.stack = value

    def dispatch(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        collective = FUNCTIONAL.get(func._overloadpacket)
        if collective is not None:
            return collective(self.works, *args, **kwargs)
        body = _library_op_body(func)
        if body is not None:
            return body(*args, **kwargs)
        if func._overloadpacket in UNSUPPORTED:
            raise NumericsOffUnsupported(f"numerics off (spawn numerics=False): {func} is not supported"
                                         f"{called_at()}")
        device = kwargs.get("device")
        if isinstance(device, torch.device) and device.type == "cpu" and device.index is not None:
            kwargs = {**kwargs, "device": torch.device("cpu")}  # as torch makes a real one: a CPU has one device
        try:
            return super().dispatch(func, types, args, kwargs)
        except _NEEDS_VALUES:
            raise NumericsOffUnsupported(f"numerics off (spawn numerics=False): {func} needs tensor values, which "
                                         f"fake tensors do not have{called_at()}") from None


def _library_op_body(func):
    """A library's custom operator's own implementation (`torch.library.custom_op`), run on fake tensors as it runs
    on real ones, in place of its fake kernel, which makes outputs of the right shape and nothing else: torch's
    context parallelism gathers FlexAttention's keys and values with collectives inside such an operator, which its
    fake kernel would leave out. None for any other operator, and for simtrain's own fused kernels, whose fake
    kernels are what a GPU's kernel costs (train/fused_attention.py)."""
    if func.namespace == "simtrain":
        return None
    definition = custom_ops.OPDEFS.get(func._schema.name)
    return None if definition is None else definition._init_fn


def called_at() -> str:
    """' (at file:line in function)': where the user's code asked for the op, if it did."""
    where = user_line(sys._getframe(1))
    return f" (at {where})" if where else ""


@contextmanager
def initialisers_of_fakes():
    """While it is entered, `torch.nn.init.trunc_normal_` leaves a fake tensor as it is (see above)."""
    from torch.distributed.tensor import DTensor
    draw = torch.nn.init._no_grad_trunc_normal_

    def trunc_normal(tensor, *args, **kwargs):
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        return tensor if isinstance(local, FakeTensor) else draw(tensor, *args, **kwargs)

    torch.nn.init._no_grad_trunc_normal_ = trunc_normal
    try:
        yield
    finally:
        torch.nn.init._no_grad_trunc_normal_ = draw
