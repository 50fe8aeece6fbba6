"""PAT, Parallel Aggregated Trees: NCCL's all-gather and reduce-scatter in log2(N) steps, one GPU per node.

NCCL 2.23 added PAT for all-gather and reduce-scatter at scale, where a ring's
N - 1 steps of latency dominate (S. Jeaugey, "PAT: a new algorithm for
all-gather and reduce-scatter operations at scale", 2025; NCCL 2.30's
`PatAGAlgorithm` and `PatRSAlgorithm`, src/include/collectives.h). It is a
Bruck all-gather with its dimensions reversed: each rank's block is broadcast
along a binomial tree, the far dimensions first, so that the steps that carry
the most data go the shortest distance, and the blocks a rank forwards at a
step go out together (aggregated) in one step.

The schedule here is PAT at full aggregation, what NCCL runs when a step's
data fits its buffer (small and medium calls, where its tuner picks PAT). For
N ranks, P the power of two at or above N, the steps go over the distances
d = P/2, P/4, ..., 1 (all-gather; reduce-scatter runs them the other way,
1 first). At distance d, rank r holds the blocks of the ranks r + o for every
o below N that is a multiple of 2d, and

- all-gather: sends the blocks of ranks r + 2dm (every m with 2dm + d < N) to
  rank r - d and receives the blocks of ranks r + d + 2dm from rank r + d;
- reduce-scatter: sends its partial sums of the blocks of ranks r + d + 2dm to
  rank r + d and adds those of rank r - d into its own of the blocks of ranks
  r + 2dm, so that block r ends summed over every rank at rank r.

Every offset below N has one binary form, so each block reaches each rank
once (reduce-scatter: each rank's part of each block is summed once), for any
N: a rank sends N - 1 blocks in all, as a ring does, in log2(P) steps instead
of N - 1. When a step's data outgrows its buffer NCCL aggregates fewer blocks
per step and sends the same bytes in more steps; that is left out.

Buffers follow nccl-tests: the whole N-block buffer on every rank, rank r's
own block r.

    program = pat_all_gather(rank, world, buf)        # buf: world blocks, block `rank` filled
    program = pat_reduce_scatter(rank, world, buf)    # afterwards block `rank` is the sum
"""
from .ops import Recv, Send


def distances(world: int) -> list[int]:
    """The all-gather's distances, far first: P/2, P/4, ..., 1 for P the power of two at or above `world`."""
    far = (1 << (world - 1).bit_length()) // 2
    return [far >> step for step in range(far.bit_length())]


def blocks_at(world: int, distance: int) -> int:
    """Blocks a rank sends at `distance`: the m >= 0 with 2·distance·m + distance < world."""
    return (world + distance - 1) // (2 * distance)


def pat_all_gather(rank: int, world: int, buf, tag: int = 0):
    """Per-rank program: every rank's block r of `buf` gathered into every rank's `buf`."""
    blocks = buf.tensor_split(world)
    for distance in distances(world):
        offsets = [2 * distance * m for m in range(blocks_at(world, distance))]
        yield ([Send((rank - distance) % world, blocks[(rank + offset) % world], tag) for offset in offsets]
               + [Recv((rank + distance) % world, blocks[(rank + distance + offset) % world], False, tag)
                  for offset in offsets])
    return buf


def pat_reduce_scatter(rank: int, world: int, buf, tag: int = 0):
    """Per-rank program: block r of `buf` summed over the ranks, at rank r."""
    blocks = buf.tensor_split(world)
    for distance in reversed(distances(world)):
        offsets = [2 * distance * m for m in range(blocks_at(world, distance))]
        yield ([Send((rank + distance) % world, blocks[(rank + distance + offset) % world], tag)
                for offset in offsets]
               + [Recv((rank - distance) % world, blocks[(rank + offset) % world], True, tag) for offset in offsets])
    return buf
