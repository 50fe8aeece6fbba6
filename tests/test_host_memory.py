"""The host-memory lower bound's model sizes (host_memory.model_size, closed form, no torch) against the models
train/models.py builds: their parameters' numel, and the outputs of their layers in a meta forward."""
import pytest
import torch

from simtrain.host_memory import model_size
from simtrain.scenario import ModelSpec
from simtrain.train.data_shape import DIGITS_INFO as DIGITS, DatasetInfo
from simtrain.train.models import build_model

FEATURES_7 = DatasetInfo(num_features=7, num_classes=3, image_shape=None, input_shape=(7,))
IMAGES_3x7x5 = DatasetInfo(num_features=105, num_classes=4, image_shape=(3, 7, 5), input_shape=(105,))
IMAGES_1x1x9 = DatasetInfo(num_features=9, num_classes=2, image_shape=(1, 1, 9), input_shape=(9,))


def built_size(spec: ModelSpec, info: DatasetInfo) -> tuple[int, int]:
    """(parameters, layer outputs per sample) of the built model, counted on torch's meta device."""
    with torch.device("meta"):
        model = build_model(spec, info, seed=0)
    outputs = [0]
    for layer in model.modules():
        if not list(layer.children()):
            layer.register_forward_hook(lambda _module, _inputs, out: outputs.append(out.numel()))
    model(torch.empty((2, *info.input_shape), device="meta"))  # two samples: BatchNorm refuses one
    return sum(p.numel() for p in model.parameters()), sum(outputs) // 2


@pytest.mark.parametrize("spec,info", [
    (ModelSpec(name="mlp", hidden=[128, 128]), DIGITS),
    (ModelSpec(name="mlp", hidden=[5], batchnorm=True), FEATURES_7),
    (ModelSpec(name="mlp", hidden=[300, 17, 64], batchnorm=True), DIGITS),
    (ModelSpec(name="mlp", hidden=[]), FEATURES_7),
    (ModelSpec(name="cnn", channels=[16, 32]), DIGITS),
    (ModelSpec(name="cnn", channels=[4, 8, 6, 2], batchnorm=True), DIGITS),  # 8x8 pooled down to 1x1, then not
    (ModelSpec(name="cnn", channels=[5, 3], batchnorm=True), IMAGES_3x7x5),  # odd sides
    (ModelSpec(name="cnn", channels=[2]), IMAGES_1x1x9),  # a side of 1: no pooling
])
def test_closed_form_size_is_the_built_models(spec, info):
    assert model_size(spec, info) == built_size(spec, info)


def test_models_it_does_not_count():
    assert model_size(ModelSpec(name="cnn"), FEATURES_7) == (0, 0)  # no images: the job's build refuses it
    assert model_size(ModelSpec(name="gpt", hidden=[32], layers=2, heads=4), DIGITS) == (0, 0)
    assert model_size(ModelSpec(name="mlp"), None) == (0, 0)  # a user's data set
