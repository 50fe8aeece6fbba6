"""Expert parallelism: each MoE layer's experts sharded over ep data-parallel ranks, tokens moved by all-to-all.

`parallel.ep` forms the ep groups inside the data-parallel ranks, as
Megatron-Core (expert_model_parallel_size, ep inside dp) and torchtitan (ep
borrowed from the data-parallel shard dimension) form them: the dp ranks are
cut into dp/ep groups of ep adjacent ranks, and ep rank i of every group holds
experts [i E/ep, (i+1) E/ep) of every MoE layer (train/moe.py's
keep_experts_). The rest of the model (embeddings, attention, routers, shared
experts, the head) is replicated on every rank and data parallel over all dp
ranks; an expert's parameters are data parallel over the dp/ep ranks that hold
it (the ranks of one ep index, one per group). This scheme is ep with data
parallelism alone; under pp / tp the model-parallel step runs the MoE layers
(schemes/expert_model_parallel.py).

Each step a rank runs its own batch forward and backward with every MoE layer's
tokens dispatched to their experts' ranks and combined back by all-to-all
(schemes/expert_dispatch.py; `parallel.moe_dispatch`: pairwise, or hierarchical
over the hosts the group's ranks sit on), then all-reduces the replicated gradient over dp
(`all_reduce`) and its experts' gradient over the dp/ep ranks that hold them
(`expert_allreduce`, skipped when dp = ep), and steps. The expert gradient is
a sum over the ep group's tokens of per-rank mean losses, so it is scaled by
1/dp (averaged over the dp/ep holders, then divided by ep): the gradient of the
mean loss over the global batch, as on one device.

    parallel: {ep: 4}      # with model.moe, dp divisible by 4, model.moe.experts divisible by 4

The `moe` report section (tokens per expert, dropped tokens, all-to-all bytes
and time, per step) is built here.
"""
import copy

from pydantic import Field

from ..errors import ScenarioError
from ..report.sections import ReportSection, register_section
from ..step_ops import Alloc, Busy, Collective, MemoryBound
from ..train.grad_bucket import flat_grad_buffer
from ..train.moe import MoE
from ..train.precision import persistent_bytes, update_bytes
from ..train.syncbn import synced_batchnorms
from . import selection
from .expert_dispatch import EpGroup, ExpertParallelStep, group_all_to_all
from .rank_replicas import RankReplicas
from .scheme import Scheme
from .weight_norms import WeightNormLog


class ExpertParallel(RankReplicas, Scheme):
    """Data parallelism whose MoE experts are sharded over ep groups of adjacent ranks."""

    applies = staticmethod(selection.expert_parallel)  # the registry's predicate (selection.py)

    def __init__(self, job, on_step=None):
        self.job, self.replicas, self.world = job, job.replicas, job.world
        self.ep = job.layout.ep
        train, parallel = job.scenario.train, job.scenario.parallel
        if parallel.sync_batchnorm:  # an MoE model has no BatchNorm to synchronize
            try:
                synced_batchnorms(self.replicas[job.local_ranks[0]].model)
            except ValueError as error:
                raise ScenarioError(f"parallel.sync_batchnorm: {error}") from None
        self.regroup()
        self.steps = train.steps
        self.on_step = on_step  # called as on_step(step, sim_time_s, mean_loss) when a step ends
        first = self.replicas[job.local_ranks[0]]  # every replica is alike but its experts: the first held
        self._held_bytes = persistent_bytes(first.params, train.precision, train.optimizer)
        self._step_bytes = update_bytes(first.params, train.precision, train.optimizer)
        # the update's operators, counted where a device charges a fixed cost per kernel (a calibrated host)
        self._step_kernels = self.update_kernels([job.local_ranks[0]])[job.local_ranks[0]]
        self._step_losses = [[None] * self.world for _ in range(self.steps)]
        self.loss_curve: list[tuple[float, float | None]] = []  # (sim_time_s, mean loss over devices)
        self.weight_norms = WeightNormLog(lambda: self.replicas[0].model, job.model, job.scenario.report.every,
                                          self.steps,
                                          job.numerics and len(job.local_ranks) == self.world)
        self._dense_elements = {rank: experts_last(replica) for rank, replica in enumerate(self.replicas)
                                if replica is not None}
        spec = job.scenario.model.moe
        self.routing = spec.routing
        self.experts = spec.experts
        self._step_works: list[list] = [[None] * self.world for _ in range(self.steps)]  # each rank's step record
        self.moe_steps: list[dict] = []

    @classmethod
    def steps_until_every_rank_stepped(cls, world: int) -> int:
        return 1

    def regroup(self) -> None:
        """The all-reduces, ep groups and expert groups over the job's devices as they are now."""
        job = self.job
        self.all_reduce = job.all_reduce(range(self.world))
        self.ep_groups, self.expert_groups = {}, {}
        for ranks in job.layout.groups("ep"):
            comm, draws, all_to_all = job.communicator(list(ranks)), {}, group_all_to_all(job, ranks)
            for index, rank in enumerate(ranks):
                self.ep_groups[rank] = EpGroup(comm, index, ranks, all_to_all, draws)
        for group in job.layout.groups("expert_dp"):
            ranks = list(group)
            if len(ranks) > 1:
                comm, all_reduce = job.communicator(ranks), job.all_reduce(ranks)
                for position, rank in enumerate(ranks):
                    self.expert_groups[rank] = (comm, position, len(ranks), all_reduce)

    def rewind(self, step: int) -> None:
        """Forget what came after step `step`, the routing records too (a restart from a checkpoint)."""
        super().rewind(step)
        self._step_losses[step:] = [[None] * self.world for _ in range(self.steps - step)]
        self.weight_norms.rewind(step)
        del self.moe_steps[step:]
        self._step_works[step:] = [[None] * self.world for _ in range(self.steps - step)]

    def program(self, rank: int, first_step: int = 0):
        """Step program of job rank `rank`: hold its share, then every step's exchanges and all-reduces."""
        replica, job = self.replicas[rank], self.job
        for category, nbytes in self._held_bytes.items():
            yield Alloc(category, nbytes)
        dense = self._dense_elements[rank]
        for step in range(first_step, self.steps):
            if not (yield from job.before_step(rank, step)):
                break
            if replica.loader.host_seconds > 0:
                yield Busy(replica.loader.host_seconds, "sample batch", kind="sampling")
            x, y = replica.loader.next_batch()
            replica.last_batch = (x, y)
            replica.grad_buffer.zero_()
            work = ExpertParallelStep(replica.model, self.ep_groups[rank], replica.precision.name, self.routing,
                                      job.scenario.seed, step)
            loss = yield from work.forward(x, y, replica.loader.batch_loss)
            yield from work.backward(loss)
            self._step_losses[step][rank] = loss.detach()
            self._step_works[step][rank] = work
            buffer = replica.grad_buffer
            yield Collective(self.all_reduce(rank, self.world, buffer[:dense], average=True), "all_reduce")
            if rank in self.expert_groups:
                comm, position, size, all_reduce = self.expert_groups[rank]
                yield Collective(all_reduce(position, size, buffer[dense:], average=True), "expert_allreduce",
                                 comm=comm, rank=position)
            buffer[dense:].div_(self.ep)  # the holders' mean of ep ranks' summed gradients: the global mean
            replica.step()
            yield MemoryBound(self._step_bytes, "optimizer step", kind="optimizer", kernels=self._step_kernels,
                              updates=1)
            if rank == 0 and len(job.local_ranks) == self.world:
                self._record_moe(step)
                self._end_step(step)

    def _record_moe(self, step: int) -> None:
        """Step `step`'s routing over the job: every rank's record is in (the all-reduce waited for them)."""
        works = self._step_works[step]
        self._step_works[step] = None
        received, assigned_total, kept_total, moved, seconds = [], 0, 0, 0, 0.0
        share = [0] * self.experts
        token_bytes = None
        for rank, work in enumerate(works):
            seconds += work.all_to_all_s
            if self.ep_groups[rank].index:
                continue  # one record per ep group: its first rank's
            for assigned, kept in work.layers:
                received += [sum(row[e] for row in kept) for e in range(self.experts)]
                assigned_total += sum(map(sum, assigned))
                kept_total += sum(map(sum, kept))
                share = [total + sum(row[e] for row in assigned) for e, total in enumerate(share)]
                per = self.experts // self.ep
                moved += sum(sum(row[e] for e in range(self.experts) if e // per != src)
                             for src, row in enumerate(kept))
            token_bytes = work.token_bytes
        mean = sum(received) / len(received)
        self.moe_steps.append({
            "min": min(received), "mean": mean, "max": max(received),
            "imbalance": max(received) / mean if mean else 1.0, "dropped": assigned_total - kept_total,
            # every kept token crosses to another rank four times: dispatch, combine and their backwards
            "bytes": 4 * moved * token_bytes, "seconds": seconds / self.world, "share": share})

    def _end_step(self, step: int) -> None:
        """Every rank posted its gradient before rank 0's all-reduce could finish: all of step `step`'s losses
        are in."""
        losses = self._step_losses[step]
        mean_loss = float(sum(loss.item() for loss in losses)) / self.world if self.job.numerics else None
        self._step_losses[step] = None
        now = self.job.cluster.env.now
        self.loss_curve.append((now, mean_loss))
        self.weight_norms.step_done(step)
        if self.on_step is not None:
            self.on_step(step, now, mean_loss)

    def rank_losses(self, rank: int) -> list[list[float]]:
        """The losses job rank `rank` computed in each step it ran (a real run's process holds its own rank)."""
        return [[float(losses[rank])] for losses in self._step_losses
                if losses is not None and losses[rank] is not None and self.job.numerics]

    def stuck(self) -> list[int]:
        return self.job.comm.stuck()

    def samples_per_step(self) -> int:
        return self.world * self.job.scenario.data.batch_size

    def single_device_step_s(self) -> float | None:
        """No one-device baseline: no rank holds the whole model."""
        return None

    def final_models(self) -> list:
        """The whole model each ep group ends with (its ranks' experts put together), one per group."""
        return [_whole_model([self.replicas[rank].model for rank in group]) for group in self.job.layout.groups("ep")]

    def trained_model(self):
        return _whole_model([self.replicas[rank].model for rank in self.job.layout.groups("ep")[0]])

    def report_sections(self) -> dict:
        """`weight_norms`, `parallel` (the layout: dp only) and `moe`."""
        sections = {**self.weight_norms.section(),
                    "parallel": {"dp": self.world, "pp": 1, "tp": 1, "overlap": False, "buckets": 1}}
        sections["moe"] = moe_section(self.ep, self.experts, "router" if self.job.numerics else self.routing.model,
                                      self.moe_steps, self.loss_curve,
                                      [step["seconds"] for step in self.moe_steps])
        return sections


def moe_section(ep: int, experts: int, routing: str, steps: list[dict], loss_curve, all_to_all_time_s) -> dict:
    """report.json's `moe` section from each step's routing figures (`steps`: min, mean, max, imbalance,
    dropped, bytes, share) and the loss curve's step ends; `all_to_all_time_s` a list per step, or None."""
    times = [end - start for (start, _), (end, _) in zip([(0.0, None)] + loss_curve, loss_curve)]
    shares = [sum(step["share"][e] for step in steps) for e in range(experts)]
    return {
        "ep": ep, "experts": experts, "routing": routing,
        "tokens_per_expert_min": [step["min"] for step in steps],
        "tokens_per_expert_mean": [step["mean"] for step in steps],
        "tokens_per_expert_max": [step["max"] for step in steps],
        "imbalance": [step["imbalance"] for step in steps],
        "dropped_tokens": [step["dropped"] for step in steps],
        "all_to_all_bytes": [step["bytes"] for step in steps],
        "all_to_all_time_s": all_to_all_time_s,
        "step_time_s": times,
        "expert_share": [share / sum(shares) for share in shares] if sum(shares) else [],
    }


def expert_flags(replica) -> list[bool]:
    """For each of the replica's trainable parameters, in its order, whether it belongs to an MoE layer's experts."""
    expert_ids = {id(p) for layer in replica.model.modules() if isinstance(layer, MoE)
                  for p in layer.experts.parameters()}
    return [id(p) in expert_ids for p in replica.params]


def experts_last(replica) -> int:
    """Re-point the replica's gradients into one buffer, replicated parameters first, then its experts'
    (each part all-reduced over its own group), the fp32 masters' in the same order (mixed precision: the
    averaged buffer is copied onto them); returns the replicated part's elements."""
    flags = expert_flags(replica)
    dense = sum(p.numel() for p, is_expert in zip(replica.params, flags) if not is_expert)
    order = sorted(range(len(replica.params)), key=lambda i: flags[i])  # stable
    replica.params = [replica.params[i] for i in order]
    replica.grad_buffer = flat_grad_buffer(replica.params)
    precision = replica.precision
    precision.model_params = [precision.model_params[i] for i in order]
    if precision.mixed:
        precision.master_params = [precision.master_params[i] for i in order]
        precision.master_grads = flat_grad_buffer(precision.master_params)
    else:  # fp32: the parameters are their own masters
        precision.master_params = precision.model_params
    return dense


def _whole_model(shares: list):
    """One model with every expert: the first share's replicated part, each MoE layer's experts in ep order."""
    whole = copy.deepcopy(shares[0])
    layers = [[layer for layer in share.modules() if isinstance(layer, MoE)] for share in shares]
    for position, layer in enumerate(layer for layer in whole.modules() if isinstance(layer, MoE)):
        layer.experts = copy.deepcopy(type(layer.experts)(
            expert for share in layers for expert in share[position].experts))
        layer.first_expert = 0
    return whole


class MoeSection(ReportSection):
    ep: int = Field(description="expert-parallel ranks per group (parallel.ep)")
    experts: int = Field(description="routed experts per MoE layer")
    routing: str = Field(description="where the routing came from: router (numerics on), or the routing model "
                                     "(balanced, zipf, histogram)")
    tokens_per_expert_min: list[int] = Field(description="per step: the fewest tokens an expert took (kept "
                                                         "assignments, over every MoE layer and ep group)")
    tokens_per_expert_mean: list[float] = Field(description="per step: the mean tokens an expert took")
    tokens_per_expert_max: list[int] = Field(description="per step: the most tokens an expert took")
    imbalance: list[float] = Field(description="per step: max / mean tokens per expert (1: balanced)")
    dropped_tokens: list[int] = Field(description="per step: assignments dropped past an expert's capacity")
    all_to_all_bytes: list[int] = Field(description="per step: bytes the MoE all-to-alls moved between ranks "
                                                    "(dispatch, combine and their backwards)")
    all_to_all_time_s: list[float] | None = Field(description="per step: a rank's mean seconds of all-to-all "
                                                              "communication (with transfers of its own in flight); "
                                                              "null under pp / tp (in the trace there)")
    step_time_s: list[float] = Field(description="per step: its simulated seconds")
    expert_share: list[float] = Field(description="each expert's share of the run's assignments (before drops): "
                                                  "model.moe.routing.histogram for a run without numerics")


register_section("moe", MoeSection, "mixture of experts under expert parallelism: routing, drops and all-to-all "
                                    "per step (schemes/expert_parallel.py)")
