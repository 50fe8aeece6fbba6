"""A job's parallel layout: dp x pp x cp x tp degrees and where each rank sits in them (pure logic).

As torchtitan's ParallelDims: the degrees are validated once (dp * pp * cp * tp
equals the job's devices) and the groups a scheme communicates in are derived
from them; the model code never sees ranks. `placement` orders the dimensions
innermost first: with the default [tp, cp, pp, dp], the tp ranks of a stage are
adjacent devices (inside one node, where links are fastest, as Megatron-LM
places them), then the context-parallel ranks that share a sequence, then the
stages of a pipeline, then the data-parallel replicas. With cp 1 the default is
the 3D [tp, pp, dp] layout rank for rank.

    layout = Layout.of(scenario.parallel, world=8)      # or Layout(dp=2, pp=2, tp=2)
    layout.coordinates(5)          # {"tp": 1, "cp": 0, "pp": 0, "dp": 1}
    layout.group("pp", 5)          # [5, 7]: rank 5's pipeline, stage order
    layout.group(("dp", "cp"), 5)  # the ranks that hold rank 5's shard of the model (Megatron's dp-cp group)
"""
from dataclasses import dataclass

from ..errors import ScenarioError

DIMENSIONS = ("tp", "cp", "pp", "dp")


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    placement: tuple[str, ...] = DIMENSIONS  # innermost first; without cp (a 3D order), cp goes next to tp

    def __post_init__(self):
        if "cp" not in self.placement:
            at = self.placement.index("tp") + 1
            object.__setattr__(self, "placement", (*self.placement[:at], "cp", *self.placement[at:]))

    @classmethod
    def of(cls, parallel, world: int) -> "Layout":
        """The layout `parallel` (the scenario's ParallelSpec) gives a job of `world` devices."""
        model_ranks = parallel.pp * parallel.cp * parallel.tp
        dp = parallel.dp if parallel.dp is not None else world // model_ranks
        if dp * model_ranks != world:
            raise ScenarioError(f"parallel.dp: dp {parallel.dp if parallel.dp is not None else '(default)'} x pp "
                                f"{parallel.pp} x cp {parallel.cp} x tp {parallel.tp} must equal the job's {world} "
                                "devices")
        return cls(dp=dp, pp=parallel.pp, tp=parallel.tp, cp=parallel.cp, placement=tuple(parallel.placement))

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def _strides(self) -> dict[str, int]:
        strides, stride = {}, 1
        for dimension in self.placement:
            strides[dimension] = stride
            stride *= getattr(self, dimension)
        return strides

    def coordinates(self, rank: int) -> dict[str, int]:
        """Rank `rank`'s index along each dimension."""
        strides = self._strides()
        return {dimension: rank // strides[dimension] % getattr(self, dimension) for dimension in self.placement}

    def rank(self, **coordinates: int) -> int:
        """The rank at these coordinates (tp, cp, pp, dp; a missing one is 0)."""
        strides = self._strides()
        return sum(coordinates.get(dimension, 0) * strides[dimension] for dimension in self.placement)

    def group(self, dimensions: str | tuple[str, ...], rank: int) -> list[int]:
        """The ranks that differ from `rank` only along `dimensions` (one, or several: the first varying
        fastest), in that order."""
        dimensions = (dimensions,) if isinstance(dimensions, str) else dimensions
        group = [self.coordinates(rank)]
        for dimension in dimensions:
            group = [{**where, dimension: index} for index in range(getattr(self, dimension)) for where in group]
        return [self.rank(**where) for where in group]

    def replicas(self) -> list[list[int]]:
        """Each data-parallel replica's ranks (its pp x cp x tp model-parallel group), in rank order."""
        return [[rank for rank in range(self.world) if self.coordinates(rank)["dp"] == index]
                for index in range(self.dp)]

    def groups(self, dimensions: str | tuple[str, ...]) -> list[list[int]]:
        """Every group along `dimensions`, each once, ordered by their first rank."""
        covered, groups = set(), []
        for rank in range(self.world):
            if rank not in covered:  # the first rank of a group not seen yet: its smallest
                group = self.group(dimensions, rank)
                covered.update(group)
                groups.append(group)
        return groups
