"""Hostile users' code under `simtrain.dist` (issue 55): each way a user's torch.distributed code can go wrong on
simulated ranks ends in one line naming the rank and what happened, a SimtrainError subclass, never a traceback
or a hang.

The cases: collectives that do not match across ranks, a rank that raises, a rank that never joins (the clock
runs dry with the others blocked: a deadlock), out of memory inside the ranks' code (the device's, with numerics
on and off, and the host's), reads of values with numerics off, a world size or a backend that is not the
spawn's, and what a rank hands the backend's calls that no group of its size can take (a root or peer outside
it, lists that do not hold one tensor per rank). The reference is the contract of simtrain/errors.py, message by
message; `simtrain.dist` has no command of its own, so the API's exception is the whole surface. A read of values
and a deadlock name the line of the rank's code that read or waits (`at`, from this file's own source).
"""
import inspect
import os
import re
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import simtrain.dist
from simtrain.errors import (CollectiveMismatch, Deadlock, NumericsOffUnsupported, OutOfMemory, RankFailed,
                             SimtrainError)

SMALL = {"base": "a100-40gb", "memory": "1 MiB"}  # a device that a few MiB overflow, allocated for real
HUGE = {"base": "a100-40gb", "memory": "32 PiB"}  # a device larger than any host: the host runs out first


def all_reduce_or_all_gather(rank, world):
    dist.init_process_group("simtrain")
    if rank == 0:
        dist.all_reduce(torch.ones(4))
    else:
        dist.all_gather([torch.empty(4) for _ in range(world)], torch.ones(4))


def sizes_differ(rank, world):
    dist.init_process_group("simtrain")
    dist.all_reduce(torch.ones(4 + rank))


def raises(rank, world):
    dist.init_process_group("simtrain")
    if rank == 1:
        raise ValueError("no shard for this rank\nsee the log")  # only the first line is quoted
    dist.all_reduce(torch.ones(4))


def raises_without_a_message(rank, world):
    if rank == 1:
        raise ValueError()


def returns_early(rank, world):
    dist.init_process_group("simtrain")
    if rank == 1:
        return
    dist.all_reduce(torch.ones(4))


def skips_the_last(rank, world):
    dist.init_process_group("simtrain")
    for _ in range(1 if rank == 1 else 2):
        dist.all_reduce(torch.ones(4))


def skips_one(rank, world):
    dist.init_process_group("simtrain")
    if rank != 1:
        dist.all_reduce(torch.ones(4))
    dist.barrier()


def allocates(elements):
    def rank_code(rank, world):
        dist.init_process_group("simtrain")
        torch.empty(elements)  # float32
        dist.all_reduce(torch.ones(4))
    return rank_code


def reads(read):
    def rank_code(rank, world):
        dist.init_process_group("simtrain")
        total = torch.ones(4) * 2
        dist.all_reduce(total)
        return read(total)
    return rank_code


def if_positive(tensor):
    return 1 if tensor.sum() > 0 else 0


def at(fn, text: str) -> str:
    """' (at THIS:N in name)': where an error names fn's first line holding `text` (THIS: this file)."""
    lines, first = inspect.getsourcelines(fn)
    number = first + next(index for index, line in enumerate(lines) if text in line)
    return f" (at THIS:{number} in {fn.__name__})"


def this_file_named_this(message: str) -> str:
    """The message with this file's path (relative to the working folder, or absolute) written THIS."""
    return re.sub(r"\(at (\S+):", lambda found: "(at THIS:" if os.path.abspath(found.group(1)) == __file__
                  else found.group(0), message)


READS = [(lambda t: t.sum().item(), ""), (lambda t: t.tolist(), ""), (if_positive, "tensor.sum()"),
         (lambda t: float(t[0]), "")]  # each read and the text of its line


def world_size(rank, world):
    dist.init_process_group("simtrain", world_size=world + 1, rank=rank)


def rank_given(rank, world):
    dist.init_process_group("simtrain", world_size=world, rank=(rank + 1) % world)


def mesh_too_big(rank, world):
    dist.init_process_group("simtrain")
    init_device_mesh("cpu", (2, world))


def mesh_without_a_group(rank, world):
    init_device_mesh("cpu", (world,))  # torch starts its default backend, gloo


def gloo(rank, world):
    dist.init_process_group("gloo")


def sends_outside_the_group(rank, world):
    dist.init_process_group("simtrain")
    if rank == 0:
        dist.send(torch.ones(2), dst=world)


def broadcasts_from_outside(rank, world):
    dist.init_process_group("simtrain")
    dist.broadcast(torch.ones(2), src=world + 1)


def gathers_into_too_few(rank, world):
    dist.init_process_group("simtrain")
    dist.all_gather([torch.empty(2) for _ in range(world - 1)], torch.ones(2))


def groups_differ(rank, world):
    dist.init_process_group("simtrain")
    dist.new_group([0, 1] if rank < 2 else [0, 2, 3])


CASES = [
    # mismatched collectives
    (all_reduce_or_all_gather, 2, True, None, CollectiveMismatch,
     "rank 1 raised CollectiveMismatch: collective #0 of group [0, 1]: rank 0 called all_reduce(sum) of 4 float32, "
     "rank 1 called all_gather of [4, 4] float32"),
    (sizes_differ, 2, True, None, CollectiveMismatch,
     "rank 1 raised CollectiveMismatch: collective #0 of group [0, 1]: rank 0 called all_reduce(sum) of 4 float32, "
     "rank 1 called all_reduce(sum) of 5 float32"),
    (skips_one, 4, True, None, CollectiveMismatch,
     "rank 1 raised CollectiveMismatch: collective #0 of group [0, 1, 2, 3]: rank 0 called all_reduce(sum) of 4 "
     "float32, rank 1 called barrier"),
    (groups_differ, 4, True, None, CollectiveMismatch,
     "rank 2 raised CollectiveMismatch: new_group: rank 2 makes group 1 of ranks [0, 2, 3], which another rank made "
     "of ranks [0, 1] (every rank calls new_group with the same ranks, in the same order)"),
    # a rank raising
    (raises, 2, True, None, ValueError, "rank 1 raised ValueError: no shard for this rank"),
    (raises_without_a_message, 2, True, None, ValueError, "rank 1 raised ValueError: (no message)"),
    # a rank never joining: the clock runs dry with the others blocked
    (returns_early, 3, True, None, None,
     "deadlock at T us of simulated time: rank 0 waits on all_reduce(sum) of 4 float32 (collective #0 of "
     "group [0, 1, 2]), which ranks [1] have not called" + at(returns_early, "all_reduce") + "; rank 2 waits on "
     "all_reduce(sum) of 4 float32 (collective #0 of group [0, 1, 2]), which ranks [1] have not called"
     + at(returns_early, "all_reduce")),
    (skips_the_last, 2, True, None, None,
     "deadlock at T us of simulated time: rank 0 waits on all_reduce(sum) of 4 float32 (collective #1 of "
     "group [0, 1]), which ranks [1] have not called" + at(skips_the_last, "all_reduce")),
    # out of memory inside the ranks' code
    (allocates(1 << 19), 2, True, SMALL, OutOfMemory,  # 2 MiB on a 1 MiB device, numerics on
     "rank 0 raised OutOfMemory: out of memory on rank 0 (gpu0, a100-40gb): needs 2.0 MiB of 1.0 MiB "
     "(tensors 2.0 MiB)"),
    (allocates(15 << 30), 2, False, None, OutOfMemory,  # 60 GiB of fake floats on a 40 GB device
     "rank 0 raised OutOfMemory: out of memory on rank 0 (gpu0, a100-40gb): needs 60.0 GiB of 40.0 GiB "
     "(tensors 60.0 GiB)"),
    (allocates(1 << 52), 2, True, None, OutOfMemory,  # 16 PiB: neither the device nor the host has it
     "rank 0 raised OutOfMemory: out of memory on rank 0 (gpu0, a100-40gb): needs 16384.0 TiB of 40.0 GiB "
     "(tensors 16384.0 TiB)"),
    (allocates(1 << 52), 2, True, HUGE, SimtrainError,  # 16 PiB that the device would hold, the host not
     "rank 0 raised SimtrainError: aten.empty.memory_format needs 16384.0 TiB, more than this host can allocate "
     "(the device, rank 0 (gpu0, a100-40gb), would hold it): run numerics=False, where tensors hold no values"),
    # reads of values with numerics off
    *[(reads(read), 2, False, None, NumericsOffUnsupported,
       "rank 0 raised NumericsOffUnsupported: numerics off (spawn numerics=False): aten._local_scalar_dense.default "
       "needs tensor values, which fake tensors do not have" + at(read, text)) for read, text in READS],
    (reads(nonzero := lambda t: t.nonzero()), 2, False, None, NumericsOffUnsupported,
     "rank 0 raised NumericsOffUnsupported: numerics off (spawn numerics=False): aten.nonzero.default needs tensor "
     "values, which fake tensors do not have" + at(nonzero, "")),
    # a world, a rank, a mesh or a backend that is not the spawn's
    (world_size, 2, True, None, SimtrainError, "rank 0 raised SimtrainError: init_process_group: rank 0 of world_size 3 "
                                      "given, but simtrain.dist.spawn runs this thread as rank 0 of 2"),
    (rank_given, 2, True, None, SimtrainError, "rank 0 raised SimtrainError: init_process_group: rank 1 of world_size 2 "
                                      "given, but simtrain.dist.spawn runs this thread as rank 0 of 2"),
    (mesh_too_big, 2, True, None, RuntimeError,  # torch's own check
     "rank 0 raised RuntimeError: Mesh should not be bigger than default world size 2, but found 4 ranks!"),
    (mesh_without_a_group, 2, True, None, SimtrainError,
     "rank 0 raised SimtrainError: init_process_group: no backend given (torch's default: gloo); the ranks of "
     "simtrain.dist.spawn are threads of one process, which only the simtrain backend connects: call "
     "dist.init_process_group(\"simtrain\") first, before any init_device_mesh"),
    (gloo, 2, True, None, SimtrainError,
     "rank 0 raised SimtrainError: init_process_group: backend 'gloo'; the ranks of simtrain.dist.spawn are "
     "threads of one process, which only the simtrain backend connects: call dist.init_process_group(\"simtrain\") "
     "first, before any init_device_mesh"),
    # arguments no group of the spawn's size takes
    (sends_outside_the_group, 2, True, None, SimtrainError,
     "rank 0 raised SimtrainError: send: destination rank 2 is not a rank of the group (0 to 1)"),
    (broadcasts_from_outside, 2, True, None, SimtrainError,
     "rank 0 raised SimtrainError: broadcast: root rank 3 is not a rank of the group (0 to 1)"),
    (gathers_into_too_few, 2, True, None, SimtrainError,
     "rank 0 raised SimtrainError: all_gather: 1 output tensors for a group of 2 ranks (one per rank)"),
]
IDS = ["all_reduce or all_gather", "sizes differ", "skips one", "groups differ", "raises",
       "raises without a message", "returns early", "skips the last", "device oom", "device oom numerics off",
       "device and host oom", "host oom", "item", "tolist", "if", "float", "nonzero", "world_size", "rank",
       "mesh too big", "mesh without a group", "gloo", "send outside", "broadcast root outside",
       "all_gather list too short"]


@pytest.mark.parametrize("fn,world,numerics,device,cause,expected", CASES, ids=IDS)
def test_users_code_that_goes_wrong_is_one_line_naming_the_rank(fn, world, numerics, device, cause, expected):
    threads = threading.active_count()
    options = {"device": device} if device is not None else {}
    with pytest.raises((RankFailed, Deadlock)) as error:
        simtrain.dist.spawn(fn, world=world, numerics=numerics, **options)
    # a deadlock's instant is the simulated time its last collective ended (test_dist_backend.py times those)
    assert this_file_named_this(re.sub(r"^deadlock at [0-9.e+-]+ us", "deadlock at T us", str(error.value))) == expected
    assert threading.active_count() == threads  # every rank's thread ended, the waiting ones too: never a hang
    if cause is None:  # a deadlock: no rank raised
        assert type(error.value) is Deadlock and error.value.__cause__ is None
    else:  # the rank's own exception, for the Python API
        assert type(error.value) is RankFailed and isinstance(error.value.__cause__, cause)
