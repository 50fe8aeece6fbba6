"""A user's training script run on every rank of a simulated cluster, as torchrun runs it on every GPU.

    run = run_script("train.py", ["--tp", "2"], scenario, numerics=False)
    run.step_s                 # rank 0's step times (simulated seconds between its optimizer steps)
    run.result.report.data     # each rank's compute, communication, bytes and memory

Each rank runs the script as `__main__` (`runpy.run_path`; its folder first on `sys.path`, its arguments in
`sys.argv`), in a rank of `simtrain.dist.spawn`, with the environment torchrun gives a worker: `RANK`,
`LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `MASTER_ADDR`, `MASTER_PORT`. The ranks are threads
of one process, so `os.environ` is `RankEnvironment` for the run: those names read the calling rank's values, a
rank's writes are its own, everything else is the process's environment. A node is the cluster's
`gpus_per_node` ranks (all of them where the topology has no nodes), so `LOCAL_RANK` is the rank's device on its
node.

A step ends where the script's optimizer steps: each `torch.optim` step (a framework's own optimizer steps one
inside, as Megatron-Core's does) is marked on the rank's simulated clock (`torch.optim`'s global step hook), and
the step times are the spans between marks (the first from the rank's start). The script's `sys.exit(0)` is a
normal end; another exit status fails the run, as its exception does, in one line.
"""
import contextlib
import os
import runpy
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from torch.optim.optimizer import register_optimizer_step_post_hook

from ..errors import ScenarioError, SimtrainError
from ..hw.resolved_cluster import resolve_cluster
from ..scenario import Scenario
from ..torchdist import SpawnResult, now_s, spawn
from ..torchdist.scheduler import current_rank

MASTER_PORT = "29500"  # torchrun's default; nothing listens on it (the ranks' store is in memory)


class RankEnvironment(MutableMapping):
    """`os.environ` while a script runs on rank threads: torchrun's variables read the calling rank's values and a
    rank's writes stay its own; other threads, and other names, see the process's environment `environ`."""

    def __init__(self, environ, ranks: dict[int, dict[str, str]]):
        self._environ = environ
        self._ranks = ranks  # each rank's own variables

    def _own(self) -> dict | None:
        rank = current_rank()
        return None if rank is None else self._ranks[rank]

    def __getitem__(self, name):
        own = self._own()
        return own[name] if own is not None and name in own else self._environ[name]

    def __setitem__(self, name, value):
        own = self._own()
        if own is None:
            self._environ[name] = value
        else:
            own[name] = value

    def __delitem__(self, name):
        own = self._own()
        if own is not None and name in own:
            del own[name]
        else:
            del self._environ[name]

    def __iter__(self):
        own = self._own() or {}
        yield from own
        yield from (name for name in self._environ if name not in own)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def copy(self) -> dict:
        return dict(self)


def torchrun_variables(rank: int, world: int, per_node: int) -> dict[str, str]:
    """The environment torchrun gives rank `rank` of `world`, `per_node` ranks to a node."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node), "MASTER_ADDR": "localhost",
            "MASTER_PORT": MASTER_PORT}


@dataclass
class ScriptRun:
    """What a script's run on simulated ranks gave: its command line, each rank's optimizer steps' end times on its
    clock, rank 0's device, and the spawn's result (its report)."""

    argv: list[str]
    step_ends_s: list[list[float]]
    device_name: str
    result: SpawnResult

    @property
    def step_s(self) -> list[float]:
        """Rank 0's step times: the spans between its optimizer steps, the first from its start."""
        ends = self.step_ends_s[0]
        return [end - start for start, end in zip([0.0, *ends], ends)]


def run_script(script: str, arguments: list[str], scenario: Scenario, numerics: bool = False,
               machine=contextlib.nullcontext, rank_machine=contextlib.nullcontext) -> ScriptRun:
    """`script` with `arguments` on every device of `scenario`'s cluster (see above), inside `machine()` for the
    whole run and `rank_machine()` in each rank (a framework's stand-ins)."""
    path = Path(script)
    if not path.is_file():
        raise ScenarioError(f"script: {script}: no such file")
    cluster = resolve_cluster(scenario.cluster, scenario.base_dir)
    world = cluster.devices
    per_node = scenario.cluster.gpus_per_node
    per_node = per_node if per_node and world % per_node == 0 else world
    ends: dict[int, list[float]] = {rank: [] for rank in range(world)}

    def step_ended(optimizer, args, kwargs) -> None:
        rank = current_rank()
        if rank is not None:
            ends[rank].append(now_s())

    def rank(rank: int, world: int) -> None:
        with rank_machine():
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as ended:
                if ended.code not in (None, 0):
                    raise SimtrainError(f"{script}: exited with status {ended.code}") from None

    argv = [str(path), *arguments]
    environment = RankEnvironment(os.environ, {rank: torchrun_variables(rank, world, per_node)
                                               for rank in range(world)})
    hook = register_optimizer_step_post_hook(step_ended)
    before = os.environ, list(sys.argv), list(sys.path)
    os.environ, sys.argv[:], sys.path[:0] = environment, argv, [str(path.resolve().parent)]
    try:
        with machine():
            result = spawn(rank, scenario=scenario, numerics=numerics, timeout_s=None)
    finally:
        hook.remove()
        os.environ, sys.argv[:], sys.path[:] = before
    return ScriptRun(argv=argv, step_ends_s=[ends[rank] for rank in range(world)],
                     device_name=cluster.device_specs[0].name, result=result)
