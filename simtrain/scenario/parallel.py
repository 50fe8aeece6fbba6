"""The scenario's `parallel` section: the layout, the mode and the collective algorithm.

    parallel:
      mode: sync             # sync | async
      all_reduce: ring       # naive | ring | tree | hierarchical | dbtree | nccl
      pp: 2                  # pipeline stages
      tp: 2                  # tensor-parallel ranks per stage
      cp: 2                  # context-parallel ranks sharing each sequence (ring attention)
      sharding: {stage: 3}   # ZeRO 1 | 2 | 3 (FSDP) inside the data-parallel dimension; 0: plain DDP

The scheme that runs follows from the mode and the layout: the registry in
simtrain/schemes/__init__.py (docs/concepts/schemes.md).
"""
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from ..limits import MAX_CHANNELS, MAX_DEVICES, MAX_LAYERS, MAX_MICROBATCHES
from .fields import Count, Flag, NotBoolean, Real, Section

Dimension = Literal["tp", "cp", "pp", "dp"]


# Sharding schemes as other frameworks name them -> parallel.sharding.stage (DeepSpeed's ZeRO stages; FSDP's
# FULL_SHARD is stage 3, SHARD_GRAD_OP stage 2: torch.distributed.fsdp.ShardingStrategy)
ZERO_SCHEMES = {"zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "fsdp2": 3, "fullshard": 3, "shardgradop": 2}


class AsyncSpec(Section):
    """Asynchronous SGD (mode async, schemes/asynchronous.py)."""

    consistency: Literal["hogwild", "locked"] = Field(
        "hogwild", description="hogwild: no lock, pushes share the store; locked: a FIFO lock serializes them.")
    staleness_lr: Literal["none", "inverse"] = Field(
        "none", description="inverse: an update of staleness s applies with lr / (1 + s); none: lr.")


class PipelineSpec(Section):
    """How a pipeline runs (simtrain/parallel/schedules, schemes/model_parallel.py)."""

    schedule: str = Field(
        "1f1b", description="The pipeline schedule: gpipe, 1f1b, interleaved, zero_bubble (ZB-H1), dualpipev "
                            "(virtual_stages 2, at least 2 x pp microbatches) or file (schedule_file); checked with "
                            "the layout by simtrain/parallel/schedules.")
    schedule_file: str | None = Field(
        None, description="schedule file: torch.distributed.pipelining's CSV of actions, one row per pipeline rank "
                          "(relative to the scenario's folder).")
    microbatches: Count(MAX_MICROBATCHES) | None = Field(
        None, description="Micro-batches per step: data.batch_size (each data-parallel replica's samples per "
                          "step) is cut into this many, which must divide it. With a pipeline they flow through "
                          "the stages; without one (data parallelism, ZeRO / FSDP, tp or cp alone) they are "
                          "gradient accumulation steps, run one after the other, each holding only its own "
                          "activations, the gradient reduced as in torch DDP's no_sync and FSDP2's default "
                          "(docs/guides/memory.md). The micro-batch size is data.batch_size / microbatches; the "
                          "global batch data.batch_size x dp. null: 4 with a pipeline (pp > 1), else 1.")
    virtual_stages: Count(MAX_LAYERS) = Field(
        1, description="Model chunks per device (interleaved: any; dualpipev: 2).")
    split: Annotated[list[Count(MAX_LAYERS + 2)], Field(max_length=MAX_DEVICES)] | None = Field(
        None, description="Layers (splittable units) per model part, pp x virtual_stages counts; null: balanced "
                          "by measured FLOPs.")

    @model_validator(mode="after")
    def _a_file_for_file(self) -> "PipelineSpec":
        if (self.schedule == "file") != (self.schedule_file is not None):
            raise ValueError("parallel.pipeline.schedule_file: goes with schedule file, and only with it "
                             f"(schedule {self.schedule}, schedule_file {self.schedule_file})")
        return self


class ShardingSpec(Section):
    """Sharded data parallelism (ZeRO / FSDP, strategies/distributed_optimizer.py): what each data-parallel rank holds only a
    1/degree shard of. The shard group is `degree` adjacent data-parallel ranks (torchtitan's dp_shard); the
    dp / degree groups replicate each other (dp_replicate: HSDP)."""

    stage: Annotated[Literal[0, 1, 2, 3], NotBoolean] = Field(
        0, description="0: plain DDP (nothing sharded); 1: optimizer state (and fp32 master weights and "
                       "gradients) sharded; 2: the gradients too; 3 (FSDP): the parameters too.")
    degree: Count(MAX_DEVICES) | None = Field(
        None, description="Ranks a shard group holds the state across (must divide dp); the dp / degree groups "
                          "all-reduce their shards (HSDP); null: all of dp.")
    reshard_after_forward: Flag = Field(
        True, description="stage 3: free a unit's gathered parameters after its forward and gather them again "
                          "for its backward; false: keep them from the forward to the backward.")
    reduce_dtype: Literal["fp32", "bf16", "fp16"] | None = Field(
        None, description="The dtype gradients are reduce-scattered (and HSDP all-reduced) in, as FSDP2's "
                          "MixedPrecisionPolicy.reduce_dtype (stages 2 and 3: a copy cast as a unit's reduction "
                          "starts); stages 0 (DDP) and 1 with fp32 under mixed precision: Megatron-Core's fp32 main "
                          "gradients, the gradient buffer itself in fp32, each backward's gradient added into it; "
                          "null: the compute dtype (train.precision, which is FSDP2's param_dtype).")
    offload: Literal["none", "optimizer", "optimizer_and_parameters"] = Field(
        "none", description="ZeRO-Offload (strategies/offload.py): optimizer: each rank's fp32 master shard, its "
                            "gradient and its optimizer state live in cluster.shared_memory (the host's DRAM) and "
                            "the optimizer steps there, on the host CPU; optimizer_and_parameters (stage 3): the "
                            "16-bit parameter shard too, copied to the device before each gather.")
    overlap_grad_reduce: Flag = Field(
        False, description="Stages 1 and 2 under pp/tp (Megatron-Core's --overlap-grad-reduce): the gradient "
                           "buffer cut into buckets, each reduce-scattered as soon as the last microbatch's "
                           "backward has completed it, beside the rest of the backward "
                           "(strategies/bucket_overlap.py; with parallel.ep the experts' buckets apart, each over "
                           "the experts' holders); false: one reduce-scatter after the last backward.")
    overlap_param_gather: Flag = Field(
        False, description="Stages 1 and 2 under pp/tp, with overlap_grad_reduce (Megatron-Core's "
                           "--overlap-param-gather): each bucket's updated parameters all-gathered in the next "
                           "step's forward, awaited before the first region that uses them, the next bucket's "
                           "posted then; false: all-gathered right after the optimizer step.")
    bucket_size: Count(1 << 40) | None = Field(
        None, description="Parameters (elements) per bucket under overlap_grad_reduce; null: Megatron-Core's "
                          "default, max(40,000,000, 1,000,000 x the dp x cp ranks).")


class ParallelSpec(Section):
    """How the job's devices cooperate."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, serialize_by_alias=True)

    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: every step waits for the gradient all-reduce; async: asynchronous SGD on a "
                            "shared store (schemes/asynchronous.py).")
    all_reduce: Literal["naive", "ring", "tree", "hierarchical", "dbtree", "nccl"] = Field(
        "ring", description="The all-reduce algorithm of the data-parallel gradient and of the tp all-reduces "
                            "(simtrain/comm/): naive | ring | tree (FireCaffe) | hierarchical (in-host "
                            "reduce-scatter, cross-host all-reduce per rail, in-host all-gather) | dbtree (NCCL's "
                            "double binary tree) | nccl (per call, the algorithm and protocol NCCL's tuning "
                            "model chooses for its size: comm/nccl.py).")
    channels: Count(MAX_CHANNELS) | None = Field(
        None, description="All-reduce channels (buffer parts run side by side, each crossing hosts on its own "
                          "rail); null: the topology's default, one per NIC rail across hosts, else 1 "
                          "(simtrain/comm/channels.py).")
    async_: AsyncSpec = Field(AsyncSpec(), alias="async", description="mode async's options.")
    sync_batchnorm: Flag = Field(False, description="All-reduce BatchNorm batch statistics "
                                                    "(simtrain/train/syncbn.py).")
    overlap: Flag | None = Field(
        None, description="sync, sharding.stage 0: all-reduce the gradient in DDP's buckets (reverse parameter "
                          "order), each as soon as the (last micro-batch's) backward has completed it "
                          "(train/grad_bucket.py; under pp/tp/cp strategies/bucket_overlap.py, as Megatron-Core's "
                          "--overlap-grad-reduce; with parallel.ep the experts' buckets apart, each over the "
                          "experts' holders); false: one all-reduce after the backward. null: on with data "
                          "parallelism alone (torch DDP's default; ep: off), off under pp, tp or cp (Megatron-Core's "
                          "default). Sharded data parallelism overlaps with its own flags (sharding).")
    bucket_cap_mb: Real(gt=0, le=1 << 20) = Field(25.0, description="A DDP bucket's size under parallel.overlap, "
                                                                    "in MiB (torch DDP's default 25).")
    dp: Count(MAX_DEVICES) | None = Field(None, description="Data-parallel replicas; null: devices / (pp x cp x "
                                                            "tp). dp x pp x cp x tp must equal the job's devices.")
    pp: Count(MAX_DEVICES) = Field(1, description="Pipeline stages.")
    tp: Count(MAX_DEVICES) = Field(1, description="Tensor-parallel ranks per stage (Megatron-LM's split of "
                                                  "Linear pairs and heads).")
    cp: Count(MAX_DEVICES) = Field(
        1, description="Context-parallel ranks per stage: each sequence cut into 2·cp chunks, rank r holding chunks r "
                       "and 2·cp−1−r (causal load balancing), attention by ring attention over the cp group, the "
                       "weights' gradients averaged over dp x cp (train/ring_attention.py). data.seq_len must divide "
                       "into 2·cp chunks (2·cp·tp with sequence_parallel); gpt and llama.")
    sequence_parallel: Flag = Field(
        False, description="Under tp: cut the LayerNorm, residual and bias regions of a gpt along the sequence "
                           "across the tp group, each tp all-reduce becoming a reduce-scatter and an all-gather "
                           "(Korthikanti et al. 2022; train/gpt.py). data.seq_len must divide by tp.")
    tp_comm_overlap: Flag = Field(
        False, description="Under sequence_parallel: each layer's tp all-gather and reduce-scatter cut into ring "
                           "steps or splits pipelined with slices of the GEMM next to it, as Megatron-Core's "
                           "--tp-comm-overlap (Transformer Engine's userbuffers, its default methods: "
                           "strategies/tp_overlap.py). Needs parallel.sequence_parallel.")
    ep: Count(MAX_DEVICES) = Field(1, description="Expert-parallel ranks: model.moe's experts sharded over groups of "
                                                  "ep adjacent data-parallel ranks (Megatron-Core's and torchtitan's "
                                                  "ep inside dp; with cp, inside dp x cp, cp first; under pp / tp "
                                                  "per stage and tp index: parallel/layout.py, "
                                                  "strategies/expert_model_parallel.py). Must divide dp x cp and the "
                                                  "experts.")
    moe_dispatch: Literal["pairwise", "hierarchical", "deepep"] = Field(
        "pairwise", description="The all-to-all that moves tokens to their experts and back under parallel.ep "
                                "(comm/all_to_all.py): pairwise, every rank to every peer at once (NCCL's "
                                "all-to-all); hierarchical, inside each host first, then between hosts along "
                                "the rails (PXN's order); deepep, DeepEP's internode path as DeepSeek-V3 runs it "
                                "(comm/node_dispatch.py): to the experts over the network first, each token once "
                                "to each host it reaches (to the GPU of the sender's index there, which forwards "
                                "it inside the host), back the same two hops inside the host first. The ep "
                                "group's hosts must hold equal shares of it.")
    pipeline: PipelineSpec = Field(PipelineSpec(), description="How a pipeline runs.")
    placement: tuple[Dimension, ...] = Field(
        ("tp", "cp", "pp", "dp"), description="The dimensions' order on the devices, innermost first: the default "
                                              "puts a stage's tp ranks on adjacent devices, then its cp ranks, then "
                                              "the stages, then the replicas (Megatron-LM's tp, cp first). An order "
                                              "of tp, pp and dp alone places cp next to tp.")
    sharding: ShardingSpec = Field(ShardingSpec(), description="Sharded data parallelism (ZeRO stages, FSDP, "
                                                               "HSDP).")
    representatives: Flag = Field(
        False, description="Simulate one rank per pipeline stage (tp rank 0 of replica 0) and time its "
                           "collectives with their mirrors' (strategies/representatives.py): numerics off, identical "
                           "devices; pp, tp or ep above 1 (data parallelism alone with experts: one rank for all, "
                           "its exchanges timed with every ep group's).")

    @model_validator(mode="before")
    @classmethod
    def _no_scheme(cls, raw):
        """The old `parallel.scheme` mixed the all-reduce algorithm and the mode: one line naming the new keys
        (a ZeRO stage or FSDP named there: parallel.sharding.stage)."""
        if isinstance(raw, dict) and "scheme" in raw:
            stage = ZERO_SCHEMES.get(str(raw["scheme"]).lower().replace("-", "").replace("_", ""))
            if stage is not None:
                raise ValueError(f"parallel.scheme: {raw['scheme']} is parallel.sharding.stage: {stage} (0 DDP | 1 "
                                 "optimizer state | 2 + gradients | 3 + parameters, FSDP)")
            raise ValueError("parallel.scheme: replaced by parallel.all_reduce (naive | ring | tree | hierarchical "
                             "| dbtree) and parallel.mode (sync | async); the scheme follows from them and the "
                             "layout")
        return raw

    @model_validator(mode="after")
    def _a_layout(self) -> "ParallelSpec":
        """What each degree and flag needs of the others; features that do not run together are refused from
        the support table (simtrain/parallel/support.py) by the scenario's root."""
        if self.sequence_parallel and self.tp < 2:
            raise ValueError(f"parallel.sequence_parallel: cuts the sequence across the tp group; needs parallel.tp "
                             f"> 1, got {self.tp}")
        if self.tp_comm_overlap and not self.sequence_parallel:
            raise ValueError("parallel.tp_comm_overlap: overlaps the all-gathers and reduce-scatters of sequence "
                             "parallelism with the GEMMs next to them; needs parallel.sequence_parallel: true "
                             "(as Megatron-Core's --tp-comm-overlap does)")
        if sorted(self.placement) not in (["cp", "dp", "pp", "tp"], ["dp", "pp", "tp"]):
            raise ValueError(f"parallel.placement: must order tp, cp, pp and dp (or tp, pp and dp), each once, got "
                             f"{list(self.placement)}")
        if self.pipeline.virtual_stages > 1 and self.pp < 2:
            raise ValueError(f"parallel.pipeline.virtual_stages: {self.pipeline.virtual_stages} chunks per device "
                             f"interleave a pipeline; needs parallel.pp > 1, got {self.pp}")
        if self.pipeline.schedule == "interleaved" and self.pp > 1 and self.microbatches % self.pp:
            raise ValueError(f"parallel.pipeline.microbatches: interleaved needs a multiple of pp {self.pp}, got "
                             f"{self.microbatches}")
        if self.ep == 1 and self.moe_dispatch != "pairwise":
            raise ValueError(f"parallel.moe_dispatch: {self.moe_dispatch} moves tokens between the ranks of "
                             "parallel.ep, which is 1")
        if self.ep > 1 and self.dp is not None and self.dp * self.cp % self.ep:
            raise ValueError(f"parallel.ep: {self.ep} does not divide parallel.dp {self.dp}"
                             + (f" x parallel.cp {self.cp}" if self.cp > 1 else ""))
        sharding = self.sharding
        if (sharding.overlap_grad_reduce or sharding.overlap_param_gather) and not (sharding.stage and
                                                                                  self.model_parallel):
            raise ValueError("parallel.sharding.overlap_grad_reduce: overlaps the distributed optimizer's "
                             "collectives under pp/tp (sharding.stage 1 or 2, parallel.pp or parallel.tp above 1); "
                             "plain data parallelism overlaps with parallel.overlap")
        _no_flag_ignored(self)
        if sharding.offload != "none" and sharding.stage == 0:
            raise ValueError(f"parallel.sharding.offload: {sharding.offload} offloads a rank's shard of the "
                             "training state; needs sharding.stage 1, 2 or 3")
        if sharding.stage > 0:
            if sharding.offload == "optimizer_and_parameters" and sharding.stage != 3:
                raise ValueError(f"parallel.sharding.offload: optimizer_and_parameters offloads the parameters' "
                                 f"shards, which needs sharding.stage 3, got {sharding.stage}")
            if (sharding.overlap_grad_reduce or sharding.overlap_param_gather) and sharding.stage == 3:
                raise ValueError("parallel.sharding.overlap_grad_reduce: stage 3 already reduce-scatters and "
                                 "gathers unit by unit beside the compute; the overlap flags are for stages 1 and 2")
            if sharding.overlap_param_gather and not sharding.overlap_grad_reduce:
                raise ValueError("parallel.sharding.overlap_param_gather: needs overlap_grad_reduce (its buckets), "
                                 "as in Megatron-Core")
            if sharding.degree is not None and self.dp is not None and self.dp % sharding.degree:
                raise ValueError(f"parallel.sharding.degree: {sharding.degree} does not divide parallel.dp "
                                 f"{self.dp}")
        return self

    @property
    def microbatches(self) -> int:
        """Microbatches per device batch: as given, else 4 with a pipeline and 1 without."""
        if self.pipeline.microbatches is not None:
            return self.pipeline.microbatches
        return 4 if self.pp > 1 else 1

    @property
    def overlapped(self) -> bool:
        """Whether DDP's gradient buckets are all-reduced during the backward: as given, else on without pp, tp
        and cp (torch DDP) and off with them (Megatron-Core)."""
        return self.overlap if self.overlap is not None else not self.model_parallel and self.ep == 1

    @property
    def bucket_cap_bytes(self) -> int:
        """A DDP bucket's bytes: bucket_cap_mb x 1024 x 1024, as torch DDP."""
        return int(self.bucket_cap_mb * (1 << 20))

    @property
    def model_parallel(self) -> bool:
        """Whether the model or its sequence is split (pipeline, tensor or context parallelism)."""
        return self.pp > 1 or self.tp > 1 or self.cp > 1


def _no_flag_ignored(parallel: ParallelSpec) -> None:
    """Flags the layout would not read: one line naming the field, as no scheme may accept and ignore one."""
    sharding = parallel.sharding
    refused = (
        ("parallel.overlap", parallel.overlap is not None and sharding.stage > 0,
         "sets DDP's bucketed all-reduce (sharding.stage 0); sharded data parallelism reduce-scatters unit by unit "
         "beside the backward (under pp/tp with stage 1 or 2: sharding.overlap_grad_reduce)"),
        ("parallel.bucket_cap_mb", parallel.bucket_cap_mb != ParallelSpec.model_fields["bucket_cap_mb"].default
         and sharding.stage > 0, "sizes DDP's buckets (sharding.stage 0); sharded data parallelism reduces unit by "
                                 "unit (under pp/tp: sharding.bucket_size)"),
        ("parallel.sharding.reshard_after_forward", not sharding.reshard_after_forward and sharding.stage < 3,
         "false keeps stage 3's gathered parameters to the backward; needs sharding.stage 3"),
        ("parallel.sharding.reduce_dtype", sharding.reduce_dtype not in (None, "fp32") and sharding.stage == 0,
         "sets the reduce-scatter's dtype; needs sharding.stage 1, 2 or 3 (DDP all-reduces in the compute dtype, "
         "or with fp32 in Megatron-Core's fp32 main gradients)"),
        ("parallel.sharding.degree", sharding.degree is not None and sharding.stage == 0,
         "sets the shard group (HSDP); needs sharding.stage 1, 2 or 3"),
        ("parallel.sharding.bucket_size", sharding.bucket_size is not None and not sharding.overlap_grad_reduce,
         "sizes the buckets of sharding.overlap_grad_reduce, which is off"),
        ("parallel.async", parallel.async_ != AsyncSpec() and parallel.mode != "async",
         "options of parallel.mode async; the mode is sync"),
    )
    for field, refuse, why in refused:
        if refuse:
            raise ValueError(f"{field}: {why}")
