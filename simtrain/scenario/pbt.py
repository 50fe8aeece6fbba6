"""The scenario's `pbt` section: a population of the scenario's job (simtrain/studies/pbt.py).

    pbt:
      population: 4
      perturbation_interval: 20
      hyperparam_mutations: {train.optimizer.lr: {log_uniform: [0.001, 0.5]}}

Names and defaults are Ray Tune's PopulationBasedTraining's where it has them.
"""
import math
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, ValidationError, model_validator

from ..limits import MAX_DEVICES, MAX_SCHEDULE_ENTRIES
from .fields import Bandwidth, Count, Duration, Flag, Real, Section, Steps, first_error


class MetricSpec(Section):
    """What members are compared on, evaluated at no simulated cost (evaluation.py)."""

    name: Literal["val_loss", "val_accuracy", "train_loss"] = Field(
        "val_loss", description="val_loss | val_accuracy: on data.validation_fraction of the training split "
                                "(never the test set); train_loss: over the whole training split.")
    mode: Literal["min", "max"] = Field("min", description="Whether smaller or larger is better.")


class RangeSpec(Section):
    """A continuous hyperparameter's range: exactly one of uniform or log_uniform."""

    uniform: tuple[Real(), Real()] | None = Field(None, description="[low, high], drawn uniformly.")
    log_uniform: tuple[Real(gt=0), Real(gt=0)] | None = Field(None, description="[low, high]; log(value) is drawn "
                                                                                "uniformly.")

    @model_validator(mode="after")
    def _one_range(self) -> "RangeSpec":
        given = [bounds for bounds in (self.uniform, self.log_uniform) if bounds is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of uniform: [low, high] or log_uniform: [low, high]")
        if not given[0][0] < given[0][1]:
            raise ValueError(f"low must be below high, got {list(given[0])}")
        return self


def _mutation(value):
    """A pbt.hyperparam_mutations entry: a RangeSpec, or a list of numbers (explore moves to a neighbour)."""
    if isinstance(value, dict):
        try:
            return RangeSpec.model_validate(value)
        except ValidationError as error:
            raise ValueError(first_error(error)) from None
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_SCHEDULE_ENTRIES:
        raise ValueError(f"give a range ({{uniform: [low, high]}} or {{log_uniform: [low, high]}}) or a list of "
                         f"1 to {MAX_SCHEDULE_ENTRIES} values")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, (int, float)) or not math.isfinite(item):
            raise ValueError(f"expected numbers, got {item!r}")
    return value


class CheckpointStorageSpec(Section):
    """Storage that checkpoints go through instead of device-to-device copies: every member writes its state at
    every round, a recipient's ranks read the donor's; each access takes latency + bytes / bandwidth and
    accesses do not slow one another (an aggregate limit of the storage is not modelled)."""

    bandwidth: Bandwidth = Field(description="Bandwidth of one write or read (bytes/s).")
    latency: Duration = Field(0.0, description="Latency of one write or read (s).")


class PbtStopSpec(Section):
    """When the population stops."""

    metric: Real() = Field(description="Stop every member once a member's metric reaches this (metric.mode "
                                       "decides the side).")


class PbtSpec(Section):
    """Population-based training (simtrain/studies/pbt.py); names and defaults are Ray Tune's
    PopulationBasedTraining's where it has them."""

    population: Count(MAX_DEVICES, minimum=2) = Field(description="Members; each gets cluster.devices / "
                                                                  "population devices.")
    perturbation_interval: Steps = Field(60, description="A member's steps between two exploit/explore rounds "
                                                         "(Ray: 60).")
    metric: MetricSpec = Field(MetricSpec(), description="What members are compared on.")
    quantile_fraction: Real(ge=0, le=0.5) = Field(0.25, description="The bottom fraction copies the top "
                                                                    "fraction; 0: no exploit.")
    exploit: Literal["truncation", "binary_tournament"] = Field("truncation", description="How a member picks "
                                                                                          "its donor.")
    resample_probability: Real(ge=0, le=1) = Field(0.25, description="explore: resample instead of perturbing.")
    perturbation_factors: tuple[Real(gt=0, le=1e6), Real(gt=0, le=1e6)] = Field(
        (1.2, 0.8), description="explore: multiply a value by one of these.")
    hyperparam_mutations: Annotated[dict[str, Annotated[Any, BeforeValidator(_mutation)]], Field(min_length=1)] = \
        Field(description="Path -> a range ({uniform: [low, high]} or {log_uniform: [low, high]}) or a list of "
                          "values; paths among the live hyperparameters (data.batch_size: a list).")
    synch: Flag = Field(False, description="true: rounds wait for every member; false: each member acts when it is "
                                           "ready (Ray's default).")
    stop: PbtStopSpec | None = Field(None, description="null: every member trains train.steps.")
    checkpoint: CheckpointStorageSpec | None = Field(None, description="Storage the states go through; null: "
                                                                       "exploits copy device to device over the "
                                                                       "network.")
