"""The parallel layout (parallel/layout.py) on its own: degrees validated once, groups by name (pure logic, no torch).

- Bad degrees: each is one line naming the scenario key at fault (parallel.dp, parallel.sharding.degree,
  parallel.ep), raised by Layout.of against the job's devices.
- The scenario's numbers become degrees: sharding's degree is dp_shard (all of the dp-cp group by default, 1
  without sharding), ep as given, the experts whole (etp 1).
- Groups against hand-written rank lists: HSDP's shard and replicate groups (with and without cp), ep groups
  inside dp under pp x tp, and inside dp x cp with cp as Megatron-Core's expert RankGenerator folds it
  (parallel_state.py: order tp-cp-ep-dp-pp with cp 1, ep taking the ranks cp and then dp held), placement
  orders.
- Groups against the hand slicing the schemes did at a6eb7f2 (the reference: `dp_cp[first:first + degree]`,
  `dp[position::ep]` and the rest; ep's over cp then dp, which is dp where cp is 1, the only layouts that ran ep
  then), on a grid of layouts: the simulated figures cannot move.
- Every rank is in exactly one group of each kind, and its `rank_groups` names that group.
- The kinds are torchtitan's mesh names (ParallelDims.build_mesh), with their sizes.
"""
import itertools
import re

import pytest

from simtrain.errors import ScenarioError
from simtrain.parallel import GROUP_KINDS, Layout
from simtrain.scenario import ParallelSpec


def layout_of(world: int, **parallel) -> Layout:
    return Layout.of(ParallelSpec.model_validate(parallel), world)


# ---------------------------------------------------------------- degrees

@pytest.mark.parametrize("world, parallel, message", [
    (8, {"pp": 3}, "parallel.dp: dp (default) x pp 3 x cp 1 x tp 1 must equal the job's 8 devices"),
    (8, {"dp": 2, "tp": 2}, "parallel.dp: dp 2 x pp 1 x cp 1 x tp 2 must equal the job's 8 devices"),
    (4, {"sharding": {"stage": 1, "degree": 3}}, "parallel.sharding.degree: 3 does not divide the 4 data-parallel "
                                                 "ranks"),
    (8, {"tp": 2, "sharding": {"stage": 3, "degree": 8}}, "parallel.sharding.degree: 8 does not divide the 4 "
                                                          "data-parallel ranks"),
    (8, {"cp": 2, "tp": 2, "sharding": {"stage": 3, "degree": 3}}, "parallel.sharding.degree: 3 does not divide "
                                                                   "the 4 data-parallel ranks (dp 2 x cp 2)"),
    (6, {"ep": 4}, "parallel.ep: 4 does not divide the 6 data-parallel ranks"),
    (8, {"pp": 2, "tp": 2, "ep": 4}, "parallel.ep: 4 does not divide the 2 data-parallel ranks"),
    (8, {"cp": 2, "tp": 2, "ep": 3}, "parallel.ep: 3 does not divide the 4 data-parallel ranks (dp 2 x cp 2)"),
])
def test_each_bad_degree_is_one_line_naming_its_key(world, parallel, message):
    with pytest.raises(ScenarioError, match=re.escape(message)) as raised:
        layout_of(world, **parallel)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("degrees, message", [
    ({"dp": 2, "tp": 2, "ep": 2, "etp": 3}, "parallel.ep: experts split 3 ways; expert tensor parallelism is 1"),
    ({"dp": 0}, "parallel.dp: the dp degree must be at least 1, got 0"),
    ({"dp": 4, "dp_shard": 0}, "parallel.sharding.degree: the dp_shard degree must be at least 1"),
])
def test_degrees_built_directly_are_checked_too(degrees, message):
    with pytest.raises(ScenarioError, match=message):
        Layout(**degrees)


def test_the_scenario_numbers_become_the_degrees():
    plain = layout_of(8, tp=2)
    assert (plain.dp, plain.dp_shard, plain.dp_replicate, plain.ep, plain.etp) == (4, 1, 4, 1, 1)
    fsdp = layout_of(8, tp=2, sharding={"stage": 3})  # the whole dp group shards one copy
    assert (fsdp.dp_shard, fsdp.dp_replicate) == (4, 1)
    hsdp = layout_of(16, cp=2, sharding={"stage": 2, "degree": 4})
    assert (hsdp.dp, hsdp.cp, hsdp.dp_shard, hsdp.dp_replicate) == (8, 2, 4, 4)
    experts = layout_of(16, pp=2, tp=2, ep=2)
    assert (experts.dp, experts.ep, experts.etp) == (4, 2, 1)
    with pytest.raises(ValueError, match="parallel.sharding.degree"):  # no sharding: a degree would be unused
        layout_of(8, sharding={"stage": 0, "degree": 2})


# ---------------------------------------------------------------- groups, by hand

def test_hsdp_cuts_the_dp_group_into_adjacent_shards_and_strided_replicas():
    layout = layout_of(8, sharding={"stage": 3, "degree": 2})
    assert layout.groups("dp_shard") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layout.groups("dp_replicate") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    under_tp = layout_of(8, tp=2, sharding={"stage": 1, "degree": 2})  # dp group of rank 0: 0, 2, 4, 6
    assert under_tp.groups("dp_shard") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert under_tp.groups("dp_replicate") == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_hsdp_with_cp_carves_the_dp_cp_group_in_dp_order_as_megatron_core():
    # rank = cp + 2 dp; the dp-cp group of rank 0 is dp 0, 1 at cp 0, then at cp 1: (0, 2, 1, 3)
    layout = layout_of(4, cp=2, sharding={"stage": 1, "degree": 2})
    assert layout.rank_groups(0).dp_cp == (0, 2, 1, 3)
    assert layout.groups("dp_shard") == [(0, 2), (1, 3)]
    assert layout.groups("dp_replicate") == [(0, 1), (2, 3)]
    whole = layout_of(4, cp=2, sharding={"stage": 3})  # by default one copy over every dp and cp rank
    assert whole.groups("dp_shard") == [(0, 2, 1, 3)] and whole.dp_replicate == 1


def test_ep_borrows_adjacent_dp_ranks_at_each_stage_and_tp_index():
    # rank = tp + 2 pp + 4 dp; rank 0's dp group is 0, 4, 8, 12
    layout = layout_of(16, pp=2, tp=2, ep=2)
    assert layout.groups("ep") == [(0, 4), (1, 5), (2, 6), (3, 7), (8, 12), (9, 13), (10, 14), (11, 15)]
    assert layout.groups("expert_dp") == [(0, 8), (1, 9), (2, 10), (3, 11), (4, 12), (5, 13), (6, 14), (7, 15)]
    assert layout.groups("expert_tp") == [(rank,) for rank in range(16)]  # experts whole: etp 1
    data_parallel = layout_of(8, ep=4)
    assert data_parallel.groups("ep") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert data_parallel.groups("expert_dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    split_experts = Layout(dp=2, tp=2, ep=2, etp=2)
    assert split_experts.groups("expert_tp") == split_experts.groups("tp") == [(0, 1), (2, 3)]


def test_ep_borrows_cp_ranks_first_then_dp_as_megatron_cores_expert_mesh():
    # rank = tp + 2 cp + 4 dp. Megatron-Core's expert RankGenerator (tp-cp-ep-dp-pp, cp 1) gives ep the ranks that
    # cp and then dp held in the dense mesh: ep 2 is the cp group, ep 4 spans two replicas' cp ranks
    cp_only = layout_of(8, cp=2, tp=2, ep=2)
    assert cp_only.groups("ep") == cp_only.groups("cp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert cp_only.groups("expert_dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    across = layout_of(8, cp=2, tp=2, ep=4)
    assert across.groups("ep") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert across.groups("expert_dp") == [(rank,) for rank in range(8)]
    staged = layout_of(16, cp=2, pp=2, ep=2)  # rank = cp + 2 pp + 4 dp: within a stage
    assert staged.groups("ep") == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (12, 13), (14, 15)]
    assert staged.rank_groups(0).expert_dp == (0, 4, 8, 12)


@pytest.mark.parametrize("placement, groups", [
    (("tp", "cp", "pp", "dp"), {"tp": (0, 1), "pp": (0, 2), "dp": (0, 4), "model": (0, 1, 2, 3)}),
    (("dp", "tp", "pp"), {"tp": (0, 2), "pp": (0, 4), "dp": (0, 1), "model": (0, 2, 4, 6)}),
    (("pp", "dp", "tp"), {"tp": (0, 4), "pp": (0, 1), "dp": (0, 2), "model": (0, 1, 4, 5)}),
])
def test_placement_orders_the_dimensions_innermost_first(placement, groups):
    layout = layout_of(8, pp=2, tp=2, placement=list(placement))
    assert {kind: getattr(layout.rank_groups(0), kind) for kind in groups} == groups
    assert layout.coordinates(5) == {dimension: 5 // stride % 2 for dimension, stride
                                     in zip([d for d in layout.placement if d != "cp"], (1, 2, 4))} | {"cp": 0}


# ---------------------------------------------------------------- groups, against the old hand slicing

LAYOUTS = [Layout(dp=dp, pp=pp, cp=cp, tp=tp, dp_shard=shard, ep=ep, placement=placement)
           for dp, pp, cp, tp in [(4, 1, 1, 1), (4, 2, 1, 2), (4, 1, 2, 2), (6, 2, 2, 1), (8, 1, 1, 2)]
           for shard in sorted({1, 2, dp, dp * cp}) if dp * cp % shard == 0
           for ep in (1, 2, 4) if dp * cp % ep == 0
           for placement in [("tp", "cp", "pp", "dp"), ("dp", "tp", "cp", "pp"), ("cp", "dp", "tp", "pp")]]


def reference_span(layout: Layout, rank: int, dimensions: tuple[str, ...]) -> list[int]:
    """The ranks that differ from `rank` only along `dimensions` (the first fastest), from coordinates alone."""
    where = layout.coordinates(rank)
    points = [where]
    for dimension in dimensions:
        points = [{**point, dimension: index} for index in range(getattr(layout, dimension)) for point in points]
    return [next(other for other in range(layout.world) if layout.coordinates(other) == point) for point in points]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_groups_are_the_ranks_the_schemes_sliced_by_hand(layout):
    for rank in range(layout.world):
        groups, dp_cp, dp = layout.rank_groups(rank), reference_span(layout, rank, ("dp", "cp")), \
            reference_span(layout, rank, ("dp",))
        experts = reference_span(layout, rank, ("cp", "dp"))  # dp where cp is 1
        degree, position = layout.dp_shard, dp_cp.index(rank)
        first = position // degree * degree
        assert list(groups.dp_cp) == dp_cp
        assert list(groups.dp_shard) == dp_cp[first:first + degree]  # model_parallel.py's regroup, HSDP
        assert list(groups.dp_replicate) == dp_cp[position % degree::degree]
        assert list(groups.ep) == experts[experts.index(rank) // layout.ep * layout.ep:][:layout.ep]
        assert list(groups.expert_dp) == experts[experts.index(rank) % layout.ep::layout.ep]
        assert list(groups.model) == [other for other in range(layout.world)  # the old replicas(): rank order
                                      if layout.coordinates(other)["dp"] == layout.coordinates(rank)["dp"]]
        for dimension in ("tp", "cp", "pp", "dp"):
            assert list(getattr(groups, dimension)) == reference_span(layout, rank, (dimension,))


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_every_rank_is_in_exactly_one_group_of_each_kind(layout):
    for kind in GROUP_KINDS:
        groups = layout.groups(kind)
        assert sorted(itertools.chain(*groups)) == list(range(layout.world)), kind
        assert groups == sorted(groups, key=min)
        for group in groups:
            assert all(getattr(layout.rank_groups(rank), kind) == group for rank in group), kind


# ---------------------------------------------------------------- torchtitan's names

def test_the_kinds_are_torchtitans_mesh_names_with_their_sizes():
    # torchtitan/distributed/parallel_dims.py build_mesh: pp, dp_replicate, dp_shard(_cp), dp_cp, dp, cp, tp, ep;
    # dp_shard_mod_ep and Megatron-Core's expert data-parallel group are expert_dp here
    assert {"pp", "dp_replicate", "dp_shard", "dp_cp", "dp", "cp", "tp", "ep"} <= set(GROUP_KINDS)
    layout = Layout(dp=8, pp=2, tp=2, dp_shard=4, ep=2)  # cp 1: dp_replicate x dp_shard = dp, as torchtitan's
    groups = layout.rank_groups(0)
    sizes = {kind: len(getattr(groups, kind)) for kind in GROUP_KINDS}
    assert sizes == {"tp": 2, "cp": 1, "pp": 2, "dp": 8, "dp_cp": 8, "dp_shard": 4, "dp_replicate": 2, "ep": 2,
                     "expert_dp": 4, "expert_tp": 1, "model": 4}
    assert layout.dp_replicate * layout.dp_shard * layout.cp * layout.tp * layout.pp == layout.world == 32
    with pytest.raises(ValueError, match="no group kind 'dp_shard_cp'"):
        layout.groups("dp_shard_cp")
