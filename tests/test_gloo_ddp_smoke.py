"""The gloo DDP reference trains, and equals one process on both ranks' batches concatenated."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from gloo_ddp import train_ddp
from simtrain.scenario import ModelSpec, OptimizerSpec
from simtrain.train.data import load_dataset
from simtrain.train.models import build_model
from simtrain.train.optim import build_optimizer

pytestmark = pytest.mark.gloo  # real torch.distributed processes

SEED, STEPS, HIDDEN, BATCH, LR, MOMENTUM = 3, 5, [32], 32, 0.1, 0.9


def _single_process_reference(world_size: int) -> tuple[dict, dict]:
    """Initial and final state of one process whose every step sees all ranks' batches at once."""
    splits = load_dataset("digits", {}, SEED)
    model = build_model(ModelSpec(name="mlp", hidden=HIDDEN), splits.info, SEED)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = build_optimizer(model.parameters(), OptimizerSpec(name="sgd", lr=LR, momentum=MOMENTUM))
    rank_iterators = []
    for rank in range(world_size):
        sampler = DistributedSampler(
            splits.train, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED, drop_last=True
        )
        sampler.set_epoch(0)
        rank_iterators.append(iter(DataLoader(splits.train, batch_size=BATCH, sampler=sampler, drop_last=True)))
    for _ in range(STEPS):
        batches = [next(it) for it in rank_iterators]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()  # mean over all ranks' samples == mean of rank means
        optimizer.step()
    return initial, model.state_dict()


def test_two_rank_ddp_matches_single_process_on_concatenated_batches():
    ddp_state = train_ddp(2, seed=SEED, steps=STEPS, hidden=HIDDEN, batch_size=BATCH, lr=LR, momentum=MOMENTUM)
    initial, reference = _single_process_reference(2)
    assert ddp_state.keys() == reference.keys()
    for name, value in ddp_state.items():
        assert torch.isfinite(value).all(), name
        torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-5, msg=name)
    assert all(not torch.equal(ddp_state[name], initial[name]) for name in initial)
