"""Mixture of experts under pipeline, tensor and context parallelism: ep groups, the exchanges, the expert update.

A gpt or a llama with `model.moe` under pp / tp / cp (model_parallel.py) runs each
MoE layer as regions of its stage's work with the ep group's exchanges as
boundaries (train/moe_exchange.py: counts, dispatch, combine). The groups are formed as
Megatron-Core's initialize_model_parallel formed them with
expert_model_parallel_size before its expert tensor parallelism became a
setting of its own: for each pipeline stage and tp index, the dp ranks (dp
order; with cp, the dp x cp ranks, cp first, as its expert mesh folds cp in:
parallel/layout.py) are cut into groups of ep adjacent ones (its expert
model parallel group), and the ranks that hold the same experts, one per ep
group, form the experts' data-parallel group (its data-modulo-expert group).
Under cp each rank routes the tokens of its own chunks of the sequence. Ep
rank i (its place in its ep group) holds experts [i E/ep, (i+1) E/ep) of
every MoE layer of its stage, whole: they are not split over tp (Megatron-Core's
expert_tensor_parallel_size 1). With tp above 1 each tp rank routes and
dispatches its own part of the micro-batch's sequence in its own ep group, and
no token is sent twice: under sequence parallelism (which Megatron-Core
requires beside ep and tp) the stream's part the rank holds, without it the
part it takes from the whole stream, the layer's output summed back over tp
(torchtitan's split of the tokens over tp: train/moe.py ExpertsBlock).

The data-parallel half (`ExpertUpdate`, after the backward and the sum over tp
of the gradients that are each tp rank's share, the experts' among them: each
tp rank's experts saw its part of the sequence): the
replicated parameters' gradient is averaged over the dp (x cp) group as
DDP's (`dp_allreduce`), the experts' over the dp (x cp) / ep ranks that hold them
(`expert_allreduce`) and divided by ep: each holder's gradient is a sum over
its ep group's ranks of their mean losses' gradients, so this is the
gradient of the mean loss over the global batch, as on one device. With
`parallel.overlap` each part is cut into DDP's buckets apart (Megatron-Core's
dense and expert buffers), each all-reduced over its group on the rank's
stream as soon as the last microbatch's backward has completed it
(bucket_overlap.py), the experts' divided by ep once all have ended.

`ExpertLayers` gives the step engine the groups (EpGroup, strategies/expert_groups.py),
the exchanges' collectives, the experts of the other ep ranks for the whole
model, and the `moe` report section (strategies/moe_report.py; per step: tokens
per expert, drops, the bytes the exchanges moved, from every ep group's
routing, and a rank's mean seconds in the four all-to-alls). Data
parallelism alone is the pp = tp = cp = 1 case: one chunk, the whole model,
its MoE layers' exchanges over ep groups of adjacent data-parallel ranks
(Megatron-Core's and torchtitan's ep inside dp).

The experts' compute is charged by the tokens they received (the combine
boundary's `work_share`, train/moe_exchange.py): an overloaded expert makes
its rank slow, and its ep group waits for it. With numerics off every layer
routes its tokens evenly (`model.moe.routing: balanced`, what analytical
simulators assume), replayed from the measured costs; with a drawn routing
model (zipf, histogram) each rank's assignments per expert are drawn (seeded
by step, micro-batch, MoE layer and job rank: train/moe_routing.py) once for
its ep group, and the layers run on meta tensors every step.

    experts = ExpertLayers(scheme)                  # ModelParallel with model.moe
    scheme.comms.ep, scheme.comms.expert_dp = experts.communicators()
    experts.scale_balancing_loss(rank)              # before each step: its share, times fp16's loss scale
    collective, result = experts.exchange(rank, kind, tensor)   # kind: a train/moe_exchange.py ExpertExchange
    losses = yield from experts.timed(rank, step, stage.walk(...))   # its all-to-all seconds counted
"""
from ..step_ops import Await, Collective, PostCollective
from ..train.moe import MoE
from ..train.moe_exchange import balanced_routing
from ..train.moe_routing import choice_counts, draw_choices, group_node_rows, routing_generator
from .expert_groups import EpGroup, NodeDispatch, experts_last, first_expert, group_all_to_all
from .moe_report import moe_section, routing_figures
from .replicated_update import ReplicatedUpdate

EXCHANGE_LABELS = ("moe dispatch", "moe combine", "moe dispatch backward", "moe combine backward")


class ExpertLayers:
    """The MoE layers of a step-engine job: their ep groups, exchanges, records and report section."""

    def __init__(self, scheme):
        self.scheme, self.job = scheme, scheme.job
        layout, spec = scheme.layout, scheme.job.scenario.model.moe
        self.ep, self.experts = layout.ep, spec.experts
        self.moe_steps: list[dict] = []
        self.all_to_all_s: dict[int, float] = {}  # step -> the seconds its running ranks spent in the all-to-alls
        # numerics off with a drawn routing model: each layer draws its group's routing and runs every step
        self.drawing = not self.job.numerics and spec.routing.model != "balanced"
        self._draws: dict[tuple, list[list[int]]] = {}  # (step, microbatch, layer, ep group) -> its draw
        # (step, rank, layer, again) -> the layer's first forwards (again: forwards run again) the rank ran in the step
        self._forwards: dict[tuple, int] = {}
        self._step: dict[int, int] = {}  # running rank -> the step it runs
        if self.drawing:
            whole = [name for name, module in self.job.model.named_modules() if isinstance(module, MoE)]
            for rank in scheme.running:
                replica = scheme.replicas[rank]
                if replica is None:
                    continue
                replica.run_every_step()
                for name, layer in _named_layers(replica):
                    layer.drawn_routing = _Draw(self, rank, whole.index(name))

    def communicators(self) -> tuple[dict, dict | None]:
        """(rank -> its EpGroup in its ep group, and with ep above 1 rank -> its Membership of the experts'
        data-parallel group; else None): the scheme's comms.ep and comms.expert_dp."""
        layout, ep_groups = self.scheme.layout, {}
        for group in layout.groups("ep"):
            ranks = list(group)
            comm = self.job.communicator(ranks)
            all_to_all = group_all_to_all(self.job, ranks)
            for index, rank in enumerate(ranks):
                ep_groups[rank] = EpGroup(comm, index, group, all_to_all)
                self.place(rank, all_to_all)
        return ep_groups, self.scheme._communicators(layout.groups("expert_dp")) if self.ep > 1 else None

    def place(self, rank: int, all_to_all) -> None:
        """Job rank `rank`'s MoE layers told the host of each expert where its ep group's all-to-all sends a token
        once to each host (deepep's NodeDispatch): their counts then say how many tokens reach each host (with a
        capacity, an exchange of their own after the drops: the rank's work is built again)."""
        replica = self.scheme.replicas[rank]
        if isinstance(all_to_all, NodeDispatch) and replica is not None:
            per = self.experts // self.ep
            for layer in _layers(replica):
                layer.expert_hosts = tuple(all_to_all.rank_hosts[e // per] for e in range(self.experts))
            replica.model.build_ops()

    def place_representatives(self) -> None:
        """With representatives (their exchanges mirrored, strategies/representatives.py): `place` each running rank by
        its own ep group's all-to-all (which refuses hosts holding uneven shares of it)."""
        for rank in self.scheme.running:
            self.place(rank, group_all_to_all(self.job, list(self.scheme.layout.rank_groups(rank).ep)))

    def scale_balancing_loss(self, rank: int) -> None:
        """Before a step of job rank `rank`: its MoE layers' balancing losses join the gradient as a mean over the
        micro-batches and the tp ranks' parts of the sequence, times fp16's loss scale, as the language-model loss
        does (Megatron-Core's MoEAuxLossAutoScaler.set_loss_scale: the loss scale over the micro-batches)."""
        replica = self.scheme.replicas[rank]
        scale = float(replica.precision.loss_weight(1.0 / (self.scheme.microbatches * self.scheme.layout.tp)))
        for layer in _layers(replica):
            layer.aux_loss_scale = scale

    def exchange(self, rank: int, kind, tensor):
        """(the Collective of exchange `kind` of `tensor` in rank `rank`'s ep group, the tensor that holds its
        result once it has run)."""
        return self.scheme.comms.ep[rank].exchange(kind, tensor)

    def timed(self, rank: int, step: int, program):
        """Step program: `program` (a rank's step of schedule actions), the communication seconds its all-to-alls
        are credited (the interpreter's answer to each) counted toward step `step`'s."""
        self._step[rank] = step
        self.all_to_all_s.setdefault(step, 0.0)
        try:
            operation, answer = program.send(None), None
            while True:
                answer = yield operation
                if type(operation) is Collective and operation.label in EXCHANGE_LABELS:
                    self.all_to_all_s[step] += answer or 0.0
                elif type(operation) is Await and operation.handle.label in EXCHANGE_LABELS:  # a pair's (pipeline.py)
                    self.all_to_all_s[step] += operation.handle.charged_s
                operation = program.send(answer)
        except StopIteration as stop:
            return stop.value
        finally:
            program.close()

    def draw(self, rank: int, layer: int, tokens: int, again: bool = False,
             expert_hosts: tuple[int, ...] | None = None,
             capacity: int | None = None) -> tuple[list[list[int]], list[list[int]]]:
        """Numerics off, a drawn routing model: job rank `rank`'s ep group's assignments per expert, [ep
        rank][expert], at MoE layer `layer` (of the whole model) of its current step's next micro-batch, each group
        rank's `tokens` routed once for the group (seeded by step, micro-batch, layer and job rank); and with
        `expert_hosts` (the host of each expert: a dispatch that sends a token once to each host) the tokens of each
        rank that reach each host, [ep rank][host], by the assignments each expert keeps of the group's first
        `capacity` (None: all of them) (else empty). A forward run `again` (full recomputation) draws
        what its first forward drew: the micro-batches' backwards, and so their recomputations, come in the order of
        their forwards (split backwards run no full recomputation)."""
        group, step = self.job.layout.rank_groups(rank).ep, self._step[rank]
        microbatch = self._forwards.get((step, rank, layer, again), 0)
        self._forwards[step, rank, layer, again] = microbatch + 1
        key = (step, microbatch, layer, group)
        if key not in self._draws:
            spec, seed = self.job.scenario.model.moe, self.job.scenario.seed
            draw = step * self.scheme.microbatches + microbatch  # a step's own with one micro-batch
            choices = [draw_choices(spec, tokens, routing_generator(seed, draw, layer, member)) for member in group]
            self._draws[key] = ([choice_counts(c, self.experts) for c in choices],
                                [] if expert_hosts is None
                                else group_node_rows(choices, self.experts, expert_hosts, max(expert_hosts) + 1,
                                                     capacity))
        return self._draws[key]

    def other_experts(self, pieces: dict, replica: int = 0) -> list:
        """The experts data-parallel replica `replica`'s ranks do not hold, from the other ranks of their ep groups
        (pieces: rank -> RankModule.pieces(); `replica` the first of its ep groups)."""
        layout = self.scheme.layout
        return [(source, tensor) for rank in layout.groups("model")[replica]
                for member in layout.rank_groups(rank).ep if member != rank
                for source, tensor in pieces[member] if ".experts." in source.name]

    def first_replicas(self) -> list[int]:
        """The data-parallel replicas that come first in their ep groups: one whole model each."""
        layout = self.scheme.layout
        return [replica for replica, ranks in enumerate(layout.groups("model"))
                if layout.rank_groups(ranks[0]).ep.index(ranks[0]) == 0]

    def step_done(self, step: int) -> None:
        """Step `step` has ended on every rank: its routing, every ep group's once (read off its ep rank 0). A layer
        runs once a microbatch, and a rank may have run the next step's first ones already: each layer's oldest
        records are this step's (a forward run again records nothing). With numerics off and balanced
        routing every layer charged the balanced routing of a microbatch's tokens (train/moe_exchange.py), each tp
        rank its part of the sequence."""
        layout, scheme, token_bytes, routings = self.scheme.layout, self.scheme, None, []
        m = scheme.microbatches
        taken = {}  # running rank -> per MoE layer, the step's routings
        for rank in scheme.running:
            layers = _layers(scheme.replicas[rank])
            if self.job.numerics or self.drawing:
                taken[rank] = [layer.routings[:m] for layer in layers]
                for layer in layers:
                    del layer.routings[:m]
            else:  # every layer's routing, the same for all (they share model.moe)
                taken[rank] = [[balanced_routing(layer, self._microbatch_tokens())] * m for layer in layers]
        for rank in range(layout.world):  # with representatives, each rank's figures are its representative's
            if layout.rank_groups(rank).ep.index(rank):
                continue
            representative = scheme._represented_by(rank)
            for layer, records in zip(_layers(scheme.replicas[representative]), taken.get(representative, [])):
                token_bytes = layer.router.weight.shape[1] * layer.router.weight.element_size()
                routings += records
        self._draws = {key: draw for key, draw in self._draws.items() if key[0] != step}
        self._forwards = {key: count for key, count in self._forwards.items() if key[0] != step}
        figures = routing_figures(self.experts, self.ep, routings, token_bytes)
        if figures is not None:
            self.moe_steps.append(figures)

    def _microbatch_tokens(self) -> int:
        """A rank's tokens per microbatch: its part of the sequence under cp and tp (with sequence parallelism or
        without: train/moe.py)."""
        sample, layout = self.job.sample_microbatch(), self.scheme.layout
        return sample.shape[0] * sample.shape[1] // (layout.cp * layout.tp)

    def report_sections(self, loss_curve) -> dict:
        """The `moe` section (strategies/moe_report.py): its all-to-all time a running rank's mean."""
        routing = "router" if self.job.numerics else self.job.scenario.model.moe.routing.model
        running = len(self.scheme.running)
        seconds = [self.all_to_all_s.get(step, 0.0) / running for step in range(len(self.moe_steps))]
        return {"moe": moe_section(self.ep, self.experts, routing, self.moe_steps, loss_curve, seconds)}


class ExpertUpdate(ReplicatedUpdate):
    """DDP under pp x tp with sharded experts: the replicated gradient all-reduced over the dp (x cp) group, the
    experts' over the dp/ep ranks that hold them; with `parallel.overlap` in buckets of their own beside the last
    microbatch's backward, as Megatron-Core's expert buffers."""

    def __init__(self, scheme):
        self.ep = scheme.layout.ep
        # the experts laid out last before DDP cuts the buckets: replicated parameters first, then the experts'
        # (of the ranks this process holds: a launched process its own)
        held = [rank for rank in scheme.running if scheme.replicas[rank] is not None]
        self.dense = {rank: experts_last(scheme.replicas[rank]) for rank in held}
        self._first_expert = {rank: first_expert(scheme.replicas[rank]) for rank in held}
        super().__init__(scheme)

    def first_expert(self, rank: int) -> int:
        """The index of the rank's first expert parameter (its parameter count on a stage without MoE layers)."""
        return self._first_expert[rank]

    def post_reduce(self, rank: int, unit: int):
        """Step program (BucketOverlap's): a dense bucket's all-reduce over the dp (x cp) group; an expert bucket's
        over the experts' holders (expert_dp), on the same stream; none where the rank alone holds its experts."""
        if not self.buckets[rank].buffer_of[unit]:
            yield from super().post_reduce(rank, unit)
            return
        if len(self.scheme.layout.rank_groups(rank).expert_dp) == 1:
            return
        comm, position, all_reduce = self.scheme.comms.expert_dp[rank]
        view = self.scheme.replicas[rank].grad_buffer[self.buckets[rank].layout.unit_slice(unit)]
        yield PostCollective(all_reduce(position, comm.world, view, average=True), "expert_allreduce", comm,
                             position)

    def reduce(self, rank: int):
        """Step program: the replicated part averaged over the dp (x cp) group, the experts' over their holders
        (with overlap: the buckets' all-reduces, posted in the backward, awaited), then divided by ep (the global
        batch's mean)."""
        scheme, dense = self.scheme, self.dense[rank]
        buffer = scheme.replicas[rank].grad_buffer
        if rank in self.buckets:
            yield from super().reduce(rank)
            buffer[dense:].div_(self.ep)
            return
        if scheme.layout.dp * scheme.layout.cp > 1:
            dp_comm, dp_index, dp_reduce = scheme.comms.dp_cp[rank]
            yield Collective(dp_reduce(dp_index, dp_comm.world, buffer[:dense], average=True), "dp_allreduce",
                             dp_comm, dp_index)
        comm, position, all_reduce = scheme.comms.expert_dp[rank]
        if len(scheme.layout.rank_groups(rank).expert_dp) > 1:  # (a mirrored communicator has one member)
            yield Collective(all_reduce(position, comm.world, buffer[dense:], average=True), "expert_allreduce",
                             comm, position)
        buffer[dense:].div_(self.ep)


class _Draw:
    """An MoE layer's `drawn_routing` (train/moe_exchange.py): its ep group's draw for a forward of `tokens` a rank
    (run `again`: the first forward's), with the tokens reaching each host (by the assignments kept under
    `capacity`) where the layer has `expert_hosts`; a copy (a chunk measured on a meta copy) draws nothing, as
    balanced routing."""

    def __init__(self, experts: ExpertLayers, rank: int, layer: int):
        self.layers, self.rank, self.layer = experts, rank, layer

    def __call__(self, tokens: int, again: bool, expert_hosts: tuple[int, ...] | None, capacity: int | None):
        return self.layers.draw(self.rank, self.layer, tokens, again, expert_hosts, capacity)

    def __deepcopy__(self, memo):
        return None


def _layers(replica) -> list:
    return [] if replica is None else [layer for layer in replica.model.modules() if isinstance(layer, MoE)]


def _named_layers(replica) -> list:
    """(the whole model's name of the layer, the layer) of every MoE layer the replica's share holds."""
    sources = replica.model.sources
    named = []
    for local, layer in replica.model.named_modules():
        if isinstance(layer, MoE):
            whole = sources[f"{local}.router.weight"].name
            named.append((whole.removesuffix(".router.weight"), layer))
    return named
