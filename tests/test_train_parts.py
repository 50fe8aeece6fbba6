"""Per-replica training parts against references: DataLoader, sklearn, torch, closed forms."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from simtrain.scenario import ModelSpec, OptimizerSpec, validate_scenario
from simtrain.cost import measure_step_cost
from simtrain.errors import ScenarioError
from simtrain.train.data import DataSplits, DatasetInfo, ShardLoader, load_dataset
from simtrain.train.models import build_model
from simtrain.train.optim import build_optimizer, optimizer_state_bytes, optimizer_step_bytes

DIGITS = load_dataset("digits", {}, seed=0)


class _ItemDataset(Dataset):
    """Not a TensorDataset: makes ShardLoader take its stacking path."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def image_pairs(size: int = 40):
    """An import-path dataset for the tests: (train, test) of 1x4x4 images."""
    g = torch.Generator().manual_seed(size)
    x, y = torch.rand(size, 1, 4, 4, generator=g), torch.arange(size) % 5
    return _ItemDataset(x[:30], y[:30]), _ItemDataset(x[30:], y[30:])


def not_a_pair():
    return 42


def tiny_model(width: int = 3):
    return nn.Linear(width, 2)


# ---------------------------------------------------------------- data


def _dataloader_batches(dataset, num_replicas, rank, batch_size, seed, epochs):
    sampler = DistributedSampler(
        dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        yield from loader


@pytest.mark.parametrize("num_replicas,batch_size", [(1, 128), (3, 64), (4, 50)])
@pytest.mark.parametrize("wrap", [False, True], ids=["tensor", "items"])
def test_shard_loader_gives_exactly_the_dataloader_batches(num_replicas, batch_size, wrap):
    dataset = DIGITS.train
    if wrap:
        dataset = _ItemDataset(*DIGITS.train.tensors)
    epochs, seed = 3, 7
    per_epoch = (len(dataset) // num_replicas) // batch_size
    for rank in range(num_replicas):
        shard = ShardLoader(dataset, num_replicas, rank, batch_size, seed)
        assert shard.batches_per_epoch == per_epoch
        expected = list(_dataloader_batches(dataset, num_replicas, rank, batch_size, seed, epochs))
        assert len(expected) == epochs * per_epoch
        for i, (x_ref, y_ref) in enumerate(expected):
            x, y = shard.next_batch()
            assert shard.epoch == i // per_epoch
            assert x.dtype == x_ref.dtype and y.dtype == y_ref.dtype
            assert torch.equal(x, x_ref) and torch.equal(y, y_ref)


def test_ranks_see_disjoint_shards():
    seen = [ShardLoader(DIGITS.train, 3, rank, 479, seed=1).next_batch()[0] for rank in range(3)]
    rows = {tuple(row.tolist()) for batch in seen for row in batch}
    assert len(seen[0]) == 479 and len(rows) > 3 * 479 - 20  # digits has a few duplicate images


def test_shard_smaller_than_batch_names_batch_size():
    small = TensorDataset(torch.zeros(10, 2), torch.zeros(10, dtype=torch.int64))
    with pytest.raises(ScenarioError, match=r"^data\.batch_size: 8 is larger"):
        ShardLoader(small, num_replicas=4, rank=0, batch_size=8, seed=0)


def test_digits_splits_are_sklearn_order_scaled_to_unit():
    from sklearn.datasets import load_digits

    pixels, labels = load_digits(return_X_y=True)
    x_train, y_train = DIGITS.train.tensors
    x_test, y_test = DIGITS.test.tensors
    assert (len(DIGITS.train), len(DIGITS.test)) == (1437, 360)
    assert x_train.dtype == torch.float32 and y_train.dtype == torch.int64
    assert x_train.shape == (1437, 64) and x_test.shape == (360, 64)
    assert torch.equal(x_train, torch.tensor(pixels[:1437] / 16, dtype=torch.float32))
    assert torch.equal(x_test, torch.tensor(pixels[1437:] / 16, dtype=torch.float32))
    assert torch.equal(y_test, torch.tensor(labels[1437:]))
    assert float(x_train.max()) == 1.0 and float(x_train.min()) == 0.0
    assert DIGITS.info == DatasetInfo(num_features=64, num_classes=10, image_shape=(1, 8, 8),
                                       input_shape=(64,))


def test_digits_are_read_without_importing_scikit_learn_as_its_load_digits_gives_them(monkeypatch):
    import importlib.util
    import sys

    import numpy as np
    from sklearn.datasets import load_digits

    import simtrain.train.data as data

    pixels, labels = load_digits(return_X_y=True)
    with monkeypatch.context() as patched:
        patched.setitem(sys.modules, "sklearn.datasets", None)  # importing it fails now
        table = data._digits_table()
    assert np.array_equal(table[:, :-1], pixels) and np.array_equal(table[:, -1], labels)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # a scikit-learn that keeps it elsewhere
    assert np.array_equal(data._digits_table(), table)


def test_digits_are_read_once_and_a_run_that_changes_them_does_not_reach_the_next(monkeypatch):
    import simtrain.train.data as data

    monkeypatch.setattr(data, "_digits_read", [])  # tensors of this test's own, not the ones DIGITS shares
    first, again = load_dataset("digits", {}, seed=0), load_dataset("digits", {}, seed=0)
    assert again.train.tensors[0].data_ptr() == first.train.tensors[0].data_ptr()  # read once a process
    first.test.tensors[0].add_(1.0)  # a run writing into its data in place
    fresh = load_dataset("digits", {}, seed=0)
    assert fresh.test.tensors[0].data_ptr() != first.test.tensors[0].data_ptr()
    assert torch.equal(fresh.test.tensors[0], DIGITS.test.tensors[0])


def test_synthetic_is_seeded_sized_and_learnable():
    from sklearn.linear_model import LogisticRegression

    options = {"samples": 400, "features": 6, "classes": 3, "test_fraction": 0.25}
    rng_before = torch.get_rng_state()
    a, b = load_dataset("synthetic", options, seed=5), load_dataset("synthetic", options, seed=5)
    c = load_dataset("synthetic", options, seed=6)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert (len(a.train), len(a.test)) == (300, 100)
    assert a.info == DatasetInfo(num_features=6, num_classes=3, image_shape=None, input_shape=(6,))
    for ta, tb, tc in zip(a.train.tensors, b.train.tensors, c.train.tensors):
        assert torch.equal(ta, tb)
    assert not torch.equal(a.train.tensors[0], c.train.tensors[0])
    assert set(a.train.tensors[1].tolist()) == {0, 1, 2}

    default = load_dataset("synthetic", {}, seed=0)
    assert (len(default.train), len(default.test), default.info.num_features) == (1638, 410, 32)
    classifier = LogisticRegression(max_iter=500).fit(default.train.tensors[0], default.train.tensors[1])
    assert classifier.score(default.test.tensors[0], default.test.tensors[1]) > 0.8


def test_import_path_dataset_infers_info():
    splits = load_dataset("test_train_parts:image_pairs", {"size": 40}, seed=0)
    assert isinstance(splits, DataSplits) and len(splits.train) == 30
    assert splits.info == DatasetInfo(num_features=16, num_classes=5, image_shape=(1, 4, 4),
                                        input_shape=(1, 4, 4))
    x, y = ShardLoader(splits.train, 2, 1, 5, seed=0).next_batch()
    assert x.shape == (5, 1, 4, 4) and y.shape == (5,)


@pytest.mark.parametrize(
    "name,options,field",
    [
        ("imagenet", {}, "data.name"),
        ("no_such_module_xyz:load", {}, "data.name"),
        ("test_train_parts:missing_function", {}, "data.name"),
        ("test_train_parts:not_a_pair", {}, "data.name"),
        ("test_train_parts:image_pairs", {"colour": 1}, "data.options"),
        ("digits", {"samples": 10}, "data.samples"),
        ("synthetic", {"sample": 10}, "data.sample"),
        ("synthetic", {"classes": 0}, "data.classes"),
        ("synthetic", {"test_fraction": 1.5}, "data.test_fraction"),
    ],
)
def test_dataset_errors_name_the_field(name, options, field):
    with pytest.raises(ScenarioError) as error:
        load_dataset(name, options, seed=0)
    message = str(error.value)
    assert message.startswith(field + ":") and "\n" not in message


# ---------------------------------------------------------------- models


def test_model_init_follows_the_manual_seed_contract():
    rng_before = torch.get_rng_state()
    a = build_model(ModelSpec(name="mlp", hidden=[20, 10]), DIGITS.info, seed=11)
    assert torch.equal(torch.get_rng_state(), rng_before)
    b = build_model(ModelSpec(name="mlp", hidden=[20, 10]), DIGITS.info, seed=11)
    c = build_model(ModelSpec(name="mlp", hidden=[20, 10]), DIGITS.info, seed=12)
    torch.manual_seed(11)
    by_hand = nn.Sequential(
        nn.Flatten(), nn.Linear(64, 20), nn.ReLU(), nn.Linear(20, 10), nn.ReLU(), nn.Linear(10, 10)
    )
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key])
        assert torch.equal(value, by_hand.state_dict()[key])
        assert not torch.equal(value, c.state_dict()[key])


def test_mlp_and_cnn_structure():
    mlp = build_model(ModelSpec(name="mlp"), DIGITS.info, seed=0)
    assert isinstance(mlp, nn.Sequential)
    assert [type(m).__name__ for m in mlp] == ["Flatten", "Linear", "ReLU", "Linear", "ReLU", "Linear"]
    assert [(m.in_features, m.out_features) for m in mlp if isinstance(m, nn.Linear)] == [
        (64, 128),
        (128, 128),
        (128, 10),
    ]
    cnn = build_model(ModelSpec(name="cnn", channels=[4, 8, 8]), DIGITS.info, seed=0)
    kinds = [type(m).__name__ for m in cnn]
    assert kinds[0] == "Unflatten" and kinds.count("Conv2d") == 3 and kinds.count("MaxPool2d") == 3
    assert cnn[-1].in_features == 8 * 1 * 1
    assert cnn(DIGITS.train.tensors[0][:5]).shape == (5, 10)
    two_classes = DatasetInfo(num_features=7, num_classes=2, image_shape=None, input_shape=(7,))
    tiny = ModelSpec(name="test_train_parts:tiny_model", options={"width": 7})
    assert build_model(tiny, two_classes, 0).in_features == 7


@pytest.mark.parametrize(
    "name,options,info,field",
    [
        ("resnet", {}, DIGITS.info, "model.name"),
        ("mlp", {"hiden": [3]}, DIGITS.info, "model.hiden"),
        ("mlp", {"hidden": [3, 0]}, DIGITS.info, "model.hidden"),
        ("mlp", {"hidden": 128}, DIGITS.info, "model.hidden"),
        ("cnn", {"channels": []}, DIGITS.info, "model.channels"),
        ("cnn", {}, DatasetInfo(32, 10, None, (32,)), "model.name"),
        ("no_such_module_xyz:net", {}, DIGITS.info, "model.name"),
        ("test_train_parts:not_a_pair", {}, DIGITS.info, "model.name"),
        ("test_train_parts:tiny_model", {"options": {"depth": 2}}, DIGITS.info, "model.options"),
    ],
)
def test_model_errors_name_the_field(name, options, info, field):
    with pytest.raises(ScenarioError) as error:  # from the scenario's validation or from building the model
        build_model(validate_scenario({"model": {"name": name, **options}}).model, info, seed=0)
    assert str(error.value).removeprefix("scenario: ").startswith(field)  # model.hidden.1 for one width


# ---------------------------------------------------------------- optimizers


@pytest.mark.parametrize(
    "name,options,state_copies,step_copies",
    [
        ("sgd", {"lr": 0.1}, 0, 3),
        ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True}, 1, 5),
        ("adam", {"lr": 0.01, "betas": [0.8, 0.99]}, 2, 7),
    ],
)
def test_optimizer_state_bytes_match_the_real_state(name, options, state_copies, step_copies):
    model = build_model(ModelSpec(name="mlp", hidden=[16]), DIGITS.info, seed=0)
    optimizer = build_optimizer(model.parameters(), OptimizerSpec(name=name, **options))
    assert optimizer.defaults["foreach"] is False
    x, y = DIGITS.train.tensors[0][:8], DIGITS.train.tensors[1][:8]
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Buffers shaped like their parameter; Adam's scalar step counters are not counted.
    real_state = sum(
        value.numel() * value.element_size()
        for param, state in optimizer.state.items()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.shape == param.shape
    )
    assert optimizer_state_bytes(OptimizerSpec(name=name, **options), param_bytes) == real_state == state_copies * param_bytes
    assert optimizer_step_bytes(OptimizerSpec(name=name, **options), param_bytes) == step_copies * param_bytes


@pytest.mark.parametrize(
    "name,options,field",
    [
        ("lamb", {}, "train.optimizer.name"),
        ("sgd", {"lr": -1}, "train.optimizer.lr"),
        ("sgd", {"betas": [0.9, 0.9]}, "train.optimizer.betas"),
        ("sgd", {"nesterov": True}, "train.optimizer.nesterov"),
        ("adam", {"betas": [0.9, 1.0]}, "train.optimizer.betas"),
        ("adam", {"momentum": 0.9}, "train.optimizer.momentum"),
    ],
)
def test_optimizer_errors_name_the_field(name, options, field):
    with pytest.raises(ScenarioError) as error:
        validate_scenario({"train": {"optimizer": {"name": name, **options}}})
    assert str(error.value).removeprefix("scenario: ").startswith(field)  # betas.1 for the second beta


# ---------------------------------------------------------------- cost


def test_mlp_flops_match_the_closed_form():
    batch, widths = 32, [64, 128, 64, 10]
    model = build_model(ModelSpec(name="mlp", hidden=widths[1:-1]), DIGITS.info, seed=0)
    x, y = DIGITS.train.tensors[0][:batch], DIGITS.train.tensors[1][:batch]
    layer_flops = [2 * batch * n_in * n_out for n_in, n_out in zip(widths, widths[1:])]
    # Forward: one (B x in) @ (in x out) matmul per Linear, 2 FLOPs per multiply-add;
    # the bias add, ReLU and the loss are element-wise and count 0.
    # Backward: per Linear, grad_weight = grad_out^T @ input (same FLOPs as forward) and
    # grad_input = grad_out @ W (same again), except the first layer: its input x needs
    # no gradient, so it has no grad_input matmul. The bias gradient is a sum (0 FLOPs).
    cost = measure_step_cost(model, x, y)
    assert cost.forward_flops == sum(layer_flops)
    assert cost.backward_flops == 2 * sum(layer_flops) - layer_flops[0]

    # An input that needs its gradient (a pipeline stage's) adds the first grad_input matmul.
    with_input_grad = measure_step_cost(model, x.clone().requires_grad_(), y)
    assert with_input_grad.backward_flops == 2 * sum(layer_flops)


def test_cnn_flops_match_the_closed_form():
    batch = 32
    model = build_model(ModelSpec(name="cnn", channels=[16, 32]), DIGITS.info, seed=0)
    x, y = DIGITS.train.tensors[0][:batch], DIGITS.train.tensors[1][:batch]
    conv1 = 2 * batch * 16 * 8 * 8 * (1 * 3 * 3)  # per output element: C_in * 3 * 3 multiply-adds
    conv2 = 2 * batch * 32 * 4 * 4 * (16 * 3 * 3)  # after a 2x2 max-pool
    head = 2 * batch * (32 * 2 * 2) * 10
    cost = measure_step_cost(model, x, y)
    assert cost.forward_flops == conv1 + conv2 + head
    assert cost.backward_flops == conv1 + 2 * conv2 + 2 * head  # conv1 has no grad_input


def test_activation_bytes_match_what_autograd_saves_by_hand():
    batch = 32
    model = build_model(ModelSpec(name="mlp", hidden=[128]), DIGITS.info, seed=0)  # Linear(64,128)-ReLU-Linear(128,10)
    x, y = DIGITS.train.tensors[0][:batch], DIGITS.train.tensors[1][:batch]
    # Saved for backward, float32:
    #   Linear1 (addmm) saves x                      -> the input batch: not counted
    #   ReLU saves its output h (32 x 128)           -> 16,384 bytes
    #   Linear2 (addmm) saves h again and W2^T       -> h counted once; W2 is a parameter
    #   log_softmax saves its output p (32 x 10)     ->  1,280 bytes
    #   nll_loss saves p again, y and total_weight   -> p once; y is the batch; a 0-dim float: 4 bytes
    expected = batch * 128 * 4 + batch * 10 * 4 + 4
    assert measure_step_cost(model, x, y).activation_bytes == expected == 17_668


def test_measurement_leaves_the_model_alone_and_is_cached():
    model = build_model(ModelSpec(name="mlp", hidden=[24]), DIGITS.info, seed=0)
    x, y = DIGITS.train.tensors[0][:16], DIGITS.train.tensors[1][:16]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first = measure_step_cost(model, x, y)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert measure_step_cost(model, x, y) is first
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    other = measure_step_cost(build_model(ModelSpec(name="mlp", hidden=[24]), DIGITS.info, 0), x[:8], y[:8])
    assert other.forward_flops == first.forward_flops / 2


def test_meta_tensors_give_shapes_flops_and_bytes_without_numbers():
    batch = 13  # a shape no other test measures, so nothing comes from the cache
    model = build_model(ModelSpec(name="mlp", hidden=[24]), DIGITS.info, seed=0).to("meta")
    x, y = torch.empty(batch, 64, device="meta"), torch.empty(batch, dtype=torch.int64, device="meta")
    cost = measure_step_cost(model, x, y)
    assert cost.forward_flops == 2 * batch * (64 * 24 + 24 * 10)
    assert cost.activation_bytes == batch * 24 * 4 + batch * 10 * 4 + 4
