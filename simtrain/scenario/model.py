"""The scenario's `model` section: which network trains (simtrain/train/models.py builds it).

    model: {name: gpt, hidden: 768, layers: 12, heads: 12}
"""
from typing import Annotated, Any

from pydantic import Field, model_validator

from ..limits import MAX_HEADS, MAX_LAYERS
from .fields import Count, Flag, Real, Section, Width


class MoESpec(Section):
    """Mixture-of-experts layers in a gpt (train/moe.py): a router sends each token to `top_k` of `experts` MLPs."""

    experts: Count(MAX_HEADS, minimum=2) = Field(8, description="Routed experts per MoE layer, each an MLP of 4 x "
                                                                "model.hidden, as the dense MLP.")
    top_k: Count(MAX_HEADS) = Field(2, description="Experts each token is sent to (at most `experts`); their outputs "
                                                   "are summed with the router's renormalized top-k weights.")
    capacity_factor: Real(gt=0) | None = Field(
        None, description="Tokens an expert takes per micro-batch, as a multiple of the balanced share "
                          "(tokens x top_k / experts, rounded up); assignments past it are dropped, earliest "
                          "token first kept. null: dropless, every assignment is computed.")
    shared_experts: Count(MAX_HEADS, minimum=0) = Field(0, description="Experts every token goes through as well, "
                                                                       "unweighted (DeepSeekMoE's shared experts).")
    aux_loss_coeff: Real(ge=0, le=1e3) = Field(0.01, description="Weight of the Switch Transformer load-balancing "
                                                                 "loss added to the training loss (0: none).")
    every: Count(MAX_LAYERS) = Field(1, description="Every n-th block is MoE (blocks n, 2n, ...; 1: every block).")

    @model_validator(mode="after")
    def _top_k_fits(self) -> "MoESpec":
        if self.top_k > self.experts:
            raise ValueError(f"model.moe.top_k: {self.top_k} is more than the {self.experts} experts")
        return self


class ModelSpec(Section):
    """The model: a built-in (mlp, cnn, gpt) or a user's function."""

    name: str = Field("mlp", description="mlp | cnn | gpt | package.module:function (a user's model).")
    hidden: Annotated[list[Width], Field(max_length=MAX_LAYERS)] = Field(
        [128, 128], description="mlp: the hidden layers' widths; gpt: the model width, one number (default 64).")
    layers: Count(MAX_LAYERS) = Field(2, description="gpt: transformer blocks.")
    heads: Count(MAX_HEADS) = Field(4, description="gpt: attention heads per block (must divide hidden).")
    channels: Annotated[list[Width], Field(min_length=1, max_length=MAX_LAYERS)] = Field(
        [16, 32], description="cnn: the convolutions' output channels.")
    batchnorm: Flag = Field(False, description="mlp, cnn: BatchNorm after each hidden Linear or Conv2d.")
    options: dict[str, Any] = Field({}, description="Keyword arguments of a user's model function (not mlp, cnn "
                                                    "or gpt).")
    moe: MoESpec | None = Field(None, description="gpt: mixture-of-experts layers in place of the MLP (null: dense).")

    @model_validator(mode="before")
    @classmethod
    def _gpt_width(cls, raw):
        """A gpt's width is one number (kept as a one-entry list); its default is 64."""
        if isinstance(raw, dict) and raw.get("name") == "gpt":
            hidden = raw.get("hidden", 64)
            raw = {**raw, "hidden": [hidden] if isinstance(hidden, int) and not isinstance(hidden, bool) else hidden}
        return raw

    @model_validator(mode="after")
    def _fields_of_this_model(self) -> "ModelSpec":
        if self.moe is not None and self.name != "gpt":
            raise ValueError(f"model.moe: mixture-of-experts layers are for the gpt model, not {self.name}")
        if self.moe is not None and self.moe.every > self.layers:
            raise ValueError(f"model.moe.every: {self.moe.every} is past the gpt's {self.layers} model.layers")
        if self.name == "gpt":
            if len(self.hidden) != 1:
                raise ValueError("model.hidden: a gpt's width is one number")
            if self.hidden[0] % self.heads:
                raise ValueError(f"model.heads: {self.heads} heads do not divide model.hidden {self.hidden[0]}")
        return self

    @property
    def width(self) -> int:
        """A gpt's width."""
        return self.hidden[0]
