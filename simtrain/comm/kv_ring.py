"""One step of ring attention's key/value ring, and of its gradients' ring back: Send/Recv programs on a cp group.

Under context parallelism (train/ring_attention.py) each rank of a cp group of
N holds its own key/value block. Ring attention passes the blocks around the
group: at each of N - 1 steps every rank sends the block it holds to its right
neighbour (cp rank r + 1) and receives its left neighbour's, computing one
block's attention while the next one moves. In backward the blocks' gradients
travel the other way, each rank adding its share to the gradient it receives
before passing it on, so that after N - 1 steps every block's gradient is back
with its owner. Each rank therefore sends N - 1 blocks forward and N - 1
gradients back: (N - 1) x 2 x b x s/N x h_kv x bytes per element, twice, per
layer and microbatch (b samples, s tokens, h_kv the key and value width).

`pass_on(rank, world, block)` and `pass_back(rank, world, grad)` return
(program, result): the per-rank program of one step, and the tensor that holds
what arrived once it has run. The two directions use different tags, so that
with N = 2 (left and right the same rank) a forward step and a backward step
never match each other.

    program, arrived = pass_on(rank, 4, kv)            # kv to rank + 1, arrived from rank - 1
    yield Collective(program, "cp_kv", comm, rank)
"""
import torch

from .ops import Recv, Send

FORWARD_TAG, BACKWARD_TAG = 0, 1


def pass_on(rank: int, world: int, block: torch.Tensor):
    """(program, arrived): `block` sent to cp rank `rank` + 1, the block of rank `rank` - 1 received."""
    arrived = torch.empty_like(block)
    return _step((rank + 1) % world, (rank - 1) % world, block, arrived, FORWARD_TAG), arrived


def pass_back(rank: int, world: int, grad: torch.Tensor):
    """(program, arrived): `grad` (the gradient of the block received from rank `rank` - 1) sent back to it,
    the gradient of the block this rank sent to rank `rank` + 1 received from there."""
    arrived = torch.empty_like(grad)
    return _step((rank - 1) % world, (rank + 1) % world, grad.contiguous(), arrived, BACKWARD_TAG), arrived


def _step(to: int, source: int, tensor: torch.Tensor, arrived: torch.Tensor, tag: int):
    yield [Send(to, tensor, tag), Recv(source, arrived, tag=tag)]
    return arrived


RING_STEPS = {"kv_ring": pass_on, "kv_ring_back": pass_back}
