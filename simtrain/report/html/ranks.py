"""The rows of report.html's per-rank charts: a rank, or ranks whose figures are the same, never 100,000 rows.

report.json has an entry per device. Under `parallel.representatives` a
mirrored rank's entry is its representative's figures under its own rank
(report/build.py), so ranks with equal figures (the same device, breakdown and
memory) are one row: the representative, the lowest rank, and the ranks it
stands for. Data-parallel replicas that ran the same step fold the same way.
Should more than `MAX_ROWS` rows remain, the job's ranks are cut into
`MAX_ROWS` runs of consecutive ranks (as long as each other, to a rank), each drawn as its ranks' mean (its label
says so).

    rows = rank_rows(report)       # [RankRow(ranks=[0], breakdown_s={...}, ...), ...]
    rows[1].label                  # 'rank 0', 'rank 1 +15 equal' or 'ranks 0-127 (mean)'
    rows[1].ranks_text             # 'ranks 1, 3, 9-11, ... (16)'
"""
from dataclasses import dataclass

from .inputs import job_devices
from .svg import rank_ranges

MAX_ROWS = 48


@dataclass(frozen=True)
class RankRow:
    ranks: list[int]
    breakdown_s: dict[str, float]  # seconds each kind, per step (over the run when no step ended)
    memory_by_category: dict[str, float]  # bytes at the peak, by category
    peak_memory_bytes: float
    capacity_bytes: float
    device: str
    mean: bool  # a mean of different ranks' figures, not one rank's

    @property
    def label(self) -> str:
        """The row's name, short: 'rank 0', 'rank 0 +15 equal' (its first rank stands for all), or
        'ranks 0-127 (mean)'."""
        if len(self.ranks) == 1:
            return f"rank {self.ranks[0]}"
        if self.mean:
            return f"ranks {self.ranks[0]}-{self.ranks[-1]} (mean)"
        return f"rank {self.ranks[0]} +{len(self.ranks) - 1} equal"

    @property
    def ranks_text(self) -> str:
        """Every rank of the row, as ranges: the row's tooltip."""
        return f"ranks {rank_ranges(self.ranks)} ({len(self.ranks)})" if len(self.ranks) > 1 else self.label

    @property
    def step_total_s(self) -> float:
        return sum(self.breakdown_s.values())


def per_step_divisor(report: dict) -> int:
    """report.json's devices hold totals over the run: a step's figures are these over `steps` (1: none ended)."""
    return report["steps"] if report["steps"] else 1


def rank_rows(report: dict) -> list[RankRow]:
    """The job's devices, ranks with equal figures folded into one row; at most MAX_ROWS rows."""
    devices = sorted(job_devices(report), key=lambda device: device["rank"])
    divisor = per_step_divisor(report)
    groups: dict[tuple, list[dict]] = {}
    for device in devices:
        key = (device["device"], tuple(device["breakdown_s"].items()),
               tuple(device["peak_memory_bytes_by_category"].items()), device["capacity_bytes"])
        groups.setdefault(key, []).append(device)
    if len(groups) <= MAX_ROWS:
        return [_row(members, divisor, mean=False) for members in groups.values()]
    bounds = [len(devices) * row // MAX_ROWS for row in range(MAX_ROWS + 1)]  # runs differ by one rank at most
    return [_row(devices[start:end], divisor, mean=True) for start, end in zip(bounds, bounds[1:])]


def _row(members: list[dict], divisor: int, mean: bool) -> RankRow:
    """One row: the members' figures (equal figures: the first's, exactly; else their mean)."""
    if not mean:
        first = members[0]
        return RankRow(ranks=[device["rank"] for device in members],
                       breakdown_s={kind: (seconds or 0.0) / divisor for kind, seconds in first["breakdown_s"].items()},
                       memory_by_category=dict(first["peak_memory_bytes_by_category"]),
                       peak_memory_bytes=first["peak_memory_bytes"], capacity_bytes=first["capacity_bytes"],
                       device=first["device"], mean=False)
    count = len(members)
    kinds = list(dict.fromkeys(kind for device in members for kind in device["breakdown_s"]))
    categories = list(dict.fromkeys(name for device in members for name in device["peak_memory_bytes_by_category"]))
    return RankRow(
        ranks=[device["rank"] for device in members],
        breakdown_s={kind: sum(device["breakdown_s"].get(kind) or 0.0 for device in members) / count / divisor
                     for kind in kinds},
        memory_by_category={name: sum(device["peak_memory_bytes_by_category"].get(name, 0) for device in members)
                            / count for name in categories},
        peak_memory_bytes=sum(device["peak_memory_bytes"] for device in members) / count,
        capacity_bytes=min(device["capacity_bytes"] for device in members),
        device=" / ".join(dict.fromkeys(device["device"] for device in members)),
        mean=mean)
