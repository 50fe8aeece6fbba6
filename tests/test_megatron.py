"""Megatron-Core's own training (tests/megatron_ranks.py: parallel_state, GPTModel, its DistributedDataParallel,
distributed optimizer and pipeline schedules, unmodified) on simulated ranks (simtrain/frameworks/megatron.py),
against the same job on real gloo processes, and with numerics off."""
import json

import pytest
import torch

pytest.importorskip("megatron.core", reason="Megatron-Core is an optional extra: pip install -e '.[megatron]'")

import simtrain.dist  # noqa: E402
from simtrain.cli import main  # noqa: E402
from gloo_processes import run_on_gloo  # noqa: E402
from megatron_ranks import Layout, gloo_rank, train  # noqa: E402
from simtrain.frameworks.megatron import cpu_machine, simulated_machine  # noqa: E402
from simtrain.scenario import load_cluster  # noqa: E402

CLUSTER = "scenarios/quickstart.yaml"
# Megatron-Core 0.16.1 calls torch.distributed's all_gather_into_tensor and reduce_scatter_tensor, which torch 2.13
# deprecates with a FutureWarning (the suite makes the project's own FutureWarnings errors)
pytestmark = [pytest.mark.frameworks,  # make test-frameworks
              pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")]


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
def test_the_command_runs_a_torchrun_script_unchanged_as_the_job_runs(tmp_path, capsys):
    """`simtrain megatron -- megatron_script.py --tp 2` (rank and world from torchrun's environment, the nccl
    backend named, the device set from LOCAL_RANK): the losses the script prints are the job's own on simulated
    ranks, its second step takes the job's time between optimizer steps, and a second run writes the same
    report.json byte for byte."""
    layout = Layout(tp=2, steps=2)
    job = simulated(layout)
    reports = []
    for out in (tmp_path / "first", tmp_path / "second"):
        with pytest.raises(SystemExit) as ended:
            main(["megatron", "--cluster", CLUSTER, "--ranks", "4", "--numerics", "--out", str(out), "--",
                  "tests/megatron_script.py", "--tp", "2", "--steps", "2", "--print-losses"])
        assert ended.value.code == 0
        reports.append((out / "report.json").read_bytes())
    assert reports[0] == reports[1]
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rank 0 step")]
    assert printed[:2] == [f"rank 0 step {step + 1} loss {loss:.6f}" for step, loss in enumerate(job[0][0].tolist())]
    report = json.loads(reports[0])
    assert report["ranks"] == 4 and len(report["steps_s"]) == 2
    ends = job[0][2]  # the job's clock after each optimizer step
    assert report["step_time_s"] == pytest.approx(ends[1] - ends[0], rel=1e-9)
    assert [device["bytes_sent"] for device in report["devices"]] == \
        [device["bytes_sent"] for device in job.report.data["devices"]]


MISTAKES = {  # a script's mistake, and what its one line says
    "exits": ("import sys\nsys.exit(3)\n", "exited with status 3"),
    "mismatched": ("import os, torch, torch.distributed as dist\ndist.init_process_group(backend='nccl')\n"
                   "x = torch.ones(4)\ndist.broadcast(x, src=0) if os.environ['RANK'] == '1' else dist.all_reduce(x)\n",
                   "rank 0 called all_reduce(sum) of 4 float32, rank 1 called broadcast(root 0) of 4 float32"),
    "never_joins": ("import os, torch, torch.distributed as dist\nif os.environ['RANK'] == '0':\n"
                    "    dist.init_process_group(backend='nccl')\n    dist.all_reduce(torch.ones(4))\n",
                    "rank 0 waits on all_reduce(sum) of 4 float32 (collective #0 of group [0, 1]), which ranks [1] "
                    "have not called"),
    "out_of_memory": ("import torch\nx = torch.empty(10 ** 11)\n", "needs 372.5 GiB of 40.0 GiB"),
}


def test_a_missing_script_and_a_script_s_mistakes_are_one_line(tmp_path, capsys):
    """No script file, a script that exits with an error, collectives that differ across ranks, a rank that never
    joins its group, and a tensor larger than the device: each one line, exit code 2."""
    cases = [(tmp_path / "absent.py", f"error: script: {tmp_path / 'absent.py'}: no such file")]
    for name, (text, expected) in MISTAKES.items():
        (tmp_path / f"{name}.py").write_text(text)
        cases.append((tmp_path / f"{name}.py", expected))
    for script, expected in cases:
        with pytest.raises(SystemExit) as ended:
            main(["megatron", "--cluster", CLUSTER, "--ranks", "2", "--out", str(tmp_path / "out"), "--", str(script)])
        assert ended.value.code == 2
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and expected in error[0]


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
