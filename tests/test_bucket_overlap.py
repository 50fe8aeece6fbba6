"""Megatron-Core's overlap of the distributed optimizer's reduce-scatters and all-gathers with the compute
(strategies/bucket_overlap.py, `parallel.sharding.overlap_grad_reduce` / `overlap_param_gather`) against references.

- Buckets: Megatron-Core's cut (param_and_grad_buffer.py), written out by hand: the first stage's first chunk
  in reverse parameter order, closed at `bucket_size` elements; every other chunk one bucket.
- Numerics: on two replicas (a sum of two is the same either way round) the overlapped buckets train what the
  one reduce-scatter after the backward trains, bit for bit, with the gathers deferred into the next forward,
  under pp x tp (interleaved) and under tp with sequence parallelism (whole parameters summed bucket by bucket).
- Time, the closed form on links without latency, each bucket's reduce-scatter and all-gather hidden behind
  the compute but the ones nothing is left to hide: with the reduce-scatters overlapped a step is its compute
  and update plus the last bucket's ring reduce-scatter, S_0 e / 2 / B (two replicas: one ring step of half
  the bucket); with the all-gathers deferred, the next step adds the first bucket's all-gather, the same;
  against 2 P e / 2 / B exposed when the whole buffer is reduce-scattered and all-gathered after the backward;
  after the last step, its deferred all-gathers run (P e / 2 / B), so that a run of N steps moves N steps' bytes.
- Bad input: one line naming the key.
"""
import pytest
import torch

from simtrain import run
from simtrain.errors import ScenarioError
from simtrain.strategies.bucket_overlap import megatron_buckets
from simtrain.scenario import validate_scenario
from simulated_steps import flat_parameters, one_step

GPT = {"name": "overlap", "seed": 1, "model": {"name": "gpt", "hidden": 32, "layers": 2, "heads": 4},
       "data": {"name": "tokens", "batch_size": 4, "samples": 64, "seq_len": 8, "vocab": 16},
       "train": {"steps": 3, "precision": "bf16", "optimizer": {"name": "adam", "lr": 1e-3}},
       "report": {"trace": False}}
OVERLAP = {"overlap_grad_reduce": True, "overlap_param_gather": True}


def scenario(parallel: dict, sharding: dict, steps: int = 3):
    devices = parallel["dp"] * parallel.get("pp", 1) * parallel["tp"]
    return validate_scenario({**GPT, "cluster": {"devices": devices}, "train": {**GPT["train"], "steps": steps},
                              "parallel": {**parallel, "sharding": {"stage": 1, **sharding}}})


def test_buckets_are_megatron_cores_cut():
    chunks = [[5, 3, 4, 2, 6], [7, 1]]
    # reverse order: 6 + 2 = 8 closes a bucket, then 4 + 3 = 7, + 5 = 12 closes the next
    assert megatron_buckets(chunks, [True, False], bucket_size=8) == [[0, 1, 2], [3, 4], [5, 6]]
    # 6 closes one alone, 2 + 4 = 6 the next, 3 + 5 = 8 the last
    assert megatron_buckets(chunks, [True, False], bucket_size=6) == [[0, 1], [2, 3], [4], [5, 6]]
    # what is left when the parameters run out is a bucket of its own
    assert megatron_buckets([[1, 9, 1]], [True], bucket_size=9) == [[0], [1, 2]]
    assert megatron_buckets(chunks, [False, False], bucket_size=1) == [[0, 1, 2, 3, 4], [5, 6]]
    assert megatron_buckets([[], [2, 2]], [True, True], bucket_size=1) == [[0], [1]]


LAYOUTS = {"zero1-pp-tp-interleaved": (1, dict(dp=2, pp=2, tp=2, pipeline={"schedule": "interleaved",
                                                                            "virtual_stages": 2, "microbatches": 2})),
           "zero2-tp-sequence-parallel": (2, dict(dp=2, tp=2, sequence_parallel=True, pipeline={"microbatches": 2}))}


@pytest.mark.parametrize("stage, layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_overlapped_buckets_train_what_one_reduce_scatter_trains_bit_for_bit(stage, layout):
    overlapped = run(scenario(layout, {"stage": stage, **OVERLAP, "bucket_size": 200}, steps=2))
    after = run(scenario(layout, {"stage": stage}, steps=2))
    assert overlapped.data["sharding"]["units"] > 2  # rank 0's first chunk cut into buckets
    assert torch.equal(flat_parameters(overlapped.final_model), flat_parameters(after.final_model))
    losses = [[loss for *_, loss in report.data["train_loss_curve"]] for report in (overlapped, after)]
    assert losses[0] == losses[1]
    moved = [report.data["sharding"]["bytes_by_kind"] for report in (overlapped, after)]
    assert moved[0]["reduce_scatter"] == moved[1]["reduce_scatter"]
    assert moved[0]["all_gather"] == moved[1]["all_gather"]  # the last step's gathers run at the end of the run


BANDWIDTH = 2e10  # B/s between the two nodes: each replica's tp pair on one node


def timed(sharding: dict, steps: int):
    return one_step(validate_scenario({
        "name": "overlap-time", "seed": 0, "numerics": False,
        "cluster": {"topology": "fat_tree", "devices": 4, "gpus_per_node": 2, "nodes_per_leaf": 2, "device": {"base": "h100-80gb", "peak_flops": {"bf16": 2e12}},
                    "link": {"bandwidth": 1e15, "latency": 0}, "inter_node_link": {"bandwidth": BANDWIDTH,
                                                                                  "latency": 0}},
        "model": {"name": "gpt", "hidden": 64, "layers": 4, "heads": 4},
        "data": {"name": "tokens", "batch_size": 4, "samples": 64, "seq_len": 64, "vocab": 64},
        "train": {"steps": steps, "precision": "bf16", "optimizer": {"name": "adam", "lr": 1e-3}},
        "parallel": {"dp": 2, "tp": 2, "sharding": {"stage": 1, **sharding}}, "report": {"trace": False}}))


def step_times(job) -> list[float]:
    ends = [end for end, _ in job.scheme.loss_curve]
    return [later - earlier for earlier, later in zip([0.0, *ends], ends)]


def test_exposed_communication_is_the_closed_form_of_the_buckets_nothing_hides():
    after, overlapped = timed({}, 1), timed({**OVERLAP, "bucket_size": 20_000}, 2)
    layout = overlapped.replicas[0].layout
    assert len(layout.units) == 5

    def ring_step_s(numel: int) -> float:  # two replicas: one ring step, half the (padded) buffer each way, bf16
        return numel / 2 * 2 / BANDWIDTH

    whole, first = after.replicas[0].layout.padded_numel, layout.chunk_numel(0) * 2  # the embedding's bucket
    assert after.cluster.log.total(0, "communication") == pytest.approx(2 * ring_step_s(whole), rel=1e-4)
    compute = after.cluster.log.total(0, "compute") + after.cluster.log.total(0, "optimizer")
    # step 1: the embedding's bucket, the last one the backward completes, reduce-scattered after it; step 2:
    # besides, the same bucket's all-gather, the first one the forward needs; every other gather hides
    assert step_times(overlapped) == pytest.approx([compute + ring_step_s(first), compute + 2 * ring_step_s(first)],
                                                 rel=1e-4)
    # after the last step, its deferred all-gathers, bucket after bucket: the whole buffer's, exposed
    assert overlapped.cluster.log.last_end_s - sum(step_times(overlapped)) == pytest.approx(ring_step_s(whole),
                                                                                            rel=1e-4)


@pytest.mark.parametrize("parallel, sharding, message", [
    ({"dp": 2, "tp": 2}, {"stage": 3, "overlap_grad_reduce": True}, "parallel.sharding.overlap_grad_reduce: stage 3"),
    ({"dp": 2, "tp": 2}, {"overlap_param_gather": True}, "parallel.sharding.overlap_param_gather: needs "
                                                         "overlap_grad_reduce"),
    ({"dp": 4, "tp": 1}, {"overlap_grad_reduce": True}, "parallel.sharding.overlap_grad_reduce: .* pp/tp"),
    ({"dp": 2, "tp": 2}, {"overlap_grad_reduce": True, "bucket_size": 0}, "parallel.sharding.bucket_size"),
])
def test_bad_input_is_one_line_naming_the_key(parallel, sharding, message):
    with pytest.raises(ScenarioError, match=message):
        scenario(parallel, sharding)


# ---------------------------------------------------------------- DDP's buckets under pp/tp (parallel.overlap)

def ddp(layout: dict, overlap: bool, steps: int = 2, bucket_cap_mb: float = 0.008):
    devices = layout["dp"] * layout.get("pp", 1) * layout["tp"]
    return validate_scenario({**GPT, "cluster": {"devices": devices}, "train": {**GPT["train"], "steps": steps},
                              "parallel": {**layout, "overlap": overlap, "bucket_cap_mb": bucket_cap_mb}})


@pytest.mark.parametrize("layout", [layout for _, layout in LAYOUTS.values()], ids=LAYOUTS.keys())
def test_ddp_buckets_under_pp_tp_train_what_one_all_reduce_trains_bit_for_bit_and_hide_behind_the_backward(layout):
    """parallel.overlap under pp/tp (Megatron-Core's DDP with --overlap-grad-reduce): each bucket of
    bucket_cap_mb all-reduced in the last microbatch's backward once complete. Two replicas: the same sums."""
    overlapped, after = (one_step(ddp(layout, overlap, steps=2)) for overlap in (True, False))
    assert max(len(update.layout.units) for update in overlapped.scheme.data_parallel.buckets.values()) > 2
    for rank in range(overlapped.world):
        assert torch.equal(flat_parameters(overlapped.scheme.replicas[rank].model),
                           flat_parameters(after.scheme.replicas[rank].model))
    moved = [sum(job.cluster.log.bytes_by_label(rank, "communication").get("dp_allreduce", 0)
                 for rank in range(job.world)) for job in (overlapped, after)]
    assert moved[0] >= moved[1] > 0  # the same gradient; each bucket's ring rounds its chunks up
    if layout.get("pp", 1) > 1:  # compute to hide behind (under sp alone this tiny step is its tp collectives)
        # two buckets: the first hides behind the backward (the three above, each paying its ring's latency one
        # after another on the rank's stream, as NCCL runs them, cost this tiny step more than they hide)
        overlapped, after = (one_step(ddp(layout, overlap, steps=2, bucket_cap_mb=0.02)) for overlap in (True, False))
        assert overlapped.cluster.env.now < after.cluster.env.now


def test_an_overlap_flag_no_scheme_reads_is_one_line_naming_it():
    for parallel, message in (({"sharding": {"stage": 3}, "overlap": False}, "parallel.overlap: sets DDP's"),
                              ({"sharding": {"stage": 2}, "bucket_cap_mb": 4}, "parallel.bucket_cap_mb: sizes"),
                              ({"sharding": {"stage": 1, "reshard_after_forward": False}},
                               "parallel.sharding.reshard_after_forward: false keeps"),
                              ({"sharding": {"reduce_dtype": "bf16"}}, "parallel.sharding.reduce_dtype: sets"),
                              ({"sharding": {"degree": 2}}, "parallel.sharding.degree: sets"),
                              ({"async": {"consistency": "locked"}}, "parallel.async: options")):
        with pytest.raises(ScenarioError, match=message) as error:
            validate_scenario({**GPT, "cluster": {"devices": 4}, "parallel": parallel})
        assert "\n" not in str(error.value)
