"""Mixture of experts under pipeline and tensor parallelism: ep groups, the exchanges' collectives, the expert update.

A gpt or a llama with `model.moe` under pp / tp (model_parallel.py) runs each
MoE layer as regions of its stage's work with the ep group's exchanges as
boundaries (train/moe_exchange.py: counts, dispatch, combine). The groups are formed as
Megatron-Core's initialize_model_parallel formed them with
expert_model_parallel_size before its expert tensor parallelism became a
setting of its own: for each pipeline stage and tp index, the dp ranks (dp
order) are cut into dp/ep groups of ep adjacent ones (its expert model
parallel group), and the ranks that hold the same experts, one per ep group,
form the experts' data-parallel group (its data-modulo-expert group). Ep rank
i (dp index mod ep) holds experts [i E/ep, (i+1) E/ep) of every MoE layer of
its stage, whole: they are not split over tp (Megatron-Core's
expert_tensor_parallel_size 1). With tp above 1 the stream is cut along the
sequence over the tp group (sequence parallelism, which Megatron-Core also
requires beside ep and tp), so each tp rank routes and dispatches its own part
of the micro-batch's tokens in its own ep group, and no token is sent twice.

The data-parallel half (`ExpertUpdate`, after the backward and sequence
parallelism's sum of whole parameters' gradients over tp, which sums the
experts' too: each tp rank's experts saw its part of the sequence): the
replicated parameters' gradient is averaged over the dp (x cp) group as
DDP's (`dp_allreduce`), the experts' over the dp/ep ranks that hold them
(`expert_allreduce`) and divided by ep: each holder's gradient is a sum over
its ep group's ranks of their mean losses' gradients, so this is the
gradient of the mean loss over the global batch, as on one device.

`ExpertLayers` gives the model-parallel scheme the groups, the exchanges'
collectives, the experts of the other ep ranks for the whole model, and the
`moe` report section (per step: tokens per expert, drops, the bytes the
exchanges moved, from every ep group's routing; all-to-all time is in the
trace and the parallel section, not split out here). With numerics off
every layer routes its tokens evenly (`model.moe.routing: balanced`, what
analytical simulators assume), and its records are that routing's.

    experts = ExpertLayers(scheme)                  # ModelParallel with model.moe
    scheme.comms.ep, scheme.comms.expert_dp = experts.communicators()
    collective, result = experts.exchange(rank, kind, tensor)   # kind: a train/moe_exchange.py ExpertExchange
"""
from ..step_ops import Collective
from ..train.moe import MoE
from ..train.moe_exchange import balanced_routing
from .replicated_update import ReplicatedUpdate
from .expert_dispatch import EpGroup, group_all_to_all
from .expert_parallel import experts_last, moe_section

EXCHANGE_LABELS = ("moe dispatch", "moe combine", "moe dispatch backward", "moe combine backward")


class ExpertLayers:
    """The MoE layers of a model-parallel job: their ep groups, exchanges, records and report section."""

    def __init__(self, scheme):
        self.scheme, self.job = scheme, scheme.job
        layout = scheme.layout
        self.ep, self.experts = layout.ep, scheme.job.scenario.model.moe.experts
        self.moe_steps: list[dict] = []
        for replica in scheme.replicas:  # the balancing loss as a mean over microbatches and sequence parts
            for layer in _layers(replica):
                layer.aux_loss_scale = 1.0 / (scheme.microbatches * layout.tp)

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
        return ep_groups, self.scheme._communicators(layout.groups("expert_dp")) if self.ep > 1 else None

    def exchange(self, rank: int, kind, tensor):
        """(the Collective of exchange `kind` of `tensor` in rank `rank`'s ep group, the tensor that holds its
        result once it has run)."""
        return self.scheme.comms.ep[rank].exchange(kind, tensor)

    def other_experts(self, pieces: dict) -> list:
        """The experts the first replica does not hold, from the ranks of ep index 1 .. ep-1 of the first ep group
        (pieces: rank -> RankModule.pieces())."""
        layout = self.scheme.layout
        return [(source, tensor) for rank in range(layout.world) if _completes_replica_0s_experts(layout, rank)
                for source, tensor in pieces[rank] if ".experts." in source.name]

    def step_done(self, step: int) -> None:
        """Step `step` has ended on every rank: its routing, every ep group's once (read off its ep rank 0). A layer
        runs once a microbatch, and a rank may have run the next step's first ones already: each layer's oldest
        records are this step's. Without numerics every layer charged the balanced routing of a microbatch's tokens
        (train/moe_exchange.py), each tp rank its part of the sequence."""
        layout, token_bytes = self.scheme.layout, None
        received, assigned_total, kept_total, moved = [], 0, 0, 0
        share = [0] * self.experts
        per, m = self.experts // self.ep, self.scheme.microbatches
        balanced = None  # numerics off: every layer's routing, the same for all (they share model.moe)
        for rank in range(layout.world):  # with representatives, each rank's figures are its representative's
            layers = _layers(self.scheme.replicas[self.scheme._represented_by(rank)])
            for layer in layers:
                if self.job.numerics:
                    routings, layer.routings = layer.routings[:m], layer.routings[m:]
                else:
                    balanced = balanced or [balanced_routing(layer, self._microbatch_tokens())] * m
                    routings = balanced
                if layout.rank_groups(rank).ep.index(rank):
                    continue
                token_bytes = layer.router.weight.shape[1] * layer.router.weight.element_size()
                for assigned, kept in routings:
                    received += [sum(row[e] for row in kept) for e in range(self.experts)]
                    assigned_total += sum(map(sum, assigned))
                    kept_total += sum(map(sum, kept))
                    share = [total + sum(row[e] for row in assigned) for e, total in enumerate(share)]
                    moved += sum(row[e] for src, row in enumerate(kept) for e in range(self.experts)
                                 if e // per != src)
        if not received:
            return
        mean = sum(received) / len(received)
        self.moe_steps.append({
            "min": min(received), "mean": mean, "max": max(received),
            "imbalance": max(received) / mean if mean else 1.0, "dropped": assigned_total - kept_total,
            # every kept token crosses to another rank four times: dispatch, combine and their backwards
            "bytes": 4 * moved * token_bytes, "share": share})

    def _microbatch_tokens(self) -> int:
        """A rank's tokens per microbatch: its part of the sequence under tp (sequence parallelism)."""
        sample = self.job.sample_microbatch()
        return sample.shape[0] * sample.shape[1] // self.scheme.layout.tp

    def report_sections(self, loss_curve) -> dict:
        """The `moe` section (schemes/expert_parallel.py's), its all-to-all time left out (null)."""
        routing = "router" if self.job.numerics else self.job.scenario.model.moe.routing.model
        return {"moe": moe_section(self.ep, self.experts, routing, self.moe_steps, loss_curve, None)}


class ExpertUpdate(ReplicatedUpdate):
    """DDP under pp x tp with sharded experts: the replicated gradient all-reduced over the dp (x cp) group, the
    experts' over the dp/ep ranks that hold them."""

    def __init__(self, scheme):
        super().__init__(scheme)
        self.ep = scheme.layout.ep
        self.dense = {rank: experts_last(scheme.replicas[rank]) for rank in scheme.running}

    def reduce(self, rank: int):
        """Step program: the replicated part averaged over the dp (x cp) group, the experts' over their holders,
        then divided by ep (the global batch's mean)."""
        scheme, dense = self.scheme, self.dense[rank]
        buffer = scheme.replicas[rank].grad_buffer
        if scheme.layout.dp * scheme.layout.cp > 1:
            dp_comm, dp_index, dp_reduce = scheme.comms.dp_cp[rank]
            yield Collective(dp_reduce(dp_index, dp_comm.world, buffer[:dense], average=True), "dp_allreduce",
                             dp_comm, dp_index)
        comm, position, all_reduce = scheme.comms.expert_dp[rank]
        if len(scheme.layout.rank_groups(rank).expert_dp) > 1:  # (a mirrored communicator has one member)
            yield Collective(all_reduce(position, comm.world, buffer[dense:], average=True), "expert_allreduce",
                             comm, position)
        buffer[dense:].div_(self.ep)


def _completes_replica_0s_experts(layout, rank: int) -> bool:
    """Whether job rank `rank` holds experts that data-parallel replica 0 does not, in their first copy: its place
    in its ep group is not the first, and in its experts' data-parallel group it is."""
    groups = layout.rank_groups(rank)
    return groups.expert_dp.index(rank) == 0 and groups.ep.index(rank) > 0


def _layers(replica) -> list:
    return [] if replica is None else [layer for layer in replica.model.modules() if isinstance(layer, MoE)]
