"""The Qwen-Image-Edit adapter reproduces ``QwenImageEditPipeline`` for a source of another size (sampling from the
same sources, with true CFG on the negative prompt, which sees the source too, and without, and LoRA:
test_families.py); the cached rows equal the pipeline's
``encode_prompt`` with the image; the source changes the prediction through both the text encoder and the latents;
the prompt cache keys on prompt and source; a prompt without its source, or too long, is refused in one line.

The pipeline sizes the source to a 1024 x 1024 area (``calculate_dimensions(1024 * 1024, ratio)``); flowrl
conditions at the model's resolution, so the pipeline here runs with that area set to the tiny model's 64 x 64
(at the default 1024 px the two are the same)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION

ATOL = 1e-5
PROMPTS = ["make the cat blue", "turn the small square on the wooden table red"]  # different lengths: the mask


@pytest.fixture
def tiny_edit(tiny_dir):
    return tiny_dir("qwen_image_edit")  # tests/conftest.py: built once per session


@pytest.fixture(autouse=True)
def _one_thread_at_the_model_area(monkeypatch):
    """One thread; the pipeline's source area is the tiny model's (64 x 64) instead of 1024 x 1024."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit

    original = edit.calculate_dimensions
    monkeypatch.setattr(edit, "calculate_dimensions", lambda area, ratio: original(TINY_RESOLUTION ** 2, ratio))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load(path, **kwargs):
    from flowrl.models.qwen_image_edit import QwenImageEditModel

    kwargs.setdefault("resolution", TINY_RESOLUTION)
    kwargs.setdefault("max_sequence_length", TINY_MAX_SEQUENCE_LENGTH)
    return QwenImageEditModel.from_pretrained(path, **kwargs)


def sources(seed=0, n=2, size=TINY_RESOLUTION):
    """``n`` random 8-bit RGB sources: (PIL images for the pipeline, ``[3, H, W]`` tensors in [0, 1] for flowrl)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)
    return ([Image.fromarray(p) for p in pixels],
            [torch.from_numpy(p.astype(np.float32) / 255.0).permute(2, 0, 1) for p in pixels])


def rows(images):
    return [{"source_image": image} for image in images]


def _euler(velocity_fn, x, sigmas, cond):
    for i in range(len(sigmas) - 1):
        x = x + (sigmas[i + 1] - sigmas[i]) * velocity_fn(x, sigmas[i], cond)
    return x


def _pipeline(model, x_t, image, prompts, steps, guidance, output_type):
    """QwenImageEditPipeline from the same [B, C, H, W] noise; latents come back unpacked to [B, C, H, W]."""
    from diffusers import QwenImageEditPipeline

    b, c, h, w = x_t.shape
    packed = QwenImageEditPipeline._pack_latents(x_t.clone(), b, c, h, w)
    negative = [model.negative_prompt] * b if guidance != 1.0 else None
    with torch.no_grad():
        out = model.pipeline(image=image, prompt=prompts, negative_prompt=negative, true_cfg_scale=guidance,
                             latents=packed, num_inference_steps=steps, height=TINY_RESOLUTION, width=TINY_RESOLUTION,
                             output_type=output_type).images
    if output_type == "latent":
        return QwenImageEditPipeline._unpack_latents(out, TINY_RESOLUTION, TINY_RESOLUTION,
                                                     model.vae_scale_factor)[:, :, 0]
    return out


def test_a_source_of_another_size_is_resized_as_the_pipeline_does(tiny_edit):
    """A 48 px source: flowrl resizes it to the model's 64 px as the pipeline does (its image processor's
    Lanczos), for the text encoder and the VAE alike."""
    model = load(tiny_edit)
    x_t = torch.randn(1, *model.latent_shape, generator=torch.Generator().manual_seed(7))
    pil, tensors = sources(7, n=1, size=48)
    with torch.no_grad():
        cond = model.encode_prompts(PROMPTS[:1], rows(tensors))
        ours = _euler(model.velocity_fn(4.0), x_t, model.sigmas(2), cond)
        theirs = _pipeline(model, x_t, pil[0], PROMPTS[:1], 2, 4.0, "latent")  # one PIL image: the pipeline resizes
    torch.testing.assert_close(ours, theirs, rtol=0, atol=ATOL)
    assert cond["image_latents"].shape == (1, 16, 8, 8)


def test_the_cond_is_the_pipelines_encoding_of_prompt_and_source(tiny_edit):
    model = load(tiny_edit)
    pil, tensors = sources(1)
    cond = model.encode_prompts(PROMPTS, rows(tensors))
    # 16 vision tokens (a 64 px source is bounded to 32 x 32 px: 8 x 8 patches of 4, merged 2 x 2) + 16 text tokens
    assert model._source_tokens == 16
    assert cond["prompt_embeds"].shape == cond["negative_prompt_embeds"].shape == (2, 16 + TINY_MAX_SEQUENCE_LENGTH, 32)
    assert cond["image_latents"].shape == (2, 16, 8, 8)
    ref, mask = model.pipeline.encode_prompt(PROMPTS, image=pil)
    length = ref.shape[1]
    torch.testing.assert_close(cond["prompt_embeds"][:, :length], ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(cond["prompt_embeds_mask"][:, :length], mask.long())
    lengths = cond["prompt_embeds_mask"].sum(1).tolist()
    # the kept sequence: vision start, 16 vision tokens, vision end, the instruction, the template's 5 closing tokens
    # (the second prompt fills the 16 text tokens exactly)
    assert lengths == [18 + 4 + 5, 18 + 9 + 5] and length == lengths[1]
    assert cond["prompt_embeds"][0, lengths[0]:].abs().max() == 0  # zero padding, masked
    neg_ref, _ = model.pipeline.encode_prompt([" "] * 2, image=pil)
    torch.testing.assert_close(cond["negative_prompt_embeds"][:, : neg_ref.shape[1]], neg_ref, rtol=1e-5, atol=1e-6)
    assert cond["negative_prompt_embeds_mask"].sum(1).tolist() == [18 + 5] * 2
    latents = model.pipeline._encode_vae_image(model.pipeline.image_processor.preprocess(pil, 64, 64).unsqueeze(2),
                                               generator=None)[:, :, 0]
    torch.testing.assert_close(cond["image_latents"], latents, rtol=1e-5, atol=1e-6)
    # the source reaches the transformer through the text (vision tokens) and beside the latent (its tokens)
    other = model.encode_prompts(PROMPTS, rows(sources(2)[1]))
    assert (other["prompt_embeds"] - cond["prompt_embeds"]).abs().max() > 1e-3
    assert (other["negative_prompt_embeds"] - cond["negative_prompt_embeds"]).abs().max() > 1e-3
    x, sigma = torch.randn(2, *model.latent_shape), torch.tensor(0.7)
    swapped_latents = {**cond, "image_latents": other["image_latents"]}
    swapped_text = {**other, "image_latents": cond["image_latents"]}
    for changed in (swapped_latents, swapped_text):
        assert (model.velocity(x, sigma, changed) - model.velocity(x, sigma, cond)).abs().max() > 1e-4


def test_the_cache_keys_on_prompt_and_source_and_bad_input_is_refused(tiny_edit):
    model = load(tiny_edit)
    _, a = sources(1)
    _, b = sources(2)
    first = model.encode_prompts(PROMPTS, rows(a))
    model.encode_prompts(PROMPTS, rows(b))
    assert len(model._prompt_cache) == 4  # same prompts, other sources: new rows
    again = model.encode_prompts(PROMPTS, rows([s.clone() for s in a]))  # equal content: a cache hit
    assert len(model._prompt_cache) == 4
    torch.testing.assert_close(again["prompt_embeds"], first["prompt_embeds"], rtol=0, atol=0)
    with pytest.raises(ValueError, match="prompt 0: QwenImageEditModel edits a source image and got no source_image"):
        model.encode_prompts(PROMPTS)
    with pytest.raises(ValueError, match="unconditional branch is the negative prompt on each row's own source"):
        model.uncond(1)
    with pytest.raises(ValueError, match="encodes to 23 text tokens beside the source image's 16, more than "
                                         "max_sequence_length 16; shorten the instruction or raise"):
        model.encode_prompts(["make the cat on the mat next to the small bowl of soup blue and big"], rows(a[:1]))
