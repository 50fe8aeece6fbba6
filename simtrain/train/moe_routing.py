"""Routing without a router: what an MoE layer's tokens do when numerics are off (meta tensors).

With numerics off there are no activations to route, so a routing model
stands for the router (`model.moe.routing`): how many of a micro-batch's
assignments (tokens x top_k) go to each expert, before any capacity drops,
`balanced_counts(spec, tokens)` or the counts of drawn choices
(`choice_counts(draw_choices(spec, tokens, generator), experts)`):

- `balanced`: the even share, assignments // experts each, the remainder one
  more each to the first experts (what analytical simulators assume);
- `zipf`: each assignment drawn independently (seeded) with expert e's
  probability proportional to 1 / (e + 1)^s, s = `zipf_exponent`: expert 0 is
  the hottest. A token's top_k choices are drawn independently too, so a
  token may pick one expert twice: a model of load, not of one router;
- `histogram`: drawn the same way with the shares a numerics-on run recorded
  (report.json's `moe.expert_share`, given as `routing.histogram`).

Under group-limited routing (`model.moe.groups` G, `group_limit` M, P = E / G
experts a group; train/moe_router.py) every model keeps each token's top_k
choices inside M groups, so the models give each token's choices
(`balanced_choices`, `draw_choices`: (T, top_k) expert indices), and the
counts are theirs:

- `balanced`: the token's choices spread over M groups, as far apart as they
  go (the worst case for the traffic between nodes, what DeepSeek-V3 sizes its
  dispatch for): choice j of token t goes to slot m = j mod M, slot m to group
  (t + floor(m G / M)) mod G, and each group hands its choices to its experts
  in turn (token order). Group g takes
  n_g = sum_m k_m (T // G + [(g - floor(m G / M)) mod G < T mod G]) choices,
  k_m = top_k // M + [m < top_k mod M] the choices of slot m, and its experts
  n_g // P each, the remainder one more each to its first experts: exactly
  even when G divides T and P divides n_g (DeepSeek-V3's 256 experts, top 8
  in 4 of 8 groups, on any even T: T top_k / E each, every token on 4 groups);
- `zipf`, `histogram`: each token draws its M groups without replacement with
  probability proportional to their experts' shares (fewer where fewer groups
  have any), then its top_k choices independently from those groups' experts
  by their shares.

Without groups, `draw_choices` gives the zipf and histogram draws token by
token (the same draws), and `balanced_choices` consecutive experts for each
token (t top_k + j mod E, the order of the even share): as few hosts as a
token's choices can reach.

`node_rows(choices, expert_hosts, hosts)` counts the tokens that reach each
host (at least one choice on it; with a capacity, one its expert keeps:
`group_node_rows`): what a dispatch that sends a token once to each node
moves between nodes (comm/node_dispatch.py).
`routing_generator(seed, step, layer, rank)` is the one seeded
torch.Generator per (step, MoE layer, rank): the same scenario draws the same
routing.

    counts = choice_counts(draw_choices(spec, 4096, routing_generator(0, step, layer, rank)), spec.experts)
    choices = balanced_choices(MoESpec(experts=256, top_k=8, groups=8, group_limit=4), 4096)   # (4096, 8)
"""
import functools

import torch

from ..scenario.model import MoESpec, RoutingSpec
from .moe_router import kept_assignments


def expert_probabilities(routing: RoutingSpec, experts: int) -> torch.Tensor:
    """The probability of each expert per assignment under `routing` (zipf or histogram), float64."""
    if routing.model == "zipf":
        weights = torch.arange(1, experts + 1, dtype=torch.float64) ** -routing.zipf_exponent
    else:
        weights = torch.tensor(routing.histogram, dtype=torch.float64)
    return weights / weights.sum()


def balanced_assignments(experts: int, assignments: int) -> list[int]:
    """The even share: assignments // experts each, the remainder one more each to the first experts."""
    return [assignments // experts + (e < assignments % experts) for e in range(experts)]


def balanced_counts(spec: MoESpec, tokens: int) -> list[int]:
    """Assignments per expert of `tokens` tokens under balanced routing: the even share, or under group-limited
    routing the closed form of the module's docstring."""
    if spec.groups is None:
        return balanced_assignments(spec.experts, tokens * spec.top_k)
    groups = spec.groups
    totals = [sum(share * (tokens // groups + ((g - offset) % groups < tokens % groups))
                  for share, offset in zip(_slot_choices(spec), _slot_offsets(spec))) for g in range(groups)]
    return [count for total in totals for count in balanced_assignments(spec.group_size, total)]


def balanced_choices(spec: MoESpec, tokens: int) -> torch.Tensor:
    """(T, top_k) each token's experts under balanced routing: without groups choice j of token t is expert
    (t top_k + j) mod E (the even share's order, consecutive experts); group-limited, the module's docstring's."""
    if spec.groups is None:
        return (torch.arange(tokens * spec.top_k) % spec.experts).view(tokens, spec.top_k)
    groups, size, limit = spec.groups, spec.group_size, spec.group_limit
    choice = torch.arange(spec.top_k)
    offsets = torch.tensor(_slot_offsets(spec))[choice % limit]
    group = (torch.arange(tokens).unsqueeze(1) + offsets) % groups  # (T, k)
    per_token = torch.nn.functional.one_hot(group, groups).sum(dim=1)  # (T, G): the token's choices per group
    before = per_token.cumsum(dim=0) - per_token  # the group's choices of the tokens before it
    return group * size + (before.gather(1, group) + choice // limit) % size


def draw_choices(spec: MoESpec, tokens: int, generator: torch.Generator) -> torch.Tensor:
    """(T, top_k) each token's experts drawn under zipf or histogram routing (the module's docstring), seeded by
    `generator`: without groups the T top_k draws one after another, token by token."""
    shares = expert_probabilities(spec.routing, spec.experts)
    if spec.groups is None:
        draws = torch.multinomial(shares, tokens * spec.top_k, replacement=True, generator=generator)
        return draws.view(tokens, spec.top_k)
    group_shares = shares.view(spec.groups, spec.group_size).sum(dim=1)
    limit = min(spec.group_limit, int((group_shares > 0).sum()))
    chosen_groups = torch.multinomial(group_shares.expand(tokens, -1), limit, replacement=False,
                                      generator=generator)
    open_groups = torch.zeros(tokens, spec.groups, dtype=torch.bool).scatter_(1, chosen_groups, True)
    weights = shares * open_groups.repeat_interleave(spec.group_size, dim=1)
    return torch.multinomial(weights, spec.top_k, replacement=True, generator=generator)


def choice_counts(choices: torch.Tensor, experts: int) -> list[int]:
    """Assignments per expert of the tokens whose experts are `choices` (T, top_k)."""
    return torch.bincount(choices.flatten(), minlength=experts).tolist()


def node_rows(choices: torch.Tensor, expert_hosts: tuple[int, ...], hosts: int,
              keep: torch.Tensor | None = None) -> list[int]:
    """How many of the tokens whose experts are `choices` (T, top_k) reach each of `hosts` hosts, expert e being on
    host expert_hosts[e]: the tokens with at least one choice there (`keep`, (T, top_k) booleans: one its expert
    keeps; None: all of them)."""
    on_host = torch.nn.functional.one_hot(torch.tensor(expert_hosts)[choices], hosts)  # (T, k, hosts)
    if keep is not None:
        on_host = on_host * keep.unsqueeze(-1)
    return on_host.amax(dim=1).sum(dim=0).tolist()


def group_node_rows(choices: list[torch.Tensor], experts: int, expert_hosts: tuple[int, ...], hosts: int,
                    capacity: int | None) -> list[list[int]]:
    """node_rows of each ep rank's `choices` (ranks in order) after the drops: each expert keeps the group's first
    `capacity` assignments, ranks in order (None: dropless, all of them)."""
    rows, ahead = [], torch.zeros(experts, dtype=torch.long)
    for chosen in choices:
        keep = None if capacity is None else kept_assignments(chosen, experts, capacity, ahead)
        rows.append(node_rows(chosen, expert_hosts, hosts, keep))
        ahead = ahead + torch.bincount(chosen.flatten(), minlength=experts)
    return rows


@functools.lru_cache(maxsize=64)
def balanced_node_rows(spec: MoESpec, tokens: int, expert_hosts: tuple[int, ...], hosts: int, ep: int,
                       capacity: int | None) -> tuple[tuple[int, ...], ...]:
    """group_node_rows of `ep` ranks whose every one routes `tokens` tokens by balanced (group-limited) routing
    (the same for every step)."""
    rows = group_node_rows([balanced_choices(spec, tokens)] * ep, spec.experts, expert_hosts, hosts, capacity)
    return tuple(map(tuple, rows))


def routing_generator(seed: int, step: int, layer: int, rank: int) -> torch.Generator:
    """The generator of rank `rank`'s draw at MoE layer `layer` of step `step`."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 10_007 + layer) * 100_003 + rank)


def _slot_choices(spec: MoESpec) -> list[int]:
    """k_m: the choices of slot m of a token's group_limit slots."""
    limit = spec.group_limit
    return [spec.top_k // limit + (m < spec.top_k % limit) for m in range(limit)]


def _slot_offsets(spec: MoESpec) -> list[int]:
    """floor(m G / M): how far slot m's group is from the token's first."""
    return [m * spec.groups // spec.group_limit for m in range(spec.group_limit)]
