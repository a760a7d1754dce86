"""Loading: clear errors for missing weights, the model registry, dtypes, and the tiny builders."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from flowrl.models.base import ModelLoadError
from flowrl.models.flux import FluxModel
from flowrl.models.sd3 import SD3Model

CLASSES = {"sd3": SD3Model, "flux": FluxModel}


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_missing_local_directory(tmp_path, kind):
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(ModelLoadError) as info:
        CLASSES[kind].from_pretrained(missing)
    message = str(info.value)
    assert str(missing) in message and "no such directory" in message
    assert "model_index.json" in message and "transformer/" in message and "text_encoder_2/" in message
    assert "huggingface-cli download" in message and "model.path" in message
    assert info.value.__cause__ is None and info.value.__context__ is None  # no chained traceback


@pytest.mark.parametrize("kind,hub_id", [("sd3", "stabilityai/stable-diffusion-3.5-medium"),
                                         ("flux", "black-forest-labs/FLUX.1-dev")])
def test_hub_id_offline_without_cached_weights(tmp_path, monkeypatch, kind, hub_id):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as info:
        CLASSES[kind].from_pretrained(hub_id, cache_dir=str(tmp_path / "empty_cache"))
    message = str(info.value)
    assert repr(hub_id) in message and "HF_HUB_OFFLINE" in message
    assert f"huggingface-cli download {hub_id}" in message
    assert "model_index.json" in message and "transformer/" in message
    assert info.value.__cause__ is None


def test_incomplete_local_directory(tiny_dir, tmp_path):
    broken = tmp_path / "sd3"
    shutil.copytree(tiny_dir("sd3"), broken)
    shutil.rmtree(broken / "text_encoder_3")
    with pytest.raises(ModelLoadError, match=r"missing component folder\(s\) text_encoder_3/"):
        SD3Model.from_pretrained(broken)
    (broken / "model_index.json").unlink()
    with pytest.raises(ModelLoadError, match="no model_index.json"):
        SD3Model.from_pretrained(broken)


def test_unreadable_local_weights_name_the_directory(tiny_dir, tmp_path):
    broken = tmp_path / "flux"
    shutil.copytree(tiny_dir("flux"), broken)
    for weights in (broken / "transformer").glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="from its directory"):
        FluxModel.from_pretrained(broken)


def test_registry_lists_and_loads_models(tiny_dir):
    from flowrl.models.registry import MODELS, available_models, load_model
    from flowrl.registry import UnknownNameError

    assert {"sd3", "flux", "shapes"} <= set(available_models())
    model = load_model("sd3", tiny_dir("sd3"), max_sequence_length=16, resolution=64,
                       lora={"rank": 4, "alpha": 8})
    assert isinstance(model, SD3Model) and model.lora.rank == 4
    flux = load_model("flux", path=tiny_dir("flux"), max_sequence_length=16)
    assert isinstance(flux, FluxModel) and flux.latent_shape == (16, 8, 8)  # default: the VAE's sample_size
    assert MODELS.get("flux") == FluxModel.from_pretrained
    with pytest.raises(UnknownNameError, match="valid names: .*flux.*sd3"):
        load_model("sd4")


def test_constructor_from_a_built_pipeline_and_options(tiny_dir):
    from diffusers import StableDiffusion3Pipeline

    pipeline = StableDiffusion3Pipeline.from_pretrained(tiny_dir("sd3"))
    model = SD3Model(pipeline, resolution=(64, 128), max_sequence_length=8, guidance_scale=7.0)
    assert model.latent_shape == (16, 8, 16) and model.default_guidance == 7.0
    cond = model.encode_prompts(["a cat"])
    assert cond["prompt_embeds"].shape == (1, 16 + 8, 32)
    assert model.decode(torch.zeros(1, *model.latent_shape)).shape == (1, 3, 64, 128)
    default = SD3Model(pipeline)  # transformer sample_size x VAE scale factor
    assert default.latent_shape == (16, 8, 8)
    with pytest.raises(ValueError, match="multiples of 16"):
        SD3Model(pipeline, resolution=72)


def test_dtype_names():
    from flowrl.models.loading import resolve_dtype

    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("fp16") is torch.float16
    assert resolve_dtype(None) is torch.float32 and resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8")


def test_tiny_builders_are_deterministic_and_cached(tiny_dir, tmp_path):
    from safetensors.torch import load_file

    from flowrl.testing import build_tiny_sd3

    again = build_tiny_sd3(tmp_path / "again")
    for component in ("transformer", "vae", "text_encoder", "text_encoder_3"):
        (a,) = (tiny_dir("sd3") / component).glob("*.safetensors")
        (b,) = (again / component).glob("*.safetensors")
        first, second = load_file(a), load_file(b)
        assert first.keys() == second.keys()
        assert all(torch.equal(first[k], second[k]) for k in first), component
    index = json.loads((again / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline" and index["tokenizer_3"][1].startswith("T5Tokenizer")
    cached = build_tiny_sd3()
    assert build_tiny_sd3() == cached and (cached / "model_index.json").is_file()
