"""A model cut into pipeline parts and tensor-parallel shares: which layers each rank holds, and what crosses a cut.

`part_counts` balances the model's splittable units over pp x v parts (by
measured FLOPs, or as `parallel.pipeline.split` says; a model that is not an
nn.Sequential, left uncut, is one unit run whole); `rank_shares` gives
every job rank its share (train/partition.py RankModule: its pipeline chunks,
the parts its schedule places on it (simtrain/parallel/schedules), cut to its
tp slice); `boundary_activations` gives the shape and dtype of
what each cut carries, an activation forward and its gradient back, from a
meta forward of the model: the size of a pipeline stage's receive buffers
(schemes/pipeline.py), known before anything arrives.

    units, counts = parts = part_counts(model, layout, scenario, sample_x)
    shares = rank_shares(model, layout, scenario, parts)
    boundaries = boundary_activations(model, units, counts, sample_x, torch.float16)
"""
import itertools

import torch

from ..errors import ScenarioError
from ..parallel.schedules import pipeline_placement
from ..train.checkpointing import require_attention
from ..train.partition import RankModule, balanced_counts, model_units, unit_flops, unit_passes
from ..train.ring_attention import ContextShard
from ..train.tensor_parallel import TP_BOUNDARIES
from ..parallel import Layout
from ..strategies.scheme_checks import NOTHING_TO_SPLIT, TP_CUT, check_pipeline_units, check_sequence


def part_counts(model, layout: Layout, scenario, sample_x: torch.Tensor) -> tuple[list, list[int]]:
    """The model's splittable units and how many go to each of its pp x v parts, balanced on batches shaped
    like `sample_x` (one-line errors name the field at fault)."""
    pipeline = scenario.parallel.pipeline
    parts = layout.pp * pipeline.virtual_stages
    pipeline_placement(scenario, layout.pp)  # the schedule runs with this layout (one-line errors otherwise)
    check_sequence(scenario.parallel, layout, sample_x.shape[1], scenario.model.moe is not None)
    try:
        units = model_units(model, tensor_parallel=layout.tp > 1, cut=parts * layout.tp * layout.cp > 1)
    except ValueError as error:
        raise ScenarioError(f"parallel.pp: {error}") from None
    check_pipeline_units(pipeline, parts, len(units))
    if pipeline.split is not None:
        return units, list(pipeline.split)
    if parts == 1:  # nothing to balance: the model is not run before the job starts
        return units, [len(units)]
    return units, balanced_counts(unit_flops(model, units, sample_x), parts)


def boundary_activations(model, units: list, counts: list[int], sample_x: torch.Tensor, dtype,
                         sequence_shards: int = 1) -> list[torch.Tensor]:
    """Meta tensors shaped as what each model part but the last hands on for a microbatch like `sample_x`
    (its activation, and the gradient that comes back), the model in compute dtype `dtype`: the receive
    buffers of a pipeline's messages, whose sizes a stage must know before they arrive. Under sequence
    parallelism a tp rank hands on its part of the sequence (dimension 1), one of `sequence_shards`."""
    passes = unit_passes(model, units, sample_x, dtype)
    boundaries = [passes[end - 1][1] for end in itertools.accumulate(counts[:-1])]
    return [h.narrow(1, 0, h.shape[1] // sequence_shards) if sequence_shards > 1 else h for h in boundaries]


def rank_shares(model, layout: Layout, scenario, parts: tuple[list, list[int]], ranks=None) -> list[RankModule | None]:
    """Every job rank's share of `model` under `layout`, cut into `parts` (part_counts' units and counts; None
    for a rank not in `ranks`, when given; one-line errors name the field at fault)."""
    units, counts = parts
    held = pipeline_placement(scenario, layout.pp)  # each pipeline rank's parts, as its schedule places them
    shares = []
    for rank in range(layout.world):
        if ranks is not None and rank not in ranks:
            shares.append(None)
            continue
        where = layout.coordinates(rank)
        try:
            shares.append(RankModule(model, units, counts, list(held[where["pp"]]), where["tp"], layout.tp,
                                     scenario.train.checkpointing, scenario.parallel.sequence_parallel,
                                     ContextShard(where["cp"], layout.cp),
                                     (layout.rank_groups(rank).ep.index(rank), layout.ep)))
        except ValueError as error:
            raise ScenarioError(TP_CUT.format(tp=layout.tp, error=error)) from None
    if scenario.train.checkpointing == "selective":
        require_attention(model)
    if layout.tp > 1 and not any(type(op) in TP_BOUNDARIES
                                 for share in shares if share is not None for ops in share.ops for op in ops):
        raise ScenarioError(NOTHING_TO_SPLIT)
    return shares
