"""torchtitan's TOML job config as a simtrain scenario: every field that maps is carried over, every other named.

A torchtitan job (releases up to 0.2.x; 0.3.0 moved its configs into Python functions, `config_registry.py`) is
a TOML file of sections: `[model]` names a model and its flavor, `[training]` the batch, sequence and steps,
`[parallelism]` the degrees, `[activation_checkpoint]`, `[compile]`, `[quantize.linear.float8]`, `[optimizer]`.
The world size is not in the file (torchrun's, `--devices` here); `data_parallel_shard_degree = -1` takes the
devices the other degrees leave, as torchtitan's ParallelDims does.

    imported = import_torchtitan("scenarios/torchtitan/llama3_8b.toml", devices=64, steps=2)
    print("\\n".join(not_carried_lines(imported.not_carried)))
    scenario = imported.scenario()

How each field maps:

- model.flavor -> model dims (FLAVORS: torchtitan 0.3.0's `torchtitan/models/llama3/__init__.py`, whose 8B, 70B
  and 405B are 0.2.x's `llama3_args` too); the SwiGLU width by torchtitan's `compute_ffn_hidden_dim` rule (2/3 of
  4 x dim, times ffn_dim_multiplier, rounded up to multiple_of); attention fused (its scaled_dot_product_attention);
- training.local_batch_size (per data-parallel rank) -> data.batch_size; global_batch_size -> gradient
  accumulation (parallel.pipeline.microbatches); seq_len -> data.seq_len; steps -> train.steps; dtype and
  mixed_precision_param -> train.precision; mixed_precision_reduce -> parallel.sharding.reduce_dtype;
  enable_cpu_offload -> parallel.sharding.offload (FSDP2's CPUOffloadPolicy);
- parallelism: dp_replicate x dp_shard -> parallel.dp, dp_shard > 1 -> FSDP (sharding stage 3, HSDP's degree
  when dp_replicate > 1); fsdp_reshard_after_forward; tensor_parallel_degree -> tp with sequence parallelism
  (torchtitan's tensor-parallel plan shards the norms along the sequence); enable_async_tensor_parallel ->
  tp_comm_overlap; pipeline degree, schedule and microbatch size; context_parallel_degree -> cp;
- activation_checkpoint.mode -> train.checkpointing; the float8 converter -> train.precision fp8 (tensorwise);
- optimizer AdamW or Adam -> adam with lr, betas, eps, weight_decay.
"""
import difflib
import math
import tomllib

from ..errors import ConfigImportError
from ..limits import MAX_BATCH_SIZE, MAX_DEVICES, MAX_LEARNING_RATE, MAX_MICROBATCHES, MAX_SEED, MAX_SEQ_LEN, MAX_STEPS
from ..user_files import read_text_file, user_path
from .imported import Imported, NotCarried, bounded_int, bounded_real, cluster_section, expect, scenario_name

# torchtitan's Llama 3 flavors (torchtitan 0.3.0, torchtitan/models/llama3/__init__.py; 0.2.x's llama3_args hold
# the same 8B, 70B and 405B): dim, layers, heads, key/value heads (None: as many as heads), vocabulary,
# multiple_of, ffn_dim_multiplier. rope theta 500,000 in every flavor.
FLAVORS = {
    "debugmodel": (256, 6, 16, None, 2048, 256, None),
    "debugmodel_flex_attn": (256, 6, 16, None, 2048, 256, None),
    "1B": (2048, 16, 32, 8, 128256, 1024, 1.5),
    "3B": (3072, 28, 24, 8, 128256, 1024, 1.0),
    "8B": (4096, 32, 32, 8, 128256, 1024, 1.3),
    "70B": (8192, 80, 64, 8, 128256, 4096, 1.3),
    "405B": (16384, 126, 128, 8, 128256, 4096, 1.2),
}
ROPE_THETA = 500000

# torchtitan's pipeline schedules (torch.distributed.pipelining's names) -> simtrain's, with model chunks per rank.
SCHEDULES = {"1F1B": ("1f1b", 1), "GPipe": ("gpipe", 1), "Interleaved1F1B": ("interleaved", 2),
             "DualPipeV": ("dualpipev", 2)}

# Every key of torchtitan 0.2.x's JobConfig (torchtitan/config/job_config.py) by section; a key not here is refused.
KNOWN_KEYS = {
    "job": "config_file dump_folder description print_config custom_config_module",
    "profiling": "enable_profiling save_traces_folder profile_freq profiler_active profiler_warmup "
                 "enable_memory_snapshot save_memory_snapshot_folder",
    "metrics": "log_freq enable_tensorboard disable_color_printing save_tb_folder save_for_all_ranks enable_wandb",
    "model": "name flavor hf_assets_path tokenizer_path converters print_after_conversion",
    "optimizer": "name lr beta1 beta2 eps weight_decay implementation early_step_in_backward",
    "lr_scheduler": "warmup_steps decay_ratio decay_type min_lr_factor",
    "training": "dataset dataset_path local_batch_size global_batch_size seq_len max_norm steps enable_cpu_offload "
                "dtype mixed_precision_param mixed_precision_reduce gc_freq gc_debug seed deterministic "
                "debug_moe_force_load_balance",
    "parallelism": "data_parallel_replicate_degree enable_compiled_autograd data_parallel_shard_degree "
                   "fsdp_reshard_after_forward tensor_parallel_degree disable_loss_parallel "
                   "enable_async_tensor_parallel pipeline_parallel_degree pipeline_parallel_split_points "
                   "module_fqns_per_model_part pipeline_parallel_first_stage_less_layers "
                   "pipeline_parallel_last_stage_less_layers pipeline_parallel_layers_per_stage "
                   "pipeline_parallel_schedule pipeline_parallel_schedule_csv pipeline_parallel_microbatch_size "
                   "context_parallel_degree context_parallel_rotate_method expert_parallel_degree "
                   "expert_tensor_parallel_degree",
    "checkpoint": "enable enable_ft_dataloader_checkpoints folder interval initial_load_path initial_load_model_only "
                  "initial_load_in_hf initial_load_in_hf_quantized last_save_model_only last_save_in_hf "
                  "export_dtype async_mode keep_latest_k load_step exclude_from_loading enable_first_step_checkpoint "
                  "create_seed_checkpoint load_only",
    "activation_checkpoint": "mode selective_ac_option per_op_sac_force_recompute_mm_shapes_by_fqns early_stop "
                             "memory_budget visualize_memory_budget_pareto",
    "compile": "enable components backend",
    "quantize.linear.float8": "enable_fsdp_float8_all_gather precompute_float8_dynamic_scale_for_fsdp recipe_name "
                              "filter_fqns emulate",
    "quantize.linear.mx": "mxfp8_dim1_cast_kernel_choice recipe_name filter_fqns",
    "quantize.grouped_mm.float8": "fqns",
    "quantize.grouped_mm.mx": "recipe_name fqns",
    "comm": "init_timeout_seconds train_timeout_seconds trace_buf_size save_traces_folder save_traces_file_prefix",
    "memory_estimation": "enable disable_fake_mode",
    "fault_tolerance": "enable process_group process_group_timeout_ms replica_id group_size min_replica_size "
                       "semi_sync_method",
    "experimental": "custom_import custom_args_module",
    "validation": "enable dataset dataset_path local_batch_size seq_len freq steps",
}
KNOWN = {section: keys.split() for section, keys in KNOWN_KEYS.items()}

# Why a whole section is not carried over.
SECTION_WHY = {
    "job": "where torchtitan writes its outputs", "profiling": "torchtitan's profiler (simtrain's trace: report.trace)",
    "metrics": "logging", "comm": "timeouts and flight-recorder traces", "experimental": "custom modules",
    "checkpoint": "checkpoints to disk (a restart's are train.checkpoint, with the storage's bandwidth)",
    "memory_estimation": "torchtitan's estimator (`simtrain memory` plans memory)",
    "fault_tolerance": "torchft replicas (a fleet's failures: the fleet section)",
    "validation": "evaluation outside the training step",
    "lr_scheduler": "the learning rate stays train.optimizer.lr; warmup and decay are not carried",
    "quantize.linear.mx": "MXFP8 training is not built (train.precision fp8 is tensorwise float8)",
    "quantize.grouped_mm.float8": "MoE grouped GEMMs; the Llama 3 flavors have none",
    "quantize.grouped_mm.mx": "MoE grouped GEMMs; the Llama 3 flavors have none",
    "compile": "torch.compile's fusions are not modelled: the kernel model times every operator",
}
# Why a key of a carried section is not carried over; the keys carried are read by `_Reader.take`.
KEY_WHY = {
    "model.hf_assets_path": "the tokenizer; the vocabulary is the flavor's",
    "model.tokenizer_path": "the tokenizer; the vocabulary is the flavor's",
    "model.print_after_conversion": "logging",
    "optimizer.implementation": "a kernel choice; the update is timed by its bytes",
    "optimizer.early_step_in_backward": "not modelled",
    "training.dataset": "token data of the flavor's vocabulary stand in",
    "training.dataset_path": "token data of the flavor's vocabulary stand in",
    "training.max_norm": "gradient clipping is not modelled",
    "training.gc_freq": "Python's garbage collector", "training.gc_debug": "Python's garbage collector",
    "training.deterministic": "simtrain is deterministic always",
    "training.debug_moe_force_load_balance": "MoE only; the Llama 3 flavors are dense",
    "parallelism.enable_compiled_autograd": "torch.compile is not modelled",
    "parallelism.disable_loss_parallel": "the loss's tensor parallelism is not modelled",
    "parallelism.pipeline_parallel_split_points": "stages are balanced by FLOPs (parallel.pipeline.split)",
    "parallelism.module_fqns_per_model_part": "stages are balanced by FLOPs (parallel.pipeline.split)",
    "parallelism.pipeline_parallel_first_stage_less_layers": "stages are balanced by FLOPs (parallel.pipeline.split)",
    "parallelism.pipeline_parallel_last_stage_less_layers": "stages are balanced by FLOPs (parallel.pipeline.split)",
    "parallelism.pipeline_parallel_layers_per_stage": "stages are balanced by FLOPs (parallel.pipeline.split)",
    "parallelism.pipeline_parallel_schedule_csv": "give the CSV as parallel.pipeline.schedule_file",
    "parallelism.context_parallel_rotate_method": "ring attention passes keys and values around the ring",
    "parallelism.expert_tensor_parallel_degree": "the Llama 3 flavors are dense",
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": "selective recomputes the attention core",
    "activation_checkpoint.early_stop": "not modelled",
    "activation_checkpoint.memory_budget": "not modelled",
    "activation_checkpoint.visualize_memory_budget_pareto": "logging",
    "quantize.linear.float8.enable_fsdp_float8_all_gather": "FSDP gathers the bf16 parameters",
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": "FSDP gathers the bf16 parameters",
    "quantize.linear.float8.recipe_name": "train.precision fp8 scales per tensor (tensorwise)",
    "quantize.linear.float8.filter_fqns": "fp8 converts every Linear, the output head too",
    "quantize.linear.float8.emulate": "numerics: fp8 runs in float8 on the simulated device",
}


def import_torchtitan(toml_file, devices: int, cluster_file: str | None = None, steps: int | None = None) -> Imported:
    """The scenario of torchtitan's TOML `toml_file` on `devices` devices (the cluster of `cluster_file`'s cluster
    section, else imported.DEFAULT_CLUSTER), `steps` steps where given in place of training.steps."""
    path = user_path(toml_file, "torchtitan config", ConfigImportError)
    source = str(path)
    text = read_text_file(path, source, ConfigImportError)
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigImportError(f"{source}: not valid TOML: {str(error).splitlines()[0]}") from None
    except (ValueError, RecursionError):  # an integer past Python's digit limit; arrays nested past recursion
        raise ConfigImportError(f"{source}: not valid TOML: a value too large or nested too deep to read") from None
    reader = _Reader(source, _sections(config, source))
    cluster = cluster_section(cluster_file, devices)
    raw = {"name": scenario_name(path), "seed": 0, "numerics": False, "cluster": cluster}
    seed = reader.take("training", "seed")
    raw["seed"] = 0 if seed is None else bounded_int(seed, "training.seed", source, MAX_SEED, minimum=0)
    raw["model"], vocab = _model(reader)
    raw["data"], raw["train"], raw["parallel"] = _training_and_layout(reader, devices, vocab, steps)
    raw["report"] = {"trace": False}
    reader.name_the_rest()
    notes = [f"torchtitan flavor {reader.flavor}: torchtitan 0.3.0, torchtitan/models/llama3/__init__.py.",
             f"World size {devices} (--devices), on the cluster of {cluster_file or 'scenarios/megatron-core-h100'}.",
             "AdamW as adam: torch's Adam, its weight decay added to the gradient (AdamW decouples it)."]
    return Imported(source=source, raw=raw, not_carried=reader.not_carried, notes=notes + reader.notes)


def _sections(config: dict, source: str) -> dict[str, dict]:
    """The file's sections by dotted name ("quantize.linear.float8"); an unknown section or key refused."""
    sections: dict[str, dict] = {}

    def walk(table: dict, prefix: str) -> None:
        for key, value in table.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict) and name not in KNOWN:
                if not any(known.startswith(name + ".") for known in KNOWN):
                    raise ConfigImportError(f"{source}: [{name}]: not a section of torchtitan's job config"
                                            + _did_you_mean(name, list(KNOWN)))
                walk(value, name + ".")
            elif name in KNOWN:
                expect(value, dict, name, source, "a table")
                for field in value:
                    if field not in KNOWN[name]:
                        raise ConfigImportError(f"{source}: {name}.{field}: not a field of torchtitan's [{name}]"
                                                + _did_you_mean(field, KNOWN[name]))
                sections[name] = value
            else:
                raise ConfigImportError(f"{source}: {name}: not a section of torchtitan's job config"
                                        + _did_you_mean(name, list(KNOWN)))

    walk(config, "")
    return sections


def _did_you_mean(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f"; did you mean {close[0]}?" if close else ""


class _Reader:
    """The file's values read one field at a time; what is left once the scenario is made is named not carried."""

    def __init__(self, source: str, sections: dict[str, dict]):
        self.source, self.sections = source, sections
        self.taken: set[str] = set()
        self.not_carried: list[NotCarried] = []
        self.flavor = ""
        self.fp8 = False
        self.cp = 1
        self.notes: list[str] = []  # how a field was carried over where it is not one to one

    def take(self, section: str, key: str, default=None):
        """The value of `section.key` (the default when the file does not give it), marked carried."""
        self.taken.add(f"{section}.{key}")
        return self.sections.get(section, {}).get(key, default)

    def given(self, section: str, key: str) -> bool:
        return key in self.sections.get(section, {})

    def drop(self, field: str, why: str) -> None:
        """A field read but not carried over (a value simtrain has no equivalent for)."""
        self.taken.add(field)
        self.not_carried.append(NotCarried(field, why))

    def name_the_rest(self) -> None:
        """Every field given and not taken: not carried, with the reason of its key or its section."""
        for section, values in self.sections.items():
            for key in values:
                field = f"{section}.{key}"
                if field not in self.taken:
                    why = KEY_WHY.get(field) or SECTION_WHY.get(section) or "not modelled"
                    if section == "quantize.linear.float8" and not self.fp8:
                        why = "the float8 converter is off (model.converters)"
                    self.not_carried.append(NotCarried(field, why))

    def int(self, section, key, default, maximum, minimum=1):
        return bounded_int(self.take(section, key, default), f"{section}.{key}", self.source, maximum, minimum)

    def str(self, section, key, default):
        return expect(self.take(section, key, default), str, f"{section}.{key}", self.source, "a string")

    def flag(self, section, key, default=False):
        return expect(self.take(section, key, default), bool, f"{section}.{key}", self.source, "true or false")

    def real(self, section, key, default, low, high):
        return bounded_real(self.take(section, key, default), f"{section}.{key}", self.source, low, high)


def _model(reader: _Reader) -> tuple[dict, int]:
    """model.name and flavor -> the llama's dims; converters -> fp8 (read with training)."""
    name = reader.str("model", "name", "llama3")
    if name != "llama3":
        raise ConfigImportError(f"{reader.source}: model.name: {name!r} is not imported (llama3 is)")
    flavor = reader.str("model", "flavor", "debugmodel")
    if flavor not in FLAVORS:
        raise ConfigImportError(f"{reader.source}: model.flavor: {flavor!r} is not a llama3 flavor (one of: "
                                f"{', '.join(FLAVORS)})")
    reader.flavor = flavor
    dim, layers, heads, kv_heads, vocab, multiple_of, multiplier = FLAVORS[flavor]
    ffn = int(2 * 4 * dim / 3)
    if multiplier is not None:
        ffn = int(multiplier * ffn)
    ffn = multiple_of * math.ceil(ffn / multiple_of)
    model = {"name": "llama", "hidden": dim, "layers": layers, "heads": heads, "kv_heads": kv_heads or heads,
             "ffn_hidden": ffn, "rope_theta": ROPE_THETA, "attention": "fused"}
    return model, vocab


def _training_and_layout(reader: _Reader, devices: int, vocab: int, steps: int | None) -> tuple[dict, dict, dict]:
    """[training], [parallelism], [activation_checkpoint], float8 and [optimizer] -> data, train, parallel (`steps`,
    where given, in place of training.steps)."""
    source = reader.source
    replicate = reader.int("parallelism", "data_parallel_replicate_degree", 1, MAX_DEVICES)
    shard = reader.int("parallelism", "data_parallel_shard_degree", -1, MAX_DEVICES, minimum=-1)
    tp = reader.int("parallelism", "tensor_parallel_degree", 1, MAX_DEVICES)
    pp = reader.int("parallelism", "pipeline_parallel_degree", 1, MAX_DEVICES)
    cp = reader.cp = reader.int("parallelism", "context_parallel_degree", 1, MAX_DEVICES)
    ep = reader.int("parallelism", "expert_parallel_degree", 1, MAX_DEVICES)
    if ep > 1:
        raise ConfigImportError(f"{source}: parallelism.expert_parallel_degree: {ep} shards experts; llama3 "
                                f"{reader.flavor} has none")
    others = replicate * tp * pp * cp
    if shard == 0 or (shard == -1 and devices % others):
        raise ConfigImportError(f"{source}: parallelism.data_parallel_shard_degree: {shard} with replicate "
                                f"{replicate} x tp {tp} x pp {pp} x cp {cp} = {others} does not divide the "
                                f"{devices} devices (--devices)")
    shard = devices // others if shard == -1 else shard
    if others * shard != devices:
        raise ConfigImportError(f"{source}: parallelism: dp_replicate {replicate} x dp_shard {shard} x tp {tp} x pp "
                                f"{pp} x cp {cp} = {others * shard}, not the {devices} devices (--devices)")
    dp = replicate * shard
    local = reader.int("training", "local_batch_size", 8, MAX_BATCH_SIZE)
    seq_len = reader.int("training", "seq_len", 2048, MAX_SEQ_LEN)
    if steps is None:
        steps = reader.int("training", "steps", 10000, MAX_STEPS)
    elif reader.given("training", "steps"):
        reader.drop("training.steps", "simtrain import --steps given")
    global_batch = reader.int("training", "global_batch_size", -1, MAX_BATCH_SIZE * MAX_DEVICES, minimum=-1)
    accumulation = 1
    if global_batch not in (-1, 0):
        if global_batch % (local * dp):
            raise ConfigImportError(f"{source}: training.global_batch_size: {global_batch} is not a multiple of "
                                    f"local_batch_size {local} x the {dp} data-parallel ranks")
        accumulation = global_batch // (local * dp)
    batch = bounded_int(local * accumulation, "training.global_batch_size / data-parallel ranks", source,
                        MAX_BATCH_SIZE)
    parallel = {"tp": tp, "pp": pp, "cp": cp}  # dp: the devices left, so that --set cluster.devices resizes it
    microbatches = _pipeline(reader, parallel, local, accumulation)
    if microbatches > 1:
        parallel.setdefault("pipeline", {})["microbatches"] = microbatches
    precision = _precision(reader)
    if tp > 1:  # torchtitan's tensor-parallel plan shards the norms' activations along the sequence
        parallel["sequence_parallel"] = True
        if reader.flag("parallelism", "enable_async_tensor_parallel"):
            parallel["tp_comm_overlap"] = True
    elif reader.flag("parallelism", "enable_async_tensor_parallel"):
        reader.drop("parallelism.enable_async_tensor_parallel", "needs tensor_parallel_degree above 1")
    parallel["sharding"] = _sharding(reader, replicate, shard, pp, precision)
    train = {"steps": steps, "precision": precision, "checkpointing": _checkpointing(reader),
             "optimizer": _optimizer(reader)}
    data = {"name": "tokens", "batch_size": batch, "seq_len": seq_len, "vocab": vocab}
    return data, train, parallel


def _pipeline(reader: _Reader, parallel: dict, local: int, accumulation: int) -> int:
    """Pipeline schedule and microbatches: torchtitan cuts each local batch into microbatches of
    pipeline_parallel_microbatch_size; gradient accumulation (global_batch_size) runs that many pipelines one
    after the other, which a scenario's step holds as more microbatches of the same size."""
    source = reader.source
    schedule = reader.str("parallelism", "pipeline_parallel_schedule", "1F1B")
    size = reader.int("parallelism", "pipeline_parallel_microbatch_size", 1, MAX_BATCH_SIZE)
    if parallel["pp"] == 1:
        for key in ("pipeline_parallel_schedule", "pipeline_parallel_microbatch_size"):
            if reader.given("parallelism", key):
                reader.drop(f"parallelism.{key}", "pipeline_parallel_degree is 1")
        return accumulation
    if schedule not in SCHEDULES:
        raise ConfigImportError(f"{source}: parallelism.pipeline_parallel_schedule: {schedule!r} is not imported "
                                f"(one of: {', '.join(SCHEDULES)})")
    if local % size:
        raise ConfigImportError(f"{source}: parallelism.pipeline_parallel_microbatch_size: {size} does not divide "
                                f"training.local_batch_size {local}")
    name, chunks = SCHEDULES[schedule]
    parallel["pipeline"] = {"schedule": name, **({"virtual_stages": chunks} if chunks > 1 else {})}
    return bounded_int(local // size * accumulation, "pipeline microbatches", source, MAX_MICROBATCHES)


def _precision(reader: _Reader) -> str:
    """training.dtype bfloat16: bf16 throughout; else mixed_precision_param (FSDP2's param_dtype, torchtitan's
    autocast dtype without FSDP); the float8 converter on top: fp8."""
    source = reader.source
    dtype = reader.str("training", "dtype", "float32")
    param = reader.str("training", "mixed_precision_param", "bfloat16")
    for key, value in (("dtype", dtype), ("mixed_precision_param", param)):
        if value not in ("bfloat16", "float32"):
            raise ConfigImportError(f"{source}: training.{key}: {value!r} is not bfloat16 or float32")
    precision = "bf16" if "bfloat16" in (dtype, param) else "fp32"
    converters = expect(reader.take("model", "converters", []), list, "model.converters", source,
                        "a list of converter names")
    for converter in converters:
        if converter == "float8":
            if precision != "bf16":
                raise ConfigImportError(f"{source}: model.converters: float8 with float32 training is not "
                                        "imported (fp8 here trains around bf16)")
            precision, reader.fp8 = "fp8", True
        elif isinstance(converter, str):
            reader.drop(f"model.converters.{converter}", "only the float8 converter is modelled")
        else:
            raise ConfigImportError(f"{source}: model.converters: expected converter names, got {converter!r}")
    return precision


def _sharding(reader: _Reader, replicate: int, shard: int, pp: int, precision: str) -> dict:
    """FSDP2 over dp_shard (HSDP with dp_replicate); its reshard policy, reduce dtype and CPU offload."""
    source = reader.source
    reshard = reader.str("parallelism", "fsdp_reshard_after_forward", "default")
    reduce = reader.str("training", "mixed_precision_reduce", "float32")
    offload = reader.flag("training", "enable_cpu_offload")
    if reshard not in ("default", "always", "never"):
        raise ConfigImportError(f"{source}: parallelism.fsdp_reshard_after_forward: {reshard!r} is not default, "
                                "always or never")
    if reduce != "float32":
        raise ConfigImportError(f"{source}: training.mixed_precision_reduce: {reduce!r} is not float32")
    if shard == 1:
        for field, given in (("parallelism.fsdp_reshard_after_forward", reader.given("parallelism",
                                                                                     "fsdp_reshard_after_forward")),
                             ("training.enable_cpu_offload", offload)):
            if given:
                reader.drop(field, "data_parallel_shard_degree is 1: no FSDP")
        return {"stage": 0}
    sharding = {"stage": 3}
    if reader.cp > 1:
        reader.notes.append(f"FSDP shards over data_parallel_shard_degree x context_parallel_degree in torchtitan; "
                            f"here over the {shard} data-parallel shard ranks, each cp rank holding its shard.")
    if replicate > 1:
        sharding["degree"] = shard
    # torchtitan's "default": reshard after forward, except under pipeline parallelism
    if reshard == "never" or (reshard == "default" and pp > 1):
        sharding["reshard_after_forward"] = False
    if precision != "fp32":
        sharding["reduce_dtype"] = "fp32"
    if offload:
        sharding["offload"] = "optimizer_and_parameters"
    return sharding


def _checkpointing(reader: _Reader) -> str:
    """activation_checkpoint.mode: none, full, or selective (per op: the attention core recomputed; per layer,
    every k-th layer recomputed whole, which a scenario has no field for: full when k is 1)."""
    source = reader.source
    mode = reader.str("activation_checkpoint", "mode", "selective")
    option = reader.take("activation_checkpoint", "selective_ac_option", "2")
    if mode not in ("none", "full", "selective", "memory_budget"):
        raise ConfigImportError(f"{source}: activation_checkpoint.mode: {mode!r} is not none, selective, full or "
                                "memory_budget")
    if mode == "memory_budget":
        reader.drop("activation_checkpoint.mode", "memory_budget is not modelled: no recomputation")
        return "none"
    if mode != "selective":
        return mode
    option = expect(option, str, "activation_checkpoint.selective_ac_option", source, "'op' or a layer count")
    if option == "op":
        return "selective"
    if not option.isdigit() or not 1 <= int(option[:8]) <= 1000:
        raise ConfigImportError(f"{source}: activation_checkpoint.selective_ac_option: {option[:40]!r} is not 'op' "
                                "or a layer count")
    if option != "1":
        reader.drop("activation_checkpoint.selective_ac_option",
                    f"one layer in every {option} recomputed is not built: every layer is (full)")
    return "full"


def _optimizer(reader: _Reader) -> dict:
    """AdamW or Adam -> adam (torch's Adam adds weight decay to the gradient; AdamW decouples it)."""
    source = reader.source
    name = reader.str("optimizer", "name", "AdamW")
    if name not in ("AdamW", "Adam"):
        raise ConfigImportError(f"{source}: optimizer.name: {name!r} is not AdamW or Adam")
    lr = reader.real("optimizer", "lr", 8e-4, 1e-30, MAX_LEARNING_RATE)
    betas = [reader.real("optimizer", key, default, 0, 0.999999) for key, default in (("beta1", 0.9),
                                                                                      ("beta2", 0.95))]
    eps = reader.real("optimizer", "eps", 1e-8, 1e-30, 1)
    decay = reader.real("optimizer", "weight_decay", 0.1, 0, 1e6)
    return {"name": "adam", "lr": lr, "betas": betas, "eps": eps, "weight_decay": decay}
