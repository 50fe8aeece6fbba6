"""Megatron-Core's own training (tests/megatron_ranks.py: parallel_state, GPTModel, its DistributedDataParallel,
distributed optimizer and pipeline schedules, unmodified) on simulated ranks (simtrain/frameworks/megatron.py),
against the same job on real gloo processes, and with numerics off."""
import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core", reason="Megatron-Core is an optional extra: pip install -e '.[megatron]'")

import simtrain.dist  # noqa: E402
from gloo_processes import run_on_gloo  # noqa: E402
from megatron_ranks import Layout, gloo_rank, train  # noqa: E402
from simtrain.frameworks.megatron import cpu_machine, simulated_machine  # noqa: E402
from simtrain.scenario import load_cluster  # noqa: E402

CLUSTER = "scenarios/quickstart.yaml"
# Megatron-Core 0.16.1 calls torch.distributed's all_gather_into_tensor and reduce_scatter_tensor, which torch 2.13
# deprecates with a FutureWarning (the suite makes the project's own FutureWarnings errors)
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning",
                                        "ignore::DeprecationWarning")


def simulated(layout: Layout, numerics: bool = True):
    """The job on 4 simulated ranks: each rank's (losses, parameters, step end times) and the spawn's result."""
    def rank(rank, world):
        ends = []
        with cpu_machine():
            losses, parameters = train(rank, world, layout, after_step=lambda: ends.append(simtrain.dist.now_s()))
        return losses, parameters, ends

    with simulated_machine(numerics):
        return simtrain.dist.spawn(rank, scenario=load_cluster(CLUSTER, [], 4), numerics=numerics, timeout_s=None)


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("layout", [Layout(tp=2), Layout(pp=2), Layout(tp=2, pp=2), Layout(pp=2, vpp=2),
                                    Layout(experts=4, ep=2), Layout(experts=4, ep=2, tp=2),
                                    Layout(tp=2, overlap_grad_reduce=True),
                                    Layout(pp=2, overlap_grad_reduce=True, overlap_param_gather=True)],
                         ids=["tp2-dp2", "pp2-dp2-1f1b", "tp2-pp2", "pp2-vpp2-dp2-interleaved", "moe-ep2-dp2",
                              "moe-tp2-sp-ep2", "tp2-dp2-overlap-grad-reduce", "pp2-dp2-overlap-grad-and-param"])
def test_training_equals_the_same_job_on_gloo(layout):
    """3 steps on 4 ranks, the distributed optimizer: each rank's losses (its last stage's) and every parameter it
    holds as 4 gloo processes give, within 1e-5 (the collectives add in another order: 5e-7 to 4e-6 apart). MoE: 4
    experts, top-2, the alltoall token dispatcher, experts 2 per expert-parallel rank (all-to-alls of token counts
    that differ by rank). Overlapped: the gradients' reduce-scatter started from the backward pass's hooks, the
    parameters' all-gather waited on in the next forward's (the stream and event stand-ins)."""
    reference = run_on_gloo(gloo_rank, 4, (layout,))
    result = simulated(layout)
    for rank, ((losses, parameters, _), (gloo_losses, gloo_parameters)) in enumerate(zip(result, reference)):
        assert len(losses) == len(gloo_losses) == (3 if rank >= 4 - 4 // layout.pp else 0)
        torch.testing.assert_close(losses, gloo_losses, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(parameters, gloo_parameters, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_numerics_off_runs_to_the_end_and_charges_what_numerics_on_charges():
    """tp 2 x dp 2 without values: every step ends, and the bytes each rank sends and its peak memory per category
    are those of the run with values. Megatron reads its gradient norm's value (clipping, logging): off, the norm's
    work runs and its value is NaN (`grad_norm_without_values`), so both runs clip nothing."""
    layout = Layout(tp=2, clip_grad=0.0, steps=2, micro_batches=2)
    off = simulated(layout, numerics=False)
    on = simulated(layout, numerics=True)
    for with_values, without in zip(on.report.data["devices"], off.report.data["devices"]):
        assert without["bytes_sent"] == with_values["bytes_sent"] > 0
        assert without["peak_memory_bytes_per_category"] == with_values["peak_memory_bytes_per_category"]
    steps_off, steps_on = off[0][2], on[0][2]
    assert len(steps_off) == 2 and 0 < steps_off[0] < steps_off[1]
    assert steps_off == pytest.approx(steps_on, rel=1e-3)


@pytest.mark.slow
def test_moe_with_numerics_off_is_refused_in_one_line():
    """Megatron's dropless MoE routes by value: the token counts per expert, which size its all-to-alls, come from
    the router's top-k of fake scores. Numerics off cannot give them: the rank stops where the counts are gathered,
    with one line naming why, instead of a traceback from inside the backend."""
    layout = Layout(experts=4, ep=2, steps=1, micro_batches=1, clip_grad=0.0)
    with pytest.raises(simtrain.dist.RankFailed,
                       match=r"NumericsOffUnsupported: numerics off .*all_gather_into_tensor of \[4, 4\] int64 would "
                             r"write the values of a fake torch.int64 tensor into a real torch.int64 one: values that "
                             r"depend on the data"):
        simulated(layout, numerics=False)
