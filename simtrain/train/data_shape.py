"""The shape of a data set, and the built-in data sets' shapes and option checks, without torch.

`DatasetInfo` is what a model is built for: one sample's input shape and
dtype (named: "float32", "int64"), its classes, its image shape. The built-in
data sets (train/data.py: digits, synthetic, tokens) have their shapes in
closed form: `builtin_splits(name, options)` checks their options, with the
lines train/data.py's `load_dataset` raises (it calls this first), and gives
the shape and the sizes of their train and test splits without drawing a
sample. `check_validation_split` is `data.validation_fraction`'s check on the
training split's size. So `simtrain validate` checks a scenario's built-in data
without importing torch (simtrain/preflight.py).

    info, train, test = builtin_splits("tokens", {"seq_len": 16})   # tokens: 1,638 train, 410 test
    check_validation_split(0.1, train)
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ScenarioError

DIGITS_TRAIN_SAMPLES = 1437
DIGITS_SAMPLES = 1797
SYNTHETIC_DEFAULTS = {"samples": 2048, "features": 32, "classes": 10, "test_fraction": 0.2}
TOKENS_DEFAULTS = {"samples": 2048, "seq_len": 32, "vocab": 64, "test_fraction": 0.2}
BUILTIN = ("digits", "synthetic", "tokens")


@dataclass(frozen=True)
class DatasetInfo:
    """Shape of a classification dataset's inputs and labels."""

    num_features: int
    num_classes: int
    image_shape: tuple[int, ...] | None
    input_shape: tuple[int, ...]  # one sample's x, as the dataset holds it
    input_dtype: str = "float32"  # the name of its torch dtype

    @property
    def tokens(self) -> bool:
        """Whether a sample is a sequence of token ids (what gpt and llama read)."""
        return self.input_dtype == "int64" and len(self.input_shape) == 1


DIGITS_INFO = DatasetInfo(num_features=64, num_classes=10, image_shape=(1, 8, 8), input_shape=(64,))


def tokens_info(seq_len: int, vocab: int) -> DatasetInfo:
    return DatasetInfo(num_features=seq_len, num_classes=vocab, image_shape=None, input_shape=(seq_len,),
                       input_dtype="int64")


def builtin_splits(name: str, options: dict) -> tuple[DatasetInfo, int, int]:
    """(info, training samples, test samples) of built-in data set `name` with `options` (data's loader options),
    after checking them (one-line errors naming the field)."""
    options = dict(options or {})
    if name == "digits":
        reject_unknown_options(options, allowed=(), field="data")
        return DIGITS_INFO, DIGITS_TRAIN_SAMPLES, DIGITS_SAMPLES - DIGITS_TRAIN_SAMPLES
    if name == "synthetic":
        reject_unknown_options(options, allowed=tuple(SYNTHETIC_DEFAULTS), field="data")
        opts = {**SYNTHETIC_DEFAULTS, **options}
        for key in ("samples", "features", "classes"):
            value = opts[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ScenarioError(f"data.{key}: must be a positive integer, got {value!r}")
        if opts["classes"] < 2:
            raise ScenarioError(f"data.classes: needs at least 2 classes, got {opts['classes']}")
        fraction = opts["test_fraction"]
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
            raise ScenarioError(f"data.test_fraction: must be between 0 and 1, got {fraction!r}")
        samples, features = opts["samples"], opts["features"]
        num_test = round(samples * fraction)
        if num_test < 1 or num_test >= samples:
            raise ScenarioError(f"data.test_fraction: {fraction} of {samples} samples leaves an empty train or test "
                                "split")
        info = DatasetInfo(num_features=features, num_classes=opts["classes"], image_shape=None,
                           input_shape=(features,))
        return info, samples - num_test, num_test
    if name == "tokens":
        reject_unknown_options(options, allowed=tuple(TOKENS_DEFAULTS), field="data")
        opts = {**TOKENS_DEFAULTS, **options}
        samples = opts["samples"]
        num_test = round(samples * opts["test_fraction"])
        if num_test < 1 or num_test >= samples:
            raise ScenarioError(f"data.test_fraction: {opts['test_fraction']} of {samples} samples leaves an empty "
                                "train or test split")
        return tokens_info(opts["seq_len"], opts["vocab"]), samples - num_test, num_test
    raise ValueError(f"{name!r} is not a built-in data set")


def check_validation_split(fraction: float, size: int) -> int:
    """How many of `size` training samples `data.validation_fraction` holds out (0 for fraction 0); a one-line
    error if that leaves either split empty."""
    if fraction == 0:
        return 0
    count = round(fraction * size)
    if not 1 <= count < size:
        raise ScenarioError(f"data.validation_fraction: {fraction} of {size} training samples leaves an empty "
                            "training or validation split")
    return count


def reject_unknown_options(options: dict, allowed, field: str) -> None:
    for key in options:
        if key not in allowed:
            known = ", ".join(allowed) if allowed else "none"
            raise ScenarioError(f"{field}.{key}: unknown option (known: {known})")
