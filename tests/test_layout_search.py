"""What would fit (simtrain/layout_search.py): every layout it offers fits when planned on its own, the layouts
it tried before them do not, its candidates come by predicted step time and its fits by replayed step time."""
import pytest

from simtrain.hw.resolved_cluster import resolve_cluster
from simtrain.layout_search import _candidates, layouts_that_fit
from simtrain.memory_plan import replay_step
from simtrain.errors import ScenarioError
from simtrain.scenario import validate_scenario

MEMORY = 40 * 10 ** 6  # bytes per device: a 3.3M-parameter gpt's fp32 Adam state (53 MB) needs a split


def scenario(dp: int = 4, pp: int = 1, tp: int = 1, batch: int = 8, checkpointing: str = "none"):
    return validate_scenario({
        "name": "layouts", "numerics": False,
        "cluster": {"topology": "ring", "devices": 4, "device": {"base": "a100-40gb", "memory": MEMORY}},
        "model": {"name": "gpt", "hidden": 256, "layers": 4, "heads": 4},
        "data": {"name": "tokens", "batch_size": batch, "seq_len": 64, "vocab": 256, "samples": 256},
        "train": {"steps": 1, "optimizer": {"name": "adam"}, "checkpointing": checkpointing},
        "parallel": {"dp": dp, "pp": pp, "tp": tp},
        "report": {"trace": False},
    })


def peak(spec) -> int:
    """The largest device's peak over one step, as `simtrain memory` replays it."""
    job = replay_step(spec, resolve_cluster(spec.cluster, spec.base_dir), spec.data.batch_size)
    return max(device.memory.peak_total for device in job.devices)


def scenario_of(fit):
    """The scenario a fit describes."""
    raw = scenario(fit.dp, fit.pp, fit.tp, fit.batch_size, fit.checkpointing).model_dump(mode="json", by_alias=True)
    raw["parallel"].update(cp=fit.cp, sequence_parallel=fit.sequence_parallel,
                           pipeline={"microbatches": fit.microbatches}, sharding={"stage": fit.stage})
    return validate_scenario(raw)


@pytest.mark.slow
def test_the_layouts_offered_fit_and_come_by_replayed_step_time():
    assert peak(scenario()) > MEMORY  # data parallelism alone does not fit
    fits = layouts_that_fit(scenario(), limit=3)
    assert len(fits) == 3
    for fit in fits:
        assert fit.dp * fit.pp * fit.tp * fit.cp == 4 and fit.batch_size * fit.dp == 4 * 8  # the same global batch
        assert peak(scenario_of(fit)) == fit.peak_bytes <= MEMORY
    assert [fit.step_time_s for fit in fits] == sorted(fit.step_time_s for fit in fits)
    assert len({(fit.dp, fit.pp, fit.tp, fit.cp) for fit in fits}) == 3  # each split of the devices once
    # what a torchtitan user tries first: accumulation and sharding on dp alone; cp is offered (it never was)
    assert fits[0].describe() == "dp 4, batch 8 per replica, 4 micro-batches, sharding.stage 2"
    assert any(fit.cp > 1 for fit in fits)
    # tried before the first: fewer micro-batches, or a lower stage, at the same predicted step time
    for microbatches, stage in ((1, 3), (2, 3), (4, 1)):
        raw = scenario().model_dump(mode="json", by_alias=True)
        raw["parallel"].update(pipeline={"microbatches": microbatches}, sharding={"stage": stage})
        assert peak(validate_scenario(raw)) > MEMORY


def test_candidates_come_in_order_of_predicted_step_time():
    """The relative prediction: recomputation (none 1, selective 1.05, full 4/3) times a pipeline's bubble
    (1 + (pp - 1) / m); selective before full, accumulation before a pipeline, cp and sp among them."""
    candidates = _candidates(scenario(), 4, 32)
    assert [c.predicted for c in candidates] == sorted(c.predicted for c in candidates)
    first = candidates[0]
    assert (first.dp, first.pp, first.tp, first.cp, first.microbatches, first.stage, first.checkpointing) == (
        4, 1, 1, 1, 1, 0, "none")
    pipelined = next(c for c in candidates if c.pp == 2 and c.microbatches == 4 and c.checkpointing == "none")
    assert pipelined.predicted == pytest.approx(1 + 1 / 4)
    order = [(c.dp, c.pp, c.tp, c.cp, c.checkpointing) for c in candidates]
    assert order.index((4, 1, 1, 1, "selective")) < order.index((4, 1, 1, 1, "full"))
    assert any(c.cp == 2 for c in candidates) and any(c.sequence_parallel for c in candidates)
    assert {c.stage for c in candidates} == {0, 1, 2, 3}


def test_an_interleaved_pipeline_is_offered_layouts_without_one():
    """A layout without a pipeline has nothing to interleave: pp 1 candidates run with one chunk per device, and
    a scenario asking for chunks at pp 1 is refused on the key."""
    interleaved = scenario(dp=2, pp=2).model_dump(mode="json", by_alias=True)
    interleaved["parallel"]["pipeline"] = {"schedule": "interleaved", "virtual_stages": 2, "microbatches": 2}
    fits = layouts_that_fit(validate_scenario(interleaved), limit=1)
    assert [fit.describe() for fit in fits] == ["dp 4, batch 4 per replica, 2 micro-batches, sharding.stage 2"]
    interleaved["parallel"].update(dp=4, pp=1)
    with pytest.raises(ScenarioError, match=r"parallel.pipeline.virtual_stages: 2 chunks per device interleave a "
                                            r"pipeline; needs parallel.pp > 1, got 1$"):
        validate_scenario(interleaved)
