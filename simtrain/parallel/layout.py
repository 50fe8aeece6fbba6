"""A job's parallel layout: every degree validated once, and the groups its ranks communicate in, by name (pure logic).

As torchtitan's ParallelDims (`torchtitan/distributed/parallel_dims.py`), the
degrees are checked once against the job's devices, and every group a scheme
communicates in is derived from them here, as Megatron-Core's RankGenerator
derives its groups from one order string and hands them out as a typed
ProcessGroupCollection. Nothing else cuts ranks into groups; the model code
never sees ranks.

The degrees:

- **tp, cp, pp, dp** span the mesh: dp x pp x cp x tp ranks equal the job's
  devices. `placement` orders them innermost first: with the default
  [tp, cp, pp, dp] a stage's tp ranks are adjacent devices (inside one node,
  where links are fastest, as Megatron-LM places them), then the cp ranks that
  share a sequence, then the stages of a pipeline, then the data-parallel
  replicas. An order without cp (3D) puts cp next to tp.
- **dp_shard, dp_replicate** cut each dp-cp group (Megatron-Core's
  data-parallel group with context parallelism; its members in dp order, then
  cp) into dp_replicate shard groups of dp_shard adjacent members
  (`parallel.sharding.degree`; without sharding, dp_shard 1): the ranks that
  together hold one copy of the training state, and those that hold the same
  shard in the other copies (HSDP). dp_shard x dp_replicate = dp x cp, as
  Megatron-Core carves its distributed optimizer's instances out of the dp-cp
  group; with cp 1 that is torchtitan's dp_replicate x dp_shard = dp.
- **ep** borrows from dp x cp (`parallel.ep`): the ranks of a stage and tp
  index that differ only in cp and dp, cp varying fastest, are cut into
  dp x cp / ep ep groups of ep adjacent members, and the members at the same
  place in each form the experts' data-parallel group (Megatron-Core's expert
  data-parallel group, torchtitan's dp_shard_mod_ep). That is how
  Megatron-Core's expert RankGenerator folds cp into its expert mesh (order
  tp-cp-ep-dp-pp with cp 1: ep takes the ranks cp and then dp held), and how
  torchtitan's ep borrows dp_shard x cp, cp innermost; with cp 1 these are
  blocks of the dp group. ep must divide dp x cp.
- **etp**, the experts' tensor-parallel degree, is 1 (an expert is whole on
  its rank) or tp, as in torchtitan.

Each kind of group is either a span of mesh dimensions (the ranks that differ
only along them, the first varying fastest) or a cut of another kind into
blocks of adjacent members or every n-th one:

    layout = Layout.of(scenario.parallel, world=16)   # or Layout(dp=2, pp=2, tp=2)
    layout.coordinates(5)          # {"tp": 1, "cp": 0, "pp": 0, "dp": 1}
    groups = layout.rank_groups(5)
    groups.pp                      # (5, 7): rank 5's pipeline, stage order
    groups.dp_cp                   # the ranks that hold rank 5's share of the model (Megatron's dp-cp group)
    layout.groups("dp_shard")      # every shard group, each once, ordered by its smallest rank
"""
from dataclasses import dataclass, fields
from functools import cached_property

from ..errors import ScenarioError

DIMENSIONS = ("tp", "cp", "pp", "dp")


@dataclass(frozen=True)
class RankGroups:
    """The groups one rank belongs to, one of each kind: each its member ranks in group order (the rank's place in a
    group is `group.index(rank)`). Names follow torchtitan's meshes where it has one."""

    tp: tuple[int, ...]  # a stage's tensor-parallel ranks
    cp: tuple[int, ...]  # the context-parallel ranks that share a sequence
    pp: tuple[int, ...]  # a pipeline, stage order
    dp: tuple[int, ...]  # the data-parallel replicas of one share of the model (torchtitan's dp: the batch)
    dp_cp: tuple[int, ...]  # dp, then cp: the ranks that average one share's gradient (torchtitan's dp_cp)
    dp_shard: tuple[int, ...]  # the ranks holding one copy of the state, sharded (torchtitan's dp_shard_cp)
    dp_replicate: tuple[int, ...]  # the ranks holding the same shard in each copy (HSDP's replicate group)
    ep: tuple[int, ...]  # the ranks whose experts make one whole MoE layer (token all-to-all), of dp x cp
    expert_dp: tuple[int, ...]  # the ranks that hold the same experts (torchtitan's dp_shard_mod_ep)
    expert_tp: tuple[int, ...]  # the ranks an expert is split across (etp)
    model: tuple[int, ...]  # one data-parallel replica: its pp x cp x tp ranks, rank order (Megatron's mp)


GROUP_KINDS = tuple(field.name for field in fields(RankGroups))
# kind -> the dimensions it spans, the first varying fastest; "cp_dp" (no kind of its own): the ranks the experts
# of a stage's MoE layers are spread over, cp first as Megatron-Core's expert mesh orders them
_SPANS = {"tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "dp": ("dp",), "dp_cp": ("dp", "cp"), "cp_dp": ("cp", "dp")}
# kind -> (the kind it is cut from, the degree that sizes the cut, "block": adjacent members; "stride": every n-th)
_CUTS = {"dp_shard": ("dp_cp", "dp_shard", "block"), "dp_replicate": ("dp_cp", "dp_shard", "stride"),
         "ep": ("cp_dp", "ep", "block"), "expert_dp": ("cp_dp", "ep", "stride"), "expert_tp": ("tp", "etp", "block")}

_FIELDS = {"dp": "parallel.dp", "pp": "parallel.pp", "tp": "parallel.tp", "cp": "parallel.cp",
           "dp_shard": "parallel.sharding.degree", "ep": "parallel.ep", "etp": "parallel.ep"}  # degree -> its key


@dataclass(frozen=True)
class Layout:
    """Every parallel degree of a job, validated, and the groups they form."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    dp_shard: int = 1  # members of a dp-cp group holding one copy of the state; dp_replicate copies
    ep: int = 1
    etp: int = 1
    placement: tuple[str, ...] = DIMENSIONS  # innermost first; without cp (a 3D order), cp goes next to tp

    def __post_init__(self):
        if "cp" not in self.placement:
            at = self.placement.index("tp") + 1
            object.__setattr__(self, "placement", (*self.placement[:at], "cp", *self.placement[at:]))
        for name, field in _FIELDS.items():
            if getattr(self, name) < 1:
                raise ScenarioError(f"{field}: the {name} degree must be at least 1, got {getattr(self, name)}")
        if self.dp * self.cp % self.dp_shard:
            raise ScenarioError(f"parallel.sharding.degree: {self.dp_shard} does not divide the {self.dp * self.cp} "
                                "data-parallel ranks" + (f" (dp {self.dp} x cp {self.cp})" if self.cp > 1 else ""))
        if self.dp * self.cp % self.ep:
            raise ScenarioError(f"parallel.ep: {self.ep} does not divide the {self.dp * self.cp} data-parallel ranks"
                                + (f" (dp {self.dp} x cp {self.cp})" if self.cp > 1 else ""))
        if self.etp not in (1, self.tp):
            raise ScenarioError(f"parallel.ep: experts split {self.etp} ways; expert tensor parallelism is 1 (whole "
                                f"experts) or tp {self.tp}")

    @classmethod
    def of(cls, parallel, world: int) -> "Layout":
        """The layout `parallel` (the scenario's ParallelSpec) gives a job of `world` devices: dp given or the
        devices left over by pp x cp x tp; the shard group `sharding.degree` members of the dp-cp group (all of
        it by default) when `sharding.stage` is above 0; ep as given; the experts whole (etp 1)."""
        model_ranks = parallel.pp * parallel.cp * parallel.tp
        dp = parallel.dp if parallel.dp is not None else world // model_ranks
        if dp * model_ranks != world:
            raise ScenarioError(f"parallel.dp: dp {parallel.dp if parallel.dp is not None else '(default)'} x pp "
                                f"{parallel.pp} x cp {parallel.cp} x tp {parallel.tp} must equal the job's {world} "
                                "devices")
        sharding = parallel.sharding
        dp_shard = (sharding.degree or dp * parallel.cp) if sharding.stage > 0 else 1
        return cls(dp=dp, pp=parallel.pp, tp=parallel.tp, cp=parallel.cp, dp_shard=dp_shard, ep=parallel.ep,
                   placement=tuple(parallel.placement))

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def dp_replicate(self) -> int:
        """Copies of the training state a dp-cp group holds (above 1: HSDP; dp x cp without sharding)."""
        return self.dp * self.cp // self.dp_shard

    def coordinates(self, rank: int) -> dict[str, int]:
        """Rank `rank`'s index along each mesh dimension."""
        return {dimension: rank // self._strides[dimension] % getattr(self, dimension) for dimension in self.placement}

    def rank_at(self, coordinates: dict[str, int]) -> int:
        """The rank at mesh `coordinates` (`coordinates`' inverse)."""
        return sum(coordinates[dimension] * stride for dimension, stride in self._strides.items())

    def rank_groups(self, rank: int) -> RankGroups:
        """Every group rank `rank` belongs to."""
        return RankGroups(**{kind: self._every(kind)[0][rank] for kind in GROUP_KINDS})

    def groups(self, kind: str) -> list[tuple[int, ...]]:
        """Every group of `kind` (one of GROUP_KINDS), each once, ordered by its smallest rank."""
        if kind not in GROUP_KINDS:
            raise ValueError(f"no group kind {kind!r}; the kinds are {', '.join(GROUP_KINDS)}")
        return list(self._every(kind)[1])

    def _every(self, kind: str) -> tuple[dict[int, tuple[int, ...]], list[tuple[int, ...]]]:
        """(rank -> its group of `kind`, every such group ordered by its smallest rank), each group derived once."""
        if kind not in self._derived:
            if kind in _CUTS:  # each group of the kind it is cut from, cut once
                parent, degree, cut = _CUTS[kind]
                size = getattr(self, degree)
                groups = sorted((piece for whole in self._every(parent)[1] for piece in _cut(whole, size, cut)),
                                key=min)
                of_rank = {member: group for group in groups for member in group}
            else:
                of_rank, groups = {}, []
                for rank in range(self.world):
                    if rank not in of_rank:  # the first rank of a group not seen yet: its smallest
                        group = self._group(kind, rank)
                        of_rank.update((member, group) for member in group)
                        groups.append(group)
            self._derived[kind] = (of_rank, groups)
        return self._derived[kind]

    @cached_property
    def _derived(self) -> dict[str, tuple[dict[int, tuple[int, ...]], list[tuple[int, ...]]]]:
        return {}

    @cached_property
    def _strides(self) -> dict[str, int]:
        strides, stride = {}, 1
        for dimension in self.placement:
            strides[dimension] = stride
            stride *= getattr(self, dimension)
        return strides

    def _group(self, kind: str, rank: int) -> tuple[int, ...]:
        """Rank `rank`'s group of a kind that spans dimensions (a cut kind's come from `_cut`)."""
        if kind == "model":  # every dimension but dp, in placement order: rank order
            return self._span(tuple(d for d in self.placement if d != "dp"), rank)
        return self._span(_SPANS[kind], rank)

    def _span(self, dimensions: tuple[str, ...], rank: int) -> tuple[int, ...]:
        """The ranks that differ from `rank` only along `dimensions`, the first varying fastest."""
        strides = self._strides
        base = rank - sum(self.coordinates(rank)[d] * strides[d] for d in dimensions)
        members = [base]
        for dimension in dimensions:
            members = [member + index * strides[dimension] for index in range(getattr(self, dimension))
                       for member in members]
        return tuple(members)


def _cut(whole: tuple[int, ...], size: int, cut: str) -> list[tuple[int, ...]]:
    """A group cut by `size`: into blocks of `size` adjacent members, or into `size` groups of every size-th."""
    if cut == "block":
        return [whole[first:first + size] for first in range(0, len(whole), size)]
    return [whole[offset::size] for offset in range(size)]
