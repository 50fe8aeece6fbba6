"""torch.distributed's process-global state, made per rank thread for the time of a spawn.

torch.distributed keeps its default group, its groups and its counters in one
module-level registry (`distributed_c10d._world`), and `init_process_group`
without arguments reads rank and world size from the environment and opens a
TCP store. Neither suits ranks that are threads of one process. While
`ranks_as_threads(...)` is entered:

- `_world` is a stand-in that gives each rank thread a registry of its own
  (default group, groups, names, counters) and any other thread torch's own,
  untouched; so every rank's `init_process_group`, `new_group`, `get_rank` and
  DDP (which takes the default group) see that rank's groups;
- the rendezvous that `init_process_group` calls, when called from a rank
  thread, returns one in-memory store shared by the ranks, with the launcher's
  rank and world size (whatever init_method was given); from any other thread
  it is torch's;
- torch's registry of group names is per thread (its thread isolation mode),
  as every rank registers the same names;
- a group of the GPU's backend (nccl), where a framework's stand-ins made the
  GPU's default backend simtrain's (frameworks/megatron.py), is simtrain's, so
  a script written for GPUs runs unchanged;
- a group of another backend made from a rank thread (gloo, which torch picks
  when none is given, as `init_device_mesh` does without a default group,
  unless the CPU's default backend is set to simtrain's) is one line: its
  ranks would wait for processes that are not there (torch's `fake` backend
  waits for no one and is let through);
- `sys.excepthook`, which `init_process_group` wraps, is put back on exit;
- when DTensor is loaded (DeviceMesh, FSDP2), torch._dynamo is imported first,
  outside the ranks (below).

The `simtrain` backend itself is registered once, on import
(`dist.Backend.register_backend`); its creator makes the calling rank's
`SimProcessGroup` on the group's shared `Group` (process_group.py).

    with ranks_as_threads(world=4):
        run.finish()       # rank threads call dist.init_process_group("simtrain")
"""
import sys
import threading
from contextlib import contextmanager

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import _set_thread_isolation_mode

from ..errors import SimtrainError
from .process_group import SimProcessGroup
from .run import SimRun
from .scheduler import current_rank


class _RankRegistry(c10d._World):
    """One rank thread's torch.distributed registry: torch's `_World` with its maps held per instance."""

    def __init__(self):
        super().__init__()
        self._maps = {name: {} for name in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config",
                                            "tags_to_pg", "pg_to_tag")}
        self._group_count = 0

    pg_map = property(lambda self: self._maps["pg_map"])
    pg_names = property(lambda self: self._maps["pg_names"])
    pg_group_ranks = property(lambda self: self._maps["pg_group_ranks"])
    pg_backend_config = property(lambda self: self._maps["pg_backend_config"])
    tags_to_pg = property(lambda self: self._maps["tags_to_pg"])
    pg_to_tag = property(lambda self: self._maps["pg_to_tag"])

    @property
    def group_count(self) -> int:
        return self._group_count

    @group_count.setter
    def group_count(self, value: int) -> None:
        self._group_count = value


class _PerThread:
    """Stands in for `distributed_c10d._world`: a rank thread's own registry, else torch's."""

    def __init__(self, shared):
        object.__setattr__(self, "_shared", shared)
        object.__setattr__(self, "_local", threading.local())

    def _registry(self):
        if current_rank() is None:
            return self._shared
        registry = getattr(self._local, "registry", None)
        if registry is None:
            registry = self._local.registry = _RankRegistry()
        return registry

    def __getattr__(self, name):
        return getattr(self._registry(), name)

    def __setattr__(self, name, value):
        setattr(self._registry(), name, value)


@contextmanager
def ranks_as_threads(world: int):
    """torch.distributed set up for rank threads of a `world`-rank spawn, until the block ends."""
    if isinstance(c10d._world, _PerThread):
        raise SimtrainError("simtrain.dist.spawn: already running (a spawn cannot run inside another)")
    if "torch.distributed.tensor" in sys.modules:
        # DTensor and FSDP2 import torch._dynamo on first use; inside a rank, the import's frames would hold
        # that rank's tensors in reference cycles (counted until the next collection), in the first spawn only
        import torch._dynamo  # noqa: F401
    store = dist.HashStore()
    torch_rendezvous, torch_world, excepthook = c10d.rendezvous, c10d._world, sys.excepthook

    def rendezvous(url, rank=-1, world_size=-1, **kwargs):
        own = current_rank()
        if own is None:
            return torch_rendezvous(url, rank, world_size, **kwargs)
        if rank not in (-1, own) or world_size not in (-1, world):
            raise SimtrainError(f"init_process_group: rank {rank} of world_size {world_size} given, but "
                                f"simtrain.dist.spawn runs this thread as rank {own} of {world}")
        return iter([(store, own, world)])

    torch_new_group = c10d._new_process_group_helper

    def new_group(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs):
        if current_rank() is not None and str(backend).lower() == "nccl" and \
                dist.Backend.default_device_backend_map.get("cuda") == "simtrain":
            backend = "simtrain"  # the GPU's backend, named, where a framework made the GPU's default simtrain's
        if current_rank() is not None and not _only_simtrain(backend):
            given = "no backend given (torch's default: gloo)" if backend == "undefined" else f"backend {backend!r}"
            raise SimtrainError(f"init_process_group: {given}; the ranks of simtrain.dist.spawn are threads of one "
                                f"process, which only the simtrain backend connects: call "
                                f"dist.init_process_group(\"simtrain\") first, before any init_device_mesh")
        return torch_new_group(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs)

    c10d._world, c10d.rendezvous, c10d._new_process_group_helper = _PerThread(torch_world), rendezvous, new_group
    _set_thread_isolation_mode(True)
    try:
        yield
    finally:
        c10d._world, c10d.rendezvous, sys.excepthook = torch_world, torch_rendezvous, excepthook
        c10d._new_process_group_helper = torch_new_group
        _set_thread_isolation_mode(False)


def _only_simtrain(backend) -> bool:
    """Whether a group's backend ('simtrain', or per device as 'cpu:simtrain') is simtrain's on every device, or
    torch's `fake` (a group whose collectives do nothing and wait for no one: torchtitan's for mesh dimensions of
    size one). No backend given is the machine's device's default, as torch resolves it (`BackendConfig`): the
    CPU's, simtrain's where a framework made it so (frameworks/megatron.py), else gloo."""
    if str(backend) == dist.Backend.UNDEFINED:
        backend = repr(c10d.BackendConfig(dist.Backend(dist.Backend.UNDEFINED)))
    return all(part.rpartition(":")[2] in ("simtrain", "fake") for part in str(backend).lower().split(","))


def _create(options, backend_options) -> SimProcessGroup:
    """The backend's creator (torch's extended API): the calling rank's process group."""
    run = SimRun.active("init_process_group / new_group with backend simtrain")
    ranks = list(options.global_ranks_in_group) or list(range(run.world))
    return SimProcessGroup(run.group(options.group_id, ranks), options.group_rank)


if not hasattr(dist.Backend, "SIMTRAIN"):
    dist.Backend.register_backend("simtrain", _create, extended_api=True, devices=["cpu"])
