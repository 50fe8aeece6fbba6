"""torch's functional collectives (`torch.ops._c10d_functional`) on fake tensors: posted on the process group.

DTensor and tensor parallelism communicate through the functional collectives.
Their fake kernels only make outputs of the right shape; with numerics off
(numerics_off.py) a rank's collectives must still run on the simulated cluster,
timed and counted as with numerics on. So each is run here as torch's own CPU
kernel runs it (torch/csrc/distributed/c10d/Functional.cpp): the output made
alike (a fake tensor), the same method of the same process group called with
the same arguments, and the work kept until `wait_tensor` waits on it.

    collective = FUNCTIONAL.get(func._overloadpacket)   # None for any other op
    out = collective(works, *args, **kwargs)            # works: {storage: Work}
"""
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _resolve_process_group
from torch.distributed._functional_collectives import AsyncCollectiveTensor

_ops = torch.ops._c10d_functional


def _options(kind, reduce_op: str | None = None, root: int | None = None):
    options = kind()
    if reduce_op is not None:
        options.reduceOp = getattr(dist.ReduceOp, reduce_op.upper())
    if root is not None:
        options.rootRank = root
    return options


def _posted(works: dict, outputs: list, work) -> list:
    for output in outputs:
        works[output.untyped_storage()] = work
    return outputs


def all_reduce_(works, tensor, reduce_op, group_name):
    work = _resolve_process_group(group_name).allreduce([tensor], _options(dist.AllreduceOptions, reduce_op))
    return _posted(works, [tensor], work)[0]


def all_reduce(works, tensor, reduce_op, group_name):
    return all_reduce_(works, tensor.clone(memory_format=torch.contiguous_format), reduce_op, group_name)


def all_reduce_coalesced_(works, tensors, reduce_op, group_name):
    options = _options(dist.AllreduceCoalescedOptions, reduce_op)
    return _posted(works, tensors, _resolve_process_group(group_name).allreduce_coalesced(tensors, options))


def all_reduce_coalesced(works, tensors, reduce_op, group_name):
    clones = [tensor.clone(memory_format=torch.contiguous_format) for tensor in tensors]
    return all_reduce_coalesced_(works, clones, reduce_op, group_name)


def all_gather_into_tensor_coalesced(works, tensors, group_size, group_name):
    outputs = [tensor.new_empty((tensor.shape[0] * group_size, *tensor.shape[1:])) for tensor in tensors]
    return _posted(works, outputs, _resolve_process_group(group_name).allgather_into_tensor_coalesced(outputs, tensors))


def all_gather_into_tensor(works, tensor, group_size, group_name):
    return all_gather_into_tensor_coalesced(works, [tensor], group_size, group_name)[0]


def all_gather_into_tensor_out(works, tensor, group_size, group_name, *, out):
    return _posted(works, [out], _resolve_process_group(group_name)._allgather_base(out, tensor))[0]


def reduce_scatter_tensor_coalesced(works, tensors, reduce_op, group_size, group_name):
    outputs = [tensor.new_empty((tensor.shape[0] // group_size, *tensor.shape[1:])) for tensor in tensors]
    options = _options(dist.ReduceScatterOptions, reduce_op)
    work = _resolve_process_group(group_name).reduce_scatter_tensor_coalesced(outputs, tensors, options)
    return _posted(works, outputs, work)


def reduce_scatter_tensor(works, tensor, reduce_op, group_size, group_name):
    return reduce_scatter_tensor_coalesced(works, [tensor], reduce_op, group_size, group_name)[0]


def reduce_scatter_tensor_out(works, tensor, reduce_op, group_size, group_name, *, out):
    options = _options(dist.ReduceScatterOptions, reduce_op)
    return _posted(works, [out], _resolve_process_group(group_name)._reduce_scatter_base(out, tensor, options))[0]


def all_to_all_single(works, tensor, output_split_sizes, input_split_sizes, group_name):
    output = tensor.new_empty((sum(output_split_sizes), *tensor.shape[1:]))
    work = _resolve_process_group(group_name).alltoall_base(output, tensor, list(output_split_sizes),
                                                            list(input_split_sizes), dist.AllToAllOptions())
    return _posted(works, [output], work)[0]


def broadcast_(works, tensor, src, group_name):
    work = _resolve_process_group(group_name).broadcast([tensor], _options(dist.BroadcastOptions, root=src))
    return _posted(works, [tensor], work)[0]


def broadcast(works, tensor, src, group_name):
    return broadcast_(works, tensor.clone(memory_format=torch.contiguous_format), src, group_name)


def wait_tensor(works, tensor):
    work = works.pop(tensor.untyped_storage(), None)
    if work is not None:
        work.wait()
    return tensor


def _wrap_tensor_autograd(works, tensor):
    """The collective's output as torch returns it outside tracing: waited on when first used."""
    return AsyncCollectiveTensor(tensor)


FUNCTIONAL = {getattr(_ops, function.__name__): function for function in (
    all_reduce_, all_reduce, all_reduce_coalesced_, all_reduce_coalesced, all_gather_into_tensor_coalesced,
    all_gather_into_tensor, all_gather_into_tensor_out, reduce_scatter_tensor_coalesced, reduce_scatter_tensor,
    reduce_scatter_tensor_out, all_to_all_single, broadcast_, broadcast, wait_tensor, _wrap_tensor_autograd)}
# Their point-to-point operations (isend, irecv, batch_p2p_ops): not run on fake tensors.
UNSUPPORTED = {_ops.isend, _ops.irecv, _ops.batch_p2p_ops}
