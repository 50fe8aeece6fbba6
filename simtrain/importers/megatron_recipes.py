"""Megatron-Bridge's Llama 3 pre-training recipes as simtrain scenarios, with Hydra-style overrides.

A Megatron-Bridge recipe is a Python function that returns its ConfigContainer (sections model, train,
optimizer, scheduler, ddp, mixed_precision, comm_overlap, ...). Calling it needs megatron-core and Transformer
Engine, and it fetches the model's Hugging Face config (`AutoBridge.from_hf_pretrained`) over the network, so
simtrain does not call it: RECIPES holds the values each recipe sets, read from its source, and overrides are
given as on Megatron-Bridge's own command line (`model.tensor_model_parallel_size=2 train.global_batch_size=64`).
Each field is then carried over as the Megatron-LM flag of the same name (megatron.py).

    imported = import_megatron_recipe("llama3_8b_pretrain_config", ["train.global_batch_size=16"], devices=8, steps=2)
    scenario = imported.scenario()

The sources: megatron-bridge 0.3.1 from PyPI (megatron/bridge/recipes/llama/llama3.py, the recipe functions;
megatron/bridge/recipes/common.py, `_pretrain_common`, the train, ddp and rng defaults they start from;
megatron/bridge/recipes/utils/optimizer_utils.py, `distributed_fused_adam_with_cosine_annealing`, the
optimizer's), and the model dims the recipe's AutoBridge reads from Hugging Face's config.json of
meta-llama/Meta-Llama-3-8B and meta-llama/Meta-Llama-3-70B (hidden_size, intermediate_size, num_hidden_layers,
num_attention_heads, num_key_value_heads, vocab_size, rope_theta).
"""
import difflib

from ..errors import ConfigImportError
from ..user_files import parse_yaml_text
from .imported import Imported
from .megatron import megatron_flags, megatron_scenario

# What `_pretrain_common` sets and the Llama 3 recipes keep, by section (common.py; optimizer_utils.py).
_COMMON = {
    "train": {"train_iters": 1168251, "global_batch_size": 512, "micro_batch_size": 1, "eval_interval": 2000,
              "eval_iters": 32, "manual_gc": True, "manual_gc_interval": 100},
    "optimizer": {"optimizer": "adam", "lr": 3e-4, "min_lr": 3e-5, "weight_decay": 0.1, "adam_beta1": 0.9,
                  "adam_beta2": 0.95, "adam_eps": 1e-8, "clip_grad": 1.0, "use_distributed_optimizer": True},
    "scheduler": {"lr_warmup_iters": 2000, "lr_decay_style": "cosine"},
    "ddp": {"overlap_grad_reduce": True, "overlap_param_gather": True, "use_distributed_optimizer": True,
            "use_megatron_fsdp": False, "grad_reduce_in_fp32": True, "average_in_collective": True,
            "check_for_nan_in_grad": True, "data_parallel_sharding_strategy": "no_shard"},
    "checkpoint": {"save_interval": 500, "ckpt_format": "torch_dist"},
    "rng": {"seed": 1234},
    "mixed_precision": "bf16_mixed",
}
# A Llama 3 model as the recipe's provider holds it (Hugging Face config.json -> Megatron-Core's field names).
_LLAMA3 = {"normalization": "RMSNorm", "gated_linear_unit": True, "position_embedding_type": "rope",
           "add_bias_linear": False, "share_embeddings_and_output_weights": False, "vocab_size": 128256,
           "rotary_base": 500000, "num_query_groups": 8, "seq_length": 8192,
           "transformer_impl": "transformer_engine", "cross_entropy_loss_fusion": True}
RECIPES = {
    "llama3_8b_pretrain_config": {
        **_COMMON,
        "model": {**_LLAMA3, "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336,
                  "num_attention_heads": 32, "kv_channels": 128, "tensor_model_parallel_size": 1,
                  "pipeline_model_parallel_size": 1, "context_parallel_size": 2, "sequence_parallel": False},
    },
    "llama3_70b_pretrain_config": {
        **_COMMON,
        "model": {**_LLAMA3, "num_layers": 80, "hidden_size": 8192, "ffn_hidden_size": 28672,
                  "num_attention_heads": 64, "kv_channels": 128, "tensor_model_parallel_size": 4,
                  "pipeline_model_parallel_size": 4, "virtual_pipeline_model_parallel_size": 5,
                  "context_parallel_size": 2, "sequence_parallel": True, "pipeline_dtype": "bfloat16"},
        "comm_overlap": {"tp_comm_overlap": True},
    },
}
# ConfigContainer's sections (megatron/bridge/training/config.py) an override may name.
SECTIONS = ("model", "train", "optimizer", "scheduler", "ddp", "dataset", "logger", "tokenizer", "checkpoint", "rng",
            "dist", "comm_overlap", "mixed_precision", "profiling", "rerun_state_machine", "straggler", "ft")
# Megatron-Core's names for what Megatron-LM's flags spell otherwise: name -> (flag name, value that sets it).
_BRIDGE_NAMES = {"gated_linear_unit": ("swiglu", True), "add_bias_linear": ("disable_bias_linear", False),
                 "share_embeddings_and_output_weights": ("untie_embeddings_and_output_weights", False)}
# mixed_precision recipes (megatron/bridge/training/mixed_precision.py) -> the flags they amount to.
_MIXED_PRECISION = {"bf16_mixed": {"bf16": True}, "fp16_mixed": {"fp16": True},
                    "bf16_with_fp8_delayed_scaling_mixed": {"bf16": True, "fp8_format": "hybrid"},
                    "bf16_with_fp8_current_scaling_mixed": {"bf16": True, "fp8_format": "hybrid"}}


def import_megatron_recipe(recipe: str, overrides: list[str], devices: int, cluster_file: str | None = None,
                           steps: int | None = None) -> Imported:
    """The scenario of Megatron-Bridge's `recipe` with Hydra-style `overrides` on `devices` devices (`steps` steps,
    where given, in place of the recipe's train.train_iters)."""
    if recipe not in RECIPES:
        close = difflib.get_close_matches(recipe, list(RECIPES), n=1)
        raise ConfigImportError(f"megatron recipe {recipe[:60]!r}: not one simtrain reads (one of: "
                                f"{', '.join(RECIPES)})" + (f"; did you mean {close[0]}?" if close else ""))
    config = {section: (dict(values) if isinstance(values, dict) else values)
              for section, values in RECIPES[recipe].items()}
    source = f"megatron-bridge recipe {recipe}"
    for override in overrides:
        _apply(config, override, source)
    values, labels = _flattened(config, source)
    notes = (f"Megatron-Bridge recipe {recipe}: megatron-bridge 0.3.1, megatron/bridge/recipes/llama/llama3.py; "
             "the model's dims from its Hugging Face config.json.",)
    return megatron_scenario(values, devices, cluster_file, source, lambda name: labels.get(name, name),
                             name=recipe.removesuffix("_pretrain_config").replace("_", "-"), notes=notes, steps=steps)


def _apply(config: dict, override: str, source: str) -> None:
    """`section.field=value` (value parsed as YAML) set in the recipe's config."""
    key, equals, text = override.partition("=")
    section, dot, field = key.strip().partition(".")
    if not equals or not dot and section != "mixed_precision":
        raise ConfigImportError(f"{source}: override {override[:60]!r}: expected section.field=value")
    if section not in SECTIONS:
        raise ConfigImportError(f"{source}: {key[:60]}: {section!r} is not a section of Megatron-Bridge's "
                                f"ConfigContainer (one of: {', '.join(SECTIONS)})")
    value = parse_yaml_text(text, f"{source}: {key}", ConfigImportError)
    if section == "mixed_precision" and not dot:
        config["mixed_precision"] = value
        return
    known = {name.replace("-", "_") for name in (flag[2:] for flag in megatron_flags())}
    known |= set(_BRIDGE_NAMES) | {"virtual_pipeline_model_parallel_size", "grad_reduce_in_fp32", "pipeline_dtype"}
    known |= {name for values in RECIPES[next(iter(RECIPES))].values() if isinstance(values, dict) for name in values}
    if section in ("model", "train", "optimizer", "ddp") and field not in known:
        close = difflib.get_close_matches(field, sorted(known), n=1)
        raise ConfigImportError(f"{source}: {key[:60]}: not a field Megatron-Bridge's {section} config has"
                                + (f"; did you mean {section}.{close[0]}?" if close else ""))
    if not isinstance(config.get(section), dict):
        config[section] = {}
    config[section][field] = value


def _flattened(config: dict, source: str) -> tuple[dict, dict]:
    """The config as Megatron-LM's flag names and values, and each name's label (model.num_layers)."""
    values, labels = {}, {}
    for section, fields in config.items():
        if section == "mixed_precision":
            if fields not in _MIXED_PRECISION:
                raise ConfigImportError(f"{source}: mixed_precision: {str(fields)[:40]!r} is not one of "
                                        f"{', '.join(_MIXED_PRECISION)}")
            for name, value in _MIXED_PRECISION[fields].items():
                values[name], labels[name] = value, "mixed_precision"
            continue
        for field, value in fields.items():
            name = field
            if field in _BRIDGE_NAMES:
                name, sets = _BRIDGE_NAMES[field]
                if not isinstance(value, bool):
                    raise ConfigImportError(f"{source}: {section}.{field}: expected true or false, got "
                                            f"{str(value)[:40]!r}")
                value = value == sets
            if value is None:
                continue  # a field the recipe leaves unset (None): Megatron's default
            values[name], labels[name] = value, f"{section}.{field}"
    return values, labels
