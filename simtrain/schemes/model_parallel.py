"""The one step engine: data, pipeline (pp), tensor (tp) and context (cp) parallelism in one rank program.

A job of dp x pp x cp x tp devices (parallel/layout.py) trains one model, each rank
its share of it (schemes/model_parts.py: pipeline parts balanced by measured
FLOPs, cut to tensor-parallel slices). Data parallelism alone is the
pp = tp = cp = 1 case: a rank's share is the whole model, one part.

- **pipeline**: each stage walks its schedule's actions (simtrain/parallel/schedules:
  forwards, backwards, split or whole), its activations and gradients going as Send/Recv programs on the
  pipeline's communicator (schemes/pipeline.py); the pipeline bubble is that
  communicator's idle accounting ("bubble" spans);
- **tensor**: each stage is split across its tp devices as Megatron-LM splits
  layers (train/tensor_parallel.py; a gpt's vocabulary too, its loss computed
  vocabulary-parallel in the last stage: train/vocab_parallel.py), with the
  all-reduces of activations and of their gradients run by the chosen
  all-reduce algorithm on the tp group's communicator, region by region
  (schemes/stage_execution.py);
- **context**: each rank of a cp group takes its two chunks of every
  sequence (train/ring_attention.py), and each attention's key/value blocks
  go around the cp group as Send/Recv programs on its communicator
  (comm/kv_ring.py), each step's transfer beside the compute of a block;
- **data**: after the last backward of a step, each device all-reduces (and
  averages) its gradient bucket with the devices that hold the same shard in
  the other replicas and the other cp ranks (Megatron-Core's dp-cp group), with
  `parallel.all_reduce`'s algorithm, then steps its own optimizer on its own
  parameters; or, with `parallel.sharding.stage` 1 or 2, reduce-scatters it,
  steps its 1/dp chunk and all-gathers the parameters (Megatron-Core's
  distributed optimizer), with stage 3 holds only its chunk of the parameters,
  gathered around each use of a model chunk (FSDP x TP; under data parallelism
  alone, of each block: FSDP2's units, strategies/unit_overlap.py), with a
  `degree` below dp as HSDP, optionally offloaded to the host:
  strategies/distributed_optimizer.py;
- **fp16 loss scaling**: the ranks of a replica (sharded, or with ep: of the
  job) vote on an overflow before stepping (strategies/overflow_vote.py);
- **experts** (`model.moe`, `parallel.ep`): each MoE layer's tokens go to
  their experts' ranks in its ep group and back by all-to-all, as regions of
  the chunk's work (train/moe_exchange.py), the experts charged by the
  tokens they received; the experts' gradients all-reduced over their
  holders (strategies/expert_model_parallel.py), under data parallelism alone
  as under pp / tp;
- **SyncBN** (data parallelism alone): every BatchNorm's statistics
  all-reduced over the dp group in the forward and backward
  (strategies/sync_batchnorm.py).

report.json's `weight_norms` follows the trained model's per-layer weight
norms every `report.every` steps (strategies/weight_norms.py).

The last stage's loss of a microbatch is its mean cross entropy times 1/m (and
the loss scale under fp16), so the gradients accumulated over the m
microbatches, averaged over the dp x cp ranks (each cp rank's tokens an equal
share of the sequence), are those of one device on the
whole global batch. With numerics off a chunk's work is replayed from its
measured costs, and with `parallel.representatives` one rank per stage runs
for all of them, on mirrored communicators (representatives.py): the scheme
runs the same program either way.

Under prioritized or Metropolis-Hastings sampling (data parallelism alone, one
microbatch: data.sampling) the model ends with its replica loader's loss,
importance-weighted, and each step charges the loader's draw first, as host
work (a `sampling` span: train/sampling.py).

Before each step every rank runs the job's `before_step` program (job.py: a
schedule's hyperparameters, a population's exploit, which copies each rank's
share from the donor's rank of the same coordinates; under data parallelism
alone, where every rank holds the whole state, 1/k from the donor's rank of
the same index and a ring all-gather: scheme.py's default).

    scheme = ModelParallel(job)        # every synchronous layout
    job.start(); run_to_end(job.cluster.env)
    scheme.report_sections()["parallel"]["bubble_fraction"]
"""
import torch

from ..comm.kv_ring import RING_STEPS
from ..comm.sequence_shards import SEQUENCE_COLLECTIVES
from ..cost import measure_step_cost
from ..parallel import GroupCommunicators, Layout, Membership, memberships
from ..parallel.schedules import pipeline_schedule
from ..step_ops import Alloc, Busy, Collective, Free, Transfer
from ..train.partition import assemble, module_structure
from ..train.moe_exchange import ExpertExchange
from ..train.precision import DTYPES
from ..train.ring_attention import shard_sequence
from . import selection
from ..strategies.distributed_optimizer import DistributedOptimizer
from ..strategies.expert_model_parallel import ExpertLayers, ExpertUpdate
from .layer_recompute import measure_layers
from .model_parts import boundary_activations
from ..strategies.overflow_vote import vote_groups
from .pipeline import PipelineStage
from .rank_replicas import RankReplicas
from ..strategies.replicated_update import ReplicatedUpdate
from .scheme import Scheme
from ..strategies.representatives import (MirroredCollective, mirrored_communicators, mirrored_sequence_collective,
                              represented_by)
from .chunk_measurement import measure_chunk
from .stage_execution import ChunkCost
from ..strategies.sync_batchnorm import SyncedBatchNorm
from ..strategies.tp_overlap import STEPWISE, mirrored_stepwise, stepwise
from ..strategies.weight_norms import WeightNormLog


class ModelParallel(RankReplicas, Scheme):
    """dp x pp x cp x tp training with a pipeline schedule, tensor-parallel layers, ring attention and a gradient
    all-reduce."""

    def __init__(self, job, on_step=None):
        self.job = job
        self.layout: Layout = job.layout
        self.replicas = job.replicas
        self.world = job.world
        scenario = job.scenario
        parallel, train = scenario.parallel, scenario.train
        self.pipeline = parallel.pipeline
        self.microbatches = parallel.microbatches
        # every pipeline rank's actions and model parts (simtrain/parallel/schedules)
        self.schedule = pipeline_schedule(self.pipeline, self.layout.pp, self.microbatches, scenario.base_dir)
        self.sequence_parallel = parallel.sequence_parallel
        self.tp_overlap = parallel.tp_comm_overlap  # the layers' tp collectives beside their GEMMs (tp_overlap.py)
        self.steps = train.steps
        self.on_step = on_step
        # Every rank runs its program, or one per stage does for all (strategies/representatives.py)
        self.representatives = parallel.representatives
        self._representative = represented_by(self.layout) if self.representatives else list(range(self.world))
        self.running = [rank for rank in range(self.world) if self._represented_by(rank) == rank]
        self.mirror_of = {job.devices[rank].rank: job.devices[self._represented_by(rank)].rank
                          for rank in range(self.world) if self._represented_by(rank) != rank}
        # data parallelism alone (pp = tp = cp = 1, no ep): every rank holds the whole model; replicated (DDP), its
        # whole training state too
        self.data_alone = self.layout.world == self.layout.dp and self.layout.ep == 1
        self.replicated = self.data_alone and not parallel.sharding.stage
        # fp16: the overflow vote of each replica's model-parallel group (a whole replica sees its whole gradient;
        # sharded, or with experts, whose holders see theirs, the whole job's)
        self.vote = train.precision == "fp16" and not self.replicated
        self.experts = ExpertLayers(self) if scenario.model.moe is not None else None  # expert_model_parallel.py
        # replicated, its all-reduces rings: alone on the network, each is timed as a group
        self.only_ring_all_reduces = (self.replicated and parallel.all_reduce == "ring"
                                      and train.optimizer.name != "kfac")  # K-FAC broadcasts too
        # SyncBN (sync_batchnorm.py; refused for a model it cannot run); an MoE model has no BatchNorm to
        # synchronize, its layers running as regions between their exchanges (train/moe_exchange.py)
        synced = SyncedBatchNorm(self) if parallel.sync_batchnorm else None
        self.synced_batchnorm = synced if self.experts is None else None
        self.regroup()
        for replica in self.replicas:  # the model ends with its loader's loss (a prioritized sampler's, weighted)
            if replica is not None:
                replica.model.loss = replica.loader.batch_loss
        if self.layout.pp > 1:  # each pipeline's activations and gradients, as Send/Recv programs
            self._boundaries = boundary_activations(job.model, *job.parts, job.sample_microbatch(),
                                                    DTYPES[train.precision],
                                                    self.layout.cp * (self.layout.tp if parallel.sequence_parallel
                                                                      else 1))
        # the distributed optimizer (each rank's share sharded over its dp group, its experts over their holders),
        # or DDP's all-reduce (with experts: theirs over their holders)
        self.data_parallel = (DistributedOptimizer(self) if parallel.sharding.stage
                              else ExpertUpdate(self) if parallel.ep > 1 else ReplicatedUpdate(self))
        self._costs: dict[tuple, ChunkCost] = {}  # by model part and shapes: the same on every rank holding it
        self._signatures: dict[int, int] = {}  # model part -> the number of what it computes, among those below
        self._structures: dict[tuple, int] = {}  # what a part computes (module_structure) -> its number
        self._losses = [[] for _ in range(self.steps)]
        self._ranks_done = [0] * self.steps
        self._rank_losses = {rank: [] for rank in range(self.world)}  # rank -> its losses of every step
        self.loss_curve: list[tuple[float, float | None]] = []
        # while a step's end is reported (_step_done): the trained model, assembled once for every reader
        self._reporting, self._reported_model = False, None
        self._microbatch_s: float | None = None  # data parallelism alone: one device's microbatch (single_device_step_s)
        # report.json's weight_norms, taken where there are values and this process holds every rank
        self.weight_norms = WeightNormLog(self.trained_model, job.model, scenario.report.every, self.steps,
                                          job.numerics and len(job.local_ranks) == self.world)

    def stopped(self) -> None:
        self.data_parallel.publish()  # a distributed optimizer's shards make the trained model

    def regroup(self) -> None:
        """Every group's communicator over the job's devices as they are now (built once; again after a spare
        took a lost device's place): a GroupCommunicators record (parallel/communicators.py)."""
        layout, sharded = self.layout, self.job.scenario.parallel.sharding.stage
        if self.representatives:
            self.comms = mirrored_communicators(self.job)
        else:
            self.comms = GroupCommunicators(dp_cp=self._communicators(layout.groups("dp_cp"),  # a share's ranks
                                                                      exclusive=self.job.alone
                                                                      and self.only_ring_all_reduces),
                                            tp=self._communicators(layout.groups("tp")))
            if self.vote:  # a replica's model-parallel group; sharded or with experts, the whole job
                self.comms.model = self._communicators(vote_groups(self.job.scenario.parallel, layout))
            if sharded and layout.dp_replicate > 1:  # HSDP (distributed_optimizer.py)
                self.comms.dp_shard = self._communicators(layout.groups("dp_shard"))
                self.comms.dp_replicate = self._communicators(layout.groups("dp_replicate"))
        if layout.cp > 1 and not self.representatives:  # ring attention's key/value blocks, Send/Recv programs
            self.comms.cp = self._communicators(layout.groups("cp"), all_reduce=False)
        if layout.pp > 1:  # each pipeline's activations and gradients, as Send/Recv programs
            self.comms.pp = self._communicators(layout.groups("pp"), all_reduce=False)
        # the ep groups' exchanges, the experts' update (representatives time theirs mirrored, ep groups of one alone)
        if self.experts is not None and not (self.representatives and layout.ep > 1):
            self.comms.ep, self.comms.expert_dp = self.experts.communicators()
        elif self.experts is not None:
            self.experts.place_representatives()

    def resume(self, rank: int):
        """Step program after a load: a sharded share gathers the chunks it does not own (distributed_optimizer.py)."""
        yield from self.data_parallel.resume(rank)

    def rewind(self, step: int) -> None:
        """Forget what came after step `step`: the job restarts there from a checkpoint (recovery.py)."""
        super().rewind(step)
        self._losses[step:] = [[] for _ in range(self.steps - step)]
        self._ranks_done[step:] = [0] * (self.steps - step)
        for losses in self._rank_losses.values():
            del losses[step:]
        self.weight_norms.rewind(step)

    def _communicators(self, groups: list[tuple[int, ...]], all_reduce: bool = True,
                       exclusive: bool = False) -> dict[int, Membership]:
        """rank -> its Membership of its group among `groups` (the group's all-reduce only with `all_reduce`; its
        rings timed as a group with `exclusive`, comm/simulated.py); under representatives, a group's ranks stand
        for every tp rank of every replica."""
        copies = self.world // len(self.running)
        return memberships(groups, lambda ranks: self.job.communicator(ranks, copies=copies, exclusive=exclusive),
                           self.job.all_reduce if all_reduce else None)

    def _represented_by(self, rank: int) -> int:
        """The rank whose program stands for `rank`'s: itself, or with representatives its stage's rank
        with tp 0 in replica 0."""
        return self._representative[rank]

    @classmethod
    def steps_until_every_rank_stepped(cls, world: int) -> int:
        return 1

    # --- the program of one rank ---

    def program(self, rank: int, first_step: int = 0):
        """Step program of job rank `rank`: hold its share's state, then every step from `first_step` (with
        ZeRO-Offload, its host share held on the host meanwhile: offload.py)."""
        if self._represented_by(rank) != rank:
            return  # its representative's program stands for it
        steps = self._steps(rank, first_step)
        offload = self.data_parallel.offload if self.job.scenario.parallel.sharding.offload != "none" else None
        yield from steps if offload is None else offload.holding(rank, self.data_parallel.host_held[rank], steps)

    def _steps(self, rank: int, first_step: int):
        replica = self.replicas[rank]
        for category, nbytes in self.data_parallel.held[rank].items():
            yield Alloc(category, nbytes)
        pp_comm, pp_index, _ = self.comms.pp[rank] if self.layout.pp > 1 else (None, 0, None)
        stage = PipelineStage(self, rank, pp_comm, pp_index, self._boundaries if self.layout.pp > 1 else [])
        receives = (yield from stage.post_receives(first_step)) if first_step < self.steps else {}
        tp_comm, tp_index, tp_reduce = self.comms.tp[rank]
        cp_comm, cp_index, _ = self.comms.cp[rank] if self.layout.cp > 1 else (None, 0, None)

        def tp_collective(kind: str, tensor):
            """(the tp collective `kind` on `tensor`, or ring attention's step on the cp group, its result):
            schemes/stage_execution.py."""
            if isinstance(kind, ExpertExchange):  # an MoE layer's exchange in the ep group
                return self.experts.exchange(rank, kind, tensor)
            if kind in RING_STEPS:  # with representatives, timed with the mirrored cp groups' (numerics off)
                program, result = ((MirroredCollective(kind, tensor), tensor) if self.representatives
                                   else RING_STEPS[kind](cp_index, cp_comm.world, tensor))
                return Collective(program, "cp_kv" if kind == "kv_ring" else "cp_kv_grad", cp_comm, cp_index), result
            if kind == "all_reduce":  # collectives cut a buffer into parts along its first dimension
                return Collective(tp_reduce(tp_index, tp_comm.world, tensor.view(-1)), "tp_allreduce", tp_comm,
                                  tp_index), tensor
            if kind in STEPWISE:  # tp_comm_overlap's pieces of a collective, each with its share of a GEMM
                pieces, result = (mirrored_stepwise(kind, tensor, self.layout.tp) if self.representatives
                                  else stepwise(kind, tp_index, tp_comm.world, tensor))
                label = "tp_allgather" if kind == "all_gather_steps" else "tp_reducescatter"
                return [(Collective(program, label, tp_comm, tp_index), share) for program, share in pieces], result
            if self.representatives:  # a sequence shard gathered whole, or a whole scattered: timed mirrored
                program, result = mirrored_sequence_collective(kind, tensor, self.layout.tp)
            else:
                program, result = SEQUENCE_COLLECTIVES[kind](tp_index, tp_comm.world, tensor)
            return Collective(program, f"tp_{kind.replace('_', '')}", tp_comm, tp_index), result

        for step in range(first_step, self.steps):
            if not (yield from self.job.before_step(rank, step)):
                break
            yield from self.data_parallel.begin(rank)
            replica.grad_buffer.zero_()
            if replica.loader.host_seconds > 0:  # a prioritized sampler's bookkeeping (train/sampling.py)
                yield Busy(replica.loader.host_seconds, "sample batch", kind="sampling")
            x, y = (shard_sequence(t, replica.model.context) for t in replica.loader.next_batch())
            x = replica.precision.cast_input(x)
            replica.last_batch = (x, y)
            if step + 1 < self.steps:  # the next step's receives, ahead of its sends
                receives.update((yield from stage.post_receives(step + 1)))
            xs, ys = ((x,), (y,)) if self.microbatches == 1 else (x.chunk(self.microbatches),
                                                                  y.chunk(self.microbatches))
            walk = stage.walk(step, xs, ys, replica.precision.loss_weight(1.0 / self.microbatches), receives,
                              tp_collective)
            # with experts, their balancing losses scaled and the seconds of their all-to-alls counted
            # (expert_model_parallel.py)
            if self.experts is not None:
                self.experts.scale_balancing_loss(rank)
            losses = yield from (walk if self.experts is None else self.experts.timed(rank, step, walk))
            summed = [] if self.data_parallel.sums_tp_grads else replica.model.tp_summed_parameters()
            if summed:  # each tp rank's share of their gradients (sequence parallelism's, an MoE layer's)
                yield from self.sum_tp_grads(rank, replica.gradients(summed))
            yield from self.data_parallel.update(rank)
            self._step_done(rank, step, losses)
        yield from self.data_parallel.finish(rank)
        self.data_parallel.ended(rank)

    def cost(self, replica, chunk: int, part: int, inputs: tuple, target) -> ChunkCost:
        """What model part `part` (the replica's chunk `chunk`) costs on inputs of these shapes, measured
        once: every rank holding that part (each tp slice, each data-parallel replica), and every part alike
        (a pipeline's middle stages), has the same."""
        key = (self._signature(replica, chunk, part), replica.model.context, tuple(t.shape for t in inputs),
               None if target is None else tuple(target.shape))
        if key not in self._costs:
            self._costs[key] = measure_chunk(replica.model.chunks[chunk], replica.model.chunk_ops, inputs, target,
                                             tp=self.layout.tp, tp_overlap=self.tp_overlap,
                                             weight_split=self.schedule.splits_backward())
        return self._costs[key]

    def layer_costs(self, replica, chunk: int, part: int, inputs: tuple, target) -> list[ChunkCost]:
        """What each segment of model part `part` costs, recomputed segment by segment (schemes/layer_recompute.py),
        measured once."""
        key = ("layers", self._signature(replica, chunk, part), replica.model.context, tuple(t.shape for t in inputs),
               None if target is None else tuple(target.shape))
        if key not in self._costs:
            self._costs[key] = measure_layers(replica.model.layers[chunk], replica.model.chunk_ops, inputs, target,
                                              tp=self.layout.tp, measured=self._costs, tp_overlap=self.tp_overlap,
                                              weight_split=self.schedule.splits_backward())
        return self._costs[key]

    def _signature(self, replica, chunk: int, part: int) -> int:
        """What model part `part` (the replica's chunk `chunk`) computes (train/partition.py `module_structure`),
        read off the first rank asked about it, as a number (the same for parts alike: they cost alike; a number
        hashes at once where the structure, a tuple of tuples, hashes anew on every look-up): every rank holding
        the part computes the same."""
        if part not in self._signatures:
            structure = module_structure(replica.model.chunks[chunk])
            self._signatures[part] = self._structures.setdefault(structure, len(self._structures))
        return self._signatures[part]

    def sum_tp_grads(self, rank: int, grads: list):
        """Step program: under sequence parallelism the parameters every tp rank holds whole (LayerNorms,
        the row-split Linears' biases, position embeddings), and without it an MoE layer's (each tp rank routes
        its part of the sequence: train/moe.py), get each rank's share of their gradient: sum `grads` (of such
        parameters: RankModule.tp_summed_parameters) across the tp group, as Megatron-LM does, in one all-reduce
        labelled tp_sp_grads (all of them after the walk; with overlap each bucket's before its reduction:
        replicated_update.py, distributed_optimizer.py)."""
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        tp_comm, tp_index, tp_reduce = self.comms.tp[rank]
        yield Collective(tp_reduce(tp_index, tp_comm.world, flat), "tp_sp_grads", tp_comm, tp_index)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def rank_losses(self, rank: int) -> list[list[float]]:
        """The losses job rank `rank` computed in each step (its microbatches' in the last stage, none in the
        others), where the job holds only some ranks (a real run, simtrain/real: each process its own)."""
        return self._rank_losses[rank]

    def _step_done(self, rank: int, step: int, losses: list) -> None:
        if self.job.numerics:  # each loss's value, read once
            losses = [loss.item() for loss in losses]
            self._rank_losses[rank].append(losses)
        self._losses[step].extend(losses)
        self._ranks_done[step] += 1
        if self._ranks_done[step] < len(self.running):
            return
        if self._microbatch_s is None and self.data_alone:  # the baseline, once
            self._measure_microbatch()
        # every rank has stepped: the losses of all last-stage ranks are in
        losses, self._losses[step] = self._losses[step], None
        # every last-stage rank (each tp rank of each replica) computed each of its microbatches' loss
        mean = float(sum(losses)) / len(losses) if self.job.numerics else None
        now = self.job.cluster.env.now
        self.loss_curve.append((now, mean))
        self._reporting = True  # the weight norms and the training-set loss read one assembled model
        try:
            self.weight_norms.step_done(step)
            if self.experts is not None:
                self.experts.step_done(step)
            if self.on_step is not None:
                self.on_step(step, now, mean)
        finally:
            self._reporting, self._reported_model = False, None

    # --- what the runner reads ---

    def stuck(self) -> list[int]:
        return sorted({self.job.devices[rank].rank for rank, comm, index in self.comms.places()
                       if index in comm.stuck()})

    def trained_model(self):
        """The whole model, assembled from the shares of data-parallel replica 0 (with representatives, which
        compute nothing, the initial meta model); while a step's end is reported, the same model for every reader
        (the weight norms, the training-set loss), as nothing trains in between."""
        if self.representatives:
            return self.job.model
        if self._reported_model is not None:
            return self._reported_model
        # replica 0's ranks (with experts, every rank: the experts replica 0 does not hold come from the others)
        ranks = range(self.world) if self.experts is not None else self.layout.groups("model")[0]
        model = self.assemble({rank: self.data_parallel.whole_model(rank).pieces() for rank in ranks})
        if self._reporting:
            self._reported_model = model
        return model

    def assemble(self, pieces: dict, replica: int = 0) -> "torch.nn.Module":
        """The whole model from ranks' pieces (rank -> RankModule.pieces()): those of data-parallel replica
        `replica` (its experts: replica 0's)."""
        return assemble(self.job.model, [piece for rank in self.layout.groups("model")[replica]
                                         for piece in pieces[rank]]
                        + (self.experts.other_experts(pieces, replica) if self.experts is not None else []))

    def final_models(self) -> list:
        """The whole model each data-parallel replica ends with (with experts, each ep group's: its first replica's
        with the experts of the others; with representatives, replica 0's)."""
        if self.representatives:
            return [self.trained_model()]
        pieces = {rank: self.data_parallel.whole_model(rank).pieces() for rank in range(self.world)}
        replicas = (self.experts.first_replicas() if self.experts is not None
                    else range(len(self.layout.groups("model"))))
        return [self.assemble(pieces, replica) for replica in replicas]

    def samples_per_step(self) -> int:
        return self.layout.dp * self.job.scenario.data.batch_size

    def single_device_step_s(self) -> float | None:
        """Data parallelism alone: the seconds one device needs for a step of its own batch (its microbatches in
        turn, then its own update: under ZeRO its shard's), without communication: scaling efficiency's baseline.
        None where the model or its sequence is split (one device does not hold it), or before any step ran (out
        of memory)."""
        if self._microbatch_s is None:
            return None
        return self.microbatches * self._microbatch_s + self.data_parallel.update_s(self.running[0])

    def _measure_microbatch(self) -> None:
        """Data parallelism alone, once the first step has run: the seconds one device needs for a microbatch's
        forward and backward (the whole model's, measured as one device would run it)."""
        rank = self.running[0]
        replica, device = self.replicas[rank], self.job.devices[rank]
        x, y = (batch.chunk(self.microbatches)[0] for batch in replica.last_batch)
        cost = measure_step_cost(replica.model.chunks[0], x, y)
        self._microbatch_s = (device.compute_time(cost.forward_flops + cost.backward_flops, replica.precision.name,
                                                  cost.forward_ops + cost.backward_ops)
                              + device.fixed_time(cost.forward_kernels + cost.backward_kernels, passes=2))

    def report_sections(self) -> dict:
        """report.json's `parallel`: the layout (report/parallel.py adds the bubble and the bytes) and DDP's
        buckets; sharded, its `sharding` (distributed_optimizer.py); `weight_norms` (weight_norms.py)."""
        strategy = self.data_parallel.report_sections()
        return {"parallel": {
            "dp": self.layout.dp, "pp": self.layout.pp, "tp": self.layout.tp, "cp": self.layout.cp,
            "placement": list(self.layout.placement),
            "schedule": self.pipeline.schedule if self.layout.pp > 1 else None,
            "microbatches": self.microbatches,
            "virtual_stages": self.pipeline.virtual_stages,
            "stage_of_rank": [self.layout.coordinates(rank)["pp"] for rank in range(self.world)],
            "representatives": self.representatives,
            **strategy.pop("parallel", {}),
        }, **strategy, **self.weight_norms.section(),
            **(self.experts.report_sections(self.loss_curve) if self.experts is not None else {})}

    # --- the Scheme hooks (scheme.py) ---

    applies = staticmethod(selection.step_engine)  # the registry's predicates (selection.py)
    holds_shares = True  # every rank its share of the model, whole under data parallelism alone

    def state_source(self, rank: int) -> int:
        """Replicated, rank 0's whole state (scheme.py's default); else the rank's own share of the model and
        its optimizer state."""
        return Scheme.state_source(self, rank) if self.replicated else rank

    def receive_state(self, rank: int, donor, state):
        """Step program: replicated, 1/k from the donor's rank `rank`, then a ring all-gather (scheme.py's
        default: the state crosses between the groups once); else rank `rank`'s share, whole, from the donor's
        rank of the same coordinates."""
        if self.replicated:
            yield from Scheme.receive_state(self, rank, donor, state)
            return
        yield Alloc("comm_buffers", state.nbytes)
        yield Transfer(donor.devices[rank].node, self.job.devices[rank].node, state.nbytes, "exploit")
        self.load_training_state(rank, state, state.flat.clone())
        yield Free("comm_buffers", state.nbytes)
