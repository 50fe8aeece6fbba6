"""The scenario's root: its sections, the checks across them, and validation of a raw mapping.

    scenario = validate_scenario({"cluster": {"devices": 8}, "parallel": {"pp": 2}})
    scenario.to_yaml()                      # every default filled in

A check that spans sections (what each technique needs of the model, the data
and the layout; faults where recovery handles them, live hyperparameters) is
here, and its one-line error names the field at fault. Features that do not run
together are refused from the one support table (simtrain/parallel/support.py),
after each technique's own needs. Reading files and `--set` overrides: loading.py.
"""
from pathlib import Path

import yaml
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator

from ..errors import ScenarioError, one_line
from ..limits import MAX_NAME_BYTES, MAX_SEED, MAX_STEPS
from ..parallel.support import Case, refuse
from .cluster import ClusterSpec
from .data import DataSpec
from .fields import Count, Flag, Section, error_message
from .fleet import FleetSpec
from .model import ModelSpec
from .model_presets import with_data_preset
from .parallel import ParallelSpec
from .pbt import PbtSpec
from .report import ReportSpec
from .train import LIVE_HYPERPARAMETERS, TrainSpec


class Scenario(Section):
    """What to simulate: a cluster, a model, data, a training recipe, a parallel layout, what to report."""

    name: str = Field("scenario", description="The run's name (its default output folder is runs/<name>/).")
    seed: Count(MAX_SEED, minimum=0) = Field(0, description="The one seed every random draw derives from.")
    numerics: Flag = Field(True, description="false: the same job on meta tensors (shapes, bytes and FLOPs, no "
                                             "arithmetic); loss and accuracy are null.")
    cluster: ClusterSpec = Field(ClusterSpec(), description="The simulated cluster.")
    model: ModelSpec = Field(ModelSpec(), description="The model.")
    data: DataSpec = Field(DataSpec(), description="The data set and its batches.")
    train: TrainSpec = Field(TrainSpec(), description="The training recipe.")
    parallel: ParallelSpec = Field(ParallelSpec(), description="How the devices cooperate.")
    report: ReportSpec = Field(ReportSpec(), description="What the run reports.")
    pbt: PbtSpec | None = Field(None, description="A population of this scenario's job (simtrain/studies/pbt.py); "
                                                  "null: one job.")
    fleet: FleetSpec | None = Field(None, description="A long run with a fleet's failures, simulated around the "
                                                      "measured step (simtrain/fleet/); null: the steps alone.")
    # Folder that relative paths in the scenario (topology files) are read from.
    _base_dir: Path = PrivateAttr(default=Path("."))

    @property
    def base_dir(self) -> Path:
        return self._base_dir

    @property
    def has_faults(self) -> bool:
        """Whether the scenario has faults or checkpoints: its report then has a `faults` section, and its collectives
        are moved flow by flow (links may change under them), never timed as a group."""
        return bool(self.cluster.faults or self.cluster.random_faults or self.train.checkpoint)

    @model_validator(mode="before")
    @classmethod
    def _model_preset_fills_the_data(cls, raw):
        """model.preset: its vocabulary and sequence length where the data section does not give them."""
        if isinstance(raw, dict) and isinstance(raw.get("model"), dict) and "preset" in raw["model"]:
            data = with_data_preset(raw["model"], raw.get("data", {}))
            raw = raw if data is raw.get("data") else {**raw, "data": data}
        return raw

    @model_validator(mode="before")
    @classmethod
    def _async_gets_a_store(cls, raw):
        """parallel.mode async without cluster.shared_memory: the default store (host DRAM)."""
        if not isinstance(raw, dict):
            return raw
        parallel, cluster = raw.get("parallel"), raw.get("cluster", {})
        if (isinstance(parallel, dict) and parallel.get("mode") == "async" and isinstance(cluster, dict)
                and cluster.get("shared_memory") is None):
            raw = {**raw, "cluster": {**cluster, "shared_memory": {}}}
        return raw

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        """The default output folder is runs/<name>/: a name any file system takes."""
        if not value or "/" in value or value.startswith(".") or any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise ValueError("must be a plain name (no '/', no control characters or NUL, not empty, not starting "
                             "with '.')")
        if len(value.encode("utf-8", errors="replace")) > MAX_NAME_BYTES:
            raise ValueError(f"longer than {MAX_NAME_BYTES} bytes")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate, from a YAML escape
            raise ValueError("not encodable as UTF-8") from None
        return value

    @model_validator(mode="after")
    def _techniques_fit_together(self) -> "Scenario":
        """What each technique needs of the model, the data and the layout: one-line errors naming the field,
        before anything runs."""
        _experts_fit(self)
        builtin_batchnorm = self.model.batchnorm and self.model.name in ("mlp", "cnn")
        if self.model.batchnorm and self.model.name == "gpt":
            raise ValueError("model.batchnorm: a gpt normalizes with LayerNorm; batchnorm is for mlp and cnn")
        if builtin_batchnorm and self.data.batch_size == 1:  # torch's BatchNorm raises on one sample
            raise ValueError("data.batch_size: model.batchnorm needs at least 2 samples per device (BatchNorm "
                             "normalizes over the batch; with parallel.sync_batchnorm too, as torch computes)")
        for section, spec, builtins in (("model", self.model, ("mlp", "cnn", "gpt")),
                                        ("data", self.data, ("digits", "synthetic", "tokens"))):
            if spec.name in builtins and spec.options:
                raise ValueError(f"{section}.options: the built-in {section} {spec.name} takes none (options are "
                                 "the keyword arguments of a package.module:function)")
        if self.train.checkpointing == "selective" and self.model.name in ("mlp", "cnn"):
            raise ValueError(f"train.checkpointing: selective recomputes the attention core; model {self.model.name} "
                             "has no attention (use full, sqrt or segments)")
        _microbatches_fit(self)
        _sequence_cuts_fit(self)
        _main_gradients_fit(self)
        if self.parallel.representatives:
            _representatives_fit(self)
        return self

    @model_validator(mode="after")
    def _features_combine(self) -> "Scenario":
        """Features that do not run together: the support table's line (simtrain/parallel/support.py)."""
        refuse(Case(self), ValueError)
        return self

    @model_validator(mode="after")
    def _faults_fit(self) -> "Scenario":
        """Faults and checkpoints in a population, and spares, where recovery.py handles them (with the other
        features: the support table): one-line errors naming the field."""
        cluster, checkpoint = self.cluster, self.train.checkpoint
        if self.pbt is not None:
            if cluster.random_faults is not None:
                raise ValueError("cluster.random_faults: not with a population (pbt); give its faults in "
                                 "cluster.faults")
            if checkpoint is not None:
                raise ValueError("train.checkpoint: not with a population (pbt); a member restarts from its round's "
                                 "checkpoint (pbt.checkpoint)")
            if any(fault.device is not None for fault in cluster.faults):
                if self.pbt.checkpoint is None:
                    raise ValueError("cluster.faults: a lost device's member restarts from its round's checkpoint in "
                                     "storage; give pbt.checkpoint")
                if self.parallel.mode == "async":
                    raise ValueError("cluster.faults: a lost device in an async population (a member goes on without "
                                     "the worker, which never reaches its next round); use parallel.mode sync")
        if cluster.devices is not None and cluster.spares >= cluster.devices:
            raise ValueError(f"cluster.spares: {cluster.spares} leaves no device for the job "
                             f"(cluster.devices {cluster.devices} counts the spares)")
        return self

    @model_validator(mode="after")
    def _fleet_fits(self) -> "Scenario":
        """Fleet mode measures a fault-free step of one data-parallel job: its failures are its own."""
        if self.fleet is None:
            return self
        cluster = self.cluster
        for field, used in (("pbt", self.pbt), ("cluster.faults", cluster.faults),
                            ("cluster.random_faults", cluster.random_faults), ("cluster.spares", cluster.spares),
                            ("train.checkpoint", self.train.checkpoint)):
            if used:
                raise ValueError(f"{field}: not with fleet (its failures, spares and checkpoints are fleet's)")
        if self.parallel.mode == "async":
            raise ValueError("fleet: for synchronous jobs (parallel.mode sync); async goes on without a lost worker")
        return self

    @model_validator(mode="after")
    def _hyperparameters_apply_live(self) -> "Scenario":
        """train.schedule and pbt name live hyperparameters with values their fields accept."""
        previous = -1
        for index, entry in enumerate(self.train.schedule):
            field = f"train.schedule.{index}"
            step = entry.get("step")
            if not isinstance(step, int) or not 0 <= step <= MAX_STEPS:
                raise ValueError(f"{field}.step: give the step (0 to {MAX_STEPS}) the values apply from")
            if step <= previous:
                raise ValueError(f"{field}.step: steps must be ascending, got {step} after {previous}")
            previous = step
            values = {path: value for path, value in entry.items() if path != "step"}
            if not values:
                raise ValueError(f"{field}: give at least one hyperparameter besides step")
            self._check_live(values, field)
        if self.pbt is None:
            return self
        if self.train.schedule:
            raise ValueError("train.schedule: a population makes its own schedules (drop it, or the pbt section)")
        if not self.numerics:
            raise ValueError("pbt: needs numerics (members are compared on a metric of their models)")
        if self.pbt.metric.name.startswith("val_") and self.data.validation_fraction == 0:
            raise ValueError(f"pbt.metric.name: {self.pbt.metric.name} needs data.validation_fraction above 0 "
                             "(the held-out part of the training split)")
        for path, mutation in self.pbt.hyperparam_mutations.items():
            field = f"pbt.hyperparam_mutations.{path}"
            if path == "data.batch_size" and not isinstance(mutation, list):
                raise ValueError(f"{field}: give a list of batch sizes")
            bounds = mutation if isinstance(mutation, list) else (mutation.uniform or mutation.log_uniform)
            for value in bounds:
                self._check_live({path: value}, field)
        return self

    def _check_live(self, values: dict, field: str) -> None:
        for path in values:
            if path not in LIVE_HYPERPARAMETERS:
                raise ValueError(f"{field}: {path} is not a hyperparameter that applies live (one of: "
                                 f"{', '.join(LIVE_HYPERPARAMETERS)})")
        if self.train.optimizer.name == "kfac":
            raise ValueError(f"{field}: live hyperparameters need sgd or adam (K-FAC's factors are not copied)")
        if "data.batch_size" in values and self.data.sampling != "uniform":
            raise ValueError(f"{field}: data.batch_size changes need data.sampling uniform")
        try:
            self.with_hyperparameters(values)
        except ScenarioError as error:
            raise ValueError(f"{field}: {str(error).removeprefix('scenario: ')}") from None

    def with_hyperparameters(self, values: dict) -> "Scenario":
        """This scenario with live hyperparameters set ({"train.optimizer.lr": 0.1}), without schedule or
        population; a value its field refuses is a ScenarioError naming the field."""
        raw = self.model_dump(mode="json", by_alias=True)
        raw["train"]["schedule"], raw["pbt"] = [], None
        for path, value in values.items():
            node = raw
            *parents, leaf = path.split(".")
            for part in parents:
                node = node[part]
            node[leaf] = value
        return validate_scenario(raw, base_dir=self.base_dir)

    def to_yaml(self) -> str:
        """The scenario with every default filled in, as YAML (SI units)."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _experts_fit(scenario: Scenario) -> None:
    """parallel.ep shards model.moe's experts over data-parallel ranks: every expert count divisible."""
    ep, moe = scenario.parallel.ep, scenario.model.moe
    if ep == 1:
        return
    if moe is None:
        raise ValueError(f"parallel.ep: {ep} shards the experts of model.moe; the model has none")
    if moe.experts % ep:
        raise ValueError(f"parallel.ep: {ep} does not divide model.moe.experts {moe.experts}")


def _representatives_fit(scenario: Scenario) -> None:
    """Where every replica and every tp rank of a stage do the same at the same times."""
    cluster = scenario.cluster
    parallel = scenario.parallel
    for refuse, why in ((not parallel.model_parallel and parallel.ep == 1 and parallel.sharding.stage > 0,
                         "with sharding under data parallelism alone is not built (a unit's gather and the "
                         "reduce-scatter beside it share the links; mirrored, they would run one after another)"),
                        (scenario.numerics, "needs numerics false (the mirrored ranks compute nothing)"),
                        (cluster.overrides, "needs identical devices (no cluster.overrides)"),
                        (cluster.compute_jitter > 0 or cluster.compute_jitter_fixed > 0,
                         "needs identical devices (no cluster.compute_jitter or compute_jitter_fixed)"),
                        (cluster.host_cores is not None, "needs devices that compute on their own (no "
                                                         "cluster.host_cores: the mirrored ranks take no core)")):
        if refuse:
            raise ValueError(f"parallel.representatives: {why}")


def _main_gradients_fit(scenario: Scenario) -> None:
    """DDP's fp32 main gradients (train/replica.py main_grads_of) are added into by autograd's hook after each
    backward: what adds into .grad by hand, or reads it, is another rule."""
    parallel, train = scenario.parallel, scenario.train
    if parallel.sharding.stage != 0 or parallel.sharding.reduce_dtype != "fp32" or train.precision == "fp32":
        return
    for refused, what in ((parallel.mode == "async", "parallel.mode async (workers push their own gradients)"),
                          (train.optimizer.name == "kfac", "K-FAC (it preconditions each parameter's .grad)"),
                          (parallel.sync_batchnorm, "parallel.sync_batchnorm (it adds into .grad by hand)")):
        if refused:
            raise ValueError(f"parallel.sharding.reduce_dtype: fp32 main gradients under DDP are not built with "
                             f"{what}; leave reduce_dtype null")


def _microbatches_fit(scenario: Scenario) -> None:
    """parallel.pipeline.microbatches cuts data.batch_size into equal micro-batches: under pp/tp/cp the
    pipeline's, else gradient accumulation (schemes/local_work.py, strategies/unit_overlap.py)."""
    count = scenario.parallel.microbatches
    if scenario.data.batch_size % count:
        raise ValueError(f"parallel.pipeline.microbatches: {count} does not divide data.batch_size "
                         f"{scenario.data.batch_size} (the samples per data-parallel replica per step)")


def _sequence_cuts_fit(scenario: Scenario) -> None:
    """Sequence parallelism cuts a gpt's or a llama's sequence into tp parts and context parallelism into 2·cp
    chunks whose attention runs as a ring (that data.seq_len divides into them is checked on the data's shape:
    schemes/model_parts.py)."""
    parallel, name = scenario.parallel, scenario.model.name
    if parallel.sequence_parallel and name not in ("gpt", "llama"):
        raise ValueError(f"parallel.sequence_parallel: built for the gpt and llama models' blocks, not {name}")
    if parallel.cp > 1 and name not in ("gpt", "llama"):
        raise ValueError(f"parallel.cp: built for the gpt and llama models' attention, not {name}")


def validate_scenario(raw: dict, source: str = "scenario", base_dir: Path = Path(".")) -> Scenario:
    """Validate a raw mapping; the first problem becomes a one-line ScenarioError."""
    try:
        scenario = Scenario.model_validate(raw)
        scenario._base_dir = Path(base_dir)
        return scenario
    except ValidationError as error:
        first = error.errors()[0]
        field = one_line(".".join(str(part) for part in first["loc"]))
        message = error_message(first, Scenario)
        if message.startswith("."):  # a nested model's problem continues the field's path: ".memory: ..."
            raise ScenarioError(f"{source}: {field}{message}") from None
        # A check across fields names its field at the start of its message.
        named = not field or message.startswith(field + ".")
        raise ScenarioError(f"{source}: {message}" if named else f"{source}: {field}: {message}") from None
