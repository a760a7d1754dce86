"""The FLUX.2 [klein] adapter: the latent space is the transformer's (patchified, batch-norm normalised), the distilled
model samples as ``Flux2KleinPipeline`` does without CFG, and the published architectures' footprint. Sampling the
base model (with CFG) against the pipeline, the schedule (empirical mu) and LoRA: test_families.py."""

from __future__ import annotations

import pytest
import torch

from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION

ATOL = 1e-5
PROMPTS = ["a red cat", "a blue square on a wooden table"]


@pytest.fixture
def tiny_klein(tiny_dir):
    return tiny_dir("flux2_klein")  # tests/conftest.py: built once per session


def load(path, **kwargs):
    from flowrl.models.flux2 import Flux2KleinModel

    kwargs.setdefault("resolution", TINY_RESOLUTION)
    kwargs.setdefault("max_sequence_length", TINY_MAX_SEQUENCE_LENGTH)
    return Flux2KleinModel.from_pretrained(path, **kwargs)


def _euler(velocity_fn, x, sigmas, cond):
    for i in range(len(sigmas) - 1):
        x = x + (sigmas[i + 1] - sigmas[i]) * velocity_fn(x, sigmas[i], cond)
    return x


def _pipeline_images(model, x_t, steps, guidance):
    with torch.no_grad():
        return model.pipeline(prompt=list(PROMPTS), latents=x_t.clone(), guidance_scale=guidance,
                              num_inference_steps=steps, height=TINY_RESOLUTION, width=TINY_RESOLUTION,
                              max_sequence_length=model.max_sequence_length, output_type="pt").images


def test_shapes_and_latent_space(tiny_klein):
    model = load(tiny_klein)
    assert model.latent_shape == (128, 4, 4) and model.uses_cfg and model.default_guidance == 4.0
    cond = model.encode_prompts(PROMPTS)
    assert cond["prompt_embeds"].shape == (2, TINY_MAX_SEQUENCE_LENGTH, 48)  # hidden states 9, 18, 27 stacked
    ref, _ = model.pipeline.encode_prompt(PROMPTS, max_sequence_length=model.max_sequence_length)
    torch.testing.assert_close(cond["prompt_embeds"], ref, rtol=1e-5, atol=1e-6)
    images = torch.rand(2, 3, 64, 64)
    z = model.encode_images(images)
    assert z.shape == (2, 128, 4, 4)
    vae = model.pipeline.vae
    raw = vae.encode(images * 2 - 1).latent_dist.mode()
    mean, std = vae.bn.running_mean.view(1, -1, 1, 1), (vae.bn.running_var.view(1, -1, 1, 1) + 1e-4).sqrt()
    torch.testing.assert_close(z, (type(model.pipeline)._patchify_latents(raw) - mean) / std, rtol=1e-5, atol=1e-5)
    out = model.decode(z)
    assert out.shape == (2, 3, 64, 64) and 0 <= out.min() and out.max() <= 1


def test_distilled_klein_has_no_cfg(tiny_klein, tmp_path):
    from diffusers import Flux2KleinPipeline

    from flowrl.models.flux2 import Flux2KleinModel
    from flowrl.testing.tiny_flux2 import flux2_klein_components

    model = Flux2KleinModel(Flux2KleinPipeline(**flux2_klein_components(tmp_path, distilled=True)),
                            resolution=64, max_sequence_length=TINY_MAX_SEQUENCE_LENGTH)
    assert not model.uses_cfg and model.default_guidance == 1.0 and model.velocity_fn(4.0) == model.velocity
    x_t = torch.randn(2, *model.latent_shape)
    with torch.no_grad():
        ours = _euler(model.velocity_fn(), x_t, model.sigmas(4), model.encode_prompts(PROMPTS))
        torch.testing.assert_close(model.decode(ours), _pipeline_images(model, x_t, 4, 4.0), rtol=0, atol=ATOL)


def test_footprint_of_the_published_klein_architectures():
    """FLUX.2 [klein]'s published transformers on the meta device: 4B (about 3.9B parameters, Qwen3-4B's 4.0B text
    encoder) and 9B (about 9.1B, Qwen3-8B's 8.2B); the base checkpoints share the distilled ones' architectures, and
    the token count is the 1/16 latent grid plus the text."""
    from flowrl.config import from_dict
    from flowrl.models.config import ModelConfig
    from flowrl.models.footprint import footprint

    def of(path, **extra):
        return footprint(from_dict(ModelConfig, {"name": "flux2_klein", "path": path, **extra}))

    small = of("black-forest-labs/FLUX.2-klein-base-4B", resolution=512, max_sequence_length=512)
    assert small.source == "published config" and set(small.params) == {"transformer", "vae", "text_encoder (Qwen3)"}
    assert 3.7e9 < small.params["transformer"] < 4.1e9 and 3.9e9 < small.params["text_encoder (Qwen3)"] < 4.1e9
    assert small.trainable == small.params["transformer"]  # full fine-tuning
    assert small.layers == 5 + 20 and small.hidden == 24 * 128 and small.tokens == (512 // 16) ** 2 + 512
    assert of("black-forest-labs/FLUX.2-klein-4B").params == of("black-forest-labs/FLUX.2-klein-base-4B").params
    big = of("black-forest-labs/FLUX.2-klein-9B", lora={"rank": 64, "alpha": 128})
    assert 8.8e9 < big.params["transformer"] < 9.4e9 and 8.0e9 < big.params["text_encoder (Qwen3)"] < 8.4e9
    assert big.layers == 8 + 24 and big.hidden == 32 * 128 and 0 < big.trainable < big.params["transformer"] / 20
