"""The FLUX.2 [dev] adapter reproduces ``Flux2Pipeline``: a flowrl Euler ODE rollout from the same noise equals the
pipeline's images (the guidance scale in the guidance embedding, no CFG), the Mistral text embeddings are the
pipeline's, the schedule is the pipeline's, and LoRA reaches the [klein] targets (the same transformer class)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from flowrl.config import LoraConfig

from flowrl.models.base import unwrap
from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION, build_tiny

ATOL = 1e-5
PROMPTS = ["a red cat", "a blue square on a wooden table"]


@pytest.fixture(scope="module")
def tiny_dev(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return build_tiny("flux2", tmp_path_factory.mktemp("tiny") / "flux2")
    finally:
        torch.set_num_threads(threads)


def load(path, **kwargs):
    from flowrl.models.flux2 import Flux2DevModel

    kwargs.setdefault("resolution", TINY_RESOLUTION)
    kwargs.setdefault("max_sequence_length", TINY_MAX_SEQUENCE_LENGTH)
    return Flux2DevModel.from_pretrained(path, **kwargs)


def _euler(velocity_fn, x, sigmas, cond):
    for i in range(len(sigmas) - 1):
        x = x + (sigmas[i + 1] - sigmas[i]) * velocity_fn(x, sigmas[i], cond)
    return x


def _pipeline_images(model, x_t, steps, guidance):
    with torch.no_grad():
        return model.pipeline(prompt=list(PROMPTS), latents=x_t.clone(), guidance_scale=guidance,
                              num_inference_steps=steps, height=TINY_RESOLUTION, width=TINY_RESOLUTION,
                              max_sequence_length=model.max_sequence_length, output_type="pt").images


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


@pytest.mark.parametrize("steps,guidance", [(1, 4.0), (3, 4.0), (3, 2.5)])
def test_sampling_matches_the_pipeline(tiny_dev, steps, guidance):
    model = load(tiny_dev)
    x_t = torch.randn(2, *model.latent_shape)
    with torch.no_grad():
        ours = _euler(model.velocity_fn(guidance), x_t, model.sigmas(steps), model.encode_prompts(PROMPTS))
        torch.testing.assert_close(model.decode(ours), _pipeline_images(model, x_t, steps, guidance), rtol=0,
                                   atol=ATOL)


def test_sigmas_equal_the_pipeline_schedule(tiny_dev):
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    for steps, resolution in [(4, 64), (50, 128)]:
        model = load(tiny_dev, resolution=resolution)
        scheduler = copy.deepcopy(model.pipeline.scheduler)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps),
                                mu=compute_empirical_mu((resolution // 16) ** 2, steps))
        torch.testing.assert_close(model.sigmas(steps), scheduler.sigmas, rtol=0, atol=1e-6)


def test_lora_targets_and_a_klein_transformer_is_refused(tiny_dev, tmp_path):
    from diffusers import Flux2Pipeline

    from flowrl.models.flux2 import Flux2DevModel
    from flowrl.testing.tiny_flux2 import flux2_klein_components
    from flowrl.testing.tiny_flux2_dev import flux2_dev_components

    model = load(tiny_dev, lora=LoraConfig(rank=4, alpha=8))
    adapted = [n for n, _ in unwrap(model.denoiser).named_modules() if n.endswith(".lora_A")]
    for target in model.default_lora_targets():
        assert any(n.removesuffix(".lora_A").endswith("." + target) for n in adapted), target
    components = flux2_dev_components(tmp_path)
    components["transformer"] = flux2_klein_components(tmp_path)["transformer"]  # no guidance embedding
    with pytest.raises(ValueError, match="flux2_klein"):
        Flux2DevModel(Flux2Pipeline(**components), resolution=64)
