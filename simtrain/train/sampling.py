"""Which samples each batch holds: uniform, prioritized (PER) or Metropolis-Hastings.

`data.sampling` picks one of three loaders; all are `ShardLoader`s (same
`next_batch()` / `batch_loss(logits, y)` contract, used by `Replica`):

- `uniform`: `ShardLoader` itself, the DistributedSampler stream; the loss is
  the plain mean cross entropy. It keeps no priorities and reports no
  `sampling` section (its effective sample size is B and its top-decile share
  0.1 by construction), so the default path pays for no bookkeeping.
- `prioritized`: each device keeps priorities p_i = last loss + eps for its own
  shard (the samples DistributedSampler gives its rank in epoch 0); samples
  never seen carry the largest priority ever assigned (1.0 before any), as in
  PER (Schaul et al. 2016, "Prioritized Experience Replay", Alg. 1). A batch is
  B draws with replacement from P(i) = p_i^alpha / sum_k p_k^alpha. A loss that
  diverged (inf or nan) makes P uniform: float64 cannot weigh it.
- `mh`: one Metropolis-Hastings chain per batch slot over the shard. Each
  batch, every slot makes `mh.steps` proposals j drawn uniformly from the
  shard and accepts with probability min(1, (p_j / p_cur)^alpha); the slots'
  states form the batch. The chains' target is the same P(i).

The loss of a prioritized or mh batch is (1/B) sum_i w_i l_i with
w_i = (N P(i))^-beta / max_k (N P(k))^-beta (PER's weights, normalized so they
only scale updates down; for mh, P is the chain's target), beta annealed
linearly from `beta0` at step 0 to `beta_end` (1 by default: PER) at
`beta_steps`; beta = 0 throughout (beta0 = beta_end = 0) turns the correction
off. With beta = 1 its gradient is an unbiased estimate of the shard's mean
gradient times the constant 1 / max_k w_k. The batch's real per-sample losses
then refresh its priorities, once: a forward run again for its backward
(train.checkpointing full, layer by layer) computes the same loss and leaves
them. Randomness comes from a torch.Generator per (seed, rank).

Host cost model (charged per batch by the scheme as a `sampling` span): a
priority store is a sum tree and a min tree over the N shard priorities
(depth d = ceil(log2 N)); every tree node touched is one dependent host memory
access of `HOST_ACCESS_S`. Prioritized: B draws descend the sum tree (B d) and
B refreshes climb both trees (2 B d). MH: B * steps proposals read one priority
each (B * steps) and B refreshes climb both trees (2 B d). Uniform: none.

    loader = build_loader(scenario, train_set, world, rank)
    x, y = loader.next_batch(); loss = loader.batch_loss(model(x), y); loss.backward()
"""
import math

import numpy as np
import torch
from pydantic import Field
from torch.utils.data import Dataset

from ..loss import cross_entropy
from ..report.sections import ReportSection, register_section
from ..scenario import Scenario
from .data import ShardLoader

# One dependent access to a tree node in host memory: the L3 hit latency of a
# server CPU, about 40 cycles at 4 GHz (Intel 64 and IA-32 Architectures
# Optimization Reference Manual, Skylake-SP cache latencies), i.e. ~10 ns.
# Priority trees of shards up to ~10^5 samples (2 trees x 8 B x 2N) fit in L3.
HOST_ACCESS_S = 10e-9
TOP_FRACTION = 0.1  # top_decile_share: the 10% of samples with the highest priority
_STREAM = 0x5A4D  # separates the sampler's random stream from other per-rank streams


def sampler_generator(seed: int, rank: int) -> torch.Generator:
    """The rank's sampling generator, derived from the scenario seed (never the global RNG)."""
    state = np.random.SeedSequence([seed, rank, _STREAM]).generate_state(1)[0]
    return torch.Generator().manual_seed(int(state))


class PriorityTable:
    """Priorities p_i = last loss + eps of a fixed list of dataset indices (numpy, float64).

    Position k of the table is dataset index `indices[k]`. Unseen positions
    carry `max_priority`: the largest priority ever assigned (1.0 at first).
    """

    def __init__(self, indices: torch.Tensor, eps: float):
        self.indices = indices
        self.eps = eps
        self._position = np.full(int(indices.max()) + 1, -1, dtype=np.int64)
        self._position[indices.numpy()] = np.arange(len(indices))
        self.last_loss = np.zeros(len(indices))
        self.seen = np.zeros(len(indices), dtype=bool)
        self.max_priority = 1.0

    def __len__(self) -> int:
        return len(self.indices)

    def positions(self, dataset_indices: torch.Tensor) -> np.ndarray:
        """Table positions of dataset indices that are in the table."""
        return self._position[dataset_indices.numpy()]

    def priorities(self) -> np.ndarray:
        """p_i per position."""
        return np.where(self.seen, self.last_loss + self.eps, self.max_priority)

    def refresh(self, positions: np.ndarray, losses: torch.Tensor) -> None:
        """Set the last loss of each position drawn (a position drawn twice: its larger loss)."""
        hit, slot = np.unique(positions, return_inverse=True)
        latest = np.full(len(hit), -math.inf)
        values = losses.detach().to(torch.float64).numpy()
        np.maximum.at(latest, slot, np.where(np.isnan(values), math.inf, values))  # diverged (nan): as hard as inf
        self.last_loss[hit] = latest
        self.seen[hit] = True
        self.max_priority = max(self.max_priority, float(latest.max()) + self.eps)

    def in_top_decile(self, positions: np.ndarray) -> np.ndarray:
        """Whether each position is among the ceil(10% N) of highest priority (ties: lower position first)."""
        priorities = self.priorities()
        top = math.ceil(TOP_FRACTION * len(self))
        threshold = np.partition(priorities, len(self) - top)[len(self) - top]  # the top-th largest
        above = priorities > threshold
        ties = priorities == threshold
        tie_rank = np.cumsum(ties) - 1  # ties at the threshold, in position order
        return (above | (ties & (tie_rank < top - int(above.sum()))))[positions]


def effective_sample_size(weights: np.ndarray) -> float:
    """(sum w)^2 / sum w^2 (Kish): B for equal weights, 1 when one weight dominates."""
    return float(weights.sum() ** 2 / (weights ** 2).sum())


class PrioritizedSampler(ShardLoader):
    """Batches drawn with replacement from P(i) = p_i^alpha / sum p^alpha over the rank's shard;
    it records its draws and per-sample losses for report.json's `sampling` section."""

    kind = "prioritized"

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, batch_size: int, seed: int,
                 every: int, alpha: float, eps: float, beta0: float, beta_steps: int, beta_end: float = 1.0):
        super().__init__(dataset, num_replicas, rank, batch_size, seed)
        # the rank's epoch-0 DistributedSampler shard
        self.table = PriorityTable(torch.sort(self._epoch_indices).values, eps)
        self.every = every
        self.batches = 0
        self.effective_sizes: list[float] = []  # per batch
        self.mean_priorities: list[float] = []  # after every `every` batches
        self.drawn = 0
        self.top_drawn = 0
        self._positions: np.ndarray | None = None
        self._weights: np.ndarray | None = None
        self._noted = False  # whether the last batch's losses refreshed its priorities
        self.alpha = alpha
        self.beta0 = beta0
        self.beta_end = beta_end
        self.beta_steps = beta_steps
        self.generator = sampler_generator(seed, rank)
        depth = max(1, math.ceil(math.log2(len(self.table))))
        self.host_seconds = self._host_accesses(batch_size, depth) * HOST_ACCESS_S

    def _host_accesses(self, batch_size: int, depth: int) -> int:
        return batch_size * depth + 2 * batch_size * depth  # draws down the sum tree; refreshes up both trees

    @property
    def beta(self) -> float:
        """beta0 at step 0, moving linearly to beta_end at beta_steps."""
        return self.beta0 + (self.beta_end - self.beta0) * min(1.0, self.batches / self.beta_steps)

    def target(self) -> np.ndarray:
        """P(i) = p_i^alpha / sum_k p_k^alpha over the shard; uniform when float64 cannot hold it
        (a loss diverged to inf or nan, or p^alpha under- or overflows)."""
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            scaled = self.table.priorities() ** self.alpha
            total = scaled.sum()
        if not (math.isfinite(total) and scaled.min() > 0):
            return np.full(len(scaled), 1.0 / len(scaled))
        return scaled / total

    def draw(self, target: np.ndarray) -> np.ndarray:
        """Table positions of the next batch, drawn from `target`."""
        drawn = torch.multinomial(torch.from_numpy(target), self.batch_size, replacement=True,
                                  generator=self.generator)
        return drawn.numpy()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        target, n, beta = self.target(), len(self.table), self.beta
        positions = self.draw(target)
        weights = (n * target[positions]) ** -beta / (n * target.min()) ** -beta
        self._note_draw(positions, weights)
        return self.gather(self.table.indices[torch.from_numpy(positions)])

    def batch_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The last batch's importance-weighted loss; its per-sample losses refresh the priorities the first time."""
        per_sample = cross_entropy(logits, y, reduction="none")
        loss = (torch.from_numpy(self._weights).to(per_sample.dtype) * per_sample).mean()
        if not self._noted:
            self._note_losses(per_sample.detach())
        return loss

    def _note_draw(self, positions: np.ndarray, weights: np.ndarray) -> None:
        self._positions, self._weights, self._noted = positions, weights, False
        self.drawn += len(positions)
        self.top_drawn += int(self.table.in_top_decile(positions).sum())

    def _note_losses(self, per_sample: torch.Tensor) -> None:
        self.table.refresh(self._positions, per_sample)
        self._noted = True
        self.effective_sizes.append(effective_sample_size(self._weights))
        self.batches += 1
        if self.batches % self.every == 0:
            self.mean_priorities.append(float(self.table.priorities().mean()))


class MetropolisSampler(PrioritizedSampler):
    """One Metropolis-Hastings chain per batch slot, with uniform proposals, targeting P(i)."""

    kind = "mh"

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, batch_size: int, seed: int,
                 every: int, alpha: float, eps: float, beta0: float, beta_steps: int, beta_end: float = 1.0,
                 steps: int = 2):
        self.steps = steps
        super().__init__(dataset, num_replicas, rank, batch_size, seed, every, alpha, eps, beta0, beta_steps,
                         beta_end)
        self.state = torch.randint(len(self.table), (batch_size,), generator=self.generator).numpy()
        self.proposed = 0
        self.accepted = 0

    def _host_accesses(self, batch_size: int, depth: int) -> int:
        return batch_size * self.steps + 2 * batch_size * depth  # one read per proposal; refreshes

    def draw(self, target: np.ndarray) -> np.ndarray:
        state = self.state
        for _ in range(self.steps):
            proposal = torch.randint(len(self.table), (self.batch_size,), generator=self.generator).numpy()
            uniform = torch.rand(self.batch_size, dtype=torch.float64, generator=self.generator).numpy()
            accept = uniform * target[state] < target[proposal]  # u < (p_new / p_cur)^alpha
            state = np.where(accept, proposal, state)
            self.accepted += int(accept.sum())
            self.proposed += self.batch_size
        self.state = state
        return state


def build_loader(scenario: Scenario, dataset: Dataset, num_replicas: int, rank: int) -> ShardLoader:
    """The loader `scenario.data.sampling` asks for, for one rank."""
    spec, seed, every = scenario.data, scenario.seed, scenario.report.every
    if spec.sampling == "uniform":
        return ShardLoader(dataset, num_replicas, rank, spec.batch_size, seed)
    common = (dataset, num_replicas, rank, spec.batch_size, seed, every)
    beta_steps = spec.beta_steps if spec.beta_steps is not None else scenario.train.steps
    weighting = (spec.alpha, spec.eps, spec.beta0, beta_steps, spec.beta_end)
    if spec.sampling == "prioritized":
        return PrioritizedSampler(*common, *weighting)
    return MetropolisSampler(*common, *weighting, steps=spec.mh.steps)


def sampling_section(loaders: list[PrioritizedSampler]) -> dict:
    """report.json's `sampling` section from every rank's loader, in windows of `every` batches of
    each loader (a sync step is one batch of every loader; an async worker draws at its own pace)."""
    every = loaders[0].every
    batches = max(len(loader.effective_sizes) for loader in loaders)
    ends = [min(end, batches) for end in range(every, batches + every, every)]
    starts = [0, *ends[:-1]]
    finals = [float(loader.table.priorities().mean()) for loader in loaders]
    mean_priority, effective = [], []
    for window, (start, end) in enumerate(zip(starts, ends)):
        snapshots = [loader.mean_priorities[window] if window < len(loader.mean_priorities) else final
                     for loader, final in zip(loaders, finals)]
        mean_priority.append([end, sum(snapshots) / len(snapshots)])
        sizes = [size for loader in loaders for size in loader.effective_sizes[start:end]]
        effective.append([end, sum(sizes) / len(sizes)])
    section = {
        "kind": loaders[0].kind,
        "every": every,
        "mean_priority": mean_priority,
        "effective_sample_size": effective,
        "top_decile_share": sum(l.top_drawn for l in loaders) / sum(l.drawn for l in loaders),
    }
    if isinstance(loaders[0], MetropolisSampler):
        section["acceptance_rate"] = sum(l.accepted for l in loaders) / sum(l.proposed for l in loaders)
    return section


class SamplingSection(ReportSection):
    kind: str = Field(description="the sampler: prioritized or mh (Metropolis-Hastings)")
    every: int = Field(description="batches of each loader per window")
    mean_priority: list[tuple[int, float | None]] = Field(
        description="[batches, mean priority] at each window's end; null: not finite (a diverged run)")
    effective_sample_size: list[tuple[int, float | None]] = Field(
        description="[batches, mean effective sample size of the window's batches] per window")
    top_decile_share: float | None = Field(description="share of the draws that fell in the top decile of "
                                                       "priorities")
    acceptance_rate: float | None = Field(None, description="share of proposals accepted (mh only)")


register_section("sampling", SamplingSection, "what a non-uniform sampler drew (train/sampling.py)")
