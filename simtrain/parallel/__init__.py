"""How a job's devices cooperate: its parallel layout and the groups it communicates in (no torch).

`layout.py` holds every degree (dp, dp_shard and dp_replicate, cp, tp, pp, ep,
expert tp), validated once against the job's devices, and derives every group
from them; `communicators.py` is the typed record of the communicators a scheme
builds over those groups. Schemes import this package; it imports neither
schemes nor torch, so `simtrain validate` checks a layout without torch.

    from simtrain.parallel import Layout
    layout = Layout.of(scenario.parallel, world=8)
    layout.rank_groups(5).tp       # (4, 5)
    layout.groups("dp_cp")         # every dp-cp group
"""
from .communicators import GroupCommunicators, Membership, memberships
from .layout import GROUP_KINDS, Layout, RankGroups

__all__ = ["GROUP_KINDS", "GroupCommunicators", "Layout", "Membership", "RankGroups", "memberships"]
