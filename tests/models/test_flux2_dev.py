"""The FLUX.2 [dev] adapter: the Mistral text embeddings are the pipeline's, the guidance scale goes into the guidance
embedding (no CFG), and a [klein] transformer is refused. Sampling against ``Flux2Pipeline``, the schedule and LoRA
reaching the [klein] targets (the same transformer class): test_families.py."""

from __future__ import annotations

import pytest
import torch

from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION

PROMPTS = ["a red cat", "a blue square on a wooden table"]


@pytest.fixture
def tiny_dev(tiny_dir):
    return tiny_dir("flux2")  # tests/conftest.py: built once per session


def load(path, **kwargs):
    from flowrl.models.flux2 import Flux2DevModel

    kwargs.setdefault("resolution", TINY_RESOLUTION)
    kwargs.setdefault("max_sequence_length", TINY_MAX_SEQUENCE_LENGTH)
    return Flux2DevModel.from_pretrained(path, **kwargs)


def test_shapes_text_and_no_cfg(tiny_dev):
    model = load(tiny_dev)
    assert type(model.pipeline).__name__ == "Flux2Pipeline" and model.family == "flux2"
    assert model.latent_shape == (128, 4, 4) and not model.uses_cfg and model.default_guidance == 4.0
    cond = model.encode_prompts(PROMPTS)
    assert cond["prompt_embeds"].shape == (2, TINY_MAX_SEQUENCE_LENGTH, 48)  # hidden states 10, 20, 30 stacked
    ref, _ = model.pipeline.encode_prompt(PROMPTS, max_sequence_length=model.max_sequence_length)
    torch.testing.assert_close(cond["prompt_embeds"], ref, rtol=1e-5, atol=1e-6)
    assert (cond["prompt_embeds"][0] - cond["prompt_embeds"][1]).abs().max() > 1e-3  # the prompt survived truncation
    # guidance-distilled: the scale changes the prediction through the embedding, never through CFG
    x, sigma = torch.randn(2, *model.latent_shape), torch.tensor(0.7)
    with torch.no_grad():
        v4, v1 = model.velocity_fn(4.0)(x, sigma, cond), model.velocity_fn(1.0)(x, sigma, cond)
    torch.testing.assert_close(v4, model.velocity(x, sigma, cond), rtol=0, atol=0)
    assert (v4 - v1).abs().max() > 1e-4


def test_a_klein_transformer_is_refused(tmp_path):
    """A [klein] transformer (no guidance embedding) in a Flux2Pipeline is refused, naming flux2_klein. (LoRA
    reaching the [klein] targets: test_families.py.)"""
    from diffusers import Flux2Pipeline

    from flowrl.models.flux2 import Flux2DevModel
    from flowrl.testing.tiny_flux2 import flux2_klein_components
    from flowrl.testing.tiny_flux2_dev import flux2_dev_components

    components = flux2_dev_components(tmp_path)
    components["transformer"] = flux2_klein_components(tmp_path)["transformer"]  # no guidance embedding
    with pytest.raises(ValueError, match="flux2_klein"):
        Flux2DevModel(Flux2Pipeline(**components), resolution=64)
