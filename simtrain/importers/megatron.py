"""Megatron-LM's pretrain_gpt.py arguments as a simtrain scenario: every flag that maps is carried over, every
other named.

The arguments come as a list (`--num-layers 32 --hidden-size 4096 --tensor-model-parallel-size 2 ...`), from a
command line or a file of them (a launcher and its script before them, `torchrun ... pretrain_gpt.py`, are
skipped). Every flag is checked against Megatron-LM's own (megatron_flags.txt, read from its arguments.py): an
unknown flag, a flag without its value and flags Megatron-LM refuses together are one line each. A
Megatron-Bridge recipe (megatron_recipes.py) arrives here as the same names, as Megatron-Core's config fields
spell them. The world size is not in the arguments (torchrun's, `--devices` here).

    imported = import_megatron_args(["--num-layers", "32", "--hidden-size", "4096", ...], devices=16)
    scenario = imported.scenario()

How the flags map (names as Megatron-LM's arguments.py has them, its defaults where one is not given):

- the model: a llama (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention) when any of --swiglu,
  --normalization RMSNorm, --position-embedding-type rope is given, else a gpt; --num-layers, --hidden-size,
  --num-attention-heads, --ffn-hidden-size (default 4 x hidden, with --swiglu 2/3 of it in multiples of 64),
  --num-query-groups, --rotary-base, --vocab-size, --seq-length; --num-experts, --moe-router-topk,
  --moe-ffn-hidden-size; --attention-backend unfused is eager attention, any other fused;
- the batch: --micro-batch-size and --global-batch-size: data.batch_size global / dp, in global / (micro x dp)
  micro-batches; --train-iters, or --train-samples / global batch;
- precision: --bf16, --fp16, --fp8-format (fp8 on bf16); --recompute-granularity full or selective;
- the layout: tensor, pipeline (--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank:
  interleaved), context and expert parallel sizes, --sequence-parallel, --tp-comm-overlap;
  --use-distributed-optimizer (sharding stage 1, gradients reduced in fp32 unless --grad-reduce-in-bf16),
  --use-torch-fsdp2 or --use-megatron-fsdp with --data-parallel-sharding-strategy (stages 1 to 3),
  --overlap-grad-reduce and --overlap-param-gather;
- the optimizer: adam (--adam-beta1, --adam-beta2, --adam-eps) or sgd (--sgd-momentum), --lr, --weight-decay.
"""
import difflib
import math
from importlib import resources

from ..errors import ConfigImportError
from ..limits import (MAX_BATCH_SIZE, MAX_DEVICES, MAX_FEATURES, MAX_HEADS, MAX_LAYERS, MAX_LEARNING_RATE,
                      MAX_MICROBATCHES, MAX_SEED, MAX_SEQ_LEN, MAX_STEPS, MAX_WIDTH)
from .imported import Imported, NotCarried, bounded_int, bounded_real, cluster_section

# Why a flag given is not carried over, by the start of its name (the first that matches).
_WHY_BY_PREFIX = (
    (("data-", "split", "mock-data", "tokenizer", "vocab-file", "merge-file", "num-workers", "tiktoken", "no-mmap",
      "no-create-attention-mask", "dataloader", "make-vocab-size"), "the data pipeline: token data stand in"),
    (("log-", "tensorboard", "wandb", "profile", "timing-log", "record-memory"), "logging and profiling"),
    (("save", "load", "ckpt-", "no-save", "no-load", "async-save", "finetune", "pretrained-checkpoint"),
     "checkpoints to disk"),
    (("lr-", "min-lr", "decoupled-", "start-weight-decay", "end-weight-decay", "weight-decay-incr-style"),
     "the learning-rate schedule: train.optimizer.lr stays constant"),
    (("eval-", "exit-", "distributed-timeout", "manual-gc", "empty-unused-memory", "check-for-nan"),
     "outside the step's time"),
    (("attention-dropout", "hidden-dropout"), "dropout is not modelled"),
    (("init-method",), "initialization"),
    (("fp8-", "fp4-"), "fp8's scaling details: train.precision fp8 scales per tensor"),
    (("clip-grad",), "gradient clipping is not modelled"),
    (("recompute-method", "recompute-num-layers", "recompute-modules"),
     "which layers are recomputed: train.checkpointing recomputes every layer (full) or the attention core"),
)


def megatron_flags() -> dict[str, str]:
    """Megatron-LM's flags and the values each takes ("0" a switch, "1" one value, "+" one or more):
    megatron_flags.txt, read from Megatron-LM's arguments.py (its header names the commit)."""
    text = resources.files(__package__).joinpath("megatron_flags.txt").read_text()
    return dict(line.split() for line in text.splitlines() if line and not line.startswith("#"))


def parse_megatron_args(tokens: list[str], source: str) -> dict[str, object]:
    """Megatron-LM's arguments as {name: value} (names with underscores, as its args namespace; a switch True,
    a value its text, several values a list), what comes before the first flag after a launcher's script skipped."""
    flags = megatron_flags()
    scripts = [index for index, token in enumerate(tokens) if token.endswith(".py")]
    tokens = tokens[scripts[0] + 1:] if scripts else tokens
    values: dict[str, object] = {}
    index = 0
    while index < len(tokens):
        token = tokens[index]
        flag, equals, inline = token.partition("=")
        if not flag.startswith("--"):
            raise ConfigImportError(f"{source}: {token[:40]!r}: expected a flag (--name), as pretrain_gpt.py takes")
        if flag not in flags:
            close = difflib.get_close_matches(flag, list(flags), n=1)
            raise ConfigImportError(f"{source}: {flag[:60]}: not a flag of Megatron-LM's pretrain_gpt.py"
                                    + (f"; did you mean {close[0]}?" if close else ""))
        arity, index = flags[flag], index + 1
        following = []
        while index < len(tokens) and not tokens[index].startswith("--") and (arity == "+" or not following):
            if arity == "0":
                break
            following.append(tokens[index])
            index += 1
        given = [inline] if equals else following
        if arity == "0" and given:
            raise ConfigImportError(f"{source}: {flag}: a switch, takes no value (got {given[0][:40]!r})")
        if arity != "0" and not given:
            raise ConfigImportError(f"{source}: {flag}: missing its value")
        values[flag[2:].replace("-", "_")] = True if arity == "0" else (given if arity == "+" else given[0])
    return values


def import_megatron_args(tokens: list[str], devices: int, cluster_file: str | None = None,
                         source: str = "arguments", steps: int | None = None) -> Imported:
    """The scenario of Megatron-LM's arguments `tokens` on `devices` devices (`steps` steps, where given)."""
    values = parse_megatron_args(tokens, source)
    return megatron_scenario(values, devices, cluster_file, source, lambda name: "--" + name.replace("_", "-"),
                             name="megatron-gpt", steps=steps)


def megatron_scenario(values: dict, devices: int, cluster_file: str | None, source: str, label,
                      name: str, notes: tuple[str, ...] = (), steps: int | None = None) -> Imported:
    """The scenario of Megatron names and values (Megatron-LM's args, or a Megatron-Bridge recipe's fields);
    `label(name)` is how an error line names a field (--num-layers, model.num_layers); `steps`, where given,
    replaces the source's iteration count."""
    reader = _Values(values, source, label)
    cluster = cluster_section(cluster_file, devices)
    raw = {"name": name, "seed": reader.int("seed", 1234, MAX_SEED, minimum=0), "numerics": False,
           "cluster": cluster}
    raw["model"], seq_len, vocab = _model(reader)
    raw["data"], raw["train"], raw["parallel"] = _job(reader, devices, seq_len, vocab, raw["model"], steps)
    raw["report"] = {"trace": False}
    not_carried = [NotCarried(label(key), _why(key)) for key in values if key not in reader.taken]
    notes = (*notes, f"World size {devices} (--devices), on the cluster of "
                     f"{cluster_file or 'scenarios/megatron-core-h100'}.", *reader.notes)
    return Imported(source=source, raw=raw, not_carried=not_carried, notes=list(notes))


# Why a flag read is not carried over, where the start of its name does not say it.
_WHY_BY_NAME = {
    "overlap_grad_reduce": "a distributed optimizer's collectives overlap here under tensor, pipeline or context "
                           "parallelism only",
    "overlap_param_gather": "a distributed optimizer's collectives overlap here under tensor, pipeline or context "
                            "parallelism only",
    "sequence_parallel": "Megatron-LM turns sequence parallelism off at tensor-parallel size 1",
    "tp_comm_overlap": "Megatron-LM turns sequence parallelism off at tensor-parallel size 1",
    "normalization": "a llama normalizes with RMSNorm", "position_embedding_type": "a llama has rotary embeddings",
    "swiglu": "a llama's MLP is SwiGLU",
    "train_iters": "simtrain import --steps given", "train_samples": "simtrain import --steps given",
}


def _why(name: str) -> str:
    if name in _WHY_BY_NAME:
        return _WHY_BY_NAME[name]
    flag = name.replace("_", "-")
    for prefixes, why in _WHY_BY_PREFIX:
        if flag.startswith(prefixes):
            return why
    return "not modelled"


class _Values:
    """Megatron names read one at a time, typed and bounded; what is never read is named not carried."""

    def __init__(self, values: dict, source: str, label):
        self.values, self.source, self.label = values, source, label
        self.taken: set[str] = set()
        self.notes: list[str] = []  # how a field was carried over where it is not one to one

    def get(self, name: str, default=None):
        self.taken.add(name)
        return self.values.get(name, default)

    def given(self, name: str) -> bool:
        return self.values.get(name) not in (None, False)

    def fail(self, name: str, why: str):
        raise ConfigImportError(f"{self.source}: {self.label(name)}: {why}")

    def int(self, name: str, default, maximum: int, minimum: int = 1, required: bool = False, hint: str = ""):
        value = self.get(name, default)
        if value is None:
            if required:
                self.fail(name, "missing (Megatron-LM has no default for it)")
            return None
        if isinstance(value, str):
            if not value.strip().lstrip("-").isdigit() or len(value) > 64:
                self.fail(name, f"expected an integer, got {value[:40]!r}")
            value = int(value)
        return bounded_int(value, self.label(name), self.source, maximum, minimum, hint)

    def real(self, name: str, default, low: float, high: float):
        value = self.get(name, default)
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = float(value[:64])
            except ValueError:
                self.fail(name, f"expected a number, got {value[:40]!r}")
        return bounded_real(value, self.label(name), self.source, low, high)

    def switch(self, name: str) -> bool:
        value = self.get(name, False)
        if not isinstance(value, bool):
            self.fail(name, f"expected true or false, got {str(value)[:40]!r}")
        return value

    def choice(self, name: str, default, choices: tuple):
        value = self.get(name, default)
        if value is not None and value not in choices:
            self.fail(name, f"{str(value)[:40]!r} is not one of {', '.join(map(str, choices))}")
        return value


def _model(reader: _Values) -> tuple[dict, int, int]:
    """The model's section, its sequence length and vocabulary."""
    swiglu = reader.switch("swiglu")
    norm = reader.choice("normalization", "LayerNorm", ("LayerNorm", "RMSNorm"))
    position = reader.choice("position_embedding_type", "learned_absolute",
                             ("learned_absolute", "rope", "mrope", "relative", "none"))
    llama = swiglu or norm == "RMSNorm" or position == "rope"
    layers = reader.int("num_layers", None, MAX_LAYERS, required=True)
    hidden = reader.int("hidden_size", None, MAX_WIDTH, required=True)
    heads = reader.int("num_attention_heads", None, MAX_HEADS, required=True)
    default_ffn = int(4 * hidden * 2 / 3 / 64) * 64 if swiglu else 4 * hidden  # Megatron-LM's arguments.py
    ffn = reader.int("ffn_hidden_size", default_ffn, MAX_WIDTH)
    kv_channels = reader.int("kv_channels", hidden // heads, MAX_WIDTH)
    if kv_channels != hidden // heads:
        reader.fail("kv_channels", f"{kv_channels} is not hidden / heads ({hidden // heads}): simtrain's heads are "
                                   "hidden / heads wide")
    reader.switch("group_query_attention")
    groups = reader.int("num_query_groups", None, MAX_HEADS)
    seq_len = reader.int("seq_length", None, MAX_SEQ_LEN, required=True)
    vocab = reader.int("vocab_size", None, MAX_FEATURES, minimum=2, required=True)
    backend = reader.get("attention_backend", "auto")
    model = {"name": "llama" if llama else "gpt", "hidden": hidden, "layers": layers, "heads": heads,
             "attention": "eager" if backend == "unfused" else "fused"}
    if llama:
        model.update({"kv_heads": groups or heads, "ffn_hidden": ffn,
                      "rope_theta": reader.real("rotary_base", 10000, 1.0001, 1e12)})
        for name, ok in (("normalization", norm == "RMSNorm"), ("position_embedding_type", position == "rope"),
                         ("swiglu", swiglu)):
            if not ok:
                reader.taken.discard(name)  # named below: the llama has RMSNorm, rotary embeddings and SwiGLU
        reader.get("disable_bias_linear")  # a llama has no bias
        reader.get("untie_embeddings_and_output_weights")  # a llama's output Linear is its own
    else:
        if ffn != 4 * hidden:
            reader.fail("ffn_hidden_size", f"{ffn}: a gpt's MLP here is 4 x hidden ({4 * hidden}); give --swiglu "
                                           "for a llama's")
        if groups is not None and groups != heads:
            reader.fail("num_query_groups", "grouped-query attention is a llama's here (give --swiglu, "
                                            "--normalization RMSNorm or --position-embedding-type rope)")
    experts = reader.int("num_experts", None, MAX_HEADS, minimum=2)
    if experts is not None:
        moe = {"experts": experts, "top_k": reader.int("moe_router_topk", 2, MAX_HEADS)}
        expert_hidden = reader.int("moe_ffn_hidden_size", None, MAX_WIDTH)
        if expert_hidden is not None and expert_hidden != ffn:
            moe["expert_hidden"] = expert_hidden
        model["moe"] = moe
    return model, seq_len, vocab


def _job(reader: _Values, devices: int, seq_len: int, vocab: int, model: dict,
         steps: int | None) -> tuple[dict, dict, dict]:
    """data, train and parallel: batch and steps (`steps`, where given, in place of the source's), precision,
    recomputation, optimizer, the layout."""
    tp = reader.int("tensor_model_parallel_size", 1, MAX_DEVICES)
    pp = reader.int("pipeline_model_parallel_size", 1, MAX_DEVICES)
    cp = reader.int("context_parallel_size", 1, MAX_DEVICES)
    ep = reader.int("expert_model_parallel_size", 1, MAX_DEVICES)
    if devices % (tp * pp * cp):
        reader.fail("tensor_model_parallel_size", f"tp {tp} x pp {pp} x cp {cp} = {tp * pp * cp} does not divide "
                                                  f"the {devices} devices (--devices)")
    dp = devices // (tp * pp * cp)
    micro = reader.int("micro_batch_size", 1, MAX_BATCH_SIZE)
    global_batch = reader.int("global_batch_size", micro * dp, MAX_BATCH_SIZE * MAX_DEVICES)
    if global_batch % (micro * dp):
        reader.fail("global_batch_size", f"{global_batch} is not a multiple of micro-batch {micro} x the {dp} "
                                         "data-parallel ranks")
    microbatches = bounded_int(global_batch // (micro * dp), "global batch / (micro-batch x data-parallel ranks)",
                               reader.source, MAX_MICROBATCHES)
    data = {"name": "tokens", "batch_size": bounded_int(global_batch // dp, "global batch / data-parallel ranks",
                                                        reader.source, MAX_BATCH_SIZE),
            "seq_len": seq_len, "vocab": vocab}
    few = "; give simtrain import --steps N (a few steps time the step)"
    iters = reader.int("train_iters", None, MAX_STEPS if steps is None else 1 << 62, hint=few)
    samples = reader.int("train_samples", None, 1 << 62)
    if (iters is None) == (samples is None):
        reader.fail("train_iters", "give either it or --train-samples, as Megatron-LM asks (one, not both)")
    if steps is not None:  # --steps: the source's count named, not carried
        reader.taken.difference_update({"train_iters", "train_samples"})
    elif iters is None:
        steps = bounded_int(math.ceil(samples / global_batch), reader.label("train_samples") + " / global batch",
                            reader.source, MAX_STEPS, hint=few)
    else:
        steps = iters
    train = {"steps": steps, "precision": _precision(reader), "checkpointing": _recompute(reader),
             "optimizer": _optimizer(reader)}
    parallel = {"tp": tp, "pp": pp, "cp": cp, **({"ep": ep} if ep > 1 else {})}
    pipeline = {"microbatches": microbatches} if microbatches > 1 else {}
    chunks = _virtual_stages(reader, model["layers"], pp)
    if chunks > 1:
        pipeline.update({"schedule": "interleaved", "virtual_stages": chunks})
    if pipeline:
        parallel["pipeline"] = pipeline
    sequence = reader.switch("sequence_parallel")
    overlap_tp = reader.switch("tp_comm_overlap")
    if overlap_tp and not sequence:
        reader.fail("tp_comm_overlap", "needs --sequence-parallel, as Megatron-LM asserts")
    if sequence and tp > 1:
        parallel["sequence_parallel"] = True
        if overlap_tp:
            parallel["tp_comm_overlap"] = True
    elif sequence or overlap_tp:  # Megatron-LM turns sequence parallelism off at tp 1
        reader.taken.difference_update({"sequence_parallel", "tp_comm_overlap"})
    parallel.update(_data_parallel(reader, model_parallel=tp * pp * cp > 1, precision=train["precision"]))
    return data, train, parallel


def _virtual_stages(reader: _Values, layers: int, pp: int) -> int:
    """Model chunks per pipeline rank: --num-virtual-stages-per-pipeline-rank, or layers / (pp x
    --num-layers-per-virtual-pipeline-stage); Megatron-Bridge's virtual_pipeline_model_parallel_size."""
    per_stage = reader.int("num_layers_per_virtual_pipeline_stage", None, MAX_LAYERS)
    stages = reader.int("num_virtual_stages_per_pipeline_rank", None, MAX_LAYERS)
    bridge = reader.int("virtual_pipeline_model_parallel_size", None, MAX_LAYERS)
    given = [value for value in (per_stage, stages, bridge) if value is not None]
    if len(given) > 1:
        reader.fail("num_layers_per_virtual_pipeline_stage", "give it or --num-virtual-stages-per-pipeline-rank, "
                                                             "not both (Megatron-LM asserts)")
    if per_stage is not None:
        if layers % (pp * per_stage):
            reader.fail("num_layers_per_virtual_pipeline_stage", f"{per_stage} x pp {pp} does not divide the "
                                                                 f"{layers} layers")
        return layers // (pp * per_stage)
    chunks = given[0] if given else 1
    if chunks > 1 and pp == 1:
        reader.fail("num_virtual_stages_per_pipeline_rank", "interleaves a pipeline; the pipeline size is 1")
    return chunks


def _precision(reader: _Values) -> str:
    bf16, fp16 = reader.switch("bf16"), reader.switch("fp16")
    if bf16 and fp16:
        reader.fail("fp16", "with --bf16: one or the other, as Megatron-LM asserts")
    fp8 = reader.choice("fp8_format", None, ("e4m3", "hybrid"))
    if fp8 is not None and not bf16:
        reader.fail("fp8_format", "fp8 here trains around bf16: give --bf16 too")
    return "fp8" if fp8 else "bf16" if bf16 else "fp16" if fp16 else "fp32"


def _recompute(reader: _Values) -> str:
    """--recompute-granularity: full (every layer, whatever --recompute-method and --recompute-num-layers say:
    those are named not carried) or selective (the attention core)."""
    return reader.choice("recompute_granularity", None, ("full", "selective")) or "none"


def _optimizer(reader: _Values) -> dict:
    name = reader.choice("optimizer", "adam", ("adam", "sgd"))
    optimizer = {"name": name}
    lr = reader.real("lr", None, 1e-30, MAX_LEARNING_RATE)
    if lr is not None:
        optimizer["lr"] = lr
    optimizer["weight_decay"] = reader.real("weight_decay", 0.01, 0, 1e6)
    if name == "adam":
        optimizer["betas"] = [reader.real("adam_beta1", 0.9, 0, 0.999999), reader.real("adam_beta2", 0.999, 0,
                                                                                     0.999999)]
        optimizer["eps"] = reader.real("adam_eps", 1e-8, 1e-30, 1)
    else:
        optimizer["momentum"] = reader.real("sgd_momentum", 0.9, 0, 0.999999)
    return optimizer


def _data_parallel(reader: _Values, model_parallel: bool, precision: str) -> dict:
    """The distributed optimizer (stage 1), FSDP's sharding strategy (stages 1 to 3), their overlap flags."""
    distributed = reader.switch("use_distributed_optimizer")
    torch_fsdp, megatron_fsdp = reader.switch("use_torch_fsdp2"), reader.switch("use_megatron_fsdp")
    fsdp = torch_fsdp or megatron_fsdp
    strategy = reader.choice("data_parallel_sharding_strategy", "no_shard",
                             ("no_shard", "optim", "optim_grads", "optim_grads_params"))
    if torch_fsdp and distributed:
        reader.fail("use_torch_fsdp2", "with --use-distributed-optimizer: torch FSDP2 shards on its own, as "
                                       "Megatron-LM asserts")
    stage = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}[strategy] if fsdp else 0
    if torch_fsdp and not reader.given("data_parallel_sharding_strategy"):
        stage = 3  # torch FSDP2 shards parameters, gradients and optimizer state
    if stage == 0 and distributed:
        stage = 1
    grad_reduce = reader.switch("overlap_grad_reduce")
    param_gather = reader.switch("overlap_param_gather")
    in_bf16, in_fp32 = reader.switch("grad_reduce_in_bf16"), reader.get("grad_reduce_in_fp32", True)  # LM, Bridge
    bf16_reduce = in_bf16 or in_fp32 is False
    if stage == 0:
        if param_gather:
            reader.taken.discard("overlap_param_gather")  # no distributed optimizer: nothing to gather
        ddp = {"overlap": True} if grad_reduce else {}
        if precision != "fp32" and not bf16_reduce:  # Megatron-Core's fp32 main gradients (train/replica.py)
            ddp["sharding"] = {"reduce_dtype": "fp32"}
        return ddp
    sharding = {"stage": stage}
    if precision != "fp32":
        sharding["reduce_dtype"] = "bf16" if bf16_reduce else "fp32"
    if stage < 3 and model_parallel and grad_reduce:
        sharding["overlap_grad_reduce"] = True
        if param_gather:
            sharding["overlap_param_gather"] = True
    elif stage < 3:  # simtrain overlaps a distributed optimizer's collectives under pp/tp/cp only
        reader.taken.difference_update({"overlap_grad_reduce", "overlap_param_gather"})
    return {"sharding": sharding}
