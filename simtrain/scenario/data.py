"""The scenario's `data` section: the data set, the batch and how batches are drawn.

    data: {name: synthetic, samples: 16384, features: 256, classes: 10, batch_size: 256}

simtrain/train/data.py loads the data set; simtrain/train/sampling.py draws
the batches (uniform, prioritized, mh).
"""
from typing import Any, Literal

from pydantic import Field, model_validator

from ..limits import MAX_BATCH_SIZE, MAX_FEATURES, MAX_MH_STEPS, MAX_SAMPLES, MAX_SEQ_LEN
from .fields import Count, Real, Section, Steps


class MHSpec(Section):
    """Metropolis-Hastings sampling (sampling: mh)."""

    steps: Count(MAX_MH_STEPS) = Field(2, description="Metropolis-Hastings proposals per batch slot per batch.")


class DataSpec(Section):
    """The data set and its batches."""

    name: str = Field("digits", description="digits | synthetic | tokens | package.module:function (a user's "
                                            "data).")
    batch_size: Count(MAX_BATCH_SIZE) = Field(32, description="Samples per device per step (per data-parallel "
                                                              "replica with pp or tp).")
    samples: Count(MAX_SAMPLES) | None = Field(None, description="synthetic, tokens: samples in the data set.")
    features: Count(MAX_FEATURES) | None = Field(None, description="synthetic: features per sample.")
    classes: Count(MAX_FEATURES) | None = Field(None, description="synthetic: classes.")
    seq_len: Count(MAX_SEQ_LEN) | None = Field(None, description="tokens: positions per sample.")
    vocab: Count(MAX_FEATURES, minimum=2) | None = Field(None, description="tokens: distinct tokens.")
    test_fraction: Real(gt=0, lt=1) | None = Field(None, description="synthetic, tokens: the share of samples held "
                                                                     "out as the test set.")
    options: dict[str, Any] = Field({}, description="Keyword arguments of a user's data function (not digits, "
                                                    "synthetic or tokens).")
    sampling: Literal["uniform", "prioritized", "mh"] = Field(
        "uniform", description="How batches are drawn (simtrain/train/sampling.py).")
    validation_fraction: Real(ge=0, lt=1) = Field(
        0.0, description="The share of the training split held out as a validation set (a seeded draw); pbt's "
                         "val_* metrics read it; 0: train on the whole split.")
    alpha: Real(ge=0, le=100) = Field(0.6, description="prioritized: P(i) = p_i^alpha / sum_k p_k^alpha.")
    eps: Real(gt=0, le=1e6) = Field(0.01, description="prioritized: p_i = last loss + eps.")
    beta0: Real(ge=0, le=1) = Field(0.4, description="prioritized: importance-sampling exponent at step 0.")
    beta_end: Real(ge=0, le=1) = Field(1.0, description="prioritized: the exponent, annealed linearly to this (0 "
                                                        "with beta0 0: off).")
    beta_steps: Steps | None = Field(None, description="prioritized: steps over which beta reaches beta_end; null: "
                                                       "train.steps.")
    mh: MHSpec = Field(MHSpec(), description="mh sampling's options.")

    def loader_options(self) -> dict[str, Any]:
        """The keyword options the data loader of `name` takes."""
        if self.name in _DATA_FIELDS:
            fields = {key: getattr(self, key) for key in _DATA_FIELDS[self.name]}
            return {key: value for key, value in fields.items() if value is not None}
        return dict(self.options)

    @model_validator(mode="after")
    def _fields_of_this_data(self) -> "DataSpec":
        for key in dict.fromkeys(key for keys in _DATA_FIELDS.values() for key in keys):
            if getattr(self, key) is not None and key not in _DATA_FIELDS.get(self.name, ()):
                options = "; ".join(f"{name}: {', '.join(fields)}" for name, fields in _DATA_FIELDS.items())
                raise ValueError(f"data.{key}: not an option of {self.name} ({options})")
        return self


_DATA_FIELDS = {
    "synthetic": ("samples", "features", "classes", "test_fraction"),
    "tokens": ("samples", "seq_len", "vocab", "test_fraction"),
}
