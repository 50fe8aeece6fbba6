"""The scenario's `model` section: which network trains (simtrain/train/models.py builds it).

    model: {name: gpt, hidden: 768, layers: 12, heads: 12}
"""
from typing import Annotated, Any

from pydantic import Field, model_validator

from ..limits import MAX_HEADS, MAX_LAYERS
from .fields import Count, Flag, Section, Width


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
