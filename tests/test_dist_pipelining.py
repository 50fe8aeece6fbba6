"""torch.distributed.pipelining in users' code, on simulated ranks (`simtrain.dist.spawn`): PipelineStage with
ScheduleGPipe, Schedule1F1B and ScheduleInterleaved1F1B, alone and on a 3-D ("pp", "dp", "tp") mesh with FSDP2 and
sequence-parallel tensor parallelism.

References: one process training the whole model on the global batch; the same training code on 2 and 8 real gloo
processes; the activations a stage sends, in closed form.
"""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import simtrain.dist
from dist_llama import (BATCH, DIM, MICROBATCHES, SEQ, STEPS, batches, loss_fn, pipeline_training, single_process,
                        stage_model)
from gloo_processes import run_on_gloo

# name -> (world, pp, tp, schedule, stages per rank)
RUNS = {"gpipe": (2, 2, 1, "gpipe", 1), "1f1b": (2, 2, 1, "1f1b", 1), "interleaved": (2, 2, 1, "interleaved", 2),
        "3d": (8, 2, 2, "1f1b", 1)}


def pipeline_code(rank, world, name):
    """Runs under gloo too: this rank's stages' full parameters after the run `name` of RUNS."""
    _, pp, tp, schedule, stages_per_rank = RUNS[name]
    return pipeline_training(world, pp, tp, schedule, stages_per_rank)


def simtrain_pipeline(rank, world, name):
    dist.init_process_group("simtrain")
    return pipeline_code(rank, world, name)


@pytest.fixture(scope="module", params=sorted(RUNS))
def pipeline(request):
    name = request.param
    world = RUNS[name][0]
    return name, simtrain.dist.spawn(lambda rank, size: simtrain_pipeline(rank, size, name), world=world)


@pytest.mark.slow
def test_each_stage_s_parameters_equal_one_process_on_the_global_batch(pipeline):
    name, results = pipeline
    world, pp, tp = RUNS[name][:3]
    expected = single_process(world // pp // tp)
    covered = set()
    for out in results:
        assert out
        for parameter, value in out.items():
            torch.testing.assert_close(value, expected[parameter], rtol=0, atol=1e-5)
        covered |= out.keys()
    assert covered == expected.keys()  # the stages hold the whole model between them


@pytest.mark.slow
@pytest.mark.gloo
def test_the_same_pipeline_code_gives_what_gloo_gives(pipeline):
    name, results = pipeline
    gloo = run_on_gloo(pipeline_code, RUNS[name][0], (name,))
    for rank, out in enumerate(results):
        assert out.keys() == gloo[rank].keys()
        for parameter, value in gloo[rank].items():
            torch.testing.assert_close(out[parameter], value, rtol=0, atol=1e-5)


def test_a_step_sends_each_microbatch_s_activations_forward_and_their_gradients_back():
    """After the first step (which also sends the stages' shapes), rank 0 sends the activations of the whole
    batch and rank 1 their gradients, each as float32: BATCH x SEQ x DIM x 4 bytes per step."""

    @simtrain.dist.distributed(world=2)
    def two_stages(rank, world, run):
        dist.init_process_group("simtrain")
        model = stage_model(rank, world)
        schedule = ScheduleGPipe(PipelineStage(model, rank, world, torch.device("cpu")), n_microbatches=MICROBATCHES,
                                 loss_fn=loss_fn)
        sent = []
        for tokens, targets in batches(0):
            schedule.step(tokens if rank == 0 else None, target=targets if rank == 1 else None)
            sent.append(run.bytes_sent(rank))
        assert [b - a for a, b in zip(sent, sent[1:])] == [BATCH * SEQ * DIM * 4] * (STEPS - 1)

    two_stages()
