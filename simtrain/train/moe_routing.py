"""Routing without a router: what an MoE layer's tokens do when numerics are off (meta tensors).

With numerics off there are no activations to route, so a routing model
stands for the router (`model.moe.routing`). `draw_assignments(routing, experts,
assignments, generator)` gives how many of a micro-batch's `assignments`
(tokens x top_k) go to each expert, before any capacity drops:

- `balanced`: the even share, assignments // experts each, the remainder one
  more each to the first experts (what analytical simulators assume);
- `zipf`: each assignment drawn independently (seeded) with expert e's
  probability proportional to 1 / (e + 1)^s, s = `zipf_exponent`: expert 0 is
  the hottest. A token's top_k choices are drawn independently too, so a
  token may pick one expert twice: a model of load, not of one router;
- `histogram`: drawn the same way with the shares a numerics-on run recorded
  (report.json's `moe.expert_share`, given as `routing.histogram`).

`routing_generator(seed, step, layer, rank)` is the one seeded torch.Generator
per (step, MoE layer, rank): the same scenario draws the same routing.

    counts = draw_assignments(spec.routing, 8, 4096 * 2, routing_generator(0, step, layer, rank))
"""
import torch

from ..scenario.model import RoutingSpec


def expert_probabilities(routing: RoutingSpec, experts: int) -> torch.Tensor:
    """The probability of each expert per assignment under `routing` (zipf or histogram), float64."""
    if routing.model == "zipf":
        weights = torch.arange(1, experts + 1, dtype=torch.float64) ** -routing.zipf_exponent
    else:
        weights = torch.tensor(routing.histogram, dtype=torch.float64)
    return weights / weights.sum()


def draw_assignments(routing: RoutingSpec, experts: int, assignments: int, generator: torch.Generator) -> list[int]:
    """How many of `assignments` go to each expert (their sum is `assignments`)."""
    if routing.model == "balanced":
        return balanced_assignments(experts, assignments)
    draws = torch.multinomial(expert_probabilities(routing, experts), assignments, replacement=True,
                              generator=generator)
    return torch.bincount(draws, minlength=experts).tolist()


def balanced_assignments(experts: int, assignments: int) -> list[int]:
    """The even share: assignments // experts each, the remainder one more each to the first experts."""
    return [assignments // experts + (e < assignments % experts) for e in range(experts)]


def routing_generator(seed: int, step: int, layer: int, rank: int) -> torch.Generator:
    """The generator of rank `rank`'s draw at MoE layer `layer` of step `step`."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 10_007 + layer) * 100_003 + rank)
