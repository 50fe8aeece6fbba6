"""Hostile input for the surfaces added since tests/test_hostile_input.py's pass (issue 31): sharded data
parallelism, mixture-of-experts, llama's keys, fp8, selective recomputation, sequence parallelism, the
all-to-all benchmark, sweeps (grids, Ray addresses), pbt replay, calibrated device files and
simtrain.dist.spawn's arguments.

Each ends in one line naming its key or option and exit code 2 (or, from Python, a SimtrainError of one
line), with nothing written; the contract is simtrain/errors.py's, as in test_hostile_input.py.
"""
import pytest
import torch

import simtrain.dist
from simtrain.errors import ScenarioError, SimtrainError
from simtrain.limits import MAX_FILE_BYTES
from simtrain.studies.sweep import parse_grid, run_sweep
from test_hostile_input import cli, one_line_error, strict_json

MLP = "cluster: {devices: 4}\nmodel: {hidden: [8]}\ntrain: {steps: 1}\nreport: {trace: false}\n"
GPT = "cluster: {devices: 2}\ndata: {name: tokens, seq_len: 16}\ntrain: {steps: 1}\nreport: {trace: false}\n"
GPT_MODEL = "model: {name: gpt, hidden: 32, layers: 2, heads: 4, moe: {%s}}\n"
LLAMA_MODEL = "model: {name: llama, hidden: 32, layers: 2, heads: 4, %s}\n"
HUGE = "1000000000000000000000000000000"


def sharding(fields: str) -> str:
    return MLP + f"parallel: {{sharding: {{{fields}}}}}\n"


HOSTILE_SCENARIOS = [
    # parallel.sharding
    *[(sharding(f"stage: {v}"), "parallel.sharding.stage") for v in ("4", "-1", "true", "'3'", "1.5", ".inf", HUGE)],
    *[(sharding(f"stage: 3, degree: {v}"), "parallel.sharding.degree")
      for v in ("0", "-1", "true", ".inf", "1.5", HUGE)],
    (MLP + "parallel: {dp: 4, sharding: {stage: 3, degree: 3}}\n",
     "parallel.sharding.degree: 3 does not divide parallel.dp 4"),
    *[(sharding(f"stage: 3, reshard_after_forward: {v}"), "parallel.sharding.reshard_after_forward")
      for v in ("1", "'yes'", "null")],
    *[(sharding(f"stage: 3, reduce_dtype: {v}"), "parallel.sharding.reduce_dtype") for v in ("fp8", "1", "true")],
    (MLP + "model: {hidden: [8, 8]}\nparallel: {pp: 2, sharding: {stage: 3, offload: optimizer}}\n",
     "parallel.sharding.offload: optimizer keeps the state in host memory; give cluster.shared_memory"),
    (MLP + "parallel: {sharding: 3}\n", "parallel.sharding"),
    # model.moe
    *[(GPT + GPT_MODEL % f"experts: {v}", "model.moe.experts") for v in ("0", "1", "-1", "1.0e30", ".inf", "x", HUGE)],
    *[(GPT + GPT_MODEL % f"top_k: {v}", "model.moe.top_k") for v in ("0", "-1", "9", ".inf", "x")],
    *[(GPT + GPT_MODEL % f"capacity_factor: {v}", "model.moe.capacity_factor")
      for v in ("0", "-1", "1.0e30", ".inf", ".nan", "x")],
    *[(GPT + GPT_MODEL % f"shared_experts: {v}", "model.moe.shared_experts") for v in ("-1", "1.0e30", "x", HUGE)],
    *[(GPT + GPT_MODEL % f"aux_loss_coeff: {v}", "model.moe.aux_loss_coeff") for v in ("-1", "1.0e30", ".inf", "x")],
    *[(GPT + GPT_MODEL % f"every: {v}", "model.moe.every") for v in ("0", "-1", "3", "1.0e30", "x")],
    (GPT + "model: {name: gpt, hidden: 32, layers: 2, heads: 4, moe: 3}\n", "model.moe"),
    (MLP + "model: {hidden: [8], moe: {experts: 2}}\n", "model.moe: mixture-of-experts layers are for the gpt"),
    # llama's keys
    *[(GPT + LLAMA_MODEL % f"kv_heads: {v}", "model.kv_heads") for v in ("0", "-1", "3", "8", "1.0e30", "x", "true")],
    *[(GPT + LLAMA_MODEL % f"ffn_hidden: {v}", "model.ffn_hidden") for v in ("0", "-1", "1.0e30", "x", HUGE)],
    *[(GPT + LLAMA_MODEL % f"rope_theta: {v}", "model.rope_theta")
      for v in ("0", "-1", "1", ".inf", "1.0e300", ".nan", "x")],
    (MLP + "model: {hidden: [8], rope_theta: 10000}\n", "model.rope_theta: an option of model.name llama"),
    # fp8 without an fp8 rate, selective recomputation without attention, sequence parallelism
    (GPT + LLAMA_MODEL % "kv_heads: 2" + "cluster: {devices: 2, device: a100-40gb}\ntrain: {precision: fp8}\n",
     "train.precision"),
    (MLP + "train: {checkpointing: selective}\n", "train.checkpointing"),
    (GPT + "model: {name: gpt, hidden: 32, layers: 2, heads: 4}\nparallel: {sequence_parallel: true}\n",
     "parallel.sequence_parallel: cuts the sequence across the tp group; needs parallel.tp > 1, got 1"),
    (GPT + "model: {name: gpt, hidden: 32, layers: 2, heads: 4}\nparallel: {sequence_parallel: 1, tp: 2}\n",
     "parallel.sequence_parallel"),
    (MLP + "parallel: {sequence_parallel: true, tp: 2}\n", "parallel.sequence_parallel"),
]


@pytest.mark.parametrize("text,expected", HOSTILE_SCENARIOS, ids=range(len(HOSTILE_SCENARIOS)))
def test_hostile_values_of_new_keys_are_one_line(tmp_path, capsys, text, expected):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    assert expected in one_line_error(capsys, "validate", path)


@pytest.mark.parametrize("text", [
    GPT + "model: {name: gpt, hidden: 32, layers: 2, heads: 4}\nparallel: {sequence_parallel: true, tp: 2}\n"
          "data: {name: tokens, seq_len: 15}\n",
    MLP + "train: {checkpointing: selective}\n",
])
def test_runs_that_cannot_be_are_one_line_and_write_nothing(tmp_path, capsys, text):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    err = one_line_error(capsys, "run", path, "-q", "--out", tmp_path / "out")
    assert "parallel.sequence_parallel" in err or "train.checkpointing" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model", ["{name: gpt, hidden: 32, layers: 2, heads: 4}",
                                   "{name: llama, hidden: 32, layers: 2, heads: 4, kv_heads: 2}"])
def test_token_data_without_vocab_or_seq_len_runs_with_the_data_sets_defaults(tmp_path, model):
    """A gpt's or llama's model FLOPs used to read data.vocab and data.seq_len, which may be null: a TypeError.
    The reference: the same run with the data set's defaults (vocab 64, seq_len 32) written out."""
    reports = []
    for data in ("{name: tokens}", "{name: tokens, vocab: 64, seq_len: 32}"):
        path = tmp_path / "s.yaml"
        path.write_text(f"cluster: {{devices: 2}}\nmodel: {model}\ndata: {data}\ntrain: {{steps: 1}}\n"
                        "report: {trace: false}\n")
        out = tmp_path / f"out{len(reports)}"
        assert cli("run", path, "-q", "--out", out) == 0
        reports.append(strict_json((out / "report.json").read_text()))
    assert reports[0]["flops"] == reports[1]["flops"] and reports[0]["flops"]["model_flops_per_step"] > 0


# ---------------------------------------------------------------- command lines

@pytest.mark.parametrize("args,expected", [
    (["--algo", "ring"], "--algo: ring is not an all_to_all algorithm; known: pairwise, hierarchical"),
    (["--algo", "dbtree"], "--algo: dbtree is not an all_to_all algorithm"),
    (["--channels", "2"], "--channels: all_to_all runs one message per pair of ranks, without channels"),
    (["--channels", "0"], "--channels"),
    (["--channels", HUGE], "--channels"),
    (["--algo", "hierarchical", "--devices", "6", "--topology", "hierarchical", "--gpus-per-node", "4"],
     "--gpus-per-node: 6 devices do not split into nodes of 4"),
    (["--sizes", "2T"], "--sizes"),
])
def test_hostile_all_to_all_command_lines_are_one_line(capsys, args, expected):
    command = ["collective", "--op", "all_to_all", "--devices", "4", "--sizes", "1K:1K", *args]
    assert expected in one_line_error(capsys, *command)


@pytest.mark.parametrize("address,expected", [
    ("127.0.0.1:1", "--ray '127.0.0.1:1': no Ray head answers at host:port"),  # nobody listens on port 1
    ("", "--ray '': no Ray head answers"),
    ("no-port", "--ray 'no-port': no Ray head answers"),
    ("127.0.0.1:99999", "--ray '127.0.0.1:99999'"),
])
def test_a_ray_address_where_no_head_answers_is_one_line(tmp_path, capsys, address, expected):
    path = tmp_path / "s.yaml"
    path.write_text(MLP)
    err = one_line_error(capsys, "sweep", path, "--grid", "train.steps=1,2", "--ray", address, "--out", tmp_path / "o")
    assert expected in err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("grid,expected", [
    ("train.steps=", "--grid train.steps: an empty value"),
    ("train.steps=1,,2", "--grid train.steps: an empty value"),
    ("train.steps", "--grid 'train.steps': expected dotted.path=value"),
    ("=1,2", "--grid"),
    ("seed=" + ",".join(map(str, range(10_001))), "--grid: 10001 runs, more than a sweep takes (10000)"),
])
def test_hostile_sweep_grids_are_one_line(tmp_path, capsys, grid, expected):
    path = tmp_path / "s.yaml"
    path.write_text(MLP)
    assert expected in one_line_error(capsys, "sweep", path, "--grid", grid, "--out", tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_a_grid_value_the_schema_refuses_is_its_row_s_one_line_error(tmp_path):
    """As sweep.py documents: a refused point is a row with its error; the others run."""
    path = tmp_path / "s.yaml"
    path.write_text(MLP)
    rows = run_sweep(str(path), [parse_grid(f"train.steps=1,{HUGE}")], [], tmp_path / "o")
    assert rows[0]["error"] is None and rows[0]["step_time_s"] > 0
    error = rows[1]["error"]
    assert error.startswith(f"{path}: train.steps: Input should be less than or equal to") and "\n" not in error


def test_pbt_replay_of_hostile_reports_is_one_line(tmp_path, capsys):
    big = tmp_path / "report.json"
    big.write_text(" " * MAX_FILE_BYTES + "{}")
    out = tmp_path / "replay.yaml"
    assert "larger than 512.0 KiB" in one_line_error(capsys, "pbt", "replay", big, "--out", out)
    assert "is not a regular file" in one_line_error(capsys, "pbt", "replay", "/dev/zero", "--out", out)
    big.write_text("[1, 2]")
    assert "not the report.json of a population" in one_line_error(capsys, "pbt", "replay", big, "--out", out)
    assert not out.exists()


@pytest.mark.parametrize("fields,expected", [
    ("memory: 40 GB\npeak_flops: {fp32: .nan}", "peak_flops.fp32: must be a finite number, got nan"),
    ("memory: .inf\npeak_flops: {fp32: 1.0e12}", "memory: must be a finite number, got inf"),
    ("memory: 40 GB\npeak_flops: {fp32: -1.0e12}", "peak_flops.fp32: must not be negative"),
    ("memory: -40\npeak_flops: {fp32: 1.0e12}", "memory: must not be negative"),
    ("memory: 40 GB\npeak_flops: {fp32: 0}", "peak_flops.fp32: Input should be greater than 0"),
])
def test_a_calibrated_device_file_with_impossible_figures_is_one_line(tmp_path, capsys, fields, expected):
    device = tmp_path / "device.yaml"  # what simtrain calibrate writes, with one figure spoiled
    device.write_text(f"name: calibrated\n{fields}\n")
    path = tmp_path / "s.yaml"
    path.write_text(MLP)
    err = one_line_error(capsys, "run", path, "--set", f"cluster.device={device}", "-q", "--out", tmp_path / "o")
    assert f"device file {device}" in err and expected in err and not (tmp_path / "o").exists()


# ---------------------------------------------------------------- simtrain.dist.spawn's arguments

def rank_code(rank, world):
    return torch.tensor(rank)


@pytest.mark.parametrize("fn,world,expected", [
    (rank_code, 0, "simtrain.dist.spawn: cluster.devices: Input should be greater than or equal to 1"),
    (rank_code, -1, "simtrain.dist.spawn: cluster.devices: Input should be greater than or equal to 1"),
    (rank_code, 10**30, "simtrain.dist.spawn: cluster.devices: Input should be less than or equal to 131072"),
    (rank_code, True, "simtrain.dist.spawn: world: expected an integer, got True"),
    (rank_code, 2.5, "simtrain.dist.spawn: world: expected an integer, got 2.5"),
    (rank_code, "2\nx: 1", "simtrain.dist.spawn: world: expected an integer, got '2\\nx: 1'"),
    (rank_code, None, "simtrain.dist.spawn: world: needed without a scenario"),
    (3, 2, "simtrain.dist.spawn: fn: 3 is not callable"),
    ("rank_code", 2, "simtrain.dist.spawn: fn: 'rank_code' is not callable"),
])
def test_hostile_spawn_arguments_are_one_line(fn, world, expected):
    with pytest.raises(ScenarioError) as error:
        simtrain.dist.spawn(fn, world=world)
    assert str(error.value).startswith(expected) and "\n" not in str(error.value)


def test_a_rank_function_of_the_wrong_arity_is_its_rank_s_one_line_error():
    with pytest.raises(SimtrainError, match=r"^rank 0 raised TypeError: .*takes 0 positional arguments but 2"):
        simtrain.dist.spawn(lambda: None, world=2)


USER_MODEL = '''
import torch


class _FailsBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("no gradient for this layer")


class Picky(torch.nn.Module):
    """Takes the build check's batch of two; fails at the run's batch size, in its forward or its backward."""

    def __init__(self, fail_in):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.fail_in = fail_in

    def forward(self, x):
        if x.shape[0] == 3 and self.fail_in == "forward":
            raise RuntimeError("shape mismatch at batch 3")
        out = self.linear(x)
        return _FailsBackward.apply(out) if x.shape[0] == 3 else out


def build(fail_in="forward"):
    return Picky(fail_in)
'''
USER_SCENARIO = ("cluster: {topology: ring, devices: 2}\nmodel: {name: 'picky_user_model:build', options: "
                 "{fail_in: %s}}\ndata: {name: synthetic, samples: 30, features: 4, classes: 2, batch_size: 3}\n"
                 "train: {steps: 2}\nreport: {trace: false}\n")


@pytest.mark.parametrize("fail_in,raised", [("forward", "RuntimeError: shape mismatch at batch 3"),
                                            ("backward", "ValueError: no gradient for this layer")])
def test_a_user_model_that_fails_only_during_training_is_one_line_naming_model_name(
        tmp_path, capsys, monkeypatch, fail_in, raised):
    (tmp_path / "picky_user_model.py").write_text(USER_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "s.yaml"
    path.write_text(USER_SCENARIO % fail_in)
    err = one_line_error(capsys, "run", path, "-q", "--out", tmp_path / "out")
    assert f"model.name: picky_user_model:build raised {raised.split(':')[0]} during the run: " in err
    assert err.rstrip().endswith(raised.split(": ", 1)[1])
    assert not (tmp_path / "out").exists()
