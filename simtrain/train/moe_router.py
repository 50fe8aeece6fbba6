"""A mixture-of-experts layer's router pieces: top-k routing, capacity drops and the load-balancing loss.

Shared by the layer on one device (train/moe.py) and by an expert-parallel
layer's pieces between its exchanges (train/moe_exchange.py): the formulas
are train/moe.py's docstring's.

Group-limited routing (`model.moe.groups` G, `group_limit` M): DeepSeek-V3's
node-limited routing (arXiv 2412.19437, 2.1.2 and 3.2.2), as Megatron-Core's
group_limited_topk and HF's DeepseekV3 router compute it. The experts are
cut into G runs of E / G (a node's experts in DeepSeek-V3's deployment);
each group is scored by the sum of its top_k / M highest probabilities, the
M best groups are kept (ties to the lower index, as torch.topk breaks them),
and the token's top_k experts are chosen among those groups' experts alone.
Its weights are renormalized over what it chose, as without groups.

The scores are a softmax over the experts (`model.moe.score: softmax`, HF's
Mixtral, Megatron-Core's default) or each expert's sigmoid (`sigmoid`,
DeepSeek-V3's affinities s_i = sigmoid(u_t . e_i), eq. 15), the chosen ones
renormalized (eq. 13: g_i = s_i / sum of the chosen s_j); the balancing loss
reads each expert's share of the token's sigmoid scores, as Megatron-Core
computes it for sigmoid routers. DeepSeek-V3's bias for selection alone (its
auxiliary-loss-free balancing) and its routed scaling factor (2.5) are not
built.

    probs, chosen, weights = route_tokens(layer, tokens)       # (T, E), (T, k), (T, k)
    probs, chosen, weights = router_choices(layer, tokens)     # the same, without the balancing loss's gradient
    top_probs, chosen = top_k_experts(spec, probs)             # (T, k) each: the choices, group-limited or not
    keep = kept_assignments(chosen, experts, capacity)          # (T, k) booleans
"""
import torch
import torch.nn.functional as F


def router_choices(moe, tokens: torch.Tensor):
    """The router of MoE layer `moe` on `tokens` (T, hidden): (the probabilities the balancing loss reads, top-k
    choices, their renormalized weights). Its scores are a softmax over the experts, or with `model.moe.score`
    sigmoid each expert's sigmoid (DeepSeek-V3's affinities), whose share of the token's sum the balancing loss
    reads (Megatron-Core's); either way in fp32, and the chosen scores renormalized to sum to 1."""
    logits = moe.router(tokens).float()
    scores = logits.softmax(dim=-1) if moe.spec.score == "softmax" else logits.sigmoid()
    top_scores, chosen = top_k_experts(moe.spec, scores)
    weights = top_scores / top_scores.sum(dim=-1, keepdim=True)
    probs = scores if moe.spec.score == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    return probs, chosen, weights


def route_tokens(moe, tokens: torch.Tensor):
    """router_choices; the weights carry the rank's balancing loss's gradient (times `moe.aux_loss_scale`), as
    Megatron-Core attaches it."""
    probs, chosen, weights = router_choices(moe, tokens)
    if moe.spec.aux_loss_coeff > 0 and not tokens.is_meta:
        weights = AuxLossGradient.apply(weights, balancing_loss(probs, chosen, moe.spec.experts)
                                        * (moe.spec.aux_loss_coeff * moe.aux_loss_scale))
    return probs, chosen, weights


def top_k_experts(spec, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the top_k probabilities, the experts they are) of each token's row of `probs` (T, E), highest first: among
    every expert, or under group-limited routing (`spec.groups`) among the experts of the token's group_limit best
    groups (the module's docstring)."""
    if spec.groups is None:
        return probs.topk(spec.top_k, dim=-1)
    tokens, experts = probs.shape
    grouped = probs.view(tokens, spec.groups, spec.group_size)
    group_scores = grouped.topk(spec.top_k // spec.group_limit, dim=-1).values.sum(dim=-1)  # (T, G)
    kept_groups = group_scores.topk(spec.group_limit, dim=-1).indices
    open_groups = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    open_experts = open_groups.repeat_interleave(spec.group_size, dim=1)  # (T, E)
    return probs.masked_fill(~open_experts, float("-inf")).topk(spec.top_k, dim=-1)


def kept_assignments(chosen: torch.Tensor, experts: int, capacity: int | None, ahead=None) -> torch.Tensor:
    """(T, k) booleans: which of the router's choices their expert takes. Each expert keeps its first
    `capacity` assignments in token order, a token's choices in rank order (None: all of them); `ahead[e]`
    assignments of other ranks' tokens come before these in expert e's queue (expert parallelism)."""
    if capacity is None:
        return torch.ones_like(chosen, dtype=torch.bool)
    one_hot = F.one_hot(chosen.flatten(), experts)  # (T k, E), rows in (token, rank) order
    position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1  # the assignment's place in its expert's queue
    if ahead is not None:
        position = position + torch.as_tensor(ahead, dtype=position.dtype)[chosen.flatten()]
    return (position < capacity).view_as(chosen)


def balancing_loss(probs: torch.Tensor, chosen: torch.Tensor, experts: int) -> torch.Tensor:
    """Switch Transformer's load-balancing loss for top-k (without the coefficient): E * sum_e f_e P_e."""
    tokens, top_k = chosen.shape
    share = torch.bincount(chosen.flatten(), minlength=experts).float() / (tokens * top_k)
    return experts * (share * probs.mean(dim=0)).sum()


class AuxLossGradient(torch.autograd.Function):
    """Identity on the layer's output in the forward; in the backward, the auxiliary loss gets gradient 1,
    as if it had been added to the training loss (Megatron-Core's MoEAuxLossAutoScaler, scale 1)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss)
