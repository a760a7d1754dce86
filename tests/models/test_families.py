"""Every model family's adapter against its diffusers pipeline, from one skeleton parametrised over the families:

* sampling: a flowrl Euler ODE rollout (``velocity_fn(guidance)``, ``sigmas(n)``) from the pipeline's noise equals the
  pipeline's own loop, its latents and / or its decoded images (frames for Wan), with each family's guidance
  convention (CFG, a guidance embedding, Z-Image's w = guidance_scale + 1, Qwen-Image's norm-rescaled true CFG) and,
  for the editing families, the same source images;
* the sigma schedule equals the scheduler's as the pipeline sets it (static or dynamic shift, empirical mu);
* LoRA: every default target is adapted, only the float32 LoRA weights train, ``model.reference()`` is the base,
  gradients reach the trainable parameters and the trainable state round-trips.

Each family is a :class:`Family` (its tiny pipeline from tests/conftest.py's ``tiny_dir``, its cases, its pipeline
call); what only one family has stays in its own file (test_z_image.py, test_flux2.py, ...; SD3 / FLUX:
test_conventions.py, test_adapters.py)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from flowrl.config import LoraConfig
from flowrl.models.base import ModelLoadError, unwrap
from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION

ATOL = 1e-5
PROMPTS = ["a red cat", "a blue square on a wooden table"]  # different lengths: the masks matter


def euler(velocity_fn, x, sigmas, cond):
    """flowrl's Euler ODE: x_{i+1} = x_i + (sigma_{i+1} - sigma_i) v(x_i, sigma_i)."""
    for i in range(len(sigmas) - 1):
        x = x + (sigmas[i + 1] - sigmas[i]) * velocity_fn(x, sigmas[i], cond)
    return x


def linear_sigmas(steps):
    """The sigmas the FLUX-like pipelines pass to ``set_timesteps``."""
    return np.linspace(1.0, 1 / steps, steps)


class Family:
    """One family: how to load its tiny adapter, its test cases, and how its diffusers pipeline samples."""

    kind: str  #: the tiny pipeline (tests/conftest.py's ``tiny_dir``)
    prompts = PROMPTS
    #: ``(steps, guidance)`` of the sampling test; guidance in flowrl's units
    sampling: list[tuple[int, float]] = []
    #: ``(steps, resolution)`` of the schedule test; empty: the family has none
    schedules: list[tuple[int, int]] = []
    #: what the sampling test compares: the pipeline's ``"latent"`` output and / or its decoded ``"pt"`` images
    outputs = ("latent", "pt")
    exact_sigmas = False  #: the schedule is bit-equal to the scheduler's (else within 1e-6)
    every_lora_parameter_gets_a_gradient = True
    lora_guidance = 4.0  #: the guided prediction of the LoRA test

    def model_class(self):
        raise NotImplementedError

    def load(self, path, **kwargs):
        kwargs.setdefault("resolution", TINY_RESOLUTION)
        kwargs.setdefault("max_sequence_length", TINY_MAX_SEQUENCE_LENGTH)
        return self.model_class().from_pretrained(path, **kwargs)

    def setup(self, monkeypatch):
        """Before each test of the family."""

    def check(self, model):
        """The family's own assertions on a freshly loaded adapter (in the sampling test)."""

    def inputs(self, model, steps):
        """``(x_t, cond, source)``: the noise, flowrl's cond and what the pipeline takes as the source image(s)."""
        x_t = torch.randn(2, *model.latent_shape)
        return x_t, model.encode_prompts(self.prompts), None

    def pipeline(self, model, x_t, steps, guidance, output_type, source):
        """The pipeline's output from the same noise: latents as ``[B, *latent_shape]`` or images in [0, 1]."""
        raise NotImplementedError

    def scheduler_sigmas(self, model, steps, resolution):
        """The scheduler's sigmas as the pipeline sets them (asserting the scheduler's config on the way)."""
        raise NotImplementedError

    def check_sigmas(self, model, steps):
        """Anything else the family's schedule must hold."""

    def lora_inputs(self, model):
        x, sigma = torch.randn(2, *model.latent_shape), torch.tensor(0.5)
        return x, sigma, model.encode_prompts(self.prompts)

    def check_adapted(self, adapted):
        """The family's own assertions on the names of the LoRA-adapted modules."""


class SD3(Family):
    kind = "sd3"
    prompts = ["a red cat", "a blue square"]
    sampling = [(1, 4.5), (3, 4.5), (3, 1.0)]
    schedules = [(1, 64), (4, 64), (10, 64), (40, 64)]
    exact_sigmas = True

    def model_class(self):
        from flowrl.models.sd3 import SD3Model

        return SD3Model

    def pipeline(self, model, x_t, steps, guidance, output_type, source):
        with torch.no_grad():
            return model.pipeline(self.prompts, num_inference_steps=steps, guidance_scale=guidance,
                                  latents=x_t.clone(), height=64, width=64,
                                  max_sequence_length=model.max_sequence_length, output_type=output_type).images

    def scheduler_sigmas(self, model, steps, resolution):
        scheduler = copy.deepcopy(model.pipeline.scheduler)
        scheduler.set_timesteps(steps)  # as StableDiffusion3Pipeline calls it (no dynamic shifting)
        assert model.pipeline.scheduler.config.shift == 3.0
        return scheduler.sigmas

    def lora_inputs(self, model):  # three rows, two prompts: the prompt cache in the batch
        x = torch.randn(3, *model.latent_shape, generator=torch.Generator().manual_seed(1))
        return x, torch.tensor(0.7), model.encode_prompts(["a red cat", "a blue square", "a red cat"])


class Flux(SD3):
    kind = "flux"
    sampling = [(1, 3.5), (3, 3.5), (3, 6.0)]
    schedules = [(1, 64), (4, 64), (28, 64), (10, 128)]
    outputs = ("latent",)
    lora_guidance = 3.5

    def model_class(self):
        from flowrl.models.flux import FluxModel

        return FluxModel

    def pipeline(self, model, x_t, steps, guidance, output_type, source):
        """FluxPipeline's denoising loop from the same [B, C, H, W] noise, unpacked back to [B, C, H, W]."""
        from diffusers import FluxPipeline

        b, c, h, w = x_t.shape
        packed = FluxPipeline._pack_latents(x_t.clone(), b, c, h, w)
        with torch.no_grad():
            out = model.pipeline(self.prompts, num_inference_steps=steps, guidance_scale=guidance, latents=packed,
                                 height=64, width=64, max_sequence_length=model.max_sequence_length,
                                 output_type="latent").images
        return FluxPipeline._unpack_latents(out, 64, 64, model.vae_scale_factor)

    def scheduler_sigmas(self, model, steps, resolution):
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = model.pipeline.scheduler.config
        assert config.use_dynamic_shifting
        image_seq_len = (resolution // 16) ** 2  # packed 2x2 tokens of the latent
        mu = calculate_shift(image_seq_len, config.base_image_seq_len, config.max_image_seq_len, config.base_shift,
                             config.max_shift)
        scheduler = copy.deepcopy(model.pipeline.scheduler)
        scheduler.set_timesteps(sigmas=linear_sigmas(steps), mu=mu)  # as FluxPipeline calls it
        return scheduler.sigmas


class ZImage(Family):
    """CFG in flowrl's units: w = the pipeline's guidance_scale + 1 (w = 1: no CFG, Turbo)."""

    kind = "z_image"
    sampling = [(1, 1.0), (3, 1.0), (3, 6.0)]
    schedules = [(1, 64), (8, 64), (50, 64)]
    lora_guidance = 6.0

    def model_class(self):
        from flowrl.models.z_image import ZImageModel

        return ZImageModel

    def pipeline(self, model, x_t, steps, guidance, output_type, source):
        with torch.no_grad():
            # a copy: ZImagePipeline writes the chat-templated text back into the caller's prompt list
            return model.pipeline(list(self.prompts), latents=x_t.clone(), guidance_scale=guidance - 1.0,
                                  num_inference_steps=steps, height=TINY_RESOLUTION, width=TINY_RESOLUTION,
                                  max_sequence_length=model.max_sequence_length, output_type=output_type).images

    def scheduler_sigmas(self, model, steps, resolution):
        scheduler = copy.deepcopy(model.pipeline.scheduler)
        assert scheduler.config.shift == 3.0 and not scheduler.config.use_dynamic_shifting
        scheduler.set_timesteps(sigmas=linear_sigmas(steps), mu=None)
        return scheduler.sigmas

    def check_adapted(self, adapted):
        assert any(n.startswith("noise_refiner") for n in adapted) and any(n.startswith("context_refiner")
                                                                           for n in adapted)


class Flux2Klein(Family):
    """FLUX.2 [klein] (the base model, with CFG; the distilled one: test_flux2.py): images compared."""

    kind = "flux2_klein"
    sampling = [(1, 4.0), (3, 4.0), (3, 1.0)]
    schedules = [(4, 64), (28, 64), (50, 128)]
    outputs = ("pt",)

    def model_class(self):
        from flowrl.models.flux2 import Flux2KleinModel

        return Flux2KleinModel

    def pipeline(self, model, x_t, steps, guidance, output_type, source):
        with torch.no_grad():
            return model.pipeline(prompt=list(self.prompts), latents=x_t.clone(), guidance_scale=guidance,
                                  num_inference_steps=steps, height=TINY_RESOLUTION, width=TINY_RESOLUTION,
                                  max_sequence_length=model.max_sequence_length, output_type=output_type).images

    def empirical_mu(self, image_seq_len, steps):
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        return compute_empirical_mu(image_seq_len, steps)

    def scheduler_sigmas(self, model, steps, resolution):
        scheduler = copy.deepcopy(model.pipeline.scheduler)
        scheduler.set_timesteps(sigmas=linear_sigmas(steps), mu=self.empirical_mu((resolution // 16) ** 2, steps))
        return scheduler.sigmas


class Flux2Dev(Flux2Klein):
    """FLUX.2 [dev]: the guidance scale goes into the guidance embedding, no CFG."""

    kind = "flux2"
    sampling = [(1, 4.0), (3, 4.0), (3, 2.5)]
    schedules = [(4, 64), (50, 128)]

    def model_class(self):
        from flowrl.models.flux2 import Flux2DevModel

        return Flux2DevModel

    def empirical_mu(self, image_seq_len, steps):
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        return compute_empirical_mu(image_seq_len, steps)


class QwenImage(Family):
    """True CFG on the negative prompt with the pipeline's norm rescaling when guidance > 1."""

    kind = "qwen_image"
    sampling = [(2, 4.0), (3, 4.0), (3, 1.0)]
    schedules = [(2, 64), (10, 64), (50, 128)]
    # the last block's text-stream outputs are discarded, so its txt_mlp gets no gradient
    every_lora_parameter_gets_a_gradient = False

    def model_class(self):
        from flowrl.models.qwen_image import QwenImageModel

        return QwenImageModel

    def pipeline(self, model, x_t, steps, guidance, output_type, source):
        """QwenImagePipeline from the same [B, C, H, W] noise; latents come back unpacked to [B, C, H, W]."""
        from diffusers import QwenImagePipeline

        b, c, h, w = x_t.shape
        packed = QwenImagePipeline._pack_latents(x_t.clone(), b, c, h, w)
        negative = [model.negative_prompt] * b if guidance != 1.0 else None
        with torch.no_grad():
            out = model.pipeline(self.prompts, negative_prompt=negative, true_cfg_scale=guidance, latents=packed,
                                 num_inference_steps=steps, height=TINY_RESOLUTION, width=TINY_RESOLUTION,
                                 max_sequence_length=model.max_sequence_length, output_type=output_type).images
        if output_type == "latent":
            return QwenImagePipeline._unpack_latents(out, TINY_RESOLUTION, TINY_RESOLUTION,
                                                     model.vae_scale_factor)[:, :, 0]
        return out

    def scheduler_sigmas(self, model, steps, resolution):
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        config = model.pipeline.scheduler.config
        assert config.use_dynamic_shifting and config.shift_terminal == 0.02
        mu = calculate_shift((resolution // 16) ** 2, config.base_image_seq_len, config.max_image_seq_len,
                             config.base_shift, config.max_shift)
        scheduler = copy.deepcopy(model.pipeline.scheduler)
        scheduler.set_timesteps(sigmas=linear_sigmas(steps), mu=mu)  # as QwenImagePipeline calls it
        return scheduler.sigmas

    def check_sigmas(self, model, steps):
        assert abs(float(model.sigmas(steps)[-2]) - 0.02) < 1e-6  # the terminal sigma


class QwenImageEdit(QwenImage):
    """The same sources for both (each row's negative prompt with its own source, the norm-rescaled true CFG). The
    pipeline sizes the source to a 1024 x 1024 area; flowrl conditions at the model's resolution, so the pipeline
    runs with that area set to the tiny model's 64 x 64 (see test_qwen_image_edit.py)."""

    kind = "qwen_image_edit"
    prompts = ["make the cat blue", "turn the small square on the wooden table red"]  # different lengths: the mask
    sampling = [(2, 4.0), (3, 1.0)]
    schedules = []
    every_lora_parameter_gets_a_gradient = False

    def model_class(self):
        from flowrl.models.qwen_image_edit import QwenImageEditModel

        return QwenImageEditModel

    def setup(self, monkeypatch):
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit

        original = edit.calculate_dimensions
        monkeypatch.setattr(edit, "calculate_dimensions", lambda area, ratio: original(TINY_RESOLUTION ** 2, ratio))

    def check(self, model):
        assert model.conditions_on_source and model.uses_cfg and model.default_guidance == 4.0
        assert model.latent_shape == (16, 8, 8)

    @staticmethod
    def sources(seed=0, n=2, size=TINY_RESOLUTION):
        """``n`` random 8-bit RGB sources: (PIL images for the pipeline, ``[3, H, W]`` tensors in [0, 1])."""
        from PIL import Image

        pixels = np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)
        return ([Image.fromarray(p) for p in pixels],
                [torch.from_numpy(p.astype(np.float32) / 255.0).permute(2, 0, 1) for p in pixels])

    def inputs(self, model, steps):
        x_t = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(steps))
        pil, tensors = self.sources(steps)
        return x_t, model.encode_prompts(self.prompts, [{"source_image": s} for s in tensors]), pil

    def pipeline(self, model, x_t, steps, guidance, output_type, source):
        from diffusers import QwenImageEditPipeline

        b, c, h, w = x_t.shape
        packed = QwenImageEditPipeline._pack_latents(x_t.clone(), b, c, h, w)
        negative = [model.negative_prompt] * b if guidance != 1.0 else None
        with torch.no_grad():
            out = model.pipeline(image=source, prompt=self.prompts, negative_prompt=negative,
                                 true_cfg_scale=guidance, latents=packed, num_inference_steps=steps,
                                 height=TINY_RESOLUTION, width=TINY_RESOLUTION, output_type=output_type).images
        if output_type == "latent":
            return QwenImageEditPipeline._unpack_latents(out, TINY_RESOLUTION, TINY_RESOLUTION,
                                                         model.vae_scale_factor)[:, :, 0]
        return out

    def lora_inputs(self, model):
        x, sigma = torch.randn(2, *model.latent_shape), torch.tensor(0.5)
        return x, sigma, model.encode_prompts(self.prompts, [{"source_image": s} for s in self.sources()[1]])


class FluxKontext(Family):
    """The same source images for both; the guidance scale goes into the guidance embedding."""

    kind = "flux_kontext"
    prompts = ["make the cat blue", "a red square"]
    sampling = [(2, 2.5), (4, 4.0)]

    def model_class(self):
        from flowrl.models.flux_kontext import FluxKontextModel

        return FluxKontextModel

    def check(self, model):
        assert model.conditions_on_source and not model.uses_cfg and model.latent_shape == (16, 8, 8)

    @staticmethod
    def sources(seed=0, n=2, size=TINY_RESOLUTION):
        return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))

    def inputs(self, model, steps):
        x_t = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(steps))
        source = self.sources(steps)
        with torch.no_grad():
            cond = model.encode_prompts(self.prompts, [{"source_image": s} for s in source])
        return x_t, cond, source

    def pipeline(self, model, x_t, steps, guidance, output_type, source):
        from diffusers import FluxKontextPipeline

        b, c, h, w = x_t.shape
        packed = FluxKontextPipeline._pack_latents(x_t.clone(), b, c, h, w)
        with torch.no_grad():
            out = model.pipeline(image=source, prompt=self.prompts, latents=packed, num_inference_steps=steps,
                                 guidance_scale=guidance, height=TINY_RESOLUTION, width=TINY_RESOLUTION,
                                 max_sequence_length=model.max_sequence_length, output_type=output_type,
                                 max_area=TINY_RESOLUTION ** 2, _auto_resize=False).images
        if output_type == "latent":
            return FluxKontextPipeline._unpack_latents(out, TINY_RESOLUTION, TINY_RESOLUTION, model.vae_scale_factor)
        return out

    def lora_inputs(self, model):
        x, sigma = torch.randn(2, *model.latent_shape), torch.tensor(0.5)
        return x, sigma, model.encode_prompts(self.prompts, [{"source_image": s} for s in self.sources()])


class Wan(Family):
    """Wan 2.1: video latents and ``output_type="pt"`` frames, CFG on the negative prompt."""

    kind = "wan"
    sampling = [(2, 5.0), (3, 1.0)]
    schedules = [(1, 64), (8, 64), (50, 64)]
    negative = "blurred, static"

    def model_class(self):
        from flowrl.models.wan import WanModel

        return WanModel

    def load(self, path, **kwargs):
        from flowrl.testing.tiny_wan import TINY_WAN_NUM_FRAMES

        kwargs.setdefault("num_frames", TINY_WAN_NUM_FRAMES)
        kwargs.setdefault("negative_prompt", self.negative)
        return super().load(path, **kwargs)

    def pipeline(self, model, x_t, steps, guidance, output_type, source):
        with torch.no_grad():
            return model.pipeline(self.prompts, negative_prompt=[model.negative_prompt] * len(self.prompts),
                                  latents=x_t.clone(), guidance_scale=guidance, num_inference_steps=steps,
                                  height=TINY_RESOLUTION, width=TINY_RESOLUTION, num_frames=model.num_frames,
                                  max_sequence_length=model.max_sequence_length, output_type=output_type).frames

    def scheduler_sigmas(self, model, steps, resolution):
        scheduler = copy.deepcopy(model.pipeline.scheduler)
        assert scheduler.config.shift == 3.0
        scheduler.set_timesteps(steps)  # as WanPipeline calls it
        return scheduler.sigmas

    def lora_inputs(self, model):
        x, cond = torch.randn(2, *model.latent_shape), model.encode_prompts(self.prompts)
        return x, torch.tensor([0.95, 0.3]), cond  # both experts of Wan 2.2


class Wan22(Wan):
    """Wan 2.2 A14B: two experts, split at the boundary sigma."""

    kind = "wan22"
    sampling = [(4, 4.0)]
    schedules = []

    def check_adapted(self, adapted):
        assert any(n.startswith("high.") for n in adapted) and any(n.startswith("low.") for n in adapted)


FAMILIES = {family.kind: family for family in (SD3(), Flux(), ZImage(), Flux2Klein(), Flux2Dev(), QwenImage(),
                                               QwenImageEdit(), FluxKontext(), Wan(), Wan22())}
SAMPLING = [(kind, steps, guidance) for kind, family in FAMILIES.items() for steps, guidance in family.sampling]
SCHEDULES = [(kind, steps, resolution) for kind, family in FAMILIES.items() for steps, resolution in family.schedules]


@pytest.fixture
def family(request, tiny_dir, monkeypatch):
    """``(Family, its tiny pipeline's directory)`` for the test's ``kind``, the family's setup done."""
    spec = FAMILIES[request.node.callspec.params["kind"]]
    spec.setup(monkeypatch)
    return spec, tiny_dir(spec.kind)


@pytest.mark.parametrize("kind,steps,guidance", SAMPLING)
def test_sampling_matches_the_pipeline(family, kind, steps, guidance):
    """Euler with velocity_fn(guidance) and sigmas(steps) from the same noise (and sources) == the family's
    pipeline: its latents and / or its decoded images, within ATOL."""
    spec, path = family
    model = spec.load(path)
    spec.check(model)
    x_t, cond, source = spec.inputs(model, steps)
    with torch.no_grad():
        ours = euler(model.velocity_fn(guidance), x_t, model.sigmas(steps), cond)
    assert spec.outputs
    for output_type in spec.outputs:
        with torch.no_grad():
            actual = ours if output_type == "latent" else model.decode(ours)
        expected = spec.pipeline(model, x_t, steps, guidance, output_type, source)
        torch.testing.assert_close(actual, expected, rtol=0, atol=ATOL, msg=lambda m: f"{output_type}: {m}")


@pytest.mark.parametrize("kind,steps,resolution", SCHEDULES)
def test_sigmas_equal_the_pipeline_schedule(family, kind, steps, resolution):
    spec, path = family
    model = spec.load(path, resolution=resolution)
    expected = spec.scheduler_sigmas(model, steps, resolution)
    if spec.exact_sigmas:
        assert torch.equal(model.sigmas(steps), expected)
    else:
        torch.testing.assert_close(model.sigmas(steps), expected, rtol=0, atol=1e-6)
    spec.check_sigmas(model, steps)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_lora_targets_reference_gradients_and_state(family, kind):
    """Every default LoRA target names an adapted module; only float32 LoRA weights train; at init (lora_B = 0) the
    policy is the reference; with the adapters moved every row's prediction moves, unguided and guided, and
    ``reference()`` gives the base back exactly, in eval and train mode; the guided loss reaches the trainable
    parameters; the trainable state round-trips and a partial one is refused."""
    spec, path = family
    model = spec.load(path, lora=LoraConfig(rank=4, alpha=8))
    module = unwrap(model.denoiser)
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert all(p.dtype == torch.float32 for p in model.trainable_parameters())
    adapted = [n for n, _ in module.named_modules() if n.endswith(".lora_A")]
    for target in model.default_lora_targets():
        assert any(n.removesuffix(".lora_A").endswith("." + target) for n in adapted), target
    spec.check_adapted(adapted)

    x, sigma, cond = spec.lora_inputs(model)
    rows = tuple(range(1, x.dim()))
    guided = model.velocity_fn(spec.lora_guidance)
    with torch.no_grad():
        with model.reference():
            base, base_guided = model.velocity(x, sigma, cond), guided(x, sigma, cond)
        torch.testing.assert_close(model.velocity(x, sigma, cond), base, rtol=0, atol=0)  # lora_B = 0 at init
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.add_(0.5 * torch.randn_like(p))
        policy = model.velocity(x, sigma, cond)
        assert (policy - base).abs().amax(dim=rows).min() > 1e-4  # every row
        assert (guided(x, sigma, cond) - base_guided).abs().max() > 1e-4
        with model.reference():
            torch.testing.assert_close(model.velocity(x, sigma, cond), base, rtol=0, atol=0)
            torch.testing.assert_close(guided(x, sigma, cond), base_guided, rtol=0, atol=0)
        torch.testing.assert_close(model.velocity(x, sigma, cond), policy, rtol=0, atol=0)  # adapters back on

    model.train()
    v = guided(x, sigma, cond)
    assert (v - guided(x, sigma, cond)).abs().max() == 0
    v.pow(2).mean().backward()
    grads = [p.grad for p in model.trainable_parameters()]
    if spec.every_lora_parameter_gets_a_gradient:
        assert all(g is not None for g in grads)
    else:  # most do
        assert sum(g is not None and bool(g.abs().max() > 0) for g in grads) > 0.5 * len(grads)
    with torch.no_grad(), model.reference():
        torch.testing.assert_close(model.velocity(x, sigma, cond), base, rtol=0, atol=0)

    model.eval()
    state = model.trainable_state_dict()
    assert set(state) == set(names)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.zero_()
        torch.testing.assert_close(model.velocity(x, sigma, cond), base, rtol=0, atol=0)
        model.load_trainable_state_dict(state)
        torch.testing.assert_close(model.velocity(x, sigma, cond), policy, rtol=0, atol=0)
        torch.testing.assert_close(guided(x, sigma, cond), v.detach(), rtol=0, atol=0)
    with pytest.raises(ModelLoadError, match="trainable parameters"):
        model.load_trainable_state_dict({k: v for k, v in list(state.items())[1:]})
