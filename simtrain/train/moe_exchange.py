"""An expert-parallel MoE layer's work cut at its ep group's exchanges: route, count, dispatch, experts, combine.

Under expert parallelism (`parallel.ep`) ep rank i of an ep group holds the
i-th run of experts/ep of every MoE layer (train/moe.py keep_experts_), and
the layer's tokens go to their experts' ranks and back by all-to-all. The
pieces here are what every rank computes between those exchanges, on real
tensors (or meta ones), as the step engine runs them under every layout (data
parallelism alone included: strategies/expert_model_parallel.py):
`exchange_ops` gives the layer as Apply steps with the exchanges as
boundaries between regions, as tensor parallelism's collectives are
(train/tensor_parallel.py, schemes/stage_execution.py).

One layer, on the (x, h) of a block (its residual stream and the MoE's input):

1. `route_tokens` (train/moe_router.py): router, softmax in fp32, top-k, renormalized weights (the
   balancing loss's gradient attached, times `moe.aux_loss_scale`); the
   rank's assignments per expert are all-gathered over the ep group
   (`ExpertExchange` "moe counts");
2. `kept_matrix`: capacity decided from the group's counts as one device
   decides it for the group's tokens (ranks in order); `kept_positions` picks
   this rank's kept assignments, experts in order; "moe dispatch" sends them
   (block (src, dst): the tokens src's router sent to dst's experts);
3. `run_experts` runs the rank's experts on what arrived; "moe combine" sends
   the outputs back, where they are weighted by the router and summed (plus
   shared experts) onto the residual stream.

Every boundary's backward is the reverse exchange ("moe dispatch backward",
"moe combine backward"). Without a router's output (meta tensors: numerics
off, or a cost measured before any routing) every rank's assignments are
balanced (`balanced_routing`), or, where the scheme set the layer's
`drawn_routing` (numerics off with model.moe.routing zipf or histogram), drawn
from the routing model (train/moe_routing.py) for the whole ep group. A
forward run again under full recomputation (`moe.recomputing`) routes as its
first did and records nothing.

Where the ep group's dispatch sends each token once to each node
(`parallel.moe_dispatch: deepep`, comm/node_dispatch.py), the scheme gives
the layer `expert_hosts` (the host of each of its experts, 0, 1, ... in the
group's order): each rank's counts then carry, after its assignments per
expert, how many of its tokens reach each host ("moe counts" gathers both,
as DeepEP's notify_dispatch does), and "moe dispatch" carries those rows
and the token each sent row is (`ExpertExchange.node_rows`, `token_ids`).
With a capacity (`model.moe.capacity_factor`) a token reaches the hosts of
its kept assignments alone, which a rank knows once the group's counts have
decided the drops: "moe counts" then gathers the assignments alone, and a
second all-gather after the drops, "moe notify", each rank's tokens reaching
each host (Megatron-Core's flex dispatcher drops before DeepEP's dispatch,
whose notify_dispatch then counts what is left).

The experts' region is measured once, on balanced routing; its work is
linear in the tokens the rank's experts receive (every expert of a layer
alike), so the combine boundary's `work_share` is the share of that measured
work this forward's routing gave the rank (received rows / balanced rows),
which the step engine charges the region forward and backward
(schemes/stage_execution.py): an overloaded rank's experts take longer, and
its group waits for it at the combine.

    ops = exchange_ops(block.moe)      # (x, h) -> (x + moe(h),), after a block's attention ops
    block.moe.routings                 # per first forward: (assigned, kept), [ep rank][expert], of its ep group
"""
from typing import NamedTuple

import torch

from .moe_router import kept_assignments, route_tokens
from .moe_routing import balanced_counts, balanced_node_rows, node_rows
from .tensor_parallel import Apply


class ExpertExchange(NamedTuple):
    """A collective of the ep group between two regions of an MoE layer: "moe counts" (every rank's assignments
    per expert) or "moe notify" (its tokens reaching each host after the drops), all-gathered (`rows` = ep), or an
    all-to-all ("moe dispatch", "moe combine" and their backwards)
    of `counts[src][dst]` rows; `rows`: how many this rank receives. A dispatch that sends a token once to each
    host has `node_rows[src][host]`, the tokens of rank src that reach each host, and `token_ids`, the token
    each row this rank sends is (its layer's `expert_hosts` set; else empty and None)."""

    label: str
    counts: tuple
    rows: int
    node_rows: tuple = ()
    token_ids: torch.Tensor | None = None

    @property
    def gathers(self) -> bool:
        """Whether it all-gathers each rank's counts (else it is an all-to-all of rows)."""
        return self.label in ("moe counts", "moe notify")

    def sent(self, tensor: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(what group rank `index` sends of `tensor` in this all-to-all, an empty tensor shaped as what it
        receives). Numerics off, a replayed pass's tensor (measured once, on another rank) is resized to the rows
        this routing sends from the rank: a rank whose tokens an expert's capacity dropped sends fewer."""
        rows = sum(self.counts[index])
        if tensor.is_meta and tensor.shape[0] != rows:
            tensor = tensor.new_empty((rows, *tensor.shape[1:]))
        return tensor, tensor.new_empty((sum(row[index] for row in self.counts), *tensor.shape[1:]))

    def result_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """An empty tensor shaped as what this rank receives when it sends `tensor`."""
        return tensor.new_empty((self.rows, *tensor.shape[1:]))


def balanced_routing(moe, tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(assigned, kept), [ep rank][expert], of an ep group whose every rank routes `tokens` tokens evenly over the
    experts of `moe` (an MoE layer): what a layer charges without a router's output."""
    assigned = [balanced_counts(moe.spec, tokens)] * moe.ep
    return assigned, kept_matrix(assigned, moe.capacity(tokens * moe.ep))


def kept_matrix(assigned: list[list[int]], capacity: int | None) -> list[list[int]]:
    """kept[s][e] of assigned[s][e] (ep rank s's assignments to expert e) when every expert keeps its first
    `capacity` assignments, ranks in order (None: dropless, all of them)."""
    if capacity is None:
        return [list(row) for row in assigned]
    kept, ahead = [], [0] * len(assigned[0])
    for row in assigned:
        kept.append([min(n, max(0, capacity - before)) for n, before in zip(row, ahead)])
        ahead = [before + n for before, n in zip(ahead, row)]
    return kept


def rank_counts(kept: list[list[int]]) -> list[list[int]]:
    """Rows rank src sends rank dst in a dispatch: src's kept tokens for dst's experts (experts in runs)."""
    ep = len(kept)
    per = len(kept[0]) // ep
    return [[sum(row[dst * per:(dst + 1) * per]) for dst in range(ep)] for row in kept]


def transposed(counts) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(column) for column in zip(*counts))


def kept_positions(chosen, keep, experts: int, kept_row):
    """(token index, choice rank) of every assignment `keep` (T, top_k booleans) keeps, experts in order, each
    expert's in token order (meta `chosen`, no router output: shapes only, of the `kept_row` per expert)."""
    if chosen.is_meta:
        total = sum(kept_row)
        return (torch.zeros(total, dtype=torch.long, device="meta"),) * 2
    pairs = [((chosen == e) & keep).nonzero(as_tuple=True) for e in range(experts)]
    return torch.cat([index for index, _ in pairs]), torch.cat([slot for _, slot in pairs])


def run_experts(experts, received: torch.Tensor, layout: list[list[int]]) -> torch.Tensor:
    """The outputs of this rank's experts for `received` (blocks by source, each by expert), in its layout."""
    per = len(experts)
    starts, position = [[0] * per for _ in layout], 0
    for src, row in enumerate(layout):
        for j, rows in enumerate(row):
            starts[src][j] = position
            position += rows
    device = received.device
    order = torch.cat([torch.arange(starts[src][j], starts[src][j] + layout[src][j], device=device)
                       for j in range(per) for src in range(len(layout))])
    by_expert = received[order].split([sum(row[j] for row in layout) for j in range(per)])
    outputs = torch.cat([expert(tokens) for expert, tokens in zip(experts, by_expert)])
    return torch.empty_like(outputs).index_copy(0, order, outputs) if not received.is_meta else outputs


def combine(moe, tokens, weights, token_index, slot, combined) -> torch.Tensor:
    """The layer's output for `tokens`: the experts' outputs that came back, weighted by the router and summed per
    token, plus the shared experts'."""
    weight = weights[token_index, slot].unsqueeze(-1).to(tokens.dtype)
    out = torch.zeros_like(tokens).index_add(0, token_index, weight * combined)
    for expert in moe.shared:
        out = out + expert(tokens)
    return out


class _Exchanging:
    """One rank's MoE layer as exchange_ops runs it; holds the forward's routing for its boundaries."""

    def __init__(self, moe, output):
        self.moe = moe
        self.output = output  # (x, the layer's output per token) -> what the layer hands on
        self.kept: list[list[int]] = []
        self.counts: tuple = ()
        self.share: float | None = None  # the experts' region's share of its measured (balanced) work
        self.node_rows: tuple = ()  # with expert_hosts: [ep rank][host] the tokens reaching each host
        self.token_ids = None  # with expert_hosts: the token each dispatched row is

    @property
    def ep_rank(self) -> int:
        return self.moe.first_expert // len(self.moe.experts)

    @property
    def hosts(self) -> int:
        """The hosts of the ep group a dispatch sends each token once to (0: none, the dispatch is by rank)."""
        hosts = self.moe.expert_hosts
        return 0 if hosts is None else max(hosts) + 1

    @property
    def notifying(self) -> bool:
        """Whether the tokens reaching each host are counted after the drops and gathered apart ("moe notify")."""
        return bool(self.hosts) and self.moe.spec.capacity_factor is not None

    def route(self, x, h):
        tokens = h.reshape(-1, h.shape[-1])
        _, chosen, weights = route_tokens(self.moe, tokens)
        experts, hosts = self.moe.spec.experts, 0 if self.notifying else self.hosts
        if tokens.is_meta:
            counts = torch.zeros((1, experts + hosts), dtype=torch.int64, device="meta")
        else:
            counts = torch.bincount(chosen.flatten(), minlength=experts)
            if hosts:
                counts = torch.cat([counts, torch.tensor(node_rows(chosen, self.moe.expert_hosts, hosts))])
            counts = counts.unsqueeze(0)
        return x, tokens, chosen, weights, counts

    def select(self, x, tokens, chosen, weights, gathered):
        moe, me = self.moe, self.ep_rank
        experts, ep = moe.spec.experts, moe.ep
        capacity = moe.capacity(tokens.shape[0] * ep)
        drawn = moe.drawn_routing
        balanced = balanced_routing(moe, tokens.shape[0])
        if not gathered.is_meta or drawn is not None:
            if not gathered.is_meta:
                assigned, nodes = gathered[:, :experts].tolist(), gathered[:, experts:].tolist()
            else:
                assigned, nodes = drawn(tokens.shape[0], moe.recomputing, moe.expert_hosts, capacity)
            self.kept = kept_matrix(assigned, capacity)
            if not moe.recomputing:  # a forward run again routes as its first did
                moe.routings.append((assigned, self.kept))
        else:
            assigned, self.kept = balanced
            nodes = (balanced_node_rows(moe.spec, tokens.shape[0], moe.expert_hosts, self.hosts, ep, capacity)
                     if self.hosts else ())
        self.counts = tuple(map(tuple, rank_counts(self.kept)))
        self.node_rows = tuple(map(tuple, nodes))
        self.share = _received(self.kept, moe) / max(1, _received(balanced[1], moe))
        ahead = [sum(assigned[src][e] for src in range(me)) for e in range(experts)]
        keep = None if chosen.is_meta else kept_assignments(chosen, experts, capacity, ahead)
        token_index, slot = kept_positions(chosen, keep, experts, self.kept[me])
        self.token_ids = token_index if self.hosts else None
        if not self.notifying:
            return x, tokens, weights, token_index, slot
        if chosen.is_meta:  # the tokens reaching each host came with the routing (drawn or balanced)
            notify = torch.zeros((1, self.hosts), dtype=torch.int64, device="meta")
        else:
            notify = torch.tensor([node_rows(chosen, moe.expert_hosts, self.hosts, keep)])
        return x, tokens, weights, token_index, slot, notify

    def gather(self, x, tokens, weights, token_index, slot, notified=None):
        """The rows to dispatch, each kept assignment's token; with "moe notify", every rank's tokens reaching each
        host after the drops (from the router's output) are the dispatch's."""
        if notified is not None and not notified.is_meta:
            self.node_rows = tuple(map(tuple, notified.tolist()))
        return x, tokens, weights, token_index, slot, tokens[token_index]

    def run(self, x, tokens, weights, token_index, slot, received):
        per, first = len(self.moe.experts), self.moe.first_expert
        layout = [[row[first + j] for j in range(per)] for row in self.kept]
        return x, tokens, weights, token_index, slot, run_experts(self.moe.experts, received, layout)

    def finish(self, x, tokens, weights, token_index, slot, combined):
        return self.output(x, combine(self.moe, tokens, weights, token_index, slot, combined))

    def exchange(self, label: str, reverse: bool) -> ExpertExchange:
        """The all-to-all `label` of this forward's routing (`reverse`: tokens going back to their ranks); the
        dispatch with its rows per host and token ids where the layer has expert_hosts."""
        counts = transposed(self.counts) if reverse else self.counts
        rows = sum(row[self.ep_rank] for row in counts)
        if label == "moe dispatch" and self.hosts:
            return ExpertExchange(label, counts, rows, self.node_rows, self.token_ids)
        return ExpertExchange(label, counts, rows)


def _received(kept: list[list[int]], moe) -> int:
    """The tokens the experts `moe` holds receive, of an ep group whose kept assignments are `kept`."""
    first, per = moe.first_expert, len(moe.experts)
    return sum(row[first + j] for row in kept for j in range(per))


class _Counts(NamedTuple):
    """The boundary after the router: its counts all-gathered over the ep group (no gradient goes back)."""

    index: int
    layer: _Exchanging

    @property
    def forward(self) -> ExpertExchange:
        return ExpertExchange("moe counts", (), self.layer.moe.ep)

    backward = None


class _Notify(NamedTuple):
    """The boundary after the drops where the dispatch sends a token once to each host: each rank's tokens
    reaching each host, all-gathered over the ep group (no gradient goes back)."""

    index: int
    layer: _Exchanging

    @property
    def forward(self) -> ExpertExchange:
        return ExpertExchange("moe notify", (), self.layer.moe.ep)

    backward = None


class _Dispatch(NamedTuple):
    """The boundary before the experts: tokens to their experts' ranks; their gradients back."""

    index: int
    layer: _Exchanging

    @property
    def forward(self) -> ExpertExchange:
        return self.layer.exchange("moe dispatch", reverse=False)

    @property
    def backward(self) -> ExpertExchange:
        return self.layer.exchange("moe dispatch backward", reverse=True)


class _Combine(NamedTuple):
    """The boundary after the experts: their outputs back to the tokens' ranks; the outputs' gradients out."""

    index: int
    layer: _Exchanging

    @property
    def forward(self) -> ExpertExchange:
        return self.layer.exchange("moe combine", reverse=True)

    @property
    def work_share(self) -> float | None:
        """The share of its measured work the region before this boundary (the experts') did this forward."""
        return self.layer.share

    @property
    def backward(self) -> ExpertExchange:
        return self.layer.exchange("moe combine backward", reverse=False)


def added_to_stream(x, out):
    """What an MoE layer hands on: the stream `x` plus its output `out` (tokens, hidden)."""
    return (x + out.view_as(x),)


def exchange_ops(moe, output=added_to_stream) -> list:
    """The MoE layer `moe` as steps on (x, h), the residual stream and the layer's input, to `output(x, moe(h))`
    (by default (x + moe(h),)), with its ep group's exchanges as boundaries (each boundary's `forward` and
    `backward` are the ExpertExchange of the forward just run)."""
    layer = _Exchanging(moe, output)
    notify = [_Notify(5, layer)] if layer.notifying else []
    return [Apply(layer.route), _Counts(4, layer), Apply(layer.select), *notify, Apply(layer.gather),
            _Dispatch(5, layer), Apply(layer.run), _Combine(5, layer), Apply(layer.finish)]
