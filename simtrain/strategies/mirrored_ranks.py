"""A mirrored rank as the rank it is: its own groups and pipeline peers where its representative's trace names
the representative's.

Under `parallel.representatives` a mirrored rank reports its representative's
figures (strategies/representatives.py). Its Chakra execution trace is its
representative's too, but for the names in it that differ from rank to rank:
a collective's group is the rank's own group of the same kind (rank 9's tp
group where the representative's trace has rank 8's), and a pipeline message
goes to or comes from the rank's own neighbour where the representative's
did: as many pipeline stages on (the rank of the same replica, tp and cp
ranks in that stage), or cp ranks on around the ring (ring attention's
steps). Device ranks in and out.

    counterparts = Counterparts(job)
    counterparts.group(9, (8, 10))   # rank 9's own group of the kind that (8, 10) is of rank 8's
    counterparts.peer(9, 1)          # the rank 9 sends to where its representative sends to rank 1
"""
from ..parallel import GROUP_KINDS
from .representatives import represented_by


class Counterparts:
    """A mirrored rank's own counterparts of its representative's groups and pipeline peers."""

    def __init__(self, job):
        self._layout = job.layout
        self._device_rank = [device.rank for device in job.devices]
        self._job_rank = {rank: index for index, rank in enumerate(self._device_rank)}
        self._representative = represented_by(job.layout)

    def group(self, rank: int, group: tuple[int, ...]) -> tuple[int, ...]:
        """Rank `rank`'s group of the kind that `group` is of its representative's (the whole job: itself)."""
        if len(group) == self._layout.world:
            return group
        own = self._job_rank[rank]
        of_representative = self._layout.rank_groups(self._representative[own])
        members = tuple(self._job_rank[member] for member in group)
        kind = next((kind for kind in GROUP_KINDS if getattr(of_representative, kind) == members), None)
        if kind is None:
            raise ValueError(f"ranks {group} are none of rank {self._device_rank[self._representative[own]]}'s "
                             f"groups")
        return tuple(self._device_rank[member] for member in getattr(self._layout.rank_groups(own), kind))

    def peer(self, rank: int, peer: int) -> int:
        """The rank that stands to `rank` where `peer` stands to its representative: as many stages (a pipeline's
        neighbour) and cp ranks (ring attention's) on, around each dimension."""
        layout, own = self._layout, self._job_rank[rank]
        at = layout.coordinates(own)
        theirs, representative = layout.coordinates(self._job_rank[peer]), layout.coordinates(self._representative[own])
        return self._device_rank[layout.rank_at({dimension: (at[dimension] + theirs[dimension]
                                                             - representative[dimension]) % getattr(layout, dimension)
                                                 for dimension in at})]
