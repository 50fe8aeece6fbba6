"""Mixed precision: loss scaling against torch.amp.GradScaler, training against plain torch, accuracy.

References: torch.amp.GradScaler on the same gradients; a single-process
torch loop doing Micikevicius-style fp16 training with GradScaler on fp32
master weights; fp32 training on digits.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import simtrain
from simtrain.hw.cluster import build_cluster, run_to_end
from simtrain.job import Job
from simtrain.scenario import ModelSpec
from simtrain.scenario import validate_scenario
from simtrain.train.data import ShardLoader, load_dataset
from simtrain.train.models import build_model
from simtrain.train.precision import LossScaler
from test_model_parallel import flat_parameters

SCALER_OPTIONS = {"init_scale": 2.0 ** 16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3}


def gradient_sequence(steps=14):
    """Random gradients with infs and a NaN injected, and clean runs long enough to grow the scale."""
    generator = torch.Generator().manual_seed(7)
    grads = [torch.randn(6, generator=generator) * 1e-3 for _ in range(steps)]
    grads[2][1] = float("inf")
    grads[3][0] = -float("inf")
    grads[8][5] = float("nan")
    return grads


@pytest.mark.parametrize("options", [SCALER_OPTIONS, {**SCALER_OPTIONS, "growth_factor": 3.0,
                                                      "backoff_factor": 0.25, "init_scale": 1000.0}])
def test_loss_scaler_follows_grad_scaler_step_for_step(options):
    reference = torch.amp.GradScaler("cpu", **options)
    param = torch.nn.Parameter(torch.zeros(6))
    optimizer = torch.optim.SGD([param], lr=1.0)
    ours = LossScaler(**options)
    skipped = []
    for grad in gradient_sequence():
        scale = reference.scale(torch.ones(()))  # the reference's current loss scale
        assert float(ours.scale) == float(scale)
        scaled = grad * scale  # what backward of the scaled loss would produce
        before = param.detach().clone()
        param.grad = scaled.clone()
        reference.step(optimizer)
        reference.update()
        mine = scaled.clone()
        found_inf = ours.unscale_(mine)
        ours.update(found_inf)
        skipped.append(found_inf)
        if found_inf:
            assert torch.equal(param.detach(), before)  # the reference skipped the step too
        else:
            assert torch.equal(param.grad, mine)  # GradScaler unscaled the gradient in place: bit for bit
            assert not torch.equal(param.detach(), before)
    assert float(ours.scale) == reference.get_scale()
    assert skipped.count(True) == 3


def fp16_reference(seed, steps, batch, hidden, lr, amp):
    """Plain torch: an fp16 model, fp32 master weights stepped through torch.amp.GradScaler."""
    data = load_dataset("digits", {}, seed)
    master = build_model(ModelSpec(name="mlp", hidden=hidden), data.info, seed)
    model = copy.deepcopy(master).half()
    optimizer = torch.optim.SGD(master.parameters(), lr=lr, foreach=False)
    scaler = torch.amp.GradScaler("cpu", **amp)
    loader = ShardLoader(data.train, 1, 0, batch, seed)
    for _ in range(steps):
        x, y = loader.next_batch()
        model.zero_grad()
        scaler.scale(F.cross_entropy(model(x.half()).float(), y)).backward()
        master_step(model, master, optimizer, scaler)
    return master, scaler


def master_step(model, master, optimizer, scaler) -> None:
    """An fp16 model's scaled gradients stepped on its fp32 master copy by GradScaler (skipped on an overflow),
    the master rounded back into the model."""
    for p16, p32 in zip(model.parameters(), master.parameters()):
        p32.grad = p16.grad.float()
    scaler.step(optimizer)
    scaler.update()
    with torch.no_grad():
        for p16, p32 in zip(model.parameters(), master.parameters()):
            p16.copy_(p32)


def scenario(precision, steps, devices=1, hidden=(32,), batch=16, lr=0.1, amp=None, momentum=0.0, parallel=None):
    return validate_scenario({
        "name": "amp", "seed": 2,
        "cluster": {"topology": "ring", "devices": devices},
        "model": {"name": "mlp", "hidden": list(hidden)},
        "data": {"name": "digits", "batch_size": batch},
        "train": {"steps": steps, "precision": precision, "amp": amp or {},
                  "optimizer": {"name": "sgd", "lr": lr, "momentum": momentum}},
        "report": {"trace": False},
        "parallel": parallel or {},
    })


def test_fp16_training_matches_torch_with_grad_scaler_including_overflows():
    # An initial scale of 2^30 overflows fp16 gradients: the first steps are skipped and the scale
    # backs off until the gradients fit, then grows every 4 clean steps.
    amp = {"init_scale": 2.0 ** 30, "growth_interval": 4}
    report = simtrain.run(scenario("fp16", steps=30, amp=amp))
    master, scaler = fp16_reference(seed=2, steps=30, batch=16, hidden=[32], lr=0.1, amp=amp)
    for (name, ours), (_, theirs) in zip(report.final_model.state_dict().items(), master.state_dict().items()):
        assert ours.dtype == torch.float32, name  # the trained model is the fp32 master copy
        assert torch.equal(ours, theirs), name
    section = report.data["amp"]
    assert section["loss_scale_final"] == scaler.get_scale()
    assert section["skipped_steps"] == section["overflow_steps"] > 0
    # Every skipped step halved the scale; the clean ones doubled it every 4 steps.
    clean = 30 - section["skipped_steps"]
    assert section["loss_scale_final"] == 2.0 ** 30 * 0.5 ** section["skipped_steps"] * 2.0 ** (clean // 4)


def test_fp16_all_reduce_moves_half_the_bytes_and_flops_run_at_the_fp16_peak():
    runs = {p: simtrain.run(scenario(p, steps=3, devices=4)) for p in ("fp32", "fp16")}
    wire = {p: sum(link["bytes"] for link in r.data["links"]) for p, r in runs.items()}
    assert wire["fp16"] * 2 == wire["fp32"]
    # a100-40gb: 19.5 TFLOP/s fp32, 312 TFLOP/s fp16 (dense); the same FLOPs are counted.
    compute = {p: r.data["breakdown_s"]["compute"] for p, r in runs.items()}
    assert compute["fp32"] / compute["fp16"] == pytest.approx(312 / 19.5, rel=1e-9)
    memory = runs["fp16"].data["devices"][0]["peak_memory_bytes_by_category"]
    params = sum(p.numel() for p in runs["fp16"].final_model.parameters())
    assert memory["weights"] == 2 * params and memory["master_weights"] == 4 * params
    assert memory["gradients"] == 2 * params + 4 * params  # fp16 bucket + fp32 master gradients


def test_bf16_keeps_no_loss_scale():
    section = simtrain.run(scenario("bf16", steps=3)).data["amp"]
    assert section == {"precision": "bf16", "loss_scale_final": None, "skipped_steps": 0, "overflow_steps": 0}


def test_fp16_and_bf16_reach_fp32_accuracy_on_digits():
    accuracy = {p: simtrain.run(scenario(p, steps=300, devices=2, hidden=(64,), batch=32, momentum=0.9))
                .data["final_accuracy"] for p in ("fp32", "fp16", "bf16")}
    assert accuracy["fp32"] > 0.9
    assert abs(accuracy["fp16"] - accuracy["fp32"]) <= 0.01
    assert abs(accuracy["bf16"] - accuracy["fp32"]) <= 0.01


@pytest.mark.parametrize("parallel,hidden", [({"pp": 2}, (32,)), ({"tp": 2}, (32,)), ({"pp": 2, "tp": 2}, (32, 32))],
                         ids=["pp2", "tp2", "pp2-tp2"])
def test_fp16_model_parallel_ranks_vote_on_overflows_and_skip_what_one_device_skips(parallel, hidden):
    # The 2^30 scale of the test above: every rank of the model's pp x tp group skips a step when any
    # share of the gradient overflowed, so all loss scalers agree after every step, and with the one
    # device's. Parameters: a split model is not bit for bit one device's even in fp32 (1e-8 after a
    # step); fp16 gradients round that to fp16's precision, and 30 steps at lr 0.1 grow it to ~2e-3.
    amp, steps = {"init_scale": 2.0 ** 30, "growth_interval": 4}, 30
    ranks = parallel.get("pp", 1) * parallel.get("tp", 1)
    alone = simtrain.run(scenario("fp16", steps=steps, hidden=hidden, amp=amp))
    spec = scenario("fp16", steps=steps, devices=ranks, hidden=hidden, amp=amp, parallel=parallel)
    cluster = build_cluster(spec.cluster, record=True, seed=spec.seed)
    scalers = []  # per step: every rank's (scale, skipped steps)

    def on_step(step, now, loss):
        scalers.append({(float(r.precision.scaler.scale), r.precision.skipped_steps) for r in job.replicas})

    job = Job(spec, cluster, range(ranks), on_step=on_step)
    job.start()
    run_to_end(cluster.env)
    job.finish()
    assert len(scalers) == steps and all(len(agreed) == 1 for agreed in scalers)
    section = job.replicas[0].precision.report()
    assert section == alone.data["amp"] and section["skipped_steps"] > 0
    torch.testing.assert_close(flat_parameters(job.scheme.trained_model()), flat_parameters(alone.final_model),
                               rtol=0, atol=5e-3)
    votes = 4 * 2 * (ranks - 1) * steps  # a ring all-reduce of one fp32 flag a step
    # the event log's byte totals (report/parallel.py sums them into bytes_by_kind)
    assert sum(cluster.log.bytes_by_label(rank, "communication")["overflow_vote"] for rank in range(ranks)) == votes


def test_representatives_time_the_overflow_vote_as_every_rank_does():
    # numerics off, dp 2 x pp 2 x tp 2: one rank per stage runs, waits for the other stage at the vote and
    # takes the mirrored all-reduce's time; the full simulation runs all 8 ranks' votes on the network.
    raw = {"name": "vote", "seed": 1, "numerics": False, "cluster": {"devices": 8, "topology": "ring"},
           "model": {"name": "gpt", "hidden": 64, "layers": 4, "heads": 4},
           "data": {"name": "tokens", "batch_size": 8, "samples": 256, "seq_len": 16, "vocab": 32},
           "train": {"steps": 3, "precision": "fp16"}, "report": {"trace": False}}
    reports = [simtrain.run(validate_scenario({**raw, "parallel": {
        "dp": 2, "pp": 2, "tp": 2, "pipeline": {"microbatches": 2}, "representatives": mirrored}})).data
        for mirrored in (False, True)]
    assert reports[1]["sim_time_s"] == pytest.approx(reports[0]["sim_time_s"], rel=0.01)
    votes = 2 * 3 * 4 * 2 * (4 - 1)  # replicas x steps x a ring all-reduce of one fp32 flag among 4 ranks
    assert [r["parallel"]["bytes_by_kind"]["overflow_vote"] for r in reports] == [votes, votes]
