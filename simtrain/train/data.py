"""Datasets and per-replica data shards.

`load_dataset(name, options, seed)` returns the train and test splits of a
classification dataset plus a `DatasetInfo` (input size, classes, image shape):

- `digits`: scikit-learn's bundled 8x8 digits (no download). Pixels / 16 as
  float32 of shape (n, 64); the first 1,437 samples in scikit-learn's order
  train, the last 360 test. Read once a process, shared by its runs.
- `synthetic`: standard-normal class centroids plus standard-normal noise
  per sample (a linear model learns it), drawn from a
  `torch.Generator` seeded with `seed`. Options: samples (2048), features (32),
  classes (10), test_fraction (0.2).
- `tokens`: seeded synthetic token sequences for next-token prediction
  (train/tokens.py): x is (seq_len,) int64 tokens, y the same sequence one
  token later. Options: samples (2048), seq_len (32), vocab (64),
  test_fraction (0.2).
- `package.module:function`: the function is called with the options as
  keyword arguments and returns a `DataSplits` or a (train, test) pair of
  datasets whose items are (x, y). This runs the user's code, as Hydra's
  `_target_` does: a scenario that names one is code, to be trusted as such.
  Whatever it raises, SystemExit included, is a one-line error naming
  `data.name`.

`ShardLoader(dataset, num_replicas, rank, batch_size, seed)` is one replica's
endless stream of batches. It yields exactly the batches of
`DataLoader(dataset, batch_size, sampler=DistributedSampler(dataset,
num_replicas, rank, shuffle=True, seed=seed, drop_last=True), drop_last=True)`
with `sampler.set_epoch(epoch)` before each epoch, as a real DDP job sees them,
but indexes the tensors directly instead of going through DataLoader.
`set_batch_size` changes the size of the next batches (a live hyperparameter,
train/hyperparameters.py); the stream goes on from the sample it reached.

`hold_out_validation(splits, fraction, seed)` moves a seeded draw of the
training split to `splits.validation` (`data.validation_fraction`, what
population-based training's val_* metrics read); the test split is never used
for it.

    splits = load_dataset("digits", {}, seed=0)
    loader = ShardLoader(splits.train, num_replicas=4, rank=1, batch_size=32, seed=0)
    x, y = loader.next_batch()
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.data import Dataset, DistributedSampler, Subset, TensorDataset, default_collate

from ..errors import ScenarioError, first_line
from ..loss import cross_entropy
from .data_shape import BUILTIN, DatasetInfo, builtin_splits, check_validation_split
from .tokens import markov_sequences

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_VALIDATION_STREAM = 0x5641  # separates the validation draw from the other streams of the seed


@dataclass
class DataSplits:
    """A dataset's train and test splits with their shape."""

    train: Dataset
    test: Dataset
    info: DatasetInfo
    validation: Dataset | None = None  # held out of the training split (hold_out_validation)


def load_dataset(name: str, options: dict, seed: int, values: bool = True) -> DataSplits:
    """The named dataset's splits; `seed` drives any generated data. With `values` False (numerics off)
    generated token sequences are meta tensors: their shapes without drawing them (a vocabulary of
    51,200 would need a 21 GB successor table), and so are the digits: their shapes without reading them
    (and without importing scikit-learn, seconds of a `simtrain validate`)."""
    if name in BUILTIN:
        info, train, test = builtin_splits(name, options)
        return {"digits": _digits, "synthetic": _synthetic, "tokens": _tokens}[name](info, train, test, seed, values)
    if isinstance(name, str) and ":" in name:
        return _from_function(name, dict(options or {}))
    raise ScenarioError(
        f"data.name: unknown dataset {name!r} (known: digits, synthetic, tokens, or package.module:function)"
    )


def hold_out_validation(splits: DataSplits, fraction: float, seed: int) -> DataSplits:
    """`splits` with round(fraction * N) training samples, drawn by a permutation seeded with `seed`,
    moved to a validation split (both keep the training split's order); unchanged for fraction 0."""
    size = len(splits.train)
    count = check_validation_split(fraction, size)
    if count == 0:
        return splits
    generator = torch.Generator().manual_seed(seed + _VALIDATION_STREAM)
    held = torch.zeros(size, dtype=torch.bool)
    held[torch.randperm(size, generator=generator)[:count]] = True
    train, validation = (_rows_of(splits.train, torch.nonzero(mask).flatten()) for mask in (~held, held))
    return DataSplits(train=train, test=splits.test, info=splits.info, validation=validation)


def _rows_of(dataset: Dataset, indices: torch.Tensor) -> Dataset:
    if isinstance(dataset, TensorDataset):
        return TensorDataset(*(tensor[indices] for tensor in dataset.tensors))
    return Subset(dataset, indices.tolist())


def load_callable(path: str, field: str) -> Callable:
    """The function named by an import path `package.module:function`."""
    if not isinstance(path, str) or not _IMPORT_PATH.match(path):
        raise ScenarioError(f"{field}: {path!r} is not an import path of the form package.module:function")
    module_name, function_name = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # any failure while importing the user's module is the user's
        raise ScenarioError(f"{field}: cannot import {module_name!r}: {first_line(exc)}") from exc
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ScenarioError(f"{field}: module {module_name!r} has no function {function_name!r}")
    return function


def call_with_options(function: Callable, options: dict, section: str) -> Any:
    """`function(**options)` for the scenario's `section` (model or data), after checking that it
    accepts those keywords. What the user's code raises, even SystemExit, becomes a ScenarioError
    naming `section`.name (the exception stays chained, for the Python API)."""
    name = getattr(function, "__qualname__", repr(function))
    try:
        inspect.signature(function).bind(**options)
    except TypeError as exc:
        raise ScenarioError(f"{section}.options: options do not fit {name}: {exc}") from exc
    except ValueError:  # no introspectable signature (a builtin): let the call decide
        pass
    try:
        return function(**options)
    except SystemExit as exc:  # sys.exit, or a function that ends the process the same way
        raise ScenarioError(f"{section}.name: {name} tried to end the process (SystemExit {exc.code!r}) instead of "
                            "returning") from exc
    except Exception as exc:
        raise ScenarioError(f"{section}.name: {name} raised {type(exc).__name__}: {first_line(exc)}") from exc


def _digits(info: DatasetInfo, train: int, test: int, seed: int, values: bool) -> DataSplits:
    if values:
        x, y = _digits_tensors()
    else:
        x = torch.empty((train + test, info.num_features), device="meta")
        y = torch.empty(train + test, dtype=torch.int64, device="meta")
    return DataSplits(train=TensorDataset(x[:train], y[:train]), test=TensorDataset(x[train:], y[train:]), info=info)


_digits_read: list[tuple[torch.Tensor, torch.Tensor]] = []  # the digits as read, while no run changed them


def _digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as (pixels / 16 in float32, labels in int64), read once a process: parsing its
    compressed CSV costs tens of milliseconds, which a small run, or a sweep of them, would pay every time.
    Runs share the tensors; should one change them in place (their version counter moves), the next reads
    them again, so nothing one run does reaches another. They are read outside any dispatch mode: a meter of
    users' ranks (simtrain.dist) would otherwise charge them to the rank that read them first in the process,
    and the same run would hold more memory when it came first."""
    if not _digits_read or any(tensor._version for tensor in _digits_read[0]):
        table = _digits_table()
        with _disable_current_modes():  # the host's copy: on no device's ledger, whichever rank read it first
            _digits_read[:] = [(torch.from_numpy(table[:, :-1] / 16.0).to(torch.float32),
                                torch.from_numpy(table[:, -1]).to(torch.int64))]
    return _digits_read[0]


def _digits_table() -> np.ndarray:
    """scikit-learn's digits as its CSV holds them: a row a sample, its 64 pixels then its label. The file is
    read where scikit-learn keeps it, without importing scikit-learn (a second of imports, most of a small
    run's start); a release that keeps it elsewhere is asked through its load_digits."""
    package = importlib.util.find_spec("sklearn")
    path = Path(package.origin).parent / "datasets" / "data" / "digits.csv.gz" if package is not None else None
    if path is not None and path.is_file():
        return np.loadtxt(path, delimiter=",")
    from sklearn.datasets import load_digits

    pixels, labels = load_digits(return_X_y=True)
    return np.column_stack([pixels, labels])


def _synthetic(info: DatasetInfo, train: int, test: int, seed: int, values: bool) -> DataSplits:
    """Standard-normal class centroids plus standard-normal noise per sample (drawn with numerics off too)."""
    samples, features, classes = train + test, info.num_features, info.num_classes
    generator = torch.Generator().manual_seed(seed)
    centroids = torch.randn(classes, features, generator=generator)
    y = torch.randint(0, classes, (samples,), generator=generator, dtype=torch.int64)
    x = centroids[y] + torch.randn(samples, features, generator=generator)
    return DataSplits(train=TensorDataset(x[:train], y[:train]), test=TensorDataset(x[train:], y[train:]), info=info)


def _tokens(info: DatasetInfo, train: int, test: int, seed: int, values: bool) -> DataSplits:
    """Next-token prediction on markov_sequences: x the first seq_len tokens, y the next seq_len."""
    samples, (seq_len,), vocab = train + test, info.input_shape, info.num_classes
    sequences = (markov_sequences(samples, seq_len + 1, vocab, seed) if values
                 else torch.empty(samples, seq_len + 1, dtype=torch.int64, device="meta"))
    x, y = sequences[:, :-1], sequences[:, 1:]
    return DataSplits(train=TensorDataset(x[:train], y[:train]), test=TensorDataset(x[train:], y[train:]), info=info)


def _from_function(name: str, options: dict) -> DataSplits:
    result = call_with_options(load_callable(name, "data.name"), options, "data")
    if isinstance(result, DataSplits):
        return result
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise ScenarioError(
            f"data.name: {name} must return DataSplits or a (train, test) pair of datasets, "
            f"got {type(result).__name__}"
        )
    train, test = result
    for split_name, split in (("train", train), ("test", test)):
        if not hasattr(split, "__getitem__") or not hasattr(split, "__len__") or len(split) == 0:
            raise ScenarioError(f"data.name: {name} returned an empty or unindexable {split_name} split")
    return DataSplits(train=train, test=test, info=_infer_info(train, name))


def _infer_info(train: Dataset, name: str) -> DatasetInfo:
    item = train[0]
    if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], torch.Tensor)):
        raise ScenarioError(f"data.name: {name} returned items that are not (x tensor, y) pairs")
    x = item[0]
    if isinstance(train, TensorDataset) and len(train.tensors) == 2:
        labels = train.tensors[1]
    else:
        try:
            labels = torch.as_tensor([int(train[i][1]) for i in range(len(train))])
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ScenarioError(f"data.name: {name} returned labels that are not integers ({first_line(exc)})") from None
    image_shape = tuple(x.shape) if x.dim() == 3 else None
    return DatasetInfo(num_features=x.numel(), num_classes=int(labels.max()) + 1, image_shape=image_shape,
                       input_shape=tuple(x.shape), input_dtype=str(x.dtype).removeprefix("torch."))


class ShardLoader:
    """One replica's endless, epoch-shuffled stream of batches (DistributedSampler order).

    `epoch` is the epoch of the batch most recently returned (0 before the first).
    `host_seconds` is the simulated host work of drawing the last batch beyond
    indexing it: none here (samplers in sampling.py charge their bookkeeping).
    """

    host_seconds = 0.0

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, batch_size: int, seed: int):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ScenarioError(f"data.batch_size: must be a positive integer, got {batch_size!r}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1}")
        self.dataset = dataset
        self.sampler = DistributedSampler(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.set_batch_size(batch_size)
        self._tensors = self._direct_tensors(dataset)
        self.epoch = 0
        self._epoch_indices = self._indices_for(0)
        self._start = 0  # position in the epoch's indices of the next batch's first sample
        self.last_indices: torch.Tensor | None = None  # dataset indices of the last batch
        self.samples_drawn = 0  # samples of every batch returned so far

    @staticmethod
    def _direct_tensors(dataset: Dataset) -> tuple[torch.Tensor, torch.Tensor] | None:
        if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
            return dataset.tensors[0], dataset.tensors[1]
        return None

    def _indices_for(self, epoch: int) -> torch.Tensor:
        self.sampler.set_epoch(epoch)
        return torch.tensor(list(self.sampler), dtype=torch.int64)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (x, y) batch, moving on to the next epoch when this one is used up."""
        if self._start + self.batch_size > len(self._epoch_indices):  # drop_last
            self.epoch += 1
            self._epoch_indices = self._indices_for(self.epoch)
            self._start = 0
        indices = self._epoch_indices[self._start : self._start + self.batch_size]
        self._start += self.batch_size
        return self.gather(indices)

    def set_batch_size(self, batch_size: int) -> None:
        """Batches of `batch_size` from the next one on; the stream goes on from the sample it reached
        (a batch size that does not divide the shard drops the epoch's last samples, as drop_last does)."""
        if batch_size > len(self.sampler):
            raise ScenarioError(
                f"data.batch_size: {batch_size} is larger than each replica's shard of "
                f"{len(self.sampler)} samples ({len(self.sampler.dataset)} samples over "
                f"{self.sampler.num_replicas} replicas)"
            )
        self.batch_size = batch_size
        self.batches_per_epoch = len(self.sampler) // batch_size

    def position(self) -> tuple[int, int, int, int]:
        """Where the stream stands (epoch, next sample in it, batch size, samples drawn): a checkpoint's."""
        return self.epoch, self._start, self.batch_size, self.samples_drawn

    def seek(self, position: tuple[int, int, int, int]) -> None:
        """Go back (or on) to a `position()`: the same batches follow as followed it."""
        epoch, start, batch_size, drawn = position
        self.set_batch_size(batch_size)
        if epoch != self.epoch:
            self.epoch = epoch
            self._epoch_indices = self._indices_for(epoch)
        self._start, self.samples_drawn = start, drawn

    def gather(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (x, y) batch of these dataset indices; they become `last_indices`."""
        self.last_indices = indices
        self.samples_drawn += len(indices)
        if self._tensors is not None:
            x, y = self._tensors
            return x[indices], y[indices]
        x, y = default_collate([self.dataset[i] for i in indices.tolist()])
        return x, y

    def batch_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of the batch last returned: its mean cross entropy (samplers reweight it)."""
        return cross_entropy(logits, y)


class MetaLoader:
    """Batches of meta tensors with the shapes and dtypes of a dataset's samples: numerics off.

    The same step programs run on these as on real batches, with shapes, bytes
    and FLOPs but no values (how the memory plan replays a step at any batch
    size, however large the data set or model).
    """

    host_seconds = 0.0

    def __init__(self, dataset: Dataset, batch_size: int):
        x, y = dataset[0]
        y = torch.as_tensor(y)
        self.batch_size = batch_size
        self._x = (tuple(x.shape), x.dtype)
        self._y = (tuple(y.shape), y.dtype)

    def set_batch_size(self, batch_size: int) -> None:
        self.batch_size = batch_size

    def position(self) -> int:
        return self.batch_size

    def seek(self, position: int) -> None:
        self.batch_size = position

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        (x_shape, x_dtype), (y_shape, y_dtype) = self._x, self._y
        return (torch.empty((self.batch_size, *x_shape), dtype=x_dtype, device="meta"),
                torch.empty((self.batch_size, *y_shape), dtype=y_dtype, device="meta"))

    def batch_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return cross_entropy(logits, y)
