"""A mixture-of-experts layer's router pieces: top-k routing, capacity drops and the load-balancing loss.

Shared by the layer on one device (train/moe.py) and by an expert-parallel
layer's pieces between its exchanges (train/moe_exchange.py): the formulas
are train/moe.py's docstring's.

    probs, chosen, weights = route_tokens(layer, tokens)       # (T, E), (T, k), (T, k)
    keep = kept_assignments(chosen, experts, capacity)          # (T, k) booleans
"""
import torch
import torch.nn.functional as F


def route_tokens(moe, tokens: torch.Tensor):
    """The router on `tokens` (T, hidden): (probabilities, top-k choices, their renormalized weights); the weights
    carry the rank's balancing loss's gradient (times `moe.aux_loss_scale`), as Megatron-Core attaches it."""
    probs = moe.router(tokens).float().softmax(dim=-1)
    top_probs, chosen = probs.topk(moe.spec.top_k, dim=-1)
    weights = top_probs / top_probs.sum(dim=-1, keepdim=True)
    if moe.spec.aux_loss_coeff > 0 and not tokens.is_meta:
        weights = AuxLossGradient.apply(weights, balancing_loss(probs, chosen, moe.spec.experts)
                                        * (moe.spec.aux_loss_coeff * moe.aux_loss_scale))
    return probs, chosen, weights


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
