"""simtrain.dist runs users' own torch.distributed code on simulated ranks.

References: the same function under real gloo in 2 and 4 processes (every
collective and an unmodified DDP training loop, within 1e-5), each collective's
definition computed directly (uneven sizes, a sub-group), single-process torch on
the global batch for DDP, `simtrain collective`'s benchmark and the closed forms
for time (the ring; compute from FLOPs; DDP's buckets overlapping backward),
bytes and memory, a second run for determinism; deadlocks, mismatches and a
rank that raises end in one-line errors. (The examples of docs/guides/testing-distributed-code.md run in
tests/test_docs.py.)
"""
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import simtrain.dist
from gloo_processes import run_on_gloo
from simtrain.comm.bench import benchmark_all_reduce
from simtrain.errors import ScenarioError, SimtrainError
from simtrain.hw.topology_builders import LinkClass, build_topology
from simtrain.scenario import ModelSpec, OptimizerSpec
from simtrain.train.data import load_dataset
from simtrain.train.models import build_model
from simtrain.train.optim import build_optimizer

OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
       "product": dist.ReduceOp.PRODUCT}
NUMEL = 7  # chunks that do not divide evenly over 2 or 4 ranks


def seeded(rank, numel, salt=0):
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * salt + rank))


def pair_size(src, dst):
    """Elements rank src sends rank dst in the all-to-alls: every pair a different size."""
    return 1 + src + 2 * dst


def collectives(rank, world):
    """Every collective of the backend on seeded inputs; their results by name. Runs under gloo too."""
    out = {}
    for name, op in OPS.items():
        tensor = seeded(rank, NUMEL)
        dist.all_reduce(tensor, op=op)
        out[f"all_reduce_{name}"] = tensor
    tensor = seeded(rank, NUMEL)
    version = tensor._version
    dist.all_reduce(tensor)  # written by the backend below autograd: its version counter stays
    out["all_reduce_version"] = torch.tensor(float(tensor._version - version))
    tensor = seeded(rank, NUMEL, 1)
    dist.broadcast(tensor, src=world - 1)
    out["broadcast"] = tensor
    for name in ("sum", "max"):
        tensor = seeded(rank, NUMEL, 8)
        dist.reduce(tensor, dst=1, op=OPS[name])
        out[f"reduce_{name}"] = tensor if rank == 1 else torch.empty(0)  # elsewhere torch leaves it undefined
    gathered = [torch.empty(NUMEL) for _ in range(world)] if rank == 0 else None
    dist.gather(seeded(rank, NUMEL, 9), gathered, dst=0)
    out["gather"] = torch.cat(gathered) if rank == 0 else torch.empty(0)
    scattered = torch.empty(NUMEL)
    dist.scatter(scattered, list(seeded(rank, world * NUMEL, 10).split(NUMEL)) if rank == world - 1 else None,
                 src=world - 1)
    out["scatter"] = scattered
    gathered = [torch.empty(NUMEL) for _ in range(world)]
    dist.all_gather(gathered, seeded(rank, NUMEL, 2))
    out["all_gather"] = torch.cat(gathered)
    into = torch.empty(world * NUMEL)
    dist.all_gather_single(into, seeded(rank, NUMEL, 2))
    out["all_gather_single"] = into
    for name in ("sum", "max"):
        scattered = torch.empty(3)
        dist.reduce_scatter(scattered, list(seeded(rank, 3 * world, 3).split(3)), op=OPS[name])
        out[f"reduce_scatter_{name}"] = scattered
    scattered = torch.empty(3)
    dist.reduce_scatter_single(scattered, seeded(rank, 3 * world, 3))
    out["reduce_scatter_single"] = scattered
    outputs = [torch.empty(3) for _ in range(world)]
    dist.all_to_all(outputs, list(seeded(rank, 3 * world, 4).split(3)))  # gloo's takes equal sizes
    out["all_to_all"] = torch.cat(outputs)
    inputs = seeded(rank, sum(pair_size(rank, j) for j in range(world)), 4)
    single = torch.empty(sum(pair_size(j, rank) for j in range(world)))
    dist.all_to_all_single(single, inputs, [pair_size(j, rank) for j in range(world)],
                           [pair_size(rank, j) for j in range(world)])
    out["all_to_all_single"] = single
    left = torch.empty(NUMEL)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, seeded(rank, NUMEL, 5), (rank + 1) % world),
                                    dist.P2POp(dist.irecv, left, (rank - 1) % world)])
    for work in works:
        work.wait()
    out["ring_exchange"] = left
    message = seeded(rank, NUMEL, 6)
    if rank == 0:
        dist.send(message, world - 1)
    elif rank == world - 1:
        dist.recv(message, 0)
    out["send_recv"] = message
    evens = dist.new_group(list(range(0, world, 2)))
    tensor, gathered = seeded(rank, NUMEL, 7), [torch.empty(NUMEL) for _ in range(0, world, 2)]
    if rank % 2 == 0:
        dist.all_reduce(tensor, group=evens)
        dist.all_gather(gathered, seeded(rank, NUMEL, 11), group=evens)
    out["sub_group_all_reduce"] = tensor
    out["sub_group_all_gather"] = torch.cat(gathered) if rank % 2 == 0 else torch.empty(0)
    dist.barrier()
    return out


def ddp_training(rank, world, steps=4, **ddp_options):
    """Rank's final parameters after an unmodified DDP loop on digits (as tests/gloo_ddp.py trains)."""
    splits = load_dataset("digits", {}, 0)
    model = DistributedDataParallel(build_model(ModelSpec(name="mlp", hidden=[32]), splits.info, 0), **ddp_options)
    optimizer = build_optimizer(model.parameters(), OptimizerSpec(name="sgd", lr=0.1, momentum=0.9))
    sampler = DistributedSampler(splits.train, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = iter(DataLoader(splits.train, batch_size=16, sampler=sampler, drop_last=True))
    for _ in range(steps):
        x, y = next(loader)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {name: value.clone() for name, value in model.module.state_dict().items()}


def user_code(rank, world):
    """What a user would test, after init_process_group: the same function under gloo and on simtrain."""
    return {**collectives(rank, world), **{f"ddp.{k}": v for k, v in ddp_training(rank, world).items()}}


def simtrain_rank(rank, world):
    dist.init_process_group("simtrain")
    return user_code(rank, world)


@pytest.fixture(scope="module", params=[2, 4])
def gloo_and_simtrain(request):
    world = request.param
    return world, run_on_gloo(user_code, world), simtrain.dist.spawn(simtrain_rank, world=world)


@pytest.mark.gloo
def test_same_code_gives_what_gloo_gives_collectives_and_ddp(gloo_and_simtrain):
    world, gloo, simulated = gloo_and_simtrain
    for rank in range(world):
        assert simulated[rank].keys() == gloo[rank].keys()
        for name, value in gloo[rank].items():
            torch.testing.assert_close(simulated[rank][name], value, rtol=0, atol=1e-5, msg=f"rank {rank} {name}")


@pytest.mark.gloo
def test_collectives_meet_their_definitions(gloo_and_simtrain):
    world, _, simulated = gloo_and_simtrain
    inputs = torch.stack([seeded(r, NUMEL) for r in range(world)])
    expected = {"sum": inputs.sum(0), "avg": inputs.mean(0), "max": inputs.max(0).values,
                "min": inputs.min(0).values, "product": inputs.prod(0)}
    scatter_inputs = torch.stack([seeded(r, 3 * world, 3) for r in range(world)])
    for rank, result in enumerate(simulated):
        for name, value in expected.items():
            torch.testing.assert_close(result[f"all_reduce_{name}"], value, rtol=1e-5, atol=1e-6)
        assert torch.equal(result["broadcast"], seeded(world - 1, NUMEL, 1))
        reduce_inputs = torch.stack([seeded(r, NUMEL, 8) for r in range(world)])
        if rank == 1:
            torch.testing.assert_close(result["reduce_sum"], reduce_inputs.sum(0))
            assert torch.equal(result["reduce_max"], reduce_inputs.max(0).values)
        if rank == 0:
            assert torch.equal(result["gather"], torch.cat([seeded(r, NUMEL, 9) for r in range(world)]))
        assert torch.equal(result["scatter"], seeded(world - 1, world * NUMEL, 10)[rank * NUMEL:(rank + 1) * NUMEL])
        everyone = torch.cat([seeded(r, NUMEL, 2) for r in range(world)])
        assert torch.equal(result["all_gather"], everyone) and torch.equal(result["all_gather_single"], everyone)
        mine = slice(3 * rank, 3 * rank + 3)
        torch.testing.assert_close(result["reduce_scatter_sum"], scatter_inputs[:, mine].sum(0))
        assert torch.equal(result["reduce_scatter_max"], scatter_inputs[:, mine].max(0).values)
        torch.testing.assert_close(result["reduce_scatter_single"], scatter_inputs[:, mine].sum(0))
        assert torch.equal(result["all_to_all"], torch.cat([seeded(src, 3 * world, 4)[3 * rank:3 * rank + 3]
                                                            for src in range(world)]))
        sent_to_me = []
        for src in range(world):
            offset = sum(pair_size(src, j) for j in range(rank))
            sent_to_me.append(seeded(src, sum(pair_size(src, j) for j in range(world)), 4)[
                offset:offset + pair_size(src, rank)])
        assert torch.equal(result["all_to_all_single"], torch.cat(sent_to_me))
        assert torch.equal(result["ring_exchange"], seeded((rank - 1) % world, NUMEL, 5))
        assert torch.equal(result["send_recv"], seeded(0 if rank == world - 1 else rank, NUMEL, 6))
        evens = torch.stack([seeded(r, NUMEL, 7) for r in range(0, world, 2)]).sum(0)
        sub = evens if rank % 2 == 0 else seeded(rank, NUMEL, 7)
        torch.testing.assert_close(result["sub_group_all_reduce"], sub, rtol=0, atol=1e-6)
        if rank % 2 == 0:
            assert torch.equal(result["sub_group_all_gather"], torch.cat([seeded(r, NUMEL, 11)
                                                                          for r in range(0, world, 2)]))


@pytest.mark.parametrize("gradient_as_bucket_view", [False, True])
def test_ddp_on_simulated_ranks_equals_one_process_on_the_global_batch(gradient_as_bucket_view):
    world = 2

    def rank_code(rank, size):
        dist.init_process_group("simtrain")
        # 3 steps: the third runs on the buckets DDP rebuilt after the first (one per layer: 1 KiB cap)
        return ddp_training(rank, size, steps=3, bucket_cap_mb=1 / 1024, gradient_as_bucket_view=gradient_as_bucket_view)

    simulated = simtrain.dist.spawn(rank_code, world=world)
    splits = load_dataset("digits", {}, 0)
    model = build_model(ModelSpec(name="mlp", hidden=[32]), splits.info, 0)
    optimizer = build_optimizer(model.parameters(), OptimizerSpec(name="sgd", lr=0.1, momentum=0.9))
    loaders = []
    for rank in range(world):
        sampler = DistributedSampler(splits.train, num_replicas=world, rank=rank, shuffle=True, seed=0,
                                     drop_last=True)
        loaders.append(iter(DataLoader(splits.train, batch_size=16, sampler=sampler, drop_last=True)))
    for _ in range(3):
        batches = [next(loader) for loader in loaders]
        optimizer.zero_grad()
        F.cross_entropy(model(torch.cat([b[0] for b in batches])), torch.cat([b[1] for b in batches])).backward()
        optimizer.step()
    for rank in range(world):
        for name, value in model.state_dict().items():
            torch.testing.assert_close(simulated[rank][name], value, rtol=0, atol=1e-6)


SIZE = 1 << 20  # bytes
QUICKSTART = Path(__file__).resolve().parents[1] / "scenarios" / "quickstart.yaml"


@pytest.mark.parametrize("algorithm", ["ring", "tree", "naive"])
def test_all_reduce_takes_the_time_simtrain_collective_gives(algorithm):
    def one_all_reduce(rank, world):
        dist.init_process_group("simtrain")
        dist.all_reduce(torch.ones(SIZE // 4))

    result = simtrain.dist.spawn(one_all_reduce, world=4, topology="ring", bandwidth="50 GB/s", latency="5 us",
                                 collective=algorithm)
    topology = build_topology("ring", 4, LinkClass(50e9, 5e-6))
    benchmark = next(benchmark_all_reduce(topology, algorithm, [SIZE], numerics=True))
    assert max(device["end_s"] for device in result.report.data["devices"]) == pytest.approx(benchmark.time_s,
                                                                                           rel=1e-12)


@simtrain.dist.distributed(world=4, topology="ring", bandwidth="50 GB/s", latency="5 us")
def test_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_buffer_in_the_closed_form_time(rank, world, cluster):
    dist.init_process_group("simtrain")
    tensor = torch.full((SIZE // 4,), float(rank))
    dist.all_reduce(tensor)
    assert torch.equal(tensor, torch.full_like(tensor, sum(range(world))))
    assert cluster.bytes_sent(rank) == 2 * (world - 1) / world * SIZE
    assert cluster.now_s == pytest.approx(2 * (world - 1) * (5e-6 + SIZE / (world * 50e9)), rel=1e-9)


def test_the_decorated_test_is_a_test_without_arguments():
    assert test_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_buffer_in_the_closed_form_time.__code__.co_argcount == 0

    @simtrain.dist.distributed(world=2)
    def failing(rank, world, cluster):
        assert rank == 0

    with pytest.raises(simtrain.dist.RankFailed, match="rank 1 raised AssertionError"):
        failing()


def test_compute_is_charged_from_the_flops_of_torch_ops_and_overlaps_an_async_all_reduce():
    a100_fp32 = 19.5e12 * 0.5  # catalog peak x default efficiency

    def rank_code(rank, world):
        dist.init_process_group("simtrain")
        x = torch.ones(64, 128)
        x @ torch.ones(128, 256)  # 2 * 64 * 128 * 256 FLOPs, charged before the all-reduce
        work = dist.all_reduce(torch.ones(SIZE // 4), async_op=True)
        simtrain.dist.compute(1e9)  # runs while the all-reduce moves
        work.wait()

    report = simtrain.dist.spawn(rank_code, world=2, bandwidth="50 GB/s", latency="5 us").report
    matmul_s = 2 * 64 * 128 * 256 / a100_fp32
    all_reduce_s = 2 * (5e-6 + SIZE / (2 * 50e9))
    for device in report.data["devices"]:
        assert device["compute_s"] == pytest.approx(matmul_s + 1e9 / a100_fp32, rel=1e-12)
        assert device["end_s"] == pytest.approx(matmul_s + max(all_reduce_s, 1e9 / a100_fp32), rel=1e-12)


def test_two_runs_give_identical_results_and_reports():
    first, second = (simtrain.dist.spawn(simtrain_rank, world=4, scenario=QUICKSTART)
                     for _ in range(2))
    for a, b in zip(first, second):
        assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    assert first.report.data == second.report.data and first.report.trace == second.report.trace
    assert first.report.data["sim_time_s"] > 0 and any(link["bytes"] for link in first.report.data["links"])


def _quick(fn, world=2):
    """The run's error; a hang is found from the simulated clock (its events run out while ranks wait), not by
    the host's, so no wall-clock bound: what must hold is that no rank's thread is left waiting afterwards."""
    threads = threading.active_count()
    with pytest.raises(SimtrainError) as error:
        simtrain.dist.spawn(fn, world=world)
    assert threading.active_count() == threads  # every rank ended, the waiting ones too: an error, never a hang
    return str(error.value)


def test_a_recv_nobody_sends_is_a_deadlock_naming_the_rank_and_what_it_waits_on():
    def rank_code(rank, world):
        dist.init_process_group("simtrain")
        if rank == 0:
            dist.recv(torch.empty(3), src=1)

    message = _quick(rank_code)
    assert message.startswith("deadlock at 0 us of simulated time: rank 0 waits on recv from rank 1 (tag 0)")


def test_a_collective_some_ranks_never_call_is_a_deadlock_naming_them():
    def rank_code(rank, world):
        dist.init_process_group("simtrain")
        if rank != 2:
            dist.all_reduce(torch.ones(4))

    message = _quick(rank_code, world=3)
    assert "rank 0 waits on all_reduce(sum) of 4 float32 (collective #0 of group [0, 1, 2]), which ranks [2] " \
           "have not called" in message and "rank 2" not in message.split("; ")[0]


def all_reduce_4(rank):
    dist.all_reduce(torch.ones(4))


@pytest.mark.parametrize("calls,expected", [
    ((all_reduce_4, lambda rank: dist.broadcast(torch.ones(4), src=0)),
     "rank 0 called all_reduce(sum) of 4 float32, rank 1 called broadcast(root 0) of 4 float32"),
    ((all_reduce_4, lambda rank: dist.all_reduce(torch.ones(5))),
     "rank 0 called all_reduce(sum) of 4 float32, rank 1 called all_reduce(sum) of 5 float32"),
    ((lambda rank: dist.all_to_all_single(torch.empty(4), torch.ones(4), [2, 2], [2, 2]),
      lambda rank: dist.all_to_all_single(torch.empty(3), torch.ones(3), [1, 2], [2, 1])),
     "in the all-to-all rank 0 sends 2 elements to rank 1, which expects 1"),
])
def test_mismatched_collectives_are_an_error_naming_both_ranks(calls, expected):
    def rank_code(rank, world):
        dist.init_process_group("simtrain")
        calls[rank](rank)

    message = _quick(rank_code)
    assert message == f"rank 1 raised CollectiveMismatch: collective #0 of group [0, 1]: {expected}"


def test_a_rank_that_raises_ends_the_run_with_its_error():
    def rank_code(rank, world):
        dist.init_process_group("simtrain")
        if rank == 1:
            raise ValueError("bad batch")
        dist.all_reduce(torch.ones(4))  # rank 0 would wait for rank 1 for ever

    assert _quick(rank_code) == "rank 1 raised ValueError: bad batch"


def test_bad_input_is_one_line_naming_the_field():
    with pytest.raises(ScenarioError, match="cluster.link.bandwidth"):
        simtrain.dist.spawn(simtrain_rank, world=2, bandwidth="fast")
    with pytest.raises(ScenarioError, match="cluster.devices"):
        simtrain.dist.spawn(simtrain_rank, world=0)
    with pytest.raises(ScenarioError, match="parallel.all_reduce"):
        simtrain.dist.spawn(simtrain_rank, world=2, collective="butterfly")
    with pytest.raises(SimtrainError, match="simtrain.dist.compute: only inside a rank of simtrain.dist.spawn"):
        simtrain.dist.compute(1e9)


def test_memory_of_the_tensors_a_rank_makes_is_held_on_its_device_until_the_last_view_is_freed():
    def rank_code(rank, world):
        dist.init_process_group("simtrain")
        whole = torch.ones(1 << 20)  # 4 MiB
        view = whole.view(2, -1)
        del whole
        half = torch.ones(1 << 19)  # 2 MiB while the 4 MiB are still viewed
        del view, half
        dist.all_reduce(torch.ones(1 << 18))  # 1 MiB, and the all-reduce's staging buffers
        return torch.ones(1 << 19)  # 2 MiB after everything else was freed

    devices = simtrain.dist.spawn(rank_code, world=2).report.data["devices"]
    for device in devices:
        assert device["peak_memory_bytes"] == 6 << 20
        assert device["peak_memory_bytes_by_category"]["tensors"] == 6 << 20


def test_a_spawn_inside_a_spawn_is_refused():
    def rank_code(rank, world):
        simtrain.dist.spawn(lambda r, w: None, world=2)

    assert _quick(rank_code) == ("rank 0 raised SimtrainError: simtrain.dist.spawn: already running (a spawn "
                                 "cannot run inside another)")


WIDTH, BATCH = 512, 1024  # each Linear's parameters fill one 1 MiB DDP bucket


@simtrain.dist.distributed(world=2, bandwidth="50 GB/s", latency="5 us")
def test_ddp_bucket_all_reduce_overlaps_the_rest_of_backward(rank, world, cluster):
    dist.init_process_group("simtrain")
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH))
    model = DistributedDataParallel(layers, bucket_cap_mb=1)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()  # DDP's first iteration has all parameters in one bucket
    out = model(x)  # forward FLOPs are charged with the first bucket's all-reduce
    started_s = cluster.now_s
    out.square().mean().backward()
    step_s = cluster.now_s - started_s
    # Forward 2 matmuls, backward 3 (the first layer's input needs no gradient), 2*B*W*W FLOPs each, at
    # the A100's fp32 rate; the second layer's bucket is all-reduced while the first layer's backward
    # runs, so only the first layer's bucket (its weight and bias) adds its ring all-reduce.
    compute_s = 5 * 2 * BATCH * WIDTH * WIDTH / (19.5e12 * 0.5)
    bucket_bytes = (WIDTH * WIDTH + WIDTH) * 4
    all_reduce_s = 2 * (world - 1) * (5e-6 + bucket_bytes / (world * 50e9))
    assert step_s == pytest.approx(compute_s + all_reduce_s, rel=1e-9)


def test_a_futures_tensors_wait_for_their_collective_when_first_read():
    def rank_code(rank, world):
        dist.init_process_group("simtrain")
        first, second = torch.ones(1 << 16), torch.full((1 << 16,), 2.0)
        futures = [dist.all_reduce(t, async_op=True).get_future() for t in (first, second)]
        arriving = [future.value()[0] for future in futures]  # complete at once, the collectives are not
        return torch.cat(arriving)  # the read waits for both

    for joined in simtrain.dist.spawn(rank_code, world=2):
        assert torch.equal(joined, torch.cat([torch.full((1 << 16,), 2.0), torch.full((1 << 16,), 4.0)]))


def test_point_to_point_messages_match_by_tag_in_the_group_s_mailbox():
    """Reference: torch.distributed's semantics (gloo matches an irecv to the isend of the same source and
    tag): two messages sent with tags 1 then 2, received tag 2 first, each land where their tag says, through
    the group's one mailbox, beside a collective the ranks run meanwhile."""
    def rank_code(rank, world):
        dist.init_process_group("simtrain")
        if rank == 0:
            works = [dist.isend(torch.full((3,), 1.0), 1, tag=1), dist.isend(torch.full((3,), 2.0), 1, tag=2)]
            summed = torch.ones(4)
            dist.all_reduce(summed)
            for work in works:
                work.wait()
            return summed
        second, first, summed = torch.empty(3), torch.empty(3), torch.ones(4)
        work = dist.irecv(second, 0, tag=2)
        dist.all_reduce(summed)
        work.wait()
        dist.recv(first, 0, tag=1)
        return first, second, summed

    values = simtrain.dist.spawn(rank_code, world=2)
    first, second, summed = values[1]
    assert torch.equal(first, torch.full((3,), 1.0)) and torch.equal(second, torch.full((3,), 2.0))
    assert torch.equal(summed, torch.full((4,), 2.0)) and torch.equal(values[0], summed)


def test_a_package_s_module_globals_are_each_rank_s_own_as_a_process_s_would_be(tmp_path, monkeypatch):
    """Under `ranks_own_module_state`, a global that every rank sets (Megatron-Core's parallel state) reads back as
    the rank's own after other ranks ran, each rank starts from the value at the spawn's start (a container its
    own copy), and the spawn's values are put back at its end. No backend named is the CPU's default backend, as
    torch resolves it: simtrain's where it is set so."""
    import sys

    from simtrain.torchdist.module_state import ranks_own_module_state
    (tmp_path / "stateful_package").mkdir()
    (tmp_path / "stateful_package" / "__init__.py").write_text("_GROUP = None\n_SEEN = {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import stateful_package

    def rank(rank, world):
        dist.init_process_group()  # no backend named: the CPU's default, simtrain's here
        started = (stateful_package._GROUP, dict(stateful_package._SEEN))
        stateful_package._GROUP = rank
        stateful_package._SEEN[rank] = True
        dist.all_reduce(torch.ones(1))  # the other ranks run here
        return started, stateful_package._GROUP, dict(stateful_package._SEEN)

    monkeypatch.setitem(dist.Backend.default_device_backend_map, "cpu", "simtrain")
    with ranks_own_module_state("stateful_package"):
        results = simtrain.dist.spawn(rank, world=3, topology="ring", bandwidth="50 GB/s", latency="5 us")
    assert results == [((None, {}), r, {r: True}) for r in range(3)]
    assert stateful_package._GROUP is None and stateful_package._SEEN == {}
    del sys.modules["stateful_package"]
