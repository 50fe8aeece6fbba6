"""Mixture-of-experts layers: a learned top-k router, expert MLPs, capacity, the balancing loss; gpt's MoE block.

`MoE(hidden, spec, expert)` maps (batch, positions, hidden) to the same shape,
in place of a transformer block's MLP: gpt's `MoEBlock` here, llama's
`LlamaMoEBlock` (train/llama_moe.py). Every token t (h_t its input) is routed as HF
transformers' Mixtral block and Megatron-Core's default router do: logits
l_t = router(h_t) (a Linear without bias), probabilities p_t = softmax(l_t)
in fp32 over the experts, the top_k of them kept and renormalized to sum to 1
(w_t,e = p_t,e / sum of the kept p_t; with `model.moe.score` sigmoid, each
expert's sigmoid in place of the softmax); with `model.moe.groups`, the top_k
among the experts of the token's `group_limit` best groups (DeepSeek-V3's
node-limited routing, train/moe_router.py). The output is sum over kept e of
w_t,e * expert_e(h_t), plus every shared expert's output (DeepSeekMoE), each
expert an MLP of the dense one's kind, built by `expert()`: in a gpt an
`ExpertMLP` (Linear to `model.moe.expert_hidden` features, by default 4 x
hidden as the dense MLP, GELU, Linear back), in a llama a SwiGLU expert
(train/llama_moe.py).

Capacity (`capacity_factor` c, null: dropless): expert e takes at most
C = ceil(c * T * top_k / experts) of the T tokens' assignments; it keeps them
in token order, for a token its choices in rank order (Megatron-Core's
"position" drop policy), and drops the rest: a dropped assignment adds
nothing (the other weights are not renormalized), so a token whose every
choice is dropped passes through on the residual only.

The auxiliary load-balancing loss is Switch Transformer's (Fedus et al. 2021,
eq. 4) for top-k as Megatron-Core computes it: coeff * E * sum_e f_e * P_e,
with f_e the share of the T * top_k assignments routed to e (before drops)
and P_e the mean of p_t,e over the tokens: coeff when routing is balanced.
It joins the training loss as Megatron-Core's MoEAuxLossAutoScaler adds it:
the layer's output carries it through autograd, and the backward adds its
gradient (times 1) to the router's, so the loss a run reports stays the
language-model loss. Its gradient is `aux_loss_scale`, which the step engine
sets before each step as Megatron-Core's MoEAuxLossAutoScaler.set_loss_scale
does: 1 / (micro-batches x tp), a mean over the micro-batches and the tp
ranks' parts of the sequence, times the fp16 loss scale, which scales the
language-model loss's gradient too (strategies/expert_model_parallel.py). The
router's pieces are in train/moe_router.py.

After each forward, `routing` holds what the router did: tokens per expert
(kept), assignments dropped, and the auxiliary loss. With numerics off (meta
tensors) there is no router output to read: the experts are charged balanced
routing, T * top_k assignments spread as evenly as they go. A step's FLOPs
are measured once per batch shape (cost.measure_step_cost's cache): dropless,
an MoE block's FLOPs do not depend on the routing; with a capacity, every step
is charged the drops of the first.

Under expert parallelism (`parallel.ep`) each rank's copy keeps only its
share of every layer's experts (`keep_experts_`), and the block's
`parallel_ops` run it as the regions of train/moe_exchange.py, between its ep
group's exchanges, which move the tokens to their experts' ranks (the step
engine, schemes/model_parallel.py, under every layout). Under tensor
parallelism the experts stay whole on every tp rank, and each tp rank routes
its part of the sequence: its own under sequence parallelism, else the part
sequence parallelism would give it, taken from the whole stream and its
output summed back over the tp group (`ExpertsBlock.experts_ops`); the MoE
layer's gradients are then each tp rank's share, summed over the tp group
after the backward (schemes/model_parallel.py).

    layer = MoE(64, MoESpec(experts=8, top_k=2, capacity_factor=1.25))
    y = layer(h)                         # (batch, positions, 64)
    layer.routing.tokens_per_expert      # [kept assignments of expert 0, 1, ...]
"""
import contextlib
import copy
import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..scenario.model import MoESpec
from .gpt import Block
from .moe_exchange import exchange_ops
from .moe_routing import balanced_counts
from .moe_router import AuxLossGradient, balancing_loss, kept_assignments, router_choices
from .ring_attention import attention_ops
from .tensor_parallel import AllReduceBackward, AllReduceForward, Apply, attention_half_ops


class ExpertMLP(nn.Module):
    """One gpt expert: Linear(hidden, width), GELU, Linear(width, hidden), as the dense block's MLP (width 4 hidden)."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.expand = nn.Linear(hidden, width)
        self.contract = nn.Linear(width, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.contract(F.gelu(self.expand(h)))


@dataclass(frozen=True)
class Routing:
    """One forward's routing: kept assignments per expert, assignments dropped, the auxiliary loss."""

    tokens_per_expert: tuple[int, ...]
    dropped: int
    aux_loss: float


def gpt_expert(hidden: int, spec: MoESpec) -> Callable[[], nn.Module]:
    """What builds one expert of a gpt of width `hidden`: an ExpertMLP of model.moe.expert_hidden features (default
    4 x hidden, the dense MLP's)."""
    return functools.partial(ExpertMLP, hidden, spec.expert_width(4 * hidden))


class MoE(nn.Module):
    """Router, routed experts and shared experts: the MLP of a mixture-of-experts block. `expert()` builds one
    expert, routed or shared (default: a gpt's, `gpt_expert`)."""

    # what its forwards did, and where numerics off draw their routing, not what it computes (partition.py's
    # module_structure: a cost is measured on balanced routing)
    RECORDS = ("routing", "routings", "drawn_routing", "recomputing")

    def __init__(self, hidden: int, spec: MoESpec, expert: Callable[[], nn.Module] | None = None):
        super().__init__()
        expert = expert or gpt_expert(hidden, spec)
        self.spec = spec
        self.router = nn.Linear(hidden, spec.experts, bias=False)
        self.experts = nn.ModuleList(expert() for _ in range(spec.experts))
        self.shared = nn.ModuleList(expert() for _ in range(spec.shared_experts))
        self.routing: Routing | None = None
        self.first_expert = 0  # expert parallelism: the index of the first expert this layer holds (keep_experts_)
        self.ep = 1  # expert parallelism: the ranks the layer's experts are sharded over (keep_experts_)
        # a dispatch that sends a token once to each host (parallel.moe_dispatch deepep): each expert's host in its
        # ep group, 0, 1, ... (strategies/expert_model_parallel.py); None: the dispatch is by rank
        self.expert_hosts: tuple[int, ...] | None = None
        self.aux_loss_scale = 1.0  # its balancing loss's gradient: 1 / (microbatches x tp) x fp16's loss scale
        self.routings: list = []  # the step engine: each forward's (assigned, kept) of the ep group (moe_exchange.py)
        # numerics off with a drawn routing model: (assignments a rank) -> the ep group's draw, [rank][expert]
        # (strategies/expert_model_parallel.py); None: balanced routing
        self.drawn_routing = None
        # full recomputation: this forward runs again from a kept input (schemes/layer_recompute.py), routing as the
        # first did; its routing is not recorded again
        self.recomputing = False

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if len(self.experts) < self.spec.experts:
            raise RuntimeError("an expert-parallel MoE layer runs as train/moe_exchange.py's regions (exchange_ops)")
        tokens = h.reshape(-1, h.shape[-1])
        if tokens.is_meta:
            out = self._balanced(tokens)
        else:
            out = self._routed(tokens)
        for expert in self.shared:
            out = out + expert(tokens)
        return out.view_as(h)

    def capacity(self, tokens: int) -> int | None:
        """Assignments one expert keeps out of `tokens` tokens' (None: dropless)."""
        factor = self.spec.capacity_factor
        return None if factor is None else math.ceil(factor * tokens * self.spec.top_k / self.spec.experts)

    def _routed(self, tokens: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        probs, chosen, weights = router_choices(self, tokens)  # (T, E), (T, k), (T, k)
        keep = kept_assignments(chosen, spec.experts, self.capacity(tokens.shape[0]))
        out = torch.zeros_like(tokens)
        kept_counts = []
        for e, expert in enumerate(self.experts):
            token_index, slot = ((chosen == e) & keep).nonzero(as_tuple=True)  # token order
            kept_counts.append(len(token_index))
            if len(token_index):
                weight = weights[token_index, slot].unsqueeze(-1).to(tokens.dtype)
                out = out.index_add(0, token_index, weight * expert(tokens[token_index]))
        aux_loss = balancing_loss(probs, chosen, spec.experts) * spec.aux_loss_coeff
        self.routing = Routing(tuple(kept_counts), int((~keep).sum()), float(aux_loss.detach()))
        if spec.aux_loss_coeff > 0 and torch.is_grad_enabled():
            out = AuxLossGradient.apply(out, aux_loss * self.aux_loss_scale)
        return out

    def _balanced(self, tokens: torch.Tensor) -> torch.Tensor:
        """Meta tensors: each expert runs on its balanced share of the assignments (capacity-limited;
        train/moe_routing.py)."""
        assignments = tokens.shape[0] * self.spec.top_k
        capacity = self.capacity(tokens.shape[0])
        out = torch.zeros_like(tokens) + self.router(tokens).sum() * 0
        counts = []
        for share, expert in zip(balanced_counts(self.spec, tokens.shape[0]), self.experts):
            counts.append(share if capacity is None else min(share, capacity))
            out = out + expert(tokens[:counts[-1]]).sum() * 0  # a share is at most every token
        self.routing = Routing(tuple(counts), assignments - sum(counts), float("nan"))
        return out


class ExpertsBlock:
    """A transformer block whose MLP is a mixture of experts (gpt's MoEBlock, llama's LlamaMoEBlock), as the
    step engine runs it (train/moe_exchange.py): `moe`, its MoE layer, after
    `before_experts(x)`, the block up to that layer; the block is x + moe(h) from there. (A mixin: it comes
    before the block's class among the bases.)"""

    moe: MoE
    sequence_parallel: bool
    tp_rank, tp = 0, 1  # tensor parallelism: this rank's place in its tp group, of tp (shard_)

    def before_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x after the attention, the MoE layer's input)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, h = self.before_experts(x)
        return x + self.moe(h)

    def shard_(self, tp_rank: int, tp: int) -> dict:
        """The block's attention cut as its dense block's (the experts stay whole); its tp rank noted."""
        slices = super().shard_(tp_rank, tp)
        self.tp_rank, self.tp = tp_rank, tp
        return slices

    def experts_ops(self) -> list:
        """The MoE layer as steps on (x, h), the stream and the layer's input after the attention's "g", with its
        ep group's exchanges (train/moe_exchange.py), on this tp rank's tokens. Under sequence parallelism those
        are the rank's part of the sequence already, and no tp collective is needed. Without it the stream is
        whole on every tp rank, and each routes the part of the sequence sequence parallelism would have given
        it, as torchtitan splits the tokens over tp before its dispatch (its token dispatcher's sp_rank): the
        part taken from h (an "f": the parts' gradients summed across the tp group in backward), the layer's
        output on it set among zeros for the other parts and summed across the tp group (a "g"), then added to
        the stream."""
        if self.sequence_parallel or self.tp == 1:
            return exchange_ops(self.moe)
        return [AllReduceBackward(1), Apply(lambda x, h: (x, h.chunk(self.tp, dim=1)[self.tp_rank])),
                *exchange_ops(self.moe, self._among_zeros), AllReduceForward(1), Apply(lambda x, out: (x + out,))]

    def _among_zeros(self, x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, the layer's output `out` on this tp rank's part of the sequence, zeros on the others' parts)."""
        part = x.shape[1] // self.tp
        out = out.view(x.shape[0], part, x.shape[2])
        return x, F.pad(out, (0, 0, self.tp_rank * part, (self.tp - 1 - self.tp_rank) * part))


class MoEBlock(ExpertsBlock, Block):
    """A gpt Block whose MLP is a mixture of experts: x + attention(ln1(x)), then x + moe(ln2(x))."""

    def __init__(self, hidden: int, heads: int, spec: MoESpec):
        super().__init__(hidden, heads)
        del self.expand, self.contract  # the dense MLP, replaced
        self.moe = MoE(hidden, spec)

    def before_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._after_attention(x, self._attention(self.ln1(x)))

    column_split, row_split = ("query", "key", "value"), ("projection",)  # the experts stay whole on every tp rank

    def parallel_ops(self) -> list:
        """The attention with its tensor-parallel collectives, then the mixture of experts on this tp rank's
        tokens (ExpertsBlock.experts_ops)."""
        return attention_half_ops(self.ln1, attention_ops(self), self._after_attention,
                                  self.sequence_parallel) + self.experts_ops()


@contextlib.contextmanager
def recomputing(module: nn.Module):
    """Every MoE layer of `module` marked as running its forward again (full recomputation) while inside."""
    layers = [layer for layer in module.modules() if isinstance(layer, MoE)]
    for layer in layers:
        layer.recomputing = True
    try:
        yield
    finally:
        for layer in layers:
            layer.recomputing = False


def keep_experts_(model: nn.Module, ep_rank: int, ep: int) -> nn.Module:
    """Expert parallelism: every MoE layer of `model` keeps only ep rank `ep_rank`'s experts, the
    `experts / ep` from `ep_rank * experts / ep` on (train/moe_exchange.py runs them); returns `model`."""
    for layer in model.modules() if ep > 1 else ():
        if isinstance(layer, MoE):
            count = layer.spec.experts // ep
            layer.first_expert, layer.ep = ep_rank * count, ep
            layer.experts = nn.ModuleList(list(layer.experts)[layer.first_expert:layer.first_expert + count])
    return model


def copy_holding_experts(module: nn.Module, ep_rank: int, ep: int) -> nn.Module:
    """A copy of `module` whose MoE layers hold only ep rank `ep_rank`'s experts (keep_experts_), the others never
    copied: with hundreds of experts a layer, copying them all is most of a large job's set-up."""
    others = {}  # deepcopy's memo: an expert of another ep rank stands for itself, to be dropped
    for layer in module.modules() if ep > 1 else ():
        if isinstance(layer, MoE):
            count = layer.spec.experts // ep
            others.update((id(expert), expert) for index, expert in enumerate(layer.experts)
                          if not ep_rank * count <= index < (ep_rank + 1) * count)
    return keep_experts_(copy.deepcopy(module, others), ep_rank, ep)


def whole_model_name(module: nn.Module, name: str) -> str:
    """`name`, a parameter's or buffer's name in `module` after keep_experts_, as the whole model names it: an
    expert's index counted from its layer's first expert."""
    layer_name, found, rest = name.partition(".experts.")
    if not found:
        return name
    index, _, tail = rest.partition(".")
    return f"{layer_name}.experts.{module.get_submodule(layer_name).first_expert + int(index)}.{tail}"


def moe_block(spec: MoESpec):
    """build_gpt's `block`: layer i (from 0) is an MoEBlock where `spec` puts experts (MoESpec.holds_experts: past
    the first_dense, when i + 1 is a multiple of `spec.every`)."""
    def block(layer: int, hidden: int, heads: int) -> nn.Module:
        return MoEBlock(hidden, heads, spec) if spec.holds_experts(layer) else Block(hidden, heads)
    return block
