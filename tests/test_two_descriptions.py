"""One job written twice, as a scenario and as users' torch code on simulated ranks, agrees (issue 53's item 3).

FSDP2 in bf16 with fp32 reduce-scatters, a unit per Linear, Adam, on 4 ranks: the scenario's stage 3
(strategies/distributed_optimizer.py) against torch's own `fully_shard` under `simtrain.dist`. The bytes each
kind of collective sends are the same exactly, and so is each rank's training state by category: its fp32
gradient shard and Adam's two moments (torch's Adam keeps one more 4-byte `step` tensor a parameter, which the
scenario does not count). The users' code builds its model whole before sharding it, so its `weights` peak is the
whole fp32 model at construction; the scenario's is FSDP2's fp32 shard alone.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import simtrain.dist
from simtrain import run
from simtrain.scenario import validate_scenario

WORLD, WIDTH, UNITS, BATCH = 4, 64, 4, 32
PSI = UNITS * (WIDTH * WIDTH + WIDTH)  # each Linear's parameters divide by the ranks: no padding


def units() -> nn.Sequential:
    """Equal Linear (+ ReLU) units, each an FSDP2 unit."""
    layers = []
    for _ in range(UNITS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def users_fsdp2(rank, world):
    """A user's FSDP2 step: the model built, sharded unit by unit, one Adam step."""
    dist.init_process_group("simtrain")
    model = units()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(BATCH, WIDTH), torch.randint(0, WIDTH, (BATCH,))
    F.cross_entropy(model(x).float(), y).backward()
    optimizer.step()


def test_a_scenario_and_users_fsdp2_send_the_same_bytes_and_hold_the_same_state():
    scenario = validate_scenario({
        "name": "fsdp2-twice", "seed": 0, "cluster": {"devices": WORLD, "topology": "ring"},
        "model": {"name": "test_two_descriptions:units"},
        "data": {"name": "synthetic", "samples": 256, "features": WIDTH, "classes": WIDTH, "batch_size": BATCH},
        "train": {"steps": 1, "precision": "bf16", "optimizer": {"name": "adam", "lr": 0.01}},
        "parallel": {"sharding": {"stage": 3, "reduce_dtype": "fp32"}}, "report": {"trace": False}})
    described = run(scenario).data
    users = simtrain.dist.spawn(users_fsdp2, world=WORLD).report
    log = users._cluster.log
    sent = {kind: sum(nbytes for rank in range(WORLD) for label, nbytes in log.bytes_by_label(rank, "communication")
                      .items() if label.startswith(kind)) for kind in ("all_gather", "reduce_scatter", "all_reduce")}
    assert sent == described["sharding"]["bytes_by_kind"] and sent["all_gather"] > 0 and sent["all_reduce"] == 0
    for rank in range(WORLD):
        ours = described["devices"][rank]["peak_memory_bytes_by_category"]
        theirs = users.data["devices"][rank]["peak_memory_bytes_per_category"]
        assert "master_weights" not in ours  # FSDP2's fp32 shard is the parameter
        assert ours["weights"] == 4 * PSI // WORLD and theirs["weights"] == 4 * PSI  # built whole, then sharded
        assert theirs["gradients"] == ours["gradients"] == 4 * PSI // WORLD
        assert theirs["optimizer_state"] == ours["optimizer_state"] + 4 * 2 * UNITS == 8 * PSI // WORLD + 8 * UNITS
