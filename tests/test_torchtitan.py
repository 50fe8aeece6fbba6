"""`simtrain torchtitan`: torchtitan's own Trainer on simulated ranks (simtrain/frameworks/torchtitan.py), against
the same Trainer on real gloo processes, and its numerics off against its numerics on."""
import json

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is an optional extra: pip install -e '.[titan]'")

import simtrain.dist  # noqa: E402
from gloo_processes import run_on_gloo  # noqa: E402
from simtrain.cli import main  # noqa: E402
from simtrain.errors import ScenarioError  # noqa: E402
from simtrain.frameworks.torchtitan import parse_config, run_torchtitan, simulated_machine, train  # noqa: E402
from simtrain.scenario import load_cluster  # noqa: E402
from titan_ranks import full_parameters, gloo_rank, job, titan_assets  # noqa: E402

CLUSTER = "scenarios/quickstart.yaml"
pytestmark = pytest.mark.frameworks  # make test-frameworks


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return titan_assets(tmp_path_factory.mktemp("titan"))


@pytest.mark.slow
@pytest.mark.gloo
@pytest.mark.parametrize("layout", [("--parallelism.tensor_parallel_degree", "2"),
                                    ("--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs",
                                     "--parallelism.pipeline_parallel_schedule", "1F1B"),
                                    ("--parallelism.context_parallel_degree", "2", "--training.seq_len", "256")],
                         ids=["fsdp2-tp2", "pp2-fsdp2-1f1b", "cp2-fsdp2"])
def test_training_equals_the_same_trainer_on_gloo(assets, layout):
    """FSDP 2 x TP 2, and 2 pipeline stages (1F1B) x FSDP 2, on 4 ranks, 3 steps: each rank's logged losses and
    every trained parameter it holds as 4 gloo processes give (the losses a last stage logs positive)."""
    arguments = job(assets, *layout)
    reference = run_on_gloo(gloo_rank, 4, (arguments,))

    def rank(rank, world):
        run = train(arguments, numerics=True)
        return run.losses, full_parameters(run.trainer)

    with simulated_machine():
        result = simtrain.dist.spawn(rank, scenario=load_cluster(CLUSTER, [], 4), timeout_s=None)
    assert len(result[3][0]) == 3 and all(loss > 0 for loss in result[3][0])
    for (losses, parameters), (gloo_losses, gloo_parameters) in zip(result, reference):
        assert losses == pytest.approx(gloo_losses, rel=1e-5)
        assert parameters.keys() == gloo_parameters.keys()
        for name, value in parameters.items():
            torch.testing.assert_close(value, gloo_parameters[name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("--parallelism.tensor_parallel_degree", "2"),
                                    ("--parallelism.pipeline_parallel_degree", "2", "--training.disable_cuda_graphs"),
                                    ("--parallelism.context_parallel_degree", "2", "--training.seq_len", "256")],
                         ids=["fsdp2-tp2", "pp2-fsdp2-interleaved", "cp2-fsdp2"])
def test_numerics_off_charges_what_numerics_on_charges(assets, layout):
    """Fake tensors cost what real ones do: the same step times, bytes sent and peak memory per category (FSDP 2 x
    TP 2, numerics off running one tensor-parallel rank for both, representatives; 2 pipeline stages of
    interleaved 1F1B, torchtitan's default schedule, x FSDP 2; context parallel 2 x FSDP 2). Without values there is no loss to log:
    torchtitan's metric logging, and the all-reduces of the loss it makes on the steps it logs, are off on both
    sides."""
    arguments = job(assets, *layout, "--training.steps", "2")
    on = run_torchtitan(arguments, load_cluster(CLUSTER, [], 4), numerics=True, log_metrics=False)
    off = run_torchtitan(arguments, load_cluster(CLUSTER, [], 4), numerics=False)
    # 0.08 ns (5e-8) apart: the tensor-parallel peer stood in for is that much later in the full run (a small
    # operator of its own; not traced)
    assert off.step_s == pytest.approx(on.step_s, rel=1e-6)
    assert len(on.step_s) == 2 and off.losses == on.losses == []
    for with_values, without in zip(on.result.report.data["devices"], off.result.report.data["devices"]):
        assert without["bytes_sent"] == with_values["bytes_sent"]
        assert without["peak_memory_bytes_per_category"] == with_values["peak_memory_bytes_per_category"]


def test_the_command_writes_its_report_the_same_every_time_and_a_bad_argument_is_one_line(assets, tmp_path,
                                                                                         capsys):
    """Two runs of one job write the same report.json, byte for byte; an argument torchtitan rejects, and degrees
    that do not divide the ranks, end in one line and exit code 2."""
    reports = []
    arguments = job(assets, "--training.steps", "2")
    for out in (tmp_path / "first", tmp_path / "second"):
        with pytest.raises(SystemExit) as ended:
            main(["torchtitan", "--cluster", CLUSTER, "--ranks", "2", "--out", str(out), "--", *arguments])
        assert ended.value.code == 0
        reports.append((out / "report.json").read_bytes())
    assert reports[0] == reports[1]
    out = tmp_path / "first"
    report = json.loads((out / "report.json").read_text())
    assert report["ranks"] == 2 and len(report["steps_s"]) == 2 and report["step_time_s"] > 0
    assert report["tokens_per_s_per_gpu"] == pytest.approx(2 * 128 / report["step_time_s"])
    assert report["losses"] == []  # numerics off: no loss has a value
    assert json.loads((out / "trace.json").read_text())["traceEvents"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as ended:
        main(["torchtitan", "--cluster", CLUSTER, "--out", str(out), "--", *arguments, "--training.no_such_key", "1"])
    assert ended.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "torchtitan's arguments" in error[0] and "no_such_key" in error[0]
    with pytest.raises(SystemExit) as ended:
        main(["torchtitan", "--cluster", CLUSTER, "--ranks", "3", "--out", str(out), "--", *arguments,
              "--parallelism.tensor_parallel_degree", "2"])
    assert ended.value.code == 2
    assert capsys.readouterr().err.strip() == ("error: torchtitan's arguments: parallelism: pp 1 x cp 1 x tp 2 does "
                                               "not divide the 3 ranks")
    with pytest.raises(SystemExit) as ended:  # torchtitan 0.3.0's default backend, on torch 2.13
        main(["torchtitan", "--cluster", CLUSTER, "--ranks", "2", "--out", str(out), "--", *arguments,
              "--parallelism.spmd_backend", "spmd_types"])
    assert ended.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "spmd_types" in error[0] and "partial_dtensor" in error[0]


def test_a_refusal_tyro_wraps_over_lines_is_one_whole_line(assets):
    """torchtitan's check that pipeline stages run without CUDA graphs, which tyro prints over two lines: one line,
    whole, saying what to pass."""
    with pytest.raises(ScenarioError) as refused:
        parse_config(job(assets, "--parallelism.pipeline_parallel_degree", "2"))
    assert str(refused.value) == ("torchtitan's arguments: Error parsing Config: CUDA graphs do not support pipeline "
                                  "parallelism yet. Set --training.disable_cuda_graphs.")
