"""Mixture of experts composed with context parallelism, full recomputation under pp / tp, recomputation in segments
and fp16 trains as one device.

References: single-process torch (the whole MoE gpt on the concatenation of every data-parallel replica's batch,
rank order, SGD: test_expert_parallel's one_device) for the parameters and the dropped tokens, within fp32
rounding; the routing of that model (its routers' choices for each cp rank's chunks of every sequence) times a
token's bytes for what the exchanges move, read back from the network's event log; the same job without
recomputation for the moe section's figures under full recomputation and in segments; in fp16, one device's fp16
copy with fp32 masters and torch.amp.GradScaler, on the global batch in the job's micro-batches.

Under context parallelism each cp rank routes its own chunks of the sequence; the ep groups take the ranks of
dp x cp, cp first (Megatron-Core's expert mesh; parallel/layout.py), so an ep group can hold the two halves of a
sequence or several replicas' chunks. Nothing of the exchange changes: the tokens of a group's ranks go to
their experts and back.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from simtrain.train.data import hold_out_validation, load_dataset
from simtrain.train.models import build_model
from simtrain.train.moe import MoE
from simtrain.train.ring_attention import ContextShard, shard_sequence
from simtrain.train.sampling import build_loader
from simulated_steps import bytes_by_label, one_step
from test_precision import master_step
from test_expert_model_parallel import HIDDEN, EXPERTS, scenario
from test_expert_parallel import assert_same_parameters, one_device

EXCHANGES = ("moe dispatch", "moe combine", "moe dispatch backward", "moe combine backward")


@pytest.mark.parametrize("devices,parallel", [
    (4, dict(ep=1, cp=2, pp=2)),  # the experts whole on every rank, each cp rank routing its chunks
    (8, dict(ep=2, cp=2, pp=2)),  # ep 2 is each stage's cp group: the two halves of every sequence
    (8, dict(ep=2, cp=2, tp=2)),  # with sequence parallelism: a cp rank's chunks cut again over tp
], ids=["cp2-pp2", "ep2-cp2-pp2", "ep2-cp2-tp2"])
def test_moe_with_context_parallelism_trains_as_one_device(devices, parallel):
    spec = scenario(devices, **parallel)
    job = one_step(spec)
    reference, dropped = one_device(spec, job.layout.dp)
    assert_same_parameters(job.scheme.trained_model(), reference)
    assert job.scheme.report_sections()["moe"]["dropped_tokens"] == dropped == [0]


def leaving_by_cp_chunks(spec, dp: int, cp: int, ep_rank) -> int:
    """Assignments the initial model routes to experts another ep rank holds, each (dp, cp) rank routing its own
    chunks of its replica's sequences (the router's choices read on the whole batch, then cut as cp cuts it);
    `ep_rank(d, c)` is that rank's place in its ep group."""
    data = hold_out_validation(load_dataset(spec.data.name, spec.data.loader_options(), spec.seed),
                               spec.data.validation_fraction, spec.seed)
    reference = build_model(spec.model, data.info, spec.seed)
    logits = []
    for layer in (layer for layer in reference.modules() if isinstance(layer, MoE)):
        layer.router.register_forward_hook(lambda module, inputs, output: logits.append(output.detach()))
    per, top_k, leaving = EXPERTS // spec.parallel.ep, spec.model.moe.top_k, 0
    for d in range(dp):
        x, _ = build_loader(spec, data.train, dp, d).next_batch()
        logits.clear()
        reference(x)
        for layer_logits in logits:
            by_position = layer_logits.view(*x.shape, -1)
            for c in range(cp):
                chosen = shard_sequence(by_position, ContextShard(c, cp)).topk(top_k, dim=-1).indices
                leaving += int((chosen // per != ep_rank(d, c)).sum())
    return leaving


def test_an_ep_group_across_replicas_and_cp_ranks_moves_each_routed_token_once():
    """ep 4 over dp 2 x cp 2 (4 devices, one expert a rank): the group holds both replicas' cp ranks, cp first
    (ep rank c + 2 d). Each exchange moves every assignment of a rank's chunks to another rank's expert once, an
    fp32 token of HIDDEN elements; the parameters are one device's."""
    spec = scenario(4, ep=4, cp=2, pp=1)
    job = one_step(spec)
    reference, _ = one_device(spec, 2)
    assert_same_parameters(job.scheme.trained_model(), reference)
    leaving = leaving_by_cp_chunks(spec, dp=2, cp=2, ep_rank=lambda d, c: c + 2 * d)
    moved = bytes_by_label(job)
    assert leaving > 0
    for label in EXCHANGES:
        assert moved[label] == leaving * HIDDEN * 4


@pytest.mark.parametrize("devices,parallel", [
    (4, dict(ep=2, pp=2, microbatches=4)),  # 1F1B: a stage's forwards run ahead of the backwards that repeat them
    (8, dict(ep=2, tp=2, pp=2)),  # each unit run again with its sequence-parallel gathers and its exchanges
], ids=["ep2-pp2-1f1b", "ep2-tp2-pp2"])
def test_full_recomputation_under_pp_and_tp_trains_as_one_device_and_records_each_forward_once(devices, parallel):
    """train.checkpointing full: every unit's forward runs again before its backward, its MoE layers routing as
    they did and exchanging again. The parameters are one device's; the moe section's routing figures are those
    of the same job without recomputation (a forward run again records nothing, however the schedule orders the
    repeats), and its all-to-all seconds more (the repeated exchanges)."""
    spec = scenario(devices, checkpointing="full", **parallel)
    job = one_step(spec)
    reference, _ = one_device(spec, job.layout.dp)
    assert_same_parameters(job.scheme.trained_model(), reference)
    recomputed = job.scheme.report_sections()["moe"]
    kept = one_step(scenario(devices, **parallel)).scheme.report_sections()["moe"]
    for figure in ("tokens_per_expert_max", "tokens_per_expert_min", "all_to_all_bytes", "dropped_tokens",
                   "expert_share"):
        assert recomputed[figure] == kept[figure]
    assert recomputed["all_to_all_time_s"][0] > kept["all_to_all_time_s"][0]


@pytest.mark.parametrize("devices,parallel,checkpointing", [
    (2, dict(ep=2), "sqrt"),  # data parallelism alone: [embedding, block] recomputed, [block, head] kept
    (8, dict(ep=2, tp=2, pp=2), {"segments": 2}),  # each stage's first unit recomputed: the second stage's block
    (4, dict(ep=2, cp=2), "sqrt"),  # with its ring attention steps again
], ids=["ep2-sqrt", "ep2-tp2-pp2-segments2", "ep2-cp2-sqrt"])
def test_recomputation_in_segments_trains_as_one_device_and_exchanges_again(devices, parallel, checkpointing):
    """train.checkpointing sqrt or {segments: k} (Megatron-Core's --recompute-method uniform): a segment's MoE layers
    run again with their exchanges before its backward, routing as they did. The parameters are one device's; the
    routing figures are the job's without recomputation, its all-to-all seconds more."""
    spec = scenario(devices, checkpointing=checkpointing, **parallel)
    job = one_step(spec)
    reference, _ = one_device(spec, job.layout.dp)
    assert_same_parameters(job.scheme.trained_model(), reference)
    recomputed = job.scheme.report_sections()["moe"]
    kept = one_step(scenario(devices, **parallel)).scheme.report_sections()["moe"]
    for figure in ("tokens_per_expert_max", "all_to_all_bytes", "dropped_tokens", "expert_share"):
        assert recomputed[figure] == kept[figure]
    assert recomputed["all_to_all_time_s"][0] > kept["all_to_all_time_s"][0]


def fp16_one_device(spec, dp: int, microbatches: int):
    """Plain torch on one device: an fp16 copy of the whole model, fp32 master weights stepped through
    torch.amp.GradScaler, on the global batch in its dp x micro-batches parts, each part's loss (and balancing loss)
    a 1/(dp x micro-batches) share, both scaled by the loss scale. Returns (masters, scaler)."""
    data = hold_out_validation(load_dataset(spec.data.name, spec.data.loader_options(), spec.seed),
                               spec.data.validation_fraction, spec.seed)
    master = build_model(spec.model, data.info, spec.seed)
    model = copy.deepcopy(master).half()
    layers = [layer for layer in model.modules() if isinstance(layer, MoE)]
    loaders = [build_loader(spec, data.train, dp, d) for d in range(dp)]
    optimizer = torch.optim.SGD(master.parameters(), lr=spec.train.optimizer.lr, foreach=False)
    scaler = torch.amp.GradScaler("cpu", **spec.train.amp.model_dump())
    parts = dp * microbatches
    for _ in range(spec.train.steps):
        model.zero_grad()
        for x, y in [loader.next_batch() for loader in loaders]:
            for part_x, part_y in zip(x.chunk(microbatches), y.chunk(microbatches)):
                for layer in layers:
                    layer.aux_loss_scale = float(scaler.get_scale()) / parts
                loss = F.cross_entropy(model(part_x).float().flatten(0, 1), part_y.flatten()) / parts
                scaler.scale(loss).backward()
        master_step(model, master, optimizer, scaler)
    return master, scaler


def job_masters(job) -> dict[str, torch.Tensor]:
    """Every rank's fp32 master weights, by their names in the whole model (each expert from its holders)."""
    masters = {}
    for replica in job.replicas:
        names = {id(p): replica.model.sources[local].name for local, p in replica.model.named_parameters()}
        for model_param, master in zip(replica.precision.model_params, replica.precision.master_params):
            masters[names[id(model_param)]] = master.detach()
    return masters


def test_moe_in_fp16_scales_the_balancing_loss_and_votes_over_the_job_as_one_device_with_a_grad_scaler():
    """ep 2 x pp 2 over 4 devices (dp 2, 2 micro-batches), fp16 with the balancing loss at coefficient 1 (a large
    share of the routers' gradient), 3 steps from a loss scale of 2^22 that overflows the first step's fp16
    gradients and backs off by 2^-10: every rank skips that step (the whole job votes: a replica's ranks hold only
    their ep rank's experts) and keeps the scale of one device's GradScaler. The fp32 masters' update is one fp16
    device's within 5e-3 in norm (measured 4e-4; fp16's unit roundoff is 4.9e-4, and the ranks sum their fp16
    gradients in another order); the balancing loss's gradient left unscaled by the loss scale, as Megatron-Core's
    MoEAuxLossAutoScaler scales it, would be off by half (the routers' update by all of it)."""
    amp = {"init_scale": 2.0 ** 22, "backoff_factor": 2.0 ** -10}
    spec = scenario(4, ep=2, pp=2, microbatches=2, steps=3, precision="fp16", amp=amp, aux_loss_coeff=1.0)
    job = one_step(spec)
    reference, scaler = fp16_one_device(spec, dp=2, microbatches=2)
    amp_sections = {tuple(replica.precision.report().items()) for replica in job.replicas}
    assert amp_sections == {(("precision", "fp16"), ("loss_scale_final", scaler.get_scale()), ("skipped_steps", 1),
                             ("overflow_steps", 1))}
    initial = dict(build_model(spec.model, job.data.info, spec.seed).named_parameters())
    expected, masters = dict(reference.named_parameters()), job_masters(job)
    assert masters.keys() == expected.keys()
    update, reference_update = (torch.cat([(params[name].detach() - initial[name].detach()).flatten()
                                           for name in sorted(masters)]) for params in (masters, expected))
    assert (update - reference_update).norm() <= 5e-3 * reference_update.norm()
    ranks, steps = 4, 3  # a ring all-reduce of one fp32 flag among the job's 4 ranks, each step
    assert bytes_by_label(job)["overflow_vote"] == 4 * 2 * (ranks - 1) * steps
