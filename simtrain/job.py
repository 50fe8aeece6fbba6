"""A job: a workload on a group of a cluster's devices, run on a backend that supplies its communicators.

A job is what runs on a cluster. It joins

- a **workload**: the scenario's model, data and training recipe (one replica
  per device: its model copy, data shard and optimizer, train/replica.py);
- a **parallel layout**: how the group's devices cooperate, the scenario's
  `parallel` section: every degree (parallel/layout.py), carried out
  by a scheme from the registry (simtrain/schemes/__init__.py). Under
  pipeline or tensor parallelism each rank's replica holds its share of the
  model (train/partition.py), and the ranks of one data-parallel replica
  read the same batches;
- a **group** of the cluster's devices, named by their global ranks. Inside the
  job, ranks are 0..world-1 in group order.

It runs on a **backend** (simtrain/backend/), the one thing that knows
where: which ranks this process holds, the communicators of the job and of
its sub-groups, each group's all-reduce, the interpreter of a rank's step
program. The simulated backend (the default) holds every rank, and its
communicators are SimCommunicators over the group's network nodes (the job's
own exclusive of the network when the job is built `alone` and its scheme
runs nothing but ring all-reduces: Network.time_ring, hw/ring_timing.py), logging under the
devices' global ranks; the real one (simtrain/real/backend.py) holds one rank
per process of a torch.distributed group. So several jobs on disjoint groups
run side by side on one cluster, sharing its links (max-min fair, where their
routes overlap) and its clock, and every span they log carries the job's
index (hw/eventlog.py); the report and the trace tell them apart by it.

Before each step every rank runs `job.before_step(rank, step)`, a step
program the schemes `yield from`: it sets the hyperparameters `train.schedule`
gives for that step (train/hyperparameters.py), then runs `between_steps`, a
hook the job was built with: how a population pauses its members to compare
and copy them (studies/pbt.py). The validation split `data.validation_fraction`
asks for is held out of the training split here, before the shards are cut.

With `numerics=False` the model is built on the meta device and every batch is
a meta tensor of the data's shapes (train/data.py MetaLoader): the same step
programs run with shapes, bytes and FLOPs and no arithmetic. The memory plan
(memory_plan.py) replays a step this way.

    cluster = build_cluster(scenario.cluster, scenario.base_dir)
    job = Job(scenario, cluster, ranks=range(cluster.size))
    job.start(); run_to_end(cluster.env); job.finish()
    job.scheme.report_sections()

With `train.checkpoint` the job writes checkpoints in `before_step`
(train/job_checkpoint.py). A restart after a lost device (recovery.py) puts a
spare in the lost rank's place (`replace`), builds new communicators over the
devices as they are then (the job's, and the scheme's sub-groups' through its
`regroup`), and starts every rank again from the checkpoint's step;
`finished` fires when the programs of the latest start have all ended.
"""
import copy

import torch

from .backend import SimulatedBackend
from .errors import ScenarioError
from .hw.cluster import Cluster
from .scenario import Scenario
from .schemes import build_scheme, load_schemes, scheme_class
from .parallel import Layout
from .parallel.support import Case, refuse
from .strategies.representatives import representative_ranks
from .schemes.model_parts import part_counts, rank_shares
from .train.checkpointing import apply_checkpointing
from .train.data import MetaLoader, hold_out_validation, load_dataset
from .train.hyperparameters import values_from
from .train.job_checkpoint import Checkpoints
from .train.models import build_model
from .train.replica import Replica, main_grads_of, share_gradient_rows
from .train.sampling import build_loader

load_schemes()  # every scheme registers its report sections (report/sections.py) when imported


class Job:
    """A scenario's training on a group of a cluster's devices."""

    def __init__(self, scenario: Scenario, cluster: Cluster, ranks, numerics: bool = True, on_step=None,
                 between_steps=None, alone: bool = False, backend=None):
        self.scenario = scenario
        self.name = scenario.name
        self.cluster = cluster
        self.ranks = list(ranks)
        self.devices = [cluster.devices[rank] for rank in self.ranks]
        self.world = len(self.devices)
        self.numerics = numerics
        self.index = cluster.add_job(self.name, self.ranks)
        self.backend = backend if backend is not None else SimulatedBackend()
        self.layout = Layout.of(scenario.parallel, self.world)
        refuse(Case(scenario, layout=self.layout), ScenarioError)  # the support table's rows that read the layout
        dataset = load_dataset(scenario.data.name, scenario.data.loader_options(), scenario.seed, values=numerics)
        self.data = hold_out_validation(dataset, scenario.data.validation_fraction, scenario.seed)
        device = "cpu" if numerics else "meta"
        with torch.device(device):
            model = build_model(scenario.model, self.data.info, scenario.seed)
        # Job ranks whose replicas this process holds: the backend's (every rank in a simulation, its own in a
        # real run), of those whose programs run (with representatives, one per stage: representatives.py)
        running = set(representative_ranks(self.layout)) if scenario.parallel.representatives else None
        held = [rank for rank in self.backend.local_ranks(self.world) if running is None or rank in running]
        if scheme_class(scenario.parallel).holds_shares:
            self.model = model  # the initial model; each rank holds its share of it
            self.parts = part_counts(model, self.layout, scenario, self.sample_microbatch())
            shares = rank_shares(model, self.layout, scenario, self.parts, held)
        else:
            self.model = apply_checkpointing(model, scenario.train.checkpointing)  # the initial model
            shares = [copy.deepcopy(self.model) if rank in held else None for rank in range(self.world)]
        self.local_ranks = held
        self._groups = []  # (communicator, its job ranks): every sub-group's, as the scheme asked for them
        meta_losses = {}  # numerics off: one forward and backward per batch shape for all the replicas (Replica)
        sharding = scenario.parallel.sharding  # DDP's main gradients (stage 1's are its ShardedReplica's)
        main_grads = sharding.stage == 0 and main_grads_of(0, scenario.train.precision != "fp32", sharding.reduce_dtype)
        self.replicas = [Replica(share, self._loader(rank), scenario.train, meta_losses, main_grads)
                         if rank in held else None for rank, share in enumerate(shares)]
        share_gradient_rows([replica for replica in self.replicas if replica is not None])
        self.alone = alone  # nothing else will run on the cluster's network (a scheme may time its rings as a group)
        self.scheme = build_scheme(self, on_step)
        # Alone on the cluster's network (`alone`: nothing else will run on it), a job whose collectives are
        # all ring all-reduces has them timed as a group when numerics are off (Network.time_ring,
        # hw/ring_timing.py).
        self.exclusive = self.alone and self.scheme.only_ring_all_reduces
        self.comm = self._communicator()
        self.between_steps = between_steps  # (rank, step) -> a step program returning whether to go on
        spec = scenario.train.checkpoint
        self.checkpoints = Checkpoints(spec, self.replicas) if spec is not None else None
        self.processes = []  # each rank's simpy process of the latest start
        self.finished = cluster.env.event()  # the latest start's programs have all ended, not every one lost
        self.lost: set[int] = set()  # job ranks of the latest start whose device was lost

    def _communicator(self):
        """The job's own communicator: all its ranks, over the devices as they are now."""
        return self.backend.communicator(self, list(range(self.world)), exclusive=self.exclusive)

    def communicator(self, ranks: list[int], copies: int = 1, exclusive: bool = False):
        """A communicator of job ranks `ranks` (a sub-group: a pipeline, a tensor-parallel group), each rank
        standing for `copies` ranks under representatives; `exclusive`: its links carry nothing else."""
        comm = self.backend.communicator(self, list(ranks), exclusive=exclusive, copies=copies)
        self._groups.append((comm, list(ranks)))
        return comm

    def abandon(self, rank: int) -> None:
        """Job rank `rank` is gone: its posted operations that no peer has matched are dropped from every
        communicator it belongs to, so none of them ever starts a transfer."""
        self.comm.abandon(rank)
        for comm, ranks in self._groups:
            if rank in ranks:
                comm.abandon(ranks.index(rank))

    def all_reduce(self, ranks: list[int]):
        """fn(rank, world, buf, average=False) -> the scenario's all-reduce program for job ranks `ranks`."""
        return self.backend.all_reduce(self, list(ranks))

    def sample_microbatch(self) -> torch.Tensor:
        """A meta microbatch of the data's inputs: what pipeline stages are balanced on."""
        info, parallel = self.data.info, self.scenario.parallel
        samples = self.scenario.data.batch_size // parallel.microbatches
        return torch.empty((samples, *info.input_shape), dtype=getattr(torch, info.input_dtype), device="meta")

    def _loader(self, rank: int):
        """Rank `rank`'s batches: its data-parallel replica's shard (every rank of a replica sees the same)."""
        if not self.numerics:
            return MetaLoader(self.data.train, self.scenario.data.batch_size)
        return build_loader(self.scenario, self.data.train, self.layout.dp, self.layout.coordinates(rank)["dp"])

    def start(self) -> None:
        """Start every rank's program on the cluster's clock."""
        self._launch([self.scheme.program(rank) for rank in range(self.world)])

    def restart(self, first_step: int, prologue) -> None:
        """Start every rank again at step `first_step` on new communicators over the devices as they are now
        (the scheme's too: `regroup`), after `prologue(rank)` (a step program: reading its checkpoint)."""
        self.comm = self._communicator()
        self._groups = []
        self.scheme.regroup()
        self._launch([self._then(prologue(rank), self.scheme.program(rank, first_step)) for rank in range(self.world)])

    @staticmethod
    def _then(first, second):
        yield from first
        return (yield from second)

    def _launch(self, programs: list) -> None:
        env = self.cluster.env
        self.processes = [self.backend.start(self, rank, program) for rank, program in enumerate(programs)]
        self.lost = set()
        launched = self.processes
        # a job whose every rank was lost (their programs ended where they stood) holds its training state nowhere:
        # it has not finished, and restarts once the loss is noticed; a survivor's ending is the job's
        env.all_of(launched).callbacks.append(
            lambda _event: self.finished.succeed() if self.processes is launched and len(self.lost) < self.world
            else None)

    def replace(self, rank: int, spare: int) -> None:
        """The cluster's device `spare` takes job rank `rank`'s place (its device was lost)."""
        self.ranks[rank] = spare
        self.devices[rank] = self.cluster.devices[spare]
        self.cluster.join_job(self.index, spare)

    def before_step(self, rank: int, step: int):
        """Step program every rank runs before its step `step`: the hyperparameters train.schedule sets
        from that step on, then `between_steps` (a population's rounds); returns False to end training."""
        if self.checkpoints is not None and self.checkpoints.due(step):
            yield from self.checkpoints.write(rank, self.replicas[rank], step, lambda: self.cluster.env.now)
        values = values_from(self.scenario.train.schedule, step)
        if values:
            self.scheme.set_hyperparameters(rank, values)
        if self.between_steps is None:
            return True
        return (yield from self.between_steps(rank, step))

    def finish(self) -> None:
        """After the clock stopped: mixed precision's fp32 master weights become the trained models."""
        for replica in self.replicas:
            if replica is not None:
                replica.precision.finish(replica.model)
