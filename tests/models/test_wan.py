"""The Wan adapter (Wan 2.1, and Wan 2.2 A14B's two experts): the cached prompt rows are the pipeline's zero-padded
UMT5 embeddings, Wan 2.2 routes each row to its expert, decode undoes the VAE's per-channel normalisation, the video
settings and bf16 weights. Sampling against ``WanPipeline`` (latents and frames, with CFG on the negative prompt and
without), the schedule and LoRA / reference / state: test_families.py."""

from __future__ import annotations

import pytest
import torch

from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION
from flowrl.testing.tiny_wan import TINY_WAN_NUM_FRAMES, WAN22_BOUNDARY_RATIO

PROMPTS = ["a red cat", "a blue square on a wooden table"]
NEGATIVE = "blurred, static"


@pytest.fixture
def tiny_wan(tiny_dir):
    return {kind: tiny_dir(kind) for kind in ("wan", "wan22")}  # tests/conftest.py: built once per session


def load(path, **kwargs):
    from flowrl.models.wan import WanModel

    kwargs.setdefault("resolution", TINY_RESOLUTION)
    kwargs.setdefault("num_frames", TINY_WAN_NUM_FRAMES)
    kwargs.setdefault("max_sequence_length", TINY_MAX_SEQUENCE_LENGTH)
    kwargs.setdefault("negative_prompt", NEGATIVE)
    return WanModel.from_pretrained(path, **kwargs)


def test_shapes_cond_and_decode(tiny_wan):
    model = load(tiny_wan["wan"])
    assert model.latent_shape == (16, 2, 8, 8) and model.uses_cfg and model.default_guidance == 5.0
    cond = model.encode_prompts(PROMPTS)
    assert cond["prompt_embeds"].shape == (2, TINY_MAX_SEQUENCE_LENGTH, 32)
    ref = model.pipeline._get_t5_prompt_embeds(PROMPTS, max_sequence_length=model.max_sequence_length)
    torch.testing.assert_close(cond["prompt_embeds"], ref, rtol=1e-5, atol=1e-6)
    assert cond["prompt_embeds"][0, -1].abs().max() == 0  # the pipeline's zero padding is kept
    x = torch.randn(2, *model.latent_shape)
    with torch.no_grad():
        frames = model.decode(x)
    assert frames.shape == (2, TINY_WAN_NUM_FRAMES, 3, 64, 64) and 0 <= frames.min() and frames.max() <= 1
    with pytest.raises(ValueError, match="num_frames - 1 divisible by 4"):
        load(tiny_wan["wan"], num_frames=4)


def test_wan22_routes_rows_to_their_expert(tiny_wan):
    """Rows at 1000 sigma >= 875 go to ``transformer``, the others to ``transformer_2``, in one mixed batch; the
    experts differ, so a wrong routing shows."""
    from flowrl.models.wan import WanExperts

    model = load(tiny_wan["wan22"])
    assert isinstance(model.denoiser, WanExperts) and model.boundary_ratio == WAN22_BOUNDARY_RATIO
    x = torch.randn(2, *model.latent_shape)
    cond = model.encode_prompts(PROMPTS)
    sigma = torch.tensor([0.9, 0.5])
    with torch.no_grad():
        mixed = model.velocity(x, sigma, cond)
        for i, expert in enumerate([model.pipeline.transformer, model.pipeline.transformer_2]):
            alone = expert(hidden_states=x[i:i + 1], timestep=1000 * sigma[i:i + 1],
                           encoder_hidden_states=cond["prompt_embeds"][i:i + 1], return_dict=False)[0]
            torch.testing.assert_close(mixed[i:i + 1], alone, rtol=0, atol=1e-6)
        other = model.pipeline.transformer(hidden_states=x[1:], timestep=1000 * sigma[1:],
                                           encoder_hidden_states=cond["prompt_embeds"][1:], return_dict=False)[0]
    assert (other - mixed[1:]).abs().max() > 1e-3


def test_unipc_flow_sigmas_are_the_shifted_linear_schedule(tiny_wan):
    from diffusers import UniPCMultistepScheduler

    model = load(tiny_wan["wan"])
    model.pipeline.scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                       flow_shift=5.0, num_train_timesteps=1000)
    s = torch.linspace(1, 0, 5)
    torch.testing.assert_close(model.sigmas(4), 5 * s / (1 + 4 * s), rtol=0, atol=1e-6)


def test_encode_images_inverts_the_normalisation(tiny_wan):
    model = load(tiny_wan["wan"])
    video = torch.rand(2, TINY_WAN_NUM_FRAMES, 3, 64, 64)
    z = model.encode_images(video)
    assert z.shape == (2, *model.latent_shape)
    vae = model.pipeline.vae
    raw = vae.encode(video.permute(0, 2, 1, 3, 4) * 2 - 1).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    torch.testing.assert_close(z, (raw - mean) / std, rtol=1e-5, atol=1e-5)
    still = model.encode_images(video[:, 0])  # an image: a still clip
    torch.testing.assert_close(still, model.encode_images(video[:, :1].expand_as(video)), rtol=0, atol=0)


def test_model_config_takes_video_settings_for_wan_only():
    from flowrl.config import ConfigError, from_dict
    from flowrl.models.config import ModelConfig

    cfg = from_dict(ModelConfig, {"name": "wan", "path": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "num_frames": 33,
                                  "negative_prompt": "static"})
    assert (cfg.num_frames, cfg.negative_prompt) == (33, "static")
    with pytest.raises(ConfigError, match="num_frames.*video-model setting"):
        from_dict(ModelConfig, {"name": "sd3", "path": "x", "num_frames": 5})


def test_footprint_of_the_published_wan_architectures():
    """Parameters of the real configs built on the meta device: Wan 2.1 1.3B (about 1.42B), Wan 2.2 A14B's two
    experts (about 14.3B each), UMT5-XXL's encoder (about 5.7B); LoRA counts both experts."""
    from flowrl.config import from_dict
    from flowrl.models.config import ModelConfig
    from flowrl.models.footprint import footprint

    small = footprint(from_dict(ModelConfig, {"name": "wan", "path": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
                                              "resolution": 512, "num_frames": 49, "max_sequence_length": 512}))
    assert small.source == "published config" and set(small.params) == {"transformer", "vae", "text_encoder (UMT5-XXL)"}
    assert 1.3e9 < small.params["transformer"] < 1.5e9 and 5.5e9 < small.params["text_encoder (UMT5-XXL)"] < 5.9e9
    assert small.trainable == small.params["transformer"]  # full fine-tuning
    assert small.tokens == 13 * 32 * 32 + 512 and small.layers == 30 and small.hidden == 1536
    lora = {"rank": 64, "alpha": 128}
    big = footprint(from_dict(ModelConfig, {"name": "wan", "path": "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "lora": lora}))
    assert big.params["transformer"] == big.params["transformer_2"] and 1.4e10 < big.params["transformer"] < 1.5e10
    one = footprint(from_dict(ModelConfig, {"name": "wan", "path": "Wan-AI/Wan2.1-T2V-14B-Diffusers", "lora": lora}))
    assert big.trainable == 2 * one.trainable > 0
    assert big.tokens == 21 * 30 * 52 + 226  # 81 frames at 480 x 832, the pipeline's text length


def test_bfloat16_weights_take_float32_latents(tiny_wan):
    """diffusers keeps Wan's time embedder and norms in float32 in a bf16 load: the adapter casts the latents to the
    input projection's dtype (bf16), not to the first parameter's, so a bf16 rollout runs (Wan 2.2: both experts)."""
    for kind in ("wan", "wan22"):
        model = load(tiny_wan[kind], dtype=torch.bfloat16)
        x = torch.randn(2, *model.latent_shape)
        with torch.no_grad():
            v = model.velocity_fn(5.0)(x, torch.tensor([0.95, 0.5]), model.encode_prompts(PROMPTS))
        assert v.dtype == torch.float32 and v.shape == x.shape and torch.isfinite(v).all()
