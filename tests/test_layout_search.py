"""What would fit (simtrain/layout_search.py): every layout it offers fits when planned on its own, and the layouts
it tried before them do not."""
import pytest

from simtrain.hw.resolved_cluster import resolve_cluster
from simtrain.layout_search import layouts_that_fit
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


@pytest.mark.slow
def test_the_layouts_offered_fit_and_the_ones_tried_before_them_do_not():
    assert peak(scenario()) > MEMORY  # data parallelism alone does not fit
    fits = layouts_that_fit(scenario(), limit=2)
    assert len(fits) == 2
    for fit in fits:
        assert fit.dp * fit.pp * fit.tp == 4 and fit.batch_size * fit.dp == 4 * 8  # the same global batch
        assert peak(scenario(fit.dp, fit.pp, fit.tp, fit.batch_size, fit.checkpointing)) == fit.peak_bytes <= MEMORY
    # Tried first, in this order: full recomputation, then tp 2 (its activations do not shrink), with and without
    # recomputation, then pp 2 without it.
    for dp, pp, tp, batch, checkpointing in ((4, 1, 1, 8, "full"), (2, 1, 2, 16, "none"), (2, 1, 2, 16, "full"),
                                             (2, 2, 1, 16, "none")):
        assert peak(scenario(dp, pp, tp, batch, checkpointing)) > MEMORY
    assert fits[0].describe() == "pp 2 x dp 2, batch 16 per replica, train.checkpointing full"


def test_an_interleaved_pipeline_is_offered_layouts_without_one():
    """A layout without a pipeline has nothing to interleave: pp 1 candidates run with one chunk per device, and
    a scenario asking for chunks at pp 1 is refused on the key."""
    interleaved = scenario(dp=2, pp=2).model_dump(mode="json", by_alias=True)
    interleaved["parallel"]["pipeline"] = {"schedule": "interleaved", "virtual_stages": 2, "microbatches": 2}
    fits = layouts_that_fit(validate_scenario(interleaved), limit=1)
    assert [fit.describe() for fit in fits] == ["tp 2 x dp 2, batch 8 per replica"]  # crashed at pp 1 before
    interleaved["parallel"].update(dp=4, pp=1)
    with pytest.raises(ScenarioError, match=r"parallel.pipeline.virtual_stages: 2 chunks per device interleave a "
                                            r"pipeline; needs parallel.pp > 1, got 1$"):
        validate_scenario(interleaved)
