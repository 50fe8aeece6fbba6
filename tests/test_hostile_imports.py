"""Hostile imported configs (issue 55): a torchtitan TOML or Megatron arguments that are broken or hostile end in
one line naming the file and the field, and exit code 2; never a traceback.

The reference is the contract in simtrain/errors.py. Hand-written cases cover each class (a file that does not
parse, an unknown flavor or flag, a key of the wrong type, degrees that do not divide the world, huge values
bounded by simtrain/limits.py, missing values, contradictory flags); a property test throws random values of
every TOML type at every torchtitan key and every Megatron flag the importers read.
"""
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simtrain.cli import main
from simtrain.errors import SimtrainError
from simtrain.importers.megatron import import_megatron_args
from simtrain.importers.torchtitan import KNOWN, import_torchtitan

GOOD_TOML = """
[model]
name = "llama3"
flavor = "debugmodel"
[training]
local_batch_size = 2
seq_len = 128
steps = 2
[parallelism]
data_parallel_shard_degree = -1
"""
GOOD_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
             "--vocab-size", "256", "--train-iters", "2"]


def one_line_error(capsys, *args) -> str:
    """Run the CLI; it must exit 2 with one line on stderr (returned)."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2, err
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_the_good_inputs_import(tmp_path, capsys):
    (tmp_path / "good.toml").write_text(GOOD_TOML)
    with pytest.raises(SystemExit) as exit_info:
        main(["import", "torchtitan", str(tmp_path / "good.toml")])
    assert exit_info.value.code == 0
    with pytest.raises(SystemExit) as exit_info:
        main(["import", "megatron", "--", *GOOD_ARGS])
    assert exit_info.value.code == 0


@pytest.mark.parametrize("text, expected", [
    ("[training\nsteps = 1", "bad.toml: not valid TOML"),
    ('[model]\nflavor = "9B"', "bad.toml: model.flavor: '9B' is not a llama3 flavor"),
    ('[model]\nname = "deepseek_v3"', "bad.toml: model.name: 'deepseek_v3' is not imported"),
    ('[training]\nlocal_batch_size = "8"', "bad.toml: training.local_batch_size: expected an integer, got '8'"),
    ("[training]\nlocal_batch_size = true", "training.local_batch_size: expected an integer, got True"),
    ('[optimizer]\nlr = "fast"', "bad.toml: optimizer.lr: expected a number, got 'fast'"),
    ("[optimizer]\nlr = nan", "bad.toml: optimizer.lr: nan is outside"),
    ("[optimizer]\nlr = 1e400", "bad.toml: optimizer.lr: inf is outside"),
    ('[model]\nconverters = "float8"', "bad.toml: model.converters: expected a list of converter names"),
    ("training = 5", "bad.toml: training: expected a table, got 5"),
    ("[training]\nbatch_sise = 8", "bad.toml: training.batch_sise: not a field of torchtitan's [training]"),
    ("[trainin]\nsteps = 8", "bad.toml: [trainin]: not a section of torchtitan's job config; did you mean training?"),
    ("[parallelism]\ntensor_parallel_degree = 3", "bad.toml: parallelism.data_parallel_shard_degree: -1 with "
                                                  "replicate 1 x tp 3 x pp 1 x cp 1 = 3 does not divide the 8"),
    ("[parallelism]\ndata_parallel_shard_degree = 4\ntensor_parallel_degree = 4",
     "bad.toml: parallelism: dp_replicate 1 x dp_shard 4 x tp 4 x pp 1 x cp 1 = 16, not the 8 devices"),
    ("[parallelism]\ndata_parallel_shard_degree = 0", "parallelism.data_parallel_shard_degree: 0 with"),
    ("[parallelism]\nexpert_parallel_degree = 2", "parallelism.expert_parallel_degree: 2 shards experts"),
    ("[parallelism]\npipeline_parallel_degree = 2\ndata_parallel_shard_degree = 4\n"
     'pipeline_parallel_schedule = "ZBVZeroBubble"', "parallelism.pipeline_parallel_schedule: 'ZBVZeroBubble'"),
    ("[training]\nlocal_batch_size = 3\nglobal_batch_size = 100",
     "training.global_batch_size: 100 is not a multiple of local_batch_size 3 x the 8 data-parallel ranks"),
    ('[activation_checkpoint]\nmode = "partial"', "activation_checkpoint.mode: 'partial' is not none"),
    ('[activation_checkpoint]\nselective_ac_option = "sometimes"', "selective_ac_option: 'sometimes' is not 'op'"),
    ('[optimizer]\nname = "Lion"', "bad.toml: optimizer.name: 'Lion' is not AdamW or Adam"),
    ("[training]\nlocal_batch_size = 1000000000000000000000000000000",
     "bad.toml: training.local_batch_size: 1000000000000000000000000000000 is outside 1 to 1,000,000"),
    ("[training]\nsteps = 99999999999", "training.steps: 99999999999 is outside 1 to 1,000,000"),
    ("[training]\nseq_len = 1000000", "training.seq_len: 1000000 is outside 1 to 65,536"),
    ("[parallelism]\ntensor_parallel_degree = 1099511627776", "parallelism.tensor_parallel_degree: 1099511627776 is "
                                                             "outside 1 to 131,072"),
    ("[training]\nsteps = " + "9" * 5000, "bad.toml: not valid TOML: a value too large or nested too deep"),
    ("x = " + "[" * 100_000, "bad.toml: not valid TOML"),
    ('[training]\nmixed_precision_param = "float8"', "training.mixed_precision_param: 'float8' is not bfloat16"),
])
def test_a_hostile_torchtitan_toml_is_one_line(tmp_path, capsys, text, expected):
    (tmp_path / "bad.toml").write_text(text)
    err = one_line_error(capsys, "import", "torchtitan", tmp_path / "bad.toml")
    assert expected in err, err


@pytest.mark.parametrize("make, args, expected", [
    (None, ["missing.toml"], "missing.toml: not found"),
    ("folder", ["{path}"], "is a folder, not a file"),
    ("binary", ["{path}"], "not UTF-8 text"),
    ("huge", ["{path}"], "larger than 512.0 KiB"),
    ("good", ["{path}", "--devices", "0"], "--devices"),
    ("good", ["{path}", "--cluster", "nowhere.yaml"], "--cluster nowhere.yaml: not found"),
    ("good", ["{path}", "--steps", "0"], "--steps"),
])
def test_a_hostile_torchtitan_file_or_option_is_one_line(tmp_path, capsys, make, args, expected):
    path = tmp_path / "config.toml"
    if make == "folder":
        path.mkdir()
    elif make == "binary":
        path.write_bytes(b"\xff\xfe\x00\x01")
    elif make == "huge":
        path.write_text("# " + "x" * (600 << 10))
    elif make == "good":
        path.write_text(GOOD_TOML)
    err = one_line_error(capsys, "import", "torchtitan", *(arg.format(path=path) for arg in args))
    assert expected in err, err


def without(flag: str) -> list[str]:
    index = GOOD_ARGS.index(flag)
    return GOOD_ARGS[:index] + GOOD_ARGS[index + 2:]


@pytest.mark.parametrize("args, expected", [
    (GOOD_ARGS + ["--num-layerz", "3"], "arguments: --num-layerz: not a flag of Megatron-LM's pretrain_gpt.py; did "
                                        "you mean --num-layers?"),
    (GOOD_ARGS + ["--frobnicate"], "--frobnicate: not a flag of Megatron-LM's pretrain_gpt.py"),
    (GOOD_ARGS + ["--lr"], "arguments: --lr: missing its value"),
    (["--num-layers", "--hidden-size", "64"], "arguments: --num-layers: missing its value"),
    (GOOD_ARGS + ["--bf16=yes"], "--bf16: a switch, takes no value"),
    (GOOD_ARGS + ["32"], "'32': expected a flag"),
    (without("--num-layers"), "arguments: --num-layers: missing (Megatron-LM has no default for it)"),
    (without("--seq-length"), "--seq-length: missing"),
    (without("--vocab-size"), "--vocab-size: missing"),
    (without("--train-iters"), "--train-iters: give either it or --train-samples"),
    (GOOD_ARGS + ["--train-samples", "100"], "--train-iters: give either it or --train-samples"),
    (GOOD_ARGS + ["--bf16", "--fp16"], "--fp16: with --bf16: one or the other"),
    (GOOD_ARGS + ["--fp8-format", "hybrid"], "--fp8-format: fp8 here trains around bf16"),
    (GOOD_ARGS + ["--fp8-format", "e5m2"], "--fp8-format: 'e5m2' is not one of e4m3, hybrid"),
    (GOOD_ARGS + ["--tensor-model-parallel-size", "2", "--tp-comm-overlap"], "--tp-comm-overlap: needs "
                                                                             "--sequence-parallel"),
    (GOOD_ARGS + ["--use-torch-fsdp2", "--use-distributed-optimizer"], "--use-torch-fsdp2: with "
                                                                       "--use-distributed-optimizer"),
    (GOOD_ARGS + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                  "--num-virtual-stages-per-pipeline-rank", "1"], "--num-layers-per-virtual-pipeline-stage: give it"),
    (GOOD_ARGS + ["--num-virtual-stages-per-pipeline-rank", "2"], "interleaves a pipeline; the pipeline size is 1"),
    (GOOD_ARGS + ["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size: tp 3 x pp 1 x cp 1 = 3 does "
                                                        "not divide the 8 devices"),
    (GOOD_ARGS + ["--global-batch-size", "12"], "--global-batch-size: 12 is not a multiple of micro-batch 1 x the 8"),
    (GOOD_ARGS + ["--num-layers", "thirty"], "arguments: --num-layers: expected an integer, got 'thirty'"),
    (GOOD_ARGS + ["--lr", "abc"], "--lr: expected a number, got 'abc'"),
    (GOOD_ARGS + ["--lr", "1e400"], "--lr: inf is outside"),
    (GOOD_ARGS + ["--num-layers", "1" + "0" * 30], "--num-layers: 1000000000000000000000000000000 is outside 1 to "
                                                   "1,000"),
    (GOOD_ARGS + ["--num-layers", "9" * 5000], "--num-layers: expected an integer"),
    (GOOD_ARGS + ["--hidden-size", "99999999999"], "--hidden-size: 99999999999 is outside 1 to 1,000,000"),
    (GOOD_ARGS + ["--global-batch-size", "1" + "0" * 40], "--global-batch-size: 1000000000000000000000000000000000"),
    (GOOD_ARGS + ["--train-iters", "5000000"], "--train-iters: 5000000 is outside 1 to 1,000,000 (the bound simtrain "
                                               "checks before any work: simtrain/limits.py); give simtrain import "
                                               "--steps N"),
    (GOOD_ARGS + ["--ffn-hidden-size", "100"], "--ffn-hidden-size: 100: a gpt's MLP here is 4 x hidden"),
    (GOOD_ARGS + ["--kv-channels", "8"], "--kv-channels: 8 is not hidden / heads (16)"),
    (GOOD_ARGS + ["--optimizer", "lamb"], "--optimizer: 'lamb' is not one of adam, sgd"),
])
def test_hostile_megatron_arguments_are_one_line(capsys, args, expected):
    err = one_line_error(capsys, "import", "megatron", "--", *args)
    assert expected in err, err


@pytest.mark.parametrize("args, expected", [
    (["import", "megatron"], "give pretrain_gpt.py's arguments after --, --args-file, or --recipe"),
    (["import", "megatron", "--recipe", "llama3_8b_pretrain"], "megatron recipe 'llama3_8b_pretrain': not one "
                                                               "simtrain reads"),
    (["import", "megatron", "--recipe", "llama3_8b_pretrain_config", "--devices", "3", "--steps", "2"],
     "model.tensor_model_parallel_size: tp 1 x pp 1 x cp 2 = 2 does not divide the 3 devices"),
    (["import", "megatron", "--recipe", "llama3_8b_pretrain_config", "--devices", "16"],
     "train.train_iters: 1168251 is outside 1 to 1,000,000"),
    (["import", "megatron", "--recipe", "llama3_8b_pretrain_config", "modle.num_layers=2"],
     "'modle' is not a section of Megatron-Bridge's ConfigContainer"),
    (["import", "megatron", "--recipe", "llama3_8b_pretrain_config", "model.num_layerz=2"],
     "model.num_layerz: not a field Megatron-Bridge's model config has; did you mean model.num_layers?"),
    (["import", "megatron", "--recipe", "llama3_8b_pretrain_config", "model.num_layers"], "expected section.field"),
    (["import", "megatron", "--recipe", "llama3_8b_pretrain_config", "model.num_layers=[1"], "not valid YAML"),
    (["import", "megatron", "--recipe", "llama3_8b_pretrain_config", "--devices", "16", "--steps", "2",
      "model.num_layers=two"], "model.num_layers: expected an integer, got 'two'"),
    (["import", "megatron", "--recipe", "llama3_8b_pretrain_config", "--devices", "16", "--steps", "2",
      "mixed_precision=fp4_mixed"], "mixed_precision: 'fp4_mixed' is not one of"),
    (["import", "megatron", "--recipe", "llama3_8b_pretrain_config", "--devices", "16", "--steps", "2",
      "model.gated_linear_unit=maybe"], "model.gated_linear_unit: expected true or false"),
])
def test_hostile_recipes_and_command_lines_are_one_line(capsys, args, expected):
    err = one_line_error(capsys, *args)
    assert expected in err, err


def test_a_hostile_arguments_file_is_one_line(tmp_path, capsys):
    (tmp_path / "args.txt").write_text("--num-layers 2 --split '99,1,0")
    err = one_line_error(capsys, "import", "megatron", "--args-file", tmp_path / "args.txt")
    assert f"{tmp_path / 'args.txt'}: cannot split into arguments" in err, err
    (tmp_path / "args.txt").write_text("\n".join(GOOD_ARGS[:-1]))
    err = one_line_error(capsys, "import", "megatron", "--args-file", tmp_path / "args.txt")
    assert f"{tmp_path / 'args.txt'}: --train-iters: missing its value" in err, err


# -- random values at every key the importers read --------------------------------------------------------------

def toml_value(value) -> str:
    """A TOML literal of a Python value (bool, int, float, str, list of them)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return json.dumps(value) if isinstance(value, str) else str(value)


SCALARS = st.one_of(st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=12),
                    st.sampled_from(["8B", "1F1B", "float8", "op", "full", "never", "bfloat16", "AdamW", "-1"]))
TOML_VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3))
READ_SECTIONS = ("model", "optimizer", "training", "parallelism", "activation_checkpoint", "quantize.linear.float8")


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(READ_SECTIONS), st.data()), min_size=1, max_size=6),
       st.integers(1, 64))
def test_random_values_at_every_torchtitan_key_end_in_a_scenario_or_one_error(tmp_path_factory, entries, devices):
    sections: dict[str, dict] = {}
    for section, data in entries:
        key = data.draw(st.sampled_from(KNOWN[section]))
        sections.setdefault(section, {})[key] = data.draw(TOML_VALUES)
    text = "\n".join(f"[{section}]\n" + "\n".join(f"{key} = {toml_value(value)}" for key, value in values.items())
                     for section, values in sections.items())
    path = tmp_path_factory.mktemp("toml") / "random.toml"
    path.write_text(text)
    try:
        import_torchtitan(path, devices).scenario()
    except SimtrainError as error:
        assert "\n" not in str(error) and str(error).startswith(str(path)), str(error)


FLAGS_READ = ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--num-query-groups",
              "--seq-length", "--vocab-size", "--micro-batch-size", "--global-batch-size", "--train-iters",
              "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
              "--num-layers-per-virtual-pipeline-stage", "--num-experts", "--moe-router-topk", "--lr",
              "--weight-decay", "--adam-beta1", "--rotary-base", "--recompute-granularity", "--optimizer",
              "--normalization", "--kv-channels", "--data-parallel-sharding-strategy")
SWITCHES_READ = ("--swiglu", "--bf16", "--fp16", "--sequence-parallel", "--tp-comm-overlap",
                 "--use-distributed-optimizer", "--overlap-grad-reduce", "--use-torch-fsdp2")


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(FLAGS_READ), st.text(min_size=1, max_size=12).filter(
    lambda text: not text.startswith("--")) | st.integers(-5, 10**12).map(str)), max_size=5),
       st.lists(st.sampled_from(SWITCHES_READ), max_size=4), st.integers(1, 64))
def test_random_megatron_flags_end_in_a_scenario_or_one_error(values, switches, devices):
    tokens = list(GOOD_ARGS) + [token for flag, value in values for token in (flag, value)] + list(switches)
    try:
        import_megatron_args(tokens, devices).scenario()
    except SimtrainError as error:
        assert "\n" not in str(error) and str(error).startswith("arguments"), str(error)
