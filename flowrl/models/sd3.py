"""Stable Diffusion 3 / 3.5 as a flowrl velocity model (diffusers ``StableDiffusion3Pipeline``).

Conventions, checked against diffusers (tests/models/test_families.py, tests/models/test_conventions.py):

- **Time.** SD3's ``SD3Transformer2DModel`` is trained on ``x_t = (1 - sigma) x0 + sigma eps`` and
  predicts ``eps - x0`` -- exactly flowrl's convention (docs/algorithms.md, section 1), so no conversion is needed.
  Its ``timestep`` input is ``sigma * 1000`` (``FlowMatchEulerDiscreteScheduler.timesteps =
  sigmas * num_train_timesteps``), and ``scheduler.step`` is the Euler update
  ``x_next = x + (sigma_next - sigma) * model_output``, the same as flowrl's Euler step with
  ``v_hat = model_output``.
- **Text.** The pipeline's own ``encode_prompt`` (CLIP-L + CLIP-G penultimate hidden states padded to the
  T5 width and concatenated with the T5 sequence; pooled CLIP-L + CLIP-G projections), so prompts are
  encoded exactly as ``StableDiffusion3Pipeline.__call__`` does. The unconditional input for
  classifier-free guidance is the encoded empty prompt, as the pipeline's default negative prompt.
- **Schedule.** ``sigmas(n)`` is the scheduler's ``set_timesteps(n)`` result (SD3.5: static shift 3.0,
  including diffusers' spacing down to the shifted training ``sigma_min``), via
  ``samplers.diffusers_flow_sigmas``.
- **Latents.** ``[B, 16, H / 8, W / 8]`` in the transformer's normalised space; ``decode`` undoes
  ``scaling_factor`` / ``shift_factor`` like the pipeline.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .base import Cond
from flowrl.config import LoraConfig
from .loading import latent_hw, load_adapter_pipeline, scheduler_sigmas
from .pipeline_model import PipelineModel, resolution_shift

__all__ = ["SD3Model", "SD3_LORA_TARGETS", "SD3_DEFAULT_MODEL"]

#: Flow-GRPO's SD3.5 base model.
SD3_DEFAULT_MODEL = "stabilityai/stable-diffusion-3.5-medium"

#: LoRA targets of Flow-GRPO's SD3 training (scripts/train_sd3.py, ``target_modules``): the joint
#: attention's image (``to_q/k/v``, ``to_out.0``) and text (``add_q/k/v_proj``, ``to_add_out``)
#: projections. Flow-GRPO does not adapt the feed-forward layers of SD3 (its FLUX list does); add
#: ``ff.net.0.proj``, ``ff.net.2``, ``ff_context.net.0.proj``, ``ff_context.net.2`` through
#: ``LoraConfig.target_modules`` to include them. peft matches these as module-name suffixes, so
#: ``attn.to_q`` adapts every ``transformer_blocks.N.attn.to_q`` (not SD3.5-medium's second
#: attention ``attn2``, as in Flow-GRPO).
SD3_LORA_TARGETS = [
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_k",
    "attn.to_out.0",
    "attn.to_q",
    "attn.to_v",
]

_COMPONENTS = ["transformer", "vae", "scheduler", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer",
               "tokenizer_2", "tokenizer_3"]


class SD3Model(PipelineModel):
    """Stable Diffusion 3 / 3.5 behind :class:`~flowrl.models.base.FlowModel`.

    Cond keys: ``"prompt_embeds"`` ``[B, 77 + max_sequence_length, 4096]`` (CLIP tokens, then T5 tokens)
    and ``"pooled_prompt_embeds"`` ``[B, 2048]``.

    Args:
        pipeline: a built ``StableDiffusion3Pipeline`` (its modules are used, not copied). The VAE and
            text encoders are frozen and put in eval mode.
        lora: LoRA settings (targets default to :data:`SD3_LORA_TARGETS`; LoRA weights are kept in
            float32), or None to fine-tune the whole transformer.
        gradient_checkpointing: recompute transformer blocks in the backward pass.
        resolution: image size in pixels, int or ``(H, W)``; default the transformer's ``sample_size``
            times the VAE scale factor (1024 for SD3.5). Must be a multiple of 16.
        max_sequence_length: T5 tokens (the pipeline's default 256; Flow-GRPO uses 128).
        guidance_scale: the default classifier-free guidance scale (Flow-GRPO's 4.5; the pipeline's
            ``__call__`` default is 7.0).
    """

    family = "sd3"  # its row in flowrl.models.families

    uses_cfg = True

    def __init__(self, pipeline, *, lora: LoraConfig | dict | None = None, gradient_checkpointing: bool = False,
                 resolution: int | tuple[int, int] | None = None, max_sequence_length: int = 256,
                 guidance_scale: float = 4.5):
        super().__init__(pipeline, ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"), lora=lora,
                         gradient_checkpointing=gradient_checkpointing, max_sequence_length=max_sequence_length)
        transformer = pipeline.transformer
        self.default_guidance = float(guidance_scale)
        self.vae_scale_factor = pipeline.vae_scale_factor
        self.patch_size = transformer.config.patch_size
        if resolution is None:
            resolution = transformer.config.sample_size * self.vae_scale_factor
        self.resolution = resolution
        height, width = latent_hw(resolution, self.vae_scale_factor, self.patch_size)
        self.latent_shape = (transformer.config.in_channels, height, width)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike = SD3_DEFAULT_MODEL, *, dtype: torch.dtype | str | None = None,
                        vae_dtype: torch.dtype | str | None = torch.float32, device: torch.device | str | None = None,
                        lora: LoraConfig | dict | None = None, gradient_checkpointing: bool = False,
                        resolution: int | tuple[int, int] | None = None, max_sequence_length: int = 256,
                        guidance_scale: float = 4.5, revision: str | None = None, variant: str | None = None,
                        cache_dir: str | None = None, trust_remote_code: bool = False) -> "SD3Model":
        """Load from a local pipeline directory or a hub id (``StableDiffusion3Pipeline.from_pretrained``).

        Args:
            path: directory with ``model_index.json`` and the component folders, or a hub id.
            dtype: dtype of the transformer and text encoders (``"bf16"``, ``"fp16"``, default float32).
            vae_dtype: dtype of the VAE (float32 by default, as Flow-GRPO; None: same as ``dtype``).
            device: where to put every component (default: CPU).
            lora, gradient_checkpointing, resolution, max_sequence_length, guidance_scale: see the class.
            revision, variant, cache_dir: hub options (``variant="fp16"`` picks half-precision files).
            trust_remote_code: load component code a local pipeline folder ships (off: such a folder is
                refused; only for code you have read).

        Raises:
            ModelLoadError: weights missing (offline, wrong path) or unreadable; the message says the fix.
        """
        from diffusers import StableDiffusion3Pipeline

        pipeline = load_adapter_pipeline(StableDiffusion3Pipeline, path, components=_COMPONENTS,
                                         hub_id=SD3_DEFAULT_MODEL, dtype=dtype, vae_dtype=vae_dtype,
                                         device=device, revision=revision, variant=variant, cache_dir=cache_dir,
                                         trust_remote_code=trust_remote_code)
        return cls(pipeline, lora=lora, gradient_checkpointing=gradient_checkpointing, resolution=resolution,
                   max_sequence_length=max_sequence_length, guidance_scale=guidance_scale)

    # ------------------------------------------------------------------ FlowModel hooks

    def _encode(self, prompts: list[str]) -> Cond:
        device = next(self.pipeline.text_encoder.parameters()).device
        prompt_embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=device, num_images_per_prompt=1,
            do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def _predict(self, denoiser: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        dtype = self._compute_dtype
        # SD3's timestep is sigma * num_train_timesteps (1000), as the scheduler feeds it.
        timestep = sigma.to(device=x.device, dtype=torch.float32) * self.pipeline.scheduler.config.num_train_timesteps
        return denoiser(
            hidden_states=x.to(dtype),
            timestep=timestep,
            encoder_hidden_states=cond["prompt_embeds"].to(device=x.device, dtype=dtype),
            pooled_projections=cond["pooled_prompt_embeds"].to(device=x.device, dtype=dtype),
            return_dict=False,
        )[0]

    def default_lora_targets(self) -> list[str]:
        return list(SD3_LORA_TARGETS)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The pipeline scheduler's sigmas ``[num_steps + 1]`` (from 1 to 0) at this resolution."""
        config = self.pipeline.scheduler.config
        mu = None
        if config.get("use_dynamic_shifting"):  # as StableDiffusion3Pipeline.__call__ computes it
            _, height, width = self.latent_shape
            seq_len = (height // self.patch_size) * (width // self.patch_size)
            mu = resolution_shift(config, seq_len, max_shift=1.16)
        return scheduler_sigmas(config, num_steps, mu=mu)
