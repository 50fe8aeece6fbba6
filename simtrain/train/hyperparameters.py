"""Hyperparameters that change while a job trains: a schedule by step, set live between two steps.

A live hyperparameter is one of `scenario.LIVE_HYPERPARAMETERS`: a field of
the optimizer's param groups (`train.optimizer.lr`, `momentum`,
`weight_decay`, `eps`) or the loader's `data.batch_size`. Setting one changes
the running optimizer and loader in place, as a training loop that edits
`optimizer.param_groups` does: nothing is rebuilt, so momentum buffers and
Adam's moments carry on, and the data stream goes on from the sample it had
reached (train/data.py `ShardLoader.set_batch_size`).

`train.schedule` lists the values by step; `values_from(schedule, step)` is
what takes effect before step `step` (0-based): the entry at exactly that
step, or nothing. The scenario validated every path and value
(scenario.Scenario._hyperparameters_apply_live), so none is checked here.

    values = values_from(scenario.train.schedule, step)   # {"train.optimizer.lr": 0.02} or {}
    set_live(replica.optimizer, [replica.loader], values)

The memory a replica holds and the HBM traffic of its optimizer step are those
of the scenario's own optimizer settings: a schedule that turns momentum on from
0 makes torch create the buffers, but the ledger does not count them.
"""
import torch

_PARAM_GROUP_KEYS = {"train.optimizer.lr": "lr", "train.optimizer.momentum": "momentum",
                     "train.optimizer.weight_decay": "weight_decay", "train.optimizer.eps": "eps"}


def values_from(schedule: list[dict], step: int) -> dict:
    """The hyperparameters `schedule` sets before step `step` (the entry at that step, without `step`)."""
    for entry in schedule:
        if entry["step"] == step:
            return {path: value for path, value in entry.items() if path != "step"}
    return {}


def values_at(schedule: list[dict], step: int, initial) -> dict:
    """Every hyperparameter `schedule` sets, as it stands before step `step`: its latest entry at or before
    that step, else `initial(path)` (the scenario's own value). A job restarted at `step` sets these."""
    values = {path: initial(path) for entry in schedule for path in entry if path != "step"}
    for entry in schedule:
        if entry["step"] <= step:
            values.update((path, value) for path, value in entry.items() if path != "step")
    return values


def set_live(optimizer: torch.optim.Optimizer, loaders: list, values: dict) -> None:
    """Set `values` ({path: value}) on every param group of `optimizer` and on every loader."""
    for path, value in values.items():
        if path == "data.batch_size":
            for loader in loaders:
                loader.set_batch_size(value)
            continue
        for group in optimizer.param_groups:
            group[_PARAM_GROUP_KEYS[path]] = value
