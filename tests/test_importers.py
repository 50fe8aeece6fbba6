"""`simtrain import`: torchtitan's shipped Llama 3 configs, Megatron-LM's Llama 3 arguments and a Megatron-Bridge
Llama 3 recipe become scenarios whose fields are the sources' values, and each scenario runs.

References: the TOML files themselves (torchtitan's, vendored byte for byte from its tag v0.2.2, checked by their
git blob ids), the Llama 3 paper's table 3 for the model dims the flavors must give (Grattafiori et al. 2024,
"The Llama 3 Herd of Models"), Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh for the arguments, and
megatron-bridge 0.3.1's recipes/llama/llama3.py for the recipe. Each run is small (two blocks, short sequences,
one step, numerics off) and must end in a report with the source's layout.
"""
import hashlib
import json
import tomllib
from pathlib import Path

import pytest
import yaml

from simtrain.cli import main
from simtrain.importers.megatron import import_megatron_args
from simtrain.importers.megatron_recipes import import_megatron_recipe
from simtrain.importers.torchtitan import import_torchtitan

ROOT = Path(__file__).resolve().parents[1]
TORCHTITAN = ROOT / "scenarios" / "torchtitan"
# git blob ids of torchtitan/models/llama3/train_configs/*.toml at pytorch/torchtitan tag v0.2.2
# (commit 73a0e6979dd10b6b1904098eb3c8f62c18ab87ce): `git rev-parse v0.2.2:<path>`.
SHIPPED = {"llama3_8b.toml": "ef86d783bf4347d34f4b36530597229af8dc1634",
           "llama3_70b.toml": "37fd35b5cba849d3afc3f6ebbe4c127d6ca05930",
           "llama3_405b.toml": "48c669e4043cf59777df266294489fcddd68e743"}
# The Llama 3 paper, table 3: layers, model dimension, FFN dimension, attention heads, key/value heads; vocabulary
# 128K tokens (128,256), RoPE theta 500,000.
LLAMA3 = {"8B": (32, 4096, 14336, 32, 8), "70B": (80, 8192, 28672, 64, 8), "405B": (126, 16384, 53248, 128, 8)}
# The presets' world sizes, as each file's first line says ("a preset for 64 A100 GPUs", ... 128 H100 GPUs).
WORLD = {"llama3_8b.toml": 64, "llama3_70b.toml": 64, "llama3_405b.toml": 128}
# Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh: its arguments with its variables filled in (TP 1,
# CP 1, micro-batch 1, global batch 128, 32 layers, fp8, sequence 8192; mock data).
MEGATRON_LLAMA3_8B = """
torchrun --nproc_per_node 8 --nnodes 1 examples/classes/pretrain_gpt.py
  --use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
  --group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192
  --position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0
  --hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
  --untie-embeddings-and-output-weights --disable-bias-linear
  --micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748
  --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
  --lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
  --grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
  --empty-unused-memory-level 1 --exit-duration-in-mins 235
  --fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather
  --tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path cache --tiktoken-pattern v2
  --split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
  --log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile
  --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
  --save ckpt --load ckpt --tensorboard-dir tb
"""
SMALL = ["--set", "model.layers=2", "--set", "data.seq_len=256", "--set", "train.steps=1", "-q"]


def run_small(imported, tmp_path: Path, *overrides: str) -> dict:
    """Write the imported scenario, run it small through the CLI, return its report."""
    scenario_file = tmp_path / "imported.yaml"
    scenario_file.write_text(imported.to_yaml())
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(scenario_file), *SMALL, *overrides, "--out", str(out)])
    assert exit_info.value.code == 0
    return json.loads((out / "report.json").read_text())


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_the_vendored_configs_are_torchtitans_own_files():
    for name, blob in SHIPPED.items():
        assert git_blob_id((TORCHTITAN / name).read_bytes()) == blob, name


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_a_shipped_torchtitan_config_carries_its_values_and_runs(name, tmp_path):
    source = tomllib.loads((TORCHTITAN / name).read_text())
    imported = import_torchtitan(TORCHTITAN / name, devices=WORLD[name])
    scenario = imported.scenario()
    training, parallelism = source["training"], source["parallelism"]
    layers, width, ffn, heads, kv_heads = LLAMA3[source["model"]["flavor"]]
    model = scenario.model
    assert (model.name, model.layers, model.width, model.ffn_width, model.heads, model.key_value_heads,
            model.rotary_base) == ("llama", layers, width, ffn, heads, kv_heads, 500000)
    assert (scenario.data.batch_size, scenario.data.seq_len, scenario.data.vocab) == (
        training["local_batch_size"], training["seq_len"], 128256)
    assert scenario.train.steps == training["steps"]
    assert scenario.train.optimizer.lr == source["optimizer"]["lr"]
    assert scenario.train.optimizer.eps == source["optimizer"]["eps"]
    assert scenario.train.checkpointing == source["activation_checkpoint"]["mode"]
    assert scenario.train.precision == ("fp8" if "float8" in source["model"].get("converters", []) else "bf16")
    tp = parallelism["tensor_parallel_degree"]
    assert (scenario.parallel.tp, scenario.parallel.pp, scenario.parallel.cp) == (
        tp, parallelism["pipeline_parallel_degree"], parallelism["context_parallel_degree"])
    assert scenario.parallel.sequence_parallel == (tp > 1)
    assert scenario.parallel.tp_comm_overlap == parallelism.get("enable_async_tensor_parallel", False)
    assert scenario.parallel.sharding.stage == 3  # data_parallel_shard_degree -1: FSDP over the devices left
    not_carried = {item.field for item in imported.not_carried}
    assert {"training.max_norm", "lr_scheduler.warmup_steps", "compile.enable", "job.dump_folder"} <= not_carried
    given = {f"{section}.{key}" for section, values in source.items() if section != "quantize"
             for key in values} | {f"quantize.linear.float8.{key}" for key in source["quantize"]["linear"]["float8"]}
    carried = given - not_carried
    assert carried <= {"model.name", "model.flavor", "model.converters", "optimizer.name", "optimizer.lr",
                       "optimizer.eps", "training.local_batch_size", "training.seq_len", "training.steps",
                       "activation_checkpoint.mode", "activation_checkpoint.selective_ac_option",
                       *(f"parallelism.{key}" for key in parallelism)}
    header = imported.to_yaml().split("\nname:")[0]
    assert all(f in header for f in not_carried)
    devices = max(8, 2 * tp)  # whole hosts of 8
    report = run_small(imported, tmp_path, "--set", f"cluster.devices={devices}")
    assert report["status"] == "ok" and report["devices_count"] == devices
    assert report["parallel"]["tp"] == tp and report["parallel"]["dp"] == devices // tp


# Llama 3.2 1B and 3B, Hugging Face config.json of meta-llama/Llama-3.2-1B and -3B: num_hidden_layers,
# hidden_size, intermediate_size, num_attention_heads, num_key_value_heads.
LLAMA32 = {"1B": (16, 2048, 8192, 32, 8), "3B": (28, 3072, 8192, 24, 8)}


@pytest.mark.parametrize("flavor", ["1B", "3B", "8B", "70B", "405B"])
def test_each_flavor_gives_the_published_dims(flavor, tmp_path):
    path = tmp_path / "flavor.toml"
    path.write_text(f'[model]\nflavor = "{flavor}"\n[training]\nlocal_batch_size = 1\nseq_len = 1024\nsteps = 1\n')
    model = import_torchtitan(path, devices=8).scenario().model
    assert (model.layers, model.width, model.ffn_width, model.heads, model.key_value_heads) == {**LLAMA3,
                                                                                               **LLAMA32}[flavor]


@pytest.mark.parametrize("reduce_flag, reduce_dtype", [([], "fp32"), (["--grad-reduce-in-bf16"], None)])
def test_megatron_ddp_under_bf16_keeps_fp32_main_gradients_unless_told_bf16(reduce_flag, reduce_dtype):
    """Without the distributed optimizer Megatron-LM all-reduces fp32 main gradients under --bf16 (18 bytes a
    parameter); --grad-reduce-in-bf16 keeps them in bf16."""
    arguments = [argument for argument in MEGATRON_LLAMA3_8B.split() if argument not in
                 ("--use-distributed-optimizer", "--grad-reduce-in-bf16")] + reduce_flag
    sharding = import_megatron_args(arguments, devices=8, steps=2).scenario().parallel.sharding
    assert (sharding.stage, sharding.reduce_dtype) == (0, reduce_dtype)


def test_megatron_lms_llama3_arguments_carry_their_values_and_run(tmp_path):
    imported = import_megatron_args(MEGATRON_LLAMA3_8B.split(), devices=8, steps=2)
    scenario = imported.scenario()
    model = scenario.model
    assert (model.name, model.layers, model.width, model.ffn_width, model.heads, model.key_value_heads,
            model.rotary_base, model.attention) == ("llama", 32, 4096, 14336, 32, 8, 1e6, "fused")
    # global batch 128 over 8 data-parallel ranks: 16 sequences a rank, in micro-batches of 1
    assert (scenario.data.batch_size, scenario.parallel.microbatches, scenario.data.seq_len,
            scenario.data.vocab) == (16, 16, 8192, 128256)
    assert (scenario.train.precision, scenario.train.steps, scenario.train.optimizer.lr,
            scenario.train.optimizer.betas) == ("fp8", 2, 1.5e-4, (0.9, 0.95))
    sharding = scenario.parallel.sharding
    assert (sharding.stage, sharding.reduce_dtype) == (1, "bf16")  # --use-distributed-optimizer --grad-reduce-in-bf16
    not_carried = {item.field for item in imported.not_carried}
    # Megatron-LM turns sequence parallelism off at tp 1; its distributed optimizer overlaps here under tp/pp/cp only
    assert {"--sequence-parallel", "--overlap-grad-reduce", "--train-samples", "--clip-grad", "--mock-data",
            "--save"} <= not_carried
    report = run_small(imported, tmp_path, "--set", "data.batch_size=2", "--set", "parallel.pipeline.microbatches=2")
    assert report["status"] == "ok" and report["devices_count"] == 8


def test_a_megatron_bridge_llama3_recipe_carries_its_values_and_runs(tmp_path):
    imported = import_megatron_recipe("llama3_70b_pretrain_config", ["train.global_batch_size=64"], devices=64,
                                      steps=2)
    scenario = imported.scenario()
    model, parallel = scenario.model, scenario.parallel
    assert (model.layers, model.width, model.ffn_width, model.heads, model.key_value_heads) == LLAMA3["70B"]
    # the recipe: TP 4, PP 4, VP 5, CP 2, sequence parallel with TP overlap, sequence 8192, micro-batch 1
    assert (parallel.tp, parallel.pp, parallel.pipeline.virtual_stages, parallel.cp) == (4, 4, 5, 2)
    assert parallel.pipeline.schedule == "interleaved"
    assert parallel.sequence_parallel and parallel.tp_comm_overlap
    assert scenario.data.seq_len == 8192
    # 64 devices / (4 x 4 x 2) = 2 data-parallel ranks: 32 sequences each, 32 micro-batches of 1
    assert (scenario.data.batch_size, parallel.microbatches) == (32, 32)
    assert (parallel.sharding.stage, parallel.sharding.reduce_dtype, parallel.sharding.overlap_grad_reduce,
            parallel.sharding.overlap_param_gather) == (1, "fp32", True, True)
    assert (scenario.train.precision, scenario.train.optimizer.lr, scenario.seed) == ("bf16", 3e-4, 1234)
    assert {"optimizer.clip_grad", "scheduler.lr_warmup_iters", "train.train_iters"} <= {
        item.field for item in imported.not_carried}
    report = run_small(imported, tmp_path, "--set", "model.layers=20", "--set", "cluster.devices=32",
                       "--set", "data.batch_size=4", "--set", "parallel.pipeline.microbatches=4",
                       "--set", "parallel.representatives=true")
    assert report["status"] == "ok" and report["parallel"]["pp"] == 4


def test_the_cli_writes_the_scenario_and_names_what_it_leaves(tmp_path, capsys):
    out = tmp_path / "llama3_8b.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["import", "torchtitan", str(TORCHTITAN / "llama3_8b.toml"), "--devices", "16", "--steps", "2",
              "--out", str(out)])
    assert exit_info.value.code == 0
    err = capsys.readouterr().err
    assert "not carried over: training.max_norm (gradient clipping is not modelled)" in err
    assert "not carried over: training.steps (simtrain import --steps given)" in err
    text = out.read_text()
    assert "# not carried over: training.max_norm" in text
    assert yaml.safe_load(text)["train"]["steps"] == 2
