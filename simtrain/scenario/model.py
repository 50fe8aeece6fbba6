"""The scenario's `model` section: which network trains (simtrain/train/models.py builds it).

    model: {name: gpt, hidden: 768, layers: 12, heads: 12}
    model: {name: llama, hidden: 4096, layers: 32, heads: 32, kv_heads: 8, ffn_hidden: 14336, rope_theta: 500000}
    model: {name: gpt, hidden: 4096, layers: 32, heads: 32, attention: fused}
    model: {name: llama, hidden: 4096, layers: 32, heads: 32, kv_heads: 8, ffn_hidden: 14336, moe: {experts: 8}}
    model: {name: llama, hidden: 7168, layers: 61, heads: 128, ffn_hidden: 18432, latent_attention: {},
            moe: {experts: 256, top_k: 8, expert_hidden: 2048, shared_experts: 1, first_dense: 3}}   # DeepSeek-V3
"""
import math
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from ..limits import MAX_CAPACITY_FACTOR, MAX_HEADS, MAX_LAYERS, MAX_WIDTH
from .fields import Count, Flag, Real, Section, Width
from .model_presets import ModelPresetName, with_model_preset

LLAMA_FFN_MULTIPLE = 256  # Llama's `multiple_of`: the SwiGLU width's default is rounded up to a multiple of it
_LLAMA_ONLY = ("kv_heads", "ffn_hidden", "rope_theta")
_TRANSFORMERS = ("gpt", "llama")


class RoutingSpec(Section):
    """Where a run without numerics takes its routing from (train/moe_routing.py): there is no router to run."""

    model: Literal["balanced", "zipf", "histogram"] = Field(
        "balanced", description="balanced: every expert gets its even share of a micro-batch's assignments; zipf: "
                                "each assignment drawn (seeded) with expert e's probability proportional to "
                                "1 / (e + 1)^zipf_exponent; histogram: drawn with the shares `histogram` gives "
                                "(a numerics-on run's report.json moe.expert_share).")
    zipf_exponent: Real(ge=0, le=100) = Field(1.0, description="zipf: the exponent s (0: uniform draws).")
    histogram: Annotated[list[Real(ge=0, le=1e12)], Field(max_length=MAX_HEADS)] | None = Field(
        None, description="histogram: one weight per expert (normalized to shares), e.g. a recorded run's "
                          "report.json moe.expert_share.")


class MoESpec(Section):
    """Mixture-of-experts layers in a gpt or a llama (train/moe.py, train/llama_moe.py): a router sends each token
    to `top_k` of `experts` MLPs."""

    experts: Count(MAX_HEADS, minimum=2) = Field(8, description="Routed experts per MoE layer, each an MLP of the "
                                                                "dense MLP's kind (gpt: GELU; llama: SwiGLU) and "
                                                                "of `expert_hidden` features.")
    expert_hidden: Count(MAX_WIDTH) | None = Field(
        None, description="An expert's hidden width (its first Linear's output features; routed and shared experts "
                          "alike), e.g. DeepSeek-V3's moe_intermediate_size 2048 beside its dense 18432. null: the "
                          "dense MLP's width, 4 x model.hidden in a gpt, model.ffn_hidden in a llama (Mixtral's "
                          "experts).")
    top_k: Count(MAX_HEADS) = Field(2, description="Experts each token is sent to (at most `experts`); their outputs "
                                                   "are summed with the router's renormalized top-k weights.")
    capacity_factor: Real(gt=0, le=MAX_CAPACITY_FACTOR) | None = Field(
        None, description="Tokens an expert takes per micro-batch, as a multiple of the balanced share "
                          "(tokens x top_k / experts, rounded up); assignments past it are dropped, earliest "
                          "token first kept. null: dropless, every assignment is computed.")
    shared_experts: Count(MAX_HEADS, minimum=0) = Field(0, description="Experts every token goes through as well, "
                                                                       "unweighted (DeepSeekMoE's shared experts).")
    aux_loss_coeff: Real(ge=0, le=1e3) = Field(0.01, description="Weight of the Switch Transformer load-balancing "
                                                                 "loss added to the training loss (0: none).")
    every: Count(MAX_LAYERS) = Field(1, description="Every n-th block is MoE (blocks n, 2n, ... counted from the "
                                                    "model's first block; 1: every block), past the first_dense.")
    first_dense: Count(MAX_LAYERS, minimum=0) = Field(
        0, description="The first k blocks are dense whatever `every` says (their MLP of the dense width: 4 x "
                       "model.hidden in a gpt, model.ffn_hidden in a llama), as DeepSeek-V3's first 3 "
                       "(first_k_dense_replace). Block i (from 1) is MoE when i > first_dense and i is a multiple "
                       "of `every`.")
    score: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="The router's scores (train/moe_router.py): softmax over the experts (Mixtral, "
                               "Megatron-Core's default), or each expert's sigmoid (DeepSeek-V3's affinities; HF's "
                               "scoring_func, Megatron-Core's moe_router_score_function); the chosen scores "
                               "renormalized either way. DeepSeek-V3's selection bias (auxiliary-loss-free "
                               "balancing) is not built.")
    groups: Count(MAX_HEADS) | None = Field(
        None, description="Group-limited routing, DeepSeek-V3's node-limited routing (arXiv 2412.19437, 2.1.2): "
                          "the experts cut into `groups` runs of experts / groups (HF's n_group, Megatron-Core's "
                          "moe_router_num_groups; DeepSeek-V3: 8, the experts of one node a group), and each "
                          "token's top_k experts chosen among the `group_limit` groups whose top_k / group_limit "
                          "highest scores sum highest (train/moe_router.py). null: every expert open to every "
                          "token.")
    group_limit: Count(MAX_HEADS) | None = Field(
        None, description="With `groups`: the groups a token's experts may come from (HF's topk_group, "
                          "Megatron-Core's moe_router_group_topk; DeepSeek-V3: 4, at most 4 nodes a token), at most "
                          "top_k.")
    routing: RoutingSpec = Field(RoutingSpec(), description="Numerics off: the routing model that stands for the "
                                                            "router (train/moe_routing.py).")

    def holds_experts(self, layer: int) -> bool:
        """Whether block `layer` (counted from 0) is an MoE block: past the first_dense, every `every`-th block (the
        first block every - 1)."""
        return layer >= self.first_dense and (layer + 1) % self.every == 0

    def moe_layers(self, layers: int) -> int:
        """How many of a model's `layers` blocks are MoE blocks (holds_experts)."""
        return layers // self.every - self.first_dense // self.every

    def expert_width(self, dense_width: int) -> int:
        """An expert's hidden width in a model whose dense MLP has `dense_width` hidden features."""
        return dense_width if self.expert_hidden is None else self.expert_hidden

    @model_validator(mode="after")
    def _top_k_fits(self) -> "MoESpec":
        if self.top_k > self.experts:
            raise ValueError(f"model.moe.top_k: {self.top_k} is more than the {self.experts} experts")
        self._groups_fit()
        routing = self.routing
        if routing.model == "histogram" and (routing.histogram is None or len(routing.histogram) != self.experts
                                             or not sum(routing.histogram) > 0):
            raise ValueError(f"model.moe.routing.histogram: the histogram model needs {self.experts} weights (one "
                             "per expert, not all 0)")
        return self

    def _groups_fit(self) -> None:
        """Group-limited routing: equal groups, a limit a token's top_k experts fit in and can meet."""
        if (self.groups is None) != (self.group_limit is None):
            given, missing = ("groups", "group_limit") if self.group_limit is None else ("group_limit", "groups")
            raise ValueError(f"model.moe.{missing}: group-limited routing needs it beside model.moe.{given}")
        if self.groups is None:
            return
        if self.experts % self.groups:
            raise ValueError(f"model.moe.groups: {self.groups} does not divide model.moe.experts {self.experts}")
        if self.group_limit > self.groups:
            raise ValueError(f"model.moe.group_limit: {self.group_limit} is more than the {self.groups} "
                             "model.moe.groups")
        if self.top_k > self.group_limit * (self.experts // self.groups):
            raise ValueError(f"model.moe.top_k: {self.top_k} is more than the {self.group_limit} x "
                             f"{self.experts // self.groups} experts of model.moe.group_limit groups")
        if self.group_limit > self.top_k:
            raise ValueError(f"model.moe.group_limit: {self.group_limit} is more than top_k {self.top_k} (a group "
                             f"is scored by its top_k / group_limit best experts; {self.top_k} experts reach at "
                             f"most {self.top_k} groups, so such a limit never binds)")

    @property
    def group_size(self) -> int:
        """Experts a group: experts / groups (all of them without group-limited routing)."""
        return self.experts // (self.groups or 1)


class LatentAttentionSpec(Section):
    """Multi-head latent attention in a llama (train/latent_attention.py; DeepSeek-AI 2024, "DeepSeek-V2",
    section 2.1): queries and keys/values each projected down to a latent, normalized, projected up per head. The
    defaults are DeepSeek-V3's (its config.json)."""

    q_lora_rank: Count(MAX_WIDTH) = Field(1536, description="The queries' latent width (wq_a's output features).")
    kv_lora_rank: Count(MAX_WIDTH) = Field(512, description="The keys' and values' latent width (c_kv, wkv_a's "
                                                            "output features before the rotary part).")
    qk_nope_head_dim: Count(MAX_WIDTH) = Field(128, description="A query's and a key's features without rotary "
                                                                "embeddings, per head.")
    qk_rope_head_dim: Count(MAX_WIDTH) = Field(64, description="A query's and a key's rotated features per head "
                                                               "(even); the key's are one projection shared by "
                                                               "every head.")
    v_head_dim: Count(MAX_WIDTH) = Field(128, description="A value's features per head (the output projection "
                                                          "reads heads x v_head_dim).")

    @model_validator(mode="after")
    def _rotary_pairs(self) -> "LatentAttentionSpec":
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model.latent_attention.qk_rope_head_dim: {self.qk_rope_head_dim} must be even: rotary "
                             "embeddings turn features in pairs")
        return self

    @property
    def qk_head_dim(self) -> int:
        """A query's and a key's features per head: the rotated ones and the others."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


class ModelSpec(Section):
    """The model: a built-in (mlp, cnn, gpt, llama) or a user's function."""

    preset: ModelPresetName | None = Field(
        None, description="A published model whose shape fills this section and data.vocab, data.seq_len "
                          "(scenario/model_presets.py names each source): llama3-8b, llama3-70b, llama3-405b, "
                          "gpt3-175b, mixtral-8x7b, mixtral-8x22b, deepseek-v3. A field the scenario gives wins "
                          "over the preset's (in moe and latent_attention, each of their fields); `simtrain "
                          "validate` and scenario.resolved.yaml show the filled-in values. null: none.")
    name: str = Field("mlp", description="mlp | cnn | gpt | llama | package.module:function (a user's model).")
    hidden: Annotated[list[Width], Field(max_length=MAX_LAYERS)] = Field(
        [128, 128], description="mlp: the hidden layers' widths; gpt, llama: the model width, one number "
                                "(default 64).")
    layers: Count(MAX_LAYERS) = Field(2, description="gpt, llama: transformer blocks.")
    heads: Count(MAX_HEADS) = Field(4, description="gpt, llama: attention (query) heads per block (must divide "
                                                   "hidden).")
    kv_heads: Count(MAX_HEADS) | None = Field(None, description="llama: key/value heads (grouped-query attention; "
                                                                "must divide heads); null: as many as heads.")
    ffn_hidden: Count(MAX_WIDTH) | None = Field(
        None, description="llama: the SwiGLU MLP's hidden width; null: Llama's rule, 2/3 of 4 x hidden rounded up "
                          f"to a multiple of {LLAMA_FFN_MULTIPLE}.")
    rope_theta: Real(gt=1, le=1e12) | None = Field(
        None, description="llama: the rotary embeddings' base (10000 in Llama 1 and 2, 500000 in Llama 3); null: "
                          "10000.")
    attention: Literal["eager", "fused"] = Field(
        "eager", description="gpt, llama: how the causal attention core runs and is charged. eager: written out "
                             "(QKᵀ, mask, softmax, AV as separate kernels, the s x s scores through memory and "
                             "kept for backward), as the Megatron-LM papers' runs; fused: one FlashAttention-2 "
                             "kernel (train/fused_attention.py: causal FLOPs halved, backward 2.5 x forward, only "
                             "Q, K, V, O and the log-sum-exp through memory and kept), as every framework runs "
                             "today. The numerics are the same attention either way. The default stays eager "
                             "so that the figures measured against the papers do not move (docs: what is "
                             "modelled, attention): set fused to model a framework of today; simtrain run and "
                             "validate say so when a gpt or llama leaves it unset.")
    channels: Annotated[list[Width], Field(min_length=1, max_length=MAX_LAYERS)] = Field(
        [16, 32], description="cnn: the convolutions' output channels.")
    batchnorm: Flag = Field(False, description="mlp, cnn: BatchNorm after each hidden Linear or Conv2d.")
    options: dict[str, Any] = Field({}, description="Keyword arguments of a user's model function (not mlp, cnn, "
                                                    "gpt or llama).")
    moe: MoESpec | None = Field(None, description="gpt, llama: mixture-of-experts layers in place of the MLP (null: "
                                                  "dense).")
    latent_attention: LatentAttentionSpec | None = Field(
        None, description="llama: multi-head latent attention (DeepSeek-V2 and V3) in place of grouped-query "
                          "attention; {} gives DeepSeek-V3's shapes. null: grouped-query attention.")

    @property
    def eager_by_default(self) -> bool:
        """Whether a gpt or llama runs eager attention because the scenario left model.attention unset."""
        return self.name in _TRANSFORMERS and "attention" not in self.model_fields_set

    @model_validator(mode="before")
    @classmethod
    def _transformer_width(cls, raw):
        """The preset's fields under the given ones; a gpt's or llama's width is one number (kept as a one-entry
        list); its default is 64."""
        raw = with_model_preset(raw)
        if isinstance(raw, dict) and raw.get("name") in _TRANSFORMERS:
            hidden = raw.get("hidden", 64)
            raw = {**raw, "hidden": [hidden] if isinstance(hidden, int) and not isinstance(hidden, bool) else hidden}
        return raw

    @model_validator(mode="after")
    def _fields_of_this_model(self) -> "ModelSpec":
        if self.moe is not None and self.name not in _TRANSFORMERS:
            raise ValueError(f"model.moe: mixture-of-experts layers are for the gpt model, not {self.name} (and for "
                             "llama: they take a transformer block's MLP's place)")
        if self.moe is not None and self.moe.every > self.layers:
            raise ValueError(f"model.moe.every: {self.moe.every} is past the {self.name}'s {self.layers} "
                             "model.layers")
        if self.moe is not None and self.moe.moe_layers(self.layers) == 0:
            raise ValueError(f"model.moe.first_dense: {self.moe.first_dense} leaves none of the {self.name}'s "
                             f"{self.layers} model.layers an MoE block (every {self.moe.every})")
        if self.attention == "fused" and self.name not in _TRANSFORMERS:
            raise ValueError(f"model.attention: fused is an option of gpt and llama, not of {self.name}")
        if self.name in _TRANSFORMERS:
            if len(self.hidden) != 1:
                raise ValueError(f"model.hidden: a {self.name}'s width is one number")
            if self.hidden[0] % self.heads and self.latent_attention is None:
                raise ValueError(f"model.heads: {self.heads} heads do not divide model.hidden {self.hidden[0]}")
        if self.latent_attention is not None and self.name != "llama":
            raise ValueError(f"model.latent_attention: an option of model.name llama, not of {self.name}")
        if self.latent_attention is not None and self.kv_heads is not None:
            raise ValueError("model.kv_heads: multi-head latent attention (model.latent_attention) has no key/value "
                             "heads of its own: every head reads its keys and values from the shared latent")
        if self.name == "llama":
            if self.heads % self.key_value_heads:
                raise ValueError(f"model.kv_heads: {self.key_value_heads} key/value heads do not divide model.heads "
                                 f"{self.heads}")
            if self.latent_attention is None and self.hidden[0] // self.heads % 2:
                raise ValueError(f"model.heads: a llama's head width (model.hidden / model.heads = "
                                 f"{self.hidden[0] // self.heads}) must be even: rotary embeddings turn its "
                                 "features in pairs")
        else:
            for key in _LLAMA_ONLY:
                if getattr(self, key) is not None:
                    raise ValueError(f"model.{key}: an option of model.name llama, not of {self.name}")
        return self

    @property
    def width(self) -> int:
        """A gpt's or llama's width."""
        return self.hidden[0]

    @property
    def key_value_heads(self) -> int:
        """A llama's key/value heads (model.kv_heads, default every query head its own)."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def ffn_width(self) -> int:
        """A llama's SwiGLU hidden width: model.ffn_hidden, or Llama's rule from the width."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return LLAMA_FFN_MULTIPLE * math.ceil(int(2 * 4 * self.width / 3) / LLAMA_FFN_MULTIPLE)

    @property
    def rotary_base(self) -> float:
        """A llama's rotary base (model.rope_theta, default 10000)."""
        return 10000.0 if self.rope_theta is None else self.rope_theta
