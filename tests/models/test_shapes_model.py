"""The shapes model adapter, built from a tiny checkpoint saved to disk and loaded offline."""

from __future__ import annotations

import socket

import pytest
import torch

from flowrl.models.base import ModelLoadError
from flowrl.models.shapes import ShapesModel, ShapesModelConfig
from flowrl.eval.generate import generate

TINY = dict(block_out_channels=[32, 32], head_dim=16, text_hidden_size=32, text_layers=1, text_heads=2)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(built model, its directory): a tiny randomly initialised model saved with save_pretrained."""
    path = tmp_path_factory.mktemp("tiny_shapes")
    model = ShapesModel.build(ShapesModelConfig(**TINY), seed=1, default_guidance=2.0)
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def model(saved):
    """The saved model loaded back with every network connection refused."""

    def no_network(*args, **kwargs):
        raise OSError("network access in a test")

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(socket.socket, "connect", no_network)
        loaded = ShapesModel.from_pretrained(saved[1])
    return loaded.eval()


def test_loads_the_saved_checkpoint(saved, model):
    built, path = saved
    assert model.config == built.config and model.default_guidance == 2.0
    assert model.latent_shape == (3, 32, 32) and model.dtype == torch.float32
    for name, tensor in built.denoiser.state_dict().items():
        assert torch.equal(tensor, model.denoiser.state_dict()[name]), name
    for name, tensor in built.text_encoder.state_dict().items():
        assert torch.equal(tensor, model.text_encoder.state_dict()[name]), name
    assert (model.tokenize(["a red circle"])["input_ids"].tolist()
            == built.tokenize(["a red circle"])["input_ids"].tolist())


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="missing model.json"):
        ShapesModel.from_pretrained(tmp_path)


def test_encode_prompts_caches_unique_prompts(model, monkeypatch):
    model.clear_prompt_cache()
    calls = []
    original = model._encode
    monkeypatch.setattr(model, "_encode", lambda prompts: calls.append(list(prompts)) or original(prompts))
    first = model.encode_prompts(["a circle", "a red square", "a circle"])
    assert calls == [["a circle", "a red square"]]  # each unique prompt once
    again = model.encode_prompts(["a red square", "a circle"])
    assert calls == [["a circle", "a red square"]]  # all cached
    assert first["encoder_hidden_states"].shape == (3, model.config.max_prompt_tokens, TINY["text_hidden_size"])
    assert torch.equal(first["encoder_hidden_states"][0], first["encoder_hidden_states"][2])
    assert torch.equal(again["encoder_hidden_states"][0], first["encoder_hidden_states"][1])
    model.encode_prompts(["three blue triangles"])
    assert calls[-1] == ["three blue triangles"]


def test_generate_shapes_ranges_and_determinism(model):
    prompts = ["a circle", "a red square", "two blue circles"]
    images = generate(model, prompts, [0, 1, 2], steps=2, guidance=1.0)
    assert images.shape == (3, 3, 32, 32) and images.dtype == torch.float32
    assert images.min() >= 0.0 and images.max() <= 1.0
    assert torch.equal(images, generate(model, prompts, [0, 1, 2], steps=2, guidance=1.0))
    other = generate(model, prompts, [3, 1, 2], steps=2, guidance=1.0)
    assert not torch.allclose(images[0], other[0]) and torch.allclose(images[1:], other[1:], atol=1e-5)


def test_generate_is_independent_of_batch_composition(model):
    alone = generate(model, ["a circle"], [5], steps=2, guidance=2.0)
    batch = generate(model, ["a red square", "a circle", "three green triangles"], [1, 5, 9], steps=2,
                     guidance=2.0, batch_size=2)  # also split across model calls
    assert torch.allclose(alone[0], batch[1], atol=1e-5)
