"""Expert parallelism under pipeline and tensor parallelism computes what one device computes on the global batch.

References: single-process torch (the whole MoE gpt on the concatenation of
every data-parallel rank's batch, rank order, SGD: test_expert_parallel's
one_device) for the parameters and the dropped tokens; the routed token
counts of that model, rank by rank, times a token's bytes for what the
all-to-alls move, read back from the network's event log. With tp the
tokens are split over the tp ranks (with sequence parallelism or without: torchtitan's split of the whole
stream's tokens), never sent twice; without sequence parallelism the MoE layer's tp collectives are the dense
MLP's all-reduces, and its gradients are summed over tp (closed-form bytes).
"""
import pytest
import torch

from simtrain.errors import ScenarioError
from simtrain.strategies.shard_layout import ShardLayout
from simtrain.scenario import validate_scenario
from simtrain.train.data import hold_out_validation, load_dataset
from simtrain.train.models import build_model
from simtrain.train.moe import MoE
from simtrain.train.sampling import build_loader
from simulated_steps import bytes_by_label, flat_parameters, one_step
from test_expert_parallel import assert_same_parameters, one_device

HIDDEN, EXPERTS = 32, 4


def scenario(devices, ep, **arguments):
    return validate_scenario(raw_scenario(devices, ep, **arguments))


def raw_scenario(devices, ep, tp=1, pp=1, steps=1, capacity_factor=None, microbatches=None, numerics=True,
                 schedule="1f1b", virtual_stages=1, checkpointing="none", moe_routing=None, precision="fp32",
                 amp=None, aux_loss_coeff=0.0, seq_len=8, **parallel) -> dict:
    moe = {"experts": EXPERTS, "top_k": 2, "capacity_factor": capacity_factor, "aux_loss_coeff": aux_loss_coeff,
           **({"routing": moe_routing} if moe_routing else {})}
    parallel = {"ep": ep, "tp": tp, "pp": pp, "sequence_parallel": tp > 1, **parallel}
    parallel["pipeline"] = {"microbatches": microbatches, "schedule": schedule, "virtual_stages": virtual_stages}
    return {
        "name": "t", "seed": 1, "numerics": numerics,
        "cluster": {"topology": "switch", "devices": devices, "device": "h100-80gb"},
        "model": {"name": "gpt", "hidden": HIDDEN, "layers": 2, "heads": 2, "moe": moe},
        "data": {"name": "tokens", "batch_size": 4, "seq_len": seq_len, "vocab": 32},
        "train": {"steps": steps, "optimizer": {"name": "sgd", "lr": 0.1}, "precision": precision,
                  "checkpointing": checkpointing, "amp": amp or {}},
        "parallel": parallel, "report": {"trace": False},
    }


def leaving_assignments(spec, dp: int, ep: int) -> int:
    """Assignments the initial model routes, rank by rank, to experts held by another ep rank of the rank's group."""
    data = hold_out_validation(load_dataset(spec.data.name, spec.data.loader_options(), spec.seed),
                               spec.data.validation_fraction, spec.seed)
    reference = build_model(spec.model, data.info, spec.seed)
    per, leaving = EXPERTS // ep, 0
    for rank in range(dp):
        x, _ = build_loader(spec, data.train, dp, rank).next_batch()
        reference(x)
        for layer in (layer for layer in reference.modules() if isinstance(layer, MoE)):
            leaving += sum(count for expert, count in enumerate(layer.routing.tokens_per_expert)
                           if expert // per != rank % ep)
    return leaving


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "without sp"])
def test_ep2_tp2_pp2_trains_as_one_device_and_moves_each_routed_token_once(sequence_parallel):
    """8 devices (dp 2 = ep 2, tp 2 with sequence parallelism or without, pp 2 of 4 microbatches): the parameters
    of one device after a step; each exchange moves every assignment to another rank's expert once, a token's
    fp32 hidden vector: each tp rank dispatches only its part of the sequence (without sequence parallelism, the
    part it takes from the whole stream)."""
    spec = scenario(8, ep=2, tp=2, pp=2, sequence_parallel=sequence_parallel)
    job = one_step(spec)
    reference, dropped = one_device(spec, 2)
    assert_same_parameters(job.scheme.trained_model(), reference)
    leaving = leaving_assignments(spec, dp=2, ep=2)
    moved = bytes_by_label(job)
    assert leaving > 0
    for label in ("moe dispatch", "moe combine", "moe dispatch backward", "moe combine backward"):
        assert moved[label] == leaving * HIDDEN * 4
    moe = job.scheme.report_sections()["moe"]
    assert moe["all_to_all_bytes"] == [4 * leaving * HIDDEN * 4] and moe["dropped_tokens"] == dropped == [0]


def test_without_sequence_parallelism_the_moe_layers_tp_collectives_are_the_dense_mlps():
    """ep 2 x tp 2 x pp 2 over 8 devices, tp without sequence parallelism, 2 microbatches, two steps: torchtitan's
    MoE boundary under tp is an all-reduce of the input's gradient and one of the output, so the tp all-reduces
    move what those of the dense gpt of the same shape move (its MLP's "f" and "g"); the MoE layers' gradients
    (router, experts), each tp rank's share, are summed over tp after the backward: a ring all-reduce, 2 (t - 1)
    / t of each rank's MoE parameters, fp32; the parameters those of one device."""
    raw = raw_scenario(8, ep=2, tp=2, pp=2, steps=2, microbatches=2, sequence_parallel=False)
    job = one_step(validate_scenario(raw))
    reference, _ = one_device(job.scenario, 2)
    assert_same_parameters(job.scheme.trained_model(), reference)
    dense = {**raw, "model": {**raw["model"], "moe": None}, "parallel": {**raw["parallel"], "ep": 1}}
    moved, dense_moved = bytes_by_label(job), bytes_by_label(one_step(validate_scenario(dense)))
    assert moved["tp_allreduce"] == dense_moved["tp_allreduce"] > 0
    assert "tp_sp_grads" not in dense_moved  # no parameter of a dense gpt is a tp rank's share without sp
    experts = sum(p.numel() for replica in job.replicas for name, p in replica.model.named_parameters()
                  if ".moe." in name)
    assert moved["tp_sp_grads"] == 2 * 2 * (2 - 1) * experts * 4 // 2  # two steps


def test_without_sequence_parallelism_a_sequence_tp_does_not_cut_is_refused():
    with pytest.raises(ScenarioError, match=r"model.moe: under parallel.tp each tp rank routes its part of the "
                                            r"sequence; data.seq_len 7 does not divide into cp x tp = 2 equal parts"):
        one_step(scenario(2, ep=1, tp=2, sequence_parallel=False, seq_len=7))


def test_ep4_tp2_trains_as_one_device():
    """8 devices, dp 4 = ep 4 (one expert a rank), tp 2: two steps, the parameters of one device."""
    spec = scenario(8, ep=4, tp=2, steps=2)
    job = one_step(spec)
    reference, _ = one_device(spec, 4)
    assert_same_parameters(job.scheme.trained_model(), reference)


def test_an_interleaved_pipeline_trains_as_one_device():
    """ep 2 x pp 2 with two virtual stages a rank (embedding and a block, a block and the head), 2 microbatches."""
    spec = scenario(4, ep=2, pp=2, microbatches=2, schedule="interleaved", virtual_stages=2)
    job = one_step(spec)
    reference, _ = one_device(spec, 2)
    assert_same_parameters(job.scheme.trained_model(), reference)


def test_a_capacity_under_pp_drops_the_tokens_one_device_drops():
    """ep 2 x pp 2, one microbatch: the ep group decides capacity over its ranks' tokens in rank order, as one
    device over the global batch; two steps, the same drops and parameters."""
    spec = scenario(4, ep=2, pp=2, steps=2, capacity_factor=0.75, microbatches=1)
    job = one_step(spec)
    reference, dropped = one_device(spec, 2)
    assert job.scheme.report_sections()["moe"]["dropped_tokens"] == dropped
    assert sum(dropped) > 0
    assert_same_parameters(job.scheme.trained_model(), reference)


def test_balanced_routing_under_a_capacity_below_one_drops_and_moves_the_closed_form():
    """Numerics off, ep 4 alone, balanced routing, capacity_factor 0.5: each rank sends 16 of its 64 assignments
    to each expert, whose capacity is 0.5 x 64 = 32, so ranks 0 and 1 keep theirs and ranks 2 and 3 drop all
    (128 a layer). What crosses ranks: the kept rows bound for another rank's expert, 16 + 16 + 32 + 32 a layer,
    each 32 fp32 features, two layers. A rank sends only what it kept (a traceback before: the replayed pass
    sent the rows it measured)."""
    job = one_step(scenario(4, ep=4, capacity_factor=0.5, numerics=False))
    assert job.scheme.report_sections()["moe"]["dropped_tokens"] == [2 * 128]
    assert bytes_by_label(job)["moe dispatch"] == 2 * 96 * HIDDEN * 4


@pytest.mark.parametrize("stage", [1, 2])
def test_the_distributed_optimizer_shards_experts_over_their_holders_and_trains_as_one_device(stage):
    """ep 2 x pp 2 over 8 devices (dp 4: each expert held by 2 ranks), Megatron-Core's distributed optimizer: two
    steps give the parameters of one device. Each rank reduce-scatters and all-gathers its dense parameters over
    its 4 dp ranks and its experts over their 2 holders: (N-1)/N of each padded fp32 buffer per collective."""
    spec = scenario(8, ep=2, pp=2, steps=2, sharding={"stage": stage})
    job = one_step(spec)
    reference, _ = one_device(spec, 4)
    assert_same_parameters(job.scheme.trained_model(), reference)
    expected = 0
    for replica in job.replicas:
        named = [(name, p) for name, p in replica.model.named_parameters() if p.requires_grad]
        experts = sum(p.numel() for name, p in named if ".experts." in name)
        dense = sum(p.numel() for _, p in named) - experts
        expected += 4 * (3 * -(-dense // 4) + 1 * -(-experts // 2))  # (N-1) chunks of ceil(numel / N), fp32
    moved = bytes_by_label(job)
    assert experts > 0
    assert moved["reduce_scatter"] == moved["all_gather"] == 2 * expected  # two steps


@pytest.mark.parametrize("precision,tolerance", [("bf16", 0.1), ("fp8", 0.25)])
def test_experts_sharded_in_bf16_and_fp8_update_as_replicated_experts_do(precision, tolerance):
    """ep 2 x pp 2 over 8 devices with ZeRO-1, in bf16 and in fp8 (the experts' Linears too, an expert no token
    reached included): the update of two steps is that of ep 1 with DDP (every expert replicated, the path of
    the tests above) within the precision's noise (relative, in norm: measured 3.8% in bf16, 15% in fp8, where
    rounding and fp8's per-tensor scales see other token sets); an expert gradient scaled wrong by ep would be
    off by half."""
    def update(spec):
        job = one_step(spec)
        initial = build_model(spec.model, job.data.info, spec.seed)
        trained = dict(job.scheme.trained_model().named_parameters())
        return torch.cat([(trained[name].float() - start.bfloat16().float()).flatten()  # from the bf16 copy
                          for name, start in initial.named_parameters()])

    replicated = update(scenario(8, ep=1, pp=2, steps=2, precision=precision))
    sharded = update(scenario(8, ep=2, pp=2, steps=2, precision=precision, sharding={"stage": 1}))
    assert (sharded - replicated).norm() <= tolerance * replicated.norm()


def dense_and_experts(job, rank: int) -> tuple[int, int]:
    """(elements of the rank's replicated parameters, of its experts)."""
    named = [(name, p) for name, p in job.replicas[rank].model.named_parameters() if p.requires_grad]
    experts = sum(p.numel() for name, p in named if ".experts." in name)
    return sum(p.numel() for _, p in named) - experts, experts


def test_ddp_overlap_reduces_the_experts_buckets_over_their_holders_and_trains_as_one_device():
    """parallel.overlap with ep 2 x pp 2 over 8 devices (dp 4, each expert held by 2 ranks), Megatron-Core's expert
    buffers: the experts' gradients in buckets of their own, each all-reduced over the experts' holders beside the
    last microbatch's backward, the dense ones over the dp group. Two steps: the parameters of one device, and of
    the run that all-reduces after the backward within fp32's rounding (the same sums in another order); each
    ring moves 2 (N-1)/N of its buffer, fp32, per rank, as without overlap."""
    overlapped, after = (one_step(scenario(8, ep=2, pp=2, steps=2, overlap=overlap, bucket_cap_mb=0.004))
                         for overlap in (True, False))
    reference, _ = one_device(overlapped.scenario, 4)
    assert_same_parameters(overlapped.scheme.trained_model(), reference)
    torch.testing.assert_close(flat_parameters(overlapped.scheme.trained_model()),
                               flat_parameters(after.scheme.trained_model()), rtol=0, atol=1e-6)
    buckets = overlapped.scheme.data_parallel.buckets[0]
    assert buckets.buffer_of.count(1) > 1 and buckets.buffer_of.count(0) > 1  # several of each
    dense, experts = zip(*(dense_and_experts(overlapped, rank) for rank in range(8)))
    ring = {n: 2 * 2 * (n - 1) // n * 4 for n in (2, 4)}  # two steps of 2 (N-1)/N of the buffer, 4 bytes
    closed_form = {"dp_allreduce": ring[4] * sum(dense), "expert_allreduce": ring[2] * sum(experts)}
    for job in (overlapped, after):
        moved = bytes_by_label(job)
        assert {label: moved[label] for label in closed_form} == closed_form


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "without sp"])
def test_ddp_overlap_under_tp_posts_every_ranks_buckets_at_the_same_place_among_its_regions(sequence_parallel):
    """ep 2 x tp 2 (with sequence parallelism or without) over 8 devices with small buckets: each tp rank routes
    its own part of the sequence, so its experts' backward does its own share of the measured work; a bucket is
    posted at the same share of the region's way on every rank, so the tp ranks sum the gradients that are each
    one's share (sequence parallelism's whole parameters, or the MoE layers') bucket by bucket in one order. Two
    steps: the parameters of one device."""
    job = one_step(scenario(8, ep=2, tp=2, steps=2, overlap=True, bucket_cap_mb=0.004,
                            sequence_parallel=sequence_parallel))
    reference, _ = one_device(job.scenario, 4)
    assert_same_parameters(job.scheme.trained_model(), reference)


def test_ddp_overlap_with_experts_hides_their_all_reduce_behind_the_backward():
    """The same job with DDP's default buckets (one of each buffer a chunk): the experts' bucket is all-reduced
    while the layers before them run their backward, so the step is no longer than all-reducing after it."""
    overlapped, after = (one_step(scenario(8, ep=2, pp=2, steps=2, overlap=overlap)) for overlap in (True, False))
    assert overlapped.cluster.env.now <= after.cluster.env.now
    assert bytes_by_label(overlapped)["expert_allreduce"] == bytes_by_label(after)["expert_allreduce"] > 0


@pytest.mark.parametrize("sharding", [{"stage": 1, "overlap_grad_reduce": True, "bucket_size": 2000},
                                      {"stage": 2, "overlap_grad_reduce": True, "overlap_param_gather": True,
                                       "bucket_size": 2000}])
def test_the_distributed_optimizer_overlaps_the_experts_buckets_and_trains_as_one_device(sharding):
    """overlap_grad_reduce with ep 2 x pp 2 over 8 devices (dp 4, expert holders 2): the first stage's dense and
    expert buffers cut into Megatron-Core's buckets, each reduce-scattered over its own group beside the backward
    (and with overlap_param_gather all-gathered in the next forward). Two steps: the parameters of one device;
    each ring moves (N-1) padded chunks of each bucket per rank, N its group's ranks."""
    job = one_step(scenario(8, ep=2, pp=2, steps=2, sharding=sharding))
    reference, _ = one_device(job.scenario, 4)
    assert_same_parameters(job.scheme.trained_model(), reference)
    expected, groups = 0, set()
    for shard in job.scheme.replicas:
        layout = shard.layout
        groups.update(layout.unit_shards)
        expected += sum((n - 1) * layout.chunk_numel(unit) * 4 for unit, n in enumerate(layout.unit_shards))
    assert groups == {4, 2} and len(job.scheme.replicas[0].layout.units) > 2
    moved = bytes_by_label(job)
    assert moved["reduce_scatter"] == moved["all_gather"] == 2 * expected  # two steps


def test_the_distributed_optimizers_overlap_with_experts_shortens_the_step_and_moves_the_same_bytes():
    """ZeRO-1, ep 2 x pp 2 over 8 devices, Megatron-Core's default bucket size: with overlap_grad_reduce the
    step is shorter than reduce-scattering after the backward (measured 0.725 against 0.746 ms), the bytes the
    same."""
    overlapped, after = (one_step(scenario(8, ep=2, pp=2, steps=2, sharding={"stage": 1, "overlap_grad_reduce": on}))
                         for on in (True, False))
    assert overlapped.cluster.env.now < after.cluster.env.now
    assert ({label: bytes_by_label(overlapped)[label] for label in ("reduce_scatter", "all_gather")} ==
            {label: bytes_by_label(after)[label] for label in ("reduce_scatter", "all_gather")})


def test_without_numerics_every_layer_routes_evenly_and_reports_what_its_exchanges_moved():
    """ep 2 x tp 2 x pp 2 over 16 devices in bf16, numerics off, ZeRO-1: each rank routes its 2 x 8 / 2 = 8 tokens
    per microbatch evenly over the 4 experts (top 2: 4 assignments each), so an expert takes 8 from its ep group of
    2 and half of a rank's 16 assignments leave it, each way, a bf16 token of HIDDEN elements: the moe section's
    bytes are the exchanges' bytes in the event log, and the closed form."""
    spec = scenario(16, ep=2, tp=2, pp=2, steps=2, numerics=False, precision="bf16", sharding={"stage": 1},
                    microbatches=2)
    job = one_step(spec)
    moe = job.scheme.report_sections()["moe"]
    assert moe["routing"] == "balanced" and moe["imbalance"] == [1.0, 1.0]
    assert moe["tokens_per_expert_max"] == moe["tokens_per_expert_min"] == [8, 8]
    moved = bytes_by_label(job)
    exchanged = sum(moved[label] for label in ("moe dispatch", "moe combine", "moe dispatch backward",
                                               "moe combine backward"))
    ranks_of_an_exchange, layers_a_rank, microbatches = 16, 1, 2  # pp 2: one of the two blocks a stage
    closed_form = 4 * ranks_of_an_exchange * layers_a_rank * microbatches * 8 * HIDDEN * 2
    assert moe["all_to_all_bytes"] == [exchanged // 2] * 2 == [closed_form] * 2


def test_a_shard_layout_cuts_each_unit_over_its_own_group():
    """The dense unit over 4 ranks, the experts' over 2: each padded to its group, a shard one chunk of each."""
    layout = ShardLayout([5, 3, 7], units=[[0, 1], [2]], shards=(4, 2))
    assert [layout.chunk_numel(unit) for unit in (0, 1)] == [2, 4]
    assert (layout.padded_numel, layout.shard_numel) == (16, 6)
    assert layout.unit_slice(1) == slice(8, 16) and layout.shard_slice(1) == slice(2, 6)
    assert [layout.owned(1, position) for position in range(2)] == [1, 0]


@pytest.mark.parametrize("arguments,expected", [
    (dict(numerics=False, moe_routing={"model": "zipf"}), "model.moe.routing.model: drawn routing .zipf, "
                                                            "histogram. under parallel.pp or parallel.tp with "
                                                            "numerics off is not built"),
])
def test_what_is_not_built_is_refused_naming_the_key(arguments, expected):
    with pytest.raises(ScenarioError, match=expected):
        scenario(8, **{"ep": 2, "pp": 2, **arguments})


def test_an_ep_that_does_not_divide_the_jobs_dp_is_refused_when_the_job_is_built():
    with pytest.raises(ScenarioError, match="parallel.ep: 2 does not divide the 1 data-parallel ranks"):
        one_step(scenario(4, ep=2, tp=2, pp=2))
