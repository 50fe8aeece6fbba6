"""Expert-parallel MoE layers as a step program: tokens go to their experts' ranks by all-to-all and come back.

Under expert parallelism (`parallel.ep`, schemes/expert_parallel.py) each rank
of an ep group holds experts/ep of every MoE layer's experts (ep rank i the
i-th run of them, train/moe.py's keep_experts_). `ExpertParallelStep` runs one
rank's forward and backward through such a model as Megatron-Core's
all-to-all token dispatcher does, with the real tensors:

1. the rank computes up to the router (its dense blocks, attention, router,
   top-k) and counts its assignments per expert; the ep group all-gathers the
   counts (ring, `moe counts`), so every rank knows how many tokens each rank
   sends to each expert;
2. capacity (`model.moe.capacity_factor`) is decided from the counts as one
   device decides it for the group's tokens: expert e keeps the first
   C = ceil(c * T_group * top_k / experts) assignments, T_group the group's
   tokens, in rank order then token order; the rest are dropped before they
   travel;
3. `moe dispatch`: an all-to-all (comm/all_to_all.py, `parallel.moe_dispatch`) sends every
   kept assignment's token to its expert's rank: block (src, dst) is exactly
   the tokens src's router sent to dst's experts, so sizes are uneven;
4. each rank runs its experts on the tokens they received, charged per the
   FLOPs of those tokens, so an overloaded expert makes its rank slow and the
   others wait for it in:
5. `moe combine`: the reverse all-to-all brings the expert outputs back,
   where they are weighted by the router and summed (plus shared experts).

The graph is cut at each exchange (the received tensors are leaves), and the
backward runs the pieces in reverse: the rank's own backward down to the last
layer's combine, `moe combine backward` (output gradients to the experts'
ranks), the experts' backward, `moe dispatch backward` (input gradients back),
the rank's backward to the layer before, and so on. Every piece is charged its
FLOPs as the operator recorder measures them on the tensors it ran; the saved
activations' peak is held on the ledger from the forward to the end of the
backward. With numerics off the tensors are meta: each rank's assignments per
expert are drawn from `model.moe.routing` (train/moe_routing.py), and the same
exchanges move meta tensors of the drawn sizes.

    step = ExpertParallelStep(model, group, "fp32", routing, seed, step_index)
    loss = yield from step.forward(x, y, batch_loss)
    yield from step.backward(loss)
    step.layers            # per MoE layer: assignments and kept tokens, [src][expert], of this rank's group
"""
import functools
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..comm.all_to_all import hierarchical_all_to_all, pairwise_all_to_all
from ..comm.channels import layout_of
from ..comm.ring import ring_all_gather
from ..cost import SavedTensorTracker
from ..errors import ScenarioError
from ..op_cost import OperatorRecorder
from ..step_ops import Alloc, Collective, Compute, Free
from ..train.moe import ExpertsBlock
from ..train.moe_exchange import (ExpertExchange, combine, kept_matrix, kept_positions, rank_counts,
                                  run_experts, transposed)
from ..train.moe_router import route_tokens
from ..train.moe_routing import draw_assignments, routing_generator


@dataclass(frozen=True)
class EpGroup:
    """A rank's ep group: its communicator, the rank's place in it, the job ranks in it, its all-to-all
    (comm/all_to_all.py: fn(rank, world, send, recv, counts) -> program), and (numerics off) the routing drawn
    for the group, shared by its ranks: (step, layer) -> [assignments, ranks yet to read them]."""

    comm: object
    index: int
    ranks: tuple[int, ...]
    all_to_all: Callable = pairwise_all_to_all
    draws: dict = field(default_factory=dict, compare=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def exchange(self, kind: ExpertExchange, tensor: torch.Tensor):
        """(the Collective of exchange `kind` of `tensor` over the group, the tensor that holds what arrives once
        it has run): "moe counts" all-gathers each rank's (1, experts) counts into (ranks, experts), rank order;
        an all-to-all sends `kind.counts[index]` rows to each rank."""
        if kind.label == "moe counts":
            gathered = tensor.new_zeros((self.size, tensor.shape[1]))
            gathered[self.index].copy_(tensor[0])
            # the ring starts with rank r's counts at position r + 1: chunk p is row p - 1
            program = ring_all_gather(self.index, (self.index + 1) % self.size, (self.index - 1) % self.size,
                                      [gathered[(position - 1) % self.size] for position in range(self.size)])
        else:
            gathered = kind.result_like(tensor)
            program = self.all_to_all(self.index, self.size, tensor, gathered, kind.counts)
        return Collective(program, kind.label, comm=self.comm, rank=self.index), gathered


def group_all_to_all(job, ranks) -> Callable:
    """The all-to-all program of the ep group of job ranks `ranks`: `parallel.moe_dispatch`'s, the hierarchical one
    over the hosts the topology puts them on."""
    if job.scenario.parallel.moe_dispatch == "pairwise":
        return pairwise_all_to_all
    hosts = [list(host) for host in layout_of(job.cluster.topology, [job.devices[rank].node for rank in ranks]).hosts]
    if len({len(host) for host in hosts}) > 1:
        raise ScenarioError(f"parallel.moe_dispatch: hierarchical needs the ep group's ranks {list(ranks)} spread "
                            f"evenly over hosts, got {', '.join(str(len(host)) for host in hosts)} a host")
    return functools.partial(hierarchical_all_to_all, hosts=hosts)


@dataclass
class Exchange:
    """What one MoE layer's forward leaves for its backward on this rank."""

    roots: list  # this rank's tensors before the cut (residual, router weights, shared-expert input)
    leaves: list  # their detached copies, which the rest of the forward used
    dispatched: torch.Tensor  # the tokens this rank sent (in its graph)
    expert_in: torch.Tensor  # the tokens this rank's experts received (a leaf)
    expert_out: torch.Tensor  # its experts' outputs (in their graph)
    combined: torch.Tensor  # the outputs this rank's tokens got back (a leaf)
    counts: list[list[int]]  # the dispatch's rows, [src][dst]


class ExpertParallelStep:
    """One rank's forward and backward of one step through an expert-parallel model, as a step program."""

    def __init__(self, model, group: EpGroup, dtype: str, routing, seed: int, step: int):
        self.model, self.group, self.dtype = model, group, dtype
        self.routing, self.seed, self.step = routing, seed, step
        self.tracker = SavedTensorTracker(excluded=list(model.parameters()))
        self.exchanges: list[Exchange] = []
        self.layers: list[tuple[list[list[int]], list[list[int]]]] = []  # per MoE layer: (assigned, kept)
        self.all_to_all_s = 0.0  # communication seconds credited to this rank in the all-to-alls
        self.token_bytes = 0  # bytes of one token's hidden vector (what a dispatch moves per kept assignment)

    def _charged(self, name: str, work):
        """Run `work()` on the host, recording its operators and saved tensors; (its value, the Compute)."""
        with torch.autograd.graph.saved_tensors_hooks(self.tracker.pack, self.tracker.unpack), \
                OperatorRecorder() as recorder:
            value = work()
        return value, Compute(float(recorder.flops), self.dtype, name, kernels=recorder.kernels, ops=recorder.take())

    def _exchange(self, send: torch.Tensor, rows: int, counts, label: str):
        """Step program: the ep group's all-to-all of `send`; returns what arrived."""
        collective, recv = self.group.exchange(ExpertExchange(label, counts, rows), send.detach())
        self.all_to_all_s += yield collective
        return recv

    def forward(self, x: torch.Tensor, y: torch.Tensor, batch_loss):
        """Step program: the forward on (x, y), exchanging tokens at every MoE layer; returns the loss."""
        resume, pending = (lambda: x), []
        for module in self.model:
            if not isinstance(module, ExpertsBlock):
                pending.append(module)
                continue
            before = resume

            def up_to_router(before=before, pending=tuple(pending), block=module):
                stream = before()
                for dense in pending:
                    stream = dense(stream)
                x_mid, h = block.before_experts(stream)
                tokens = h.reshape(-1, h.shape[-1])
                return x_mid, tokens, *route_tokens(block.moe, tokens)
            routed, compute = self._charged("forward", up_to_router)
            yield compute
            resume = yield from self._moe_layer(module.moe, *routed)
            pending = []
        loss, compute = self._charged("forward", lambda: _run(resume(), pending, lambda logits: batch_loss(logits, y)))
        yield compute
        yield Alloc("activations", self.tracker.peak_bytes)
        return loss

    def backward(self, loss: torch.Tensor):
        """Step program: the backward of `forward`'s loss, piece by piece; the gradients land in .grad."""
        _, compute = self._charged("backward", lambda: torch.autograd.backward(loss))
        yield compute
        for exchange in reversed(self.exchanges):
            counts = exchange.counts
            rows = exchange.expert_out.shape[0]
            grad_out = yield from self._exchange(_grad(exchange.combined), rows, counts, "moe combine backward")
            _, compute = self._charged("experts backward",
                                       lambda: torch.autograd.backward(exchange.expert_out, grad_out))
            yield compute
            grad_in = yield from self._exchange(_grad(exchange.expert_in), exchange.dispatched.shape[0],
                                                transposed(counts), "moe dispatch backward")
            roots = [root for root in exchange.roots if root.requires_grad] + [exchange.dispatched]
            grads = [_grad(leaf) for root, leaf in zip(exchange.roots, exchange.leaves) if root.requires_grad]
            _, compute = self._charged("backward", lambda: torch.autograd.backward(roots, grads + [grad_in]))
            yield compute
        self.exchanges.clear()
        yield Free("activations", self.tracker.peak_bytes)

    def _moe_layer(self, moe, x_mid, tokens, probs, chosen, weights):
        """Step program: one MoE layer's exchanges; returns the function that computes the stream after it."""
        group, spec = self.group, moe.spec
        self.token_bytes = tokens.shape[-1] * tokens.element_size()
        experts, per = spec.experts, spec.experts // group.size
        assigned = yield from self._assignments(tokens, chosen, experts, spec.top_k, len(self.layers))
        kept = kept_matrix(assigned, moe.capacity(tokens.shape[0] * group.size))
        self.layers.append((assigned, kept))
        counts = rank_counts(kept)
        me = group.index
        ahead = [sum(assigned[src][e] for src in range(me)) for e in range(experts)]

        def gather():
            index, slot = kept_positions(chosen, experts, moe.capacity(tokens.shape[0] * group.size), ahead,
                                         kept[me])
            return index, slot, tokens[index]
        (token_index, slot, dispatched), compute = self._charged("forward", gather)
        yield compute
        received = yield from self._exchange(dispatched, sum(row[me] for row in counts), counts, "moe dispatch")

        expert_in = received.requires_grad_()
        layout = [[kept[src][moe.first_expert + j] for j in range(per)] for src in range(group.size)]
        expert_out, compute = self._charged("experts", lambda: run_experts(moe.experts, expert_in, layout))
        yield compute
        combined = yield from self._exchange(expert_out, dispatched.shape[0], transposed(counts), "moe combine")
        combined.requires_grad_()

        roots = [x_mid, tokens, weights]
        leaves = [root.detach().requires_grad_(root.requires_grad) for root in roots]
        self.exchanges.append(Exchange(roots, leaves, dispatched, expert_in, expert_out, combined, counts))

        def after_combine():
            x_cut, tokens_cut, weights_cut = leaves
            return x_cut + combine(moe, tokens_cut, weights_cut, token_index, slot, combined).view_as(x_cut)
        return after_combine

    def _assignments(self, tokens, chosen, experts: int, top_k: int, layer: int):
        """Step program: every group rank's assignments per expert, [src][expert], all-gathered by ring."""
        group = self.group
        assigned = self._drawn(experts, tokens.shape[0] * top_k, layer) if tokens.is_meta else None
        mine = (torch.zeros((1, experts), dtype=torch.int64, device=tokens.device) if assigned is not None
                else torch.bincount(chosen.flatten(), minlength=experts).unsqueeze(0))
        collective, gathered = group.exchange(ExpertExchange("moe counts", (), group.size), mine)
        yield collective
        return assigned if assigned is not None else gathered.tolist()

    def _drawn(self, experts: int, assignments: int, layer: int) -> list[list[int]]:
        """No router ran: each group rank's draw from the routing model (seeded by step, layer and rank), drawn
        once for the group by its first rank to get there."""
        group, key = self.group, (self.step, layer)
        if key not in group.draws:
            group.draws[key] = [[draw_assignments(self.routing, experts, assignments,
                                                  routing_generator(self.seed, self.step, layer, rank))
                                 for rank in group.ranks], group.size]
        entry = group.draws[key]
        entry[1] -= 1
        if entry[1] == 0:
            del group.draws[key]
        return entry[0]


def _run(stream, modules, finish):
    for module in modules:
        stream = module(stream)
    return finish(stream)


def _grad(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
