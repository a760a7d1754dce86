"""The Wan adapter reproduces ``WanPipeline`` (Wan 2.1, and Wan 2.2 A14B's two experts): a flowrl Euler ODE rollout
from the same video noise equals the pipeline's latents and ``output_type="pt"`` frames (with CFG on the negative
prompt and without), the schedule equals the scheduler's, the cached prompt rows are the pipeline's zero-padded UMT5
embeddings, decode undoes the VAE's per-channel normalisation, and LoRA / reference / state behave as for the image
families."""

from __future__ import annotations

import copy

import pytest
import torch

from flowrl.config import LoraConfig

from flowrl.models.base import unwrap
from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION, build_tiny
from flowrl.testing.tiny_wan import TINY_WAN_NUM_FRAMES, WAN22_BOUNDARY_RATIO

ATOL = 1e-5
PROMPTS = ["a red cat", "a blue square on a wooden table"]
NEGATIVE = "blurred, static"


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {kind: build_tiny(kind, root / kind) for kind in ("wan", "wan22")}
    finally:
        torch.set_num_threads(threads)


def load(path, **kwargs):
    from flowrl.models.wan import WanModel

    kwargs.setdefault("resolution", TINY_RESOLUTION)
    kwargs.setdefault("num_frames", TINY_WAN_NUM_FRAMES)
    kwargs.setdefault("max_sequence_length", TINY_MAX_SEQUENCE_LENGTH)
    kwargs.setdefault("negative_prompt", NEGATIVE)
    return WanModel.from_pretrained(path, **kwargs)


def _euler(velocity_fn, x, sigmas, cond):
    for i in range(len(sigmas) - 1):
        x = x + (sigmas[i + 1] - sigmas[i]) * velocity_fn(x, sigmas[i], cond)
    return x


def _pipeline(model, x_t, steps, guidance, output_type):
    with torch.no_grad():
        return model.pipeline(PROMPTS, negative_prompt=[model.negative_prompt] * len(PROMPTS), latents=x_t.clone(),
                              guidance_scale=guidance, num_inference_steps=steps, height=TINY_RESOLUTION,
                              width=TINY_RESOLUTION, num_frames=model.num_frames,
                              max_sequence_length=model.max_sequence_length, output_type=output_type).frames


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


@pytest.mark.parametrize("kind,steps,guidance", [("wan", 2, 5.0), ("wan", 3, 1.0), ("wan22", 4, 4.0)])
def test_sampling_matches_the_pipeline(tiny_wan, kind, steps, guidance):
    """Euler with velocity_fn(guidance) and sigmas(n) from the same noise == WanPipeline, latents and frames."""
    model = load(tiny_wan[kind])
    x_t = torch.randn(2, *model.latent_shape)
    with torch.no_grad():
        ours = _euler(model.velocity_fn(guidance), x_t, model.sigmas(steps), model.encode_prompts(PROMPTS))
        torch.testing.assert_close(ours, _pipeline(model, x_t, steps, guidance, "latent"), rtol=0, atol=ATOL)
        torch.testing.assert_close(model.decode(ours), _pipeline(model, x_t, steps, guidance, "pt"), rtol=0,
                                   atol=ATOL)


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


@pytest.mark.parametrize("steps", [1, 8, 50])
def test_sigmas_equal_the_scheduler(tiny_wan, steps):
    model = load(tiny_wan["wan"])
    scheduler = copy.deepcopy(model.pipeline.scheduler)
    assert scheduler.config.shift == 3.0
    scheduler.set_timesteps(steps)  # as WanPipeline calls it
    torch.testing.assert_close(model.sigmas(steps), scheduler.sigmas, rtol=0, atol=1e-6)


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


@pytest.mark.parametrize("kind", ["wan", "wan22"])
def test_lora_reference_and_state_round_trip(tiny_wan, kind):
    model = load(tiny_wan[kind], lora=LoraConfig(rank=4, alpha=8))
    module = unwrap(model.denoiser)
    adapted = [n for n, _ in module.named_modules() if n.endswith(".lora_A")]
    for target in model.default_lora_targets():
        assert any(n.removesuffix(".lora_A").endswith("." + target) for n in adapted), target
    if kind == "wan22":
        assert any(n.startswith("high.") for n in adapted) and any(n.startswith("low.") for n in adapted)
    assert all(p.dtype == torch.float32 and "lora_" in n for n, p in module.named_parameters() if p.requires_grad)
    x, cond = torch.randn(2, *model.latent_shape), model.encode_prompts(PROMPTS)
    sigma = torch.tensor([0.95, 0.3])  # both experts of Wan 2.2
    with model.reference():
        base = model.velocity(x, sigma, cond)
    torch.testing.assert_close(model.velocity(x, sigma, cond), base, rtol=0, atol=0)  # lora_B = 0 at init
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.add_(0.5 * torch.randn_like(p))
    model.train()
    policy = model.velocity_fn(4.0)(x, sigma, cond)
    policy.pow(2).mean().backward()
    assert all(p.grad is not None for p in model.trainable_parameters())
    policy = policy.detach()
    with torch.no_grad():
        assert (model.velocity(x, sigma, cond) - base).abs().amax(dim=(1, 2, 3, 4)).min() > 1e-4  # every row
        with model.reference():
            torch.testing.assert_close(model.velocity(x, sigma, cond), base, rtol=0, atol=0)
        state = model.trainable_state_dict()
        for p in model.trainable_parameters():
            p.zero_()
        model.load_trainable_state_dict(state)
        torch.testing.assert_close(model.velocity_fn(4.0)(x, sigma, cond), policy, rtol=0, atol=0)


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
