"""Z-Image (and Z-Image-Turbo) as a flowrl velocity model (diffusers ``ZImagePipeline``).

Conventions, checked against diffusers (tests/models/test_families.py, tests/models/test_z_image.py):

- **Time and prediction.** Z-Image's transformer is fed ``t = (1000 - timestep) / 1000 = 1 - sigma`` (0 noise,
  1 data) and predicts ``x0 - eps``; the pipeline negates it before the Euler step. flowrl's velocity
  ``eps - x0`` is therefore minus the transformer's output at ``1 - sigma``.
- **Guidance.** The pipeline's CFG is ``pos + s (pos - neg)`` (``guidance_scale`` s, 5 by default; 0 for the
  distilled Turbo), which is flowrl's ``neg + w (pos - neg)`` with ``w = s + 1``. ``sampling.guidance`` is in
  flowrl's units: Z-Image's default 5 is ``guidance: 6``, Turbo's 0 is ``guidance: 1`` (no unconditional branch).
  The unconditional branch is the empty prompt, as the pipeline's default negative prompt.
- **Latents.** ``[B, 16, H / 8, W / 8]`` as the transformer takes them (it patchifies 2x2 itself), each sample a
  ``[16, 1, h, w]`` entry of a list; the VAE is FLUX's (``scaling_factor`` / ``shift_factor``).
- **Schedule.** ``linspace(1, 1/n, n)`` through the scheduler's static shift (3), then 0.
- **Text.** The pipeline's ``_encode_prompt``: Qwen3's second-to-last hidden state on its chat template, one
  variable-length tensor per prompt. The cache keeps them zero-padded to ``max_sequence_length`` with a mask;
  ``_predict`` hands the transformer each prompt's own tokens, as the pipeline does.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from .base import Cond
from flowrl.config import LoraConfig
from .loading import latent_hw, load_adapter_pipeline, scheduler_sigmas
from .pipeline_model import PipelineModel, resolution_shift

__all__ = ["ZImageModel", "Z_IMAGE_LORA_TARGETS", "Z_IMAGE_DEFAULT_MODEL"]

Z_IMAGE_DEFAULT_MODEL = "Tongyi-MAI/Z-Image-Turbo"

#: LoRA targets: every attention projection and the SwiGLU feed-forward of the main, noise-refiner and
#: caption-refiner blocks (the Linear layers diffusers' Z-Image LoRA loader maps).
Z_IMAGE_LORA_TARGETS = ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                        "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]

_COMPONENTS = ["transformer", "vae", "scheduler", "text_encoder", "tokenizer"]


class ZImageModel(PipelineModel):
    """Z-Image behind :class:`~flowrl.models.base.FlowModel`.

    Cond keys: ``"prompt_embeds"`` ``[B, max_sequence_length, hidden]`` (zero-padded) and
    ``"prompt_embeds_mask"`` ``[B, max_sequence_length]``.

    Args:
        pipeline: a built ``ZImagePipeline``; VAE and text encoder are frozen.
        lora, gradient_checkpointing: as for the other adapters (targets default to :data:`Z_IMAGE_LORA_TARGETS`).
        resolution: pixels, int or ``(H, W)``, a multiple of 16 (default 1024, the pipeline's).
        max_sequence_length: text tokens (the pipeline's default 512).
        guidance_scale: the default guidance in flowrl's units (Z-Image's ``guidance_scale`` + 1; default 1, no
            CFG, as Z-Image-Turbo samples).
    """

    family = "z_image"  # its row in flowrl.models.families
    uses_cfg = True

    def __init__(self, pipeline, *, lora: LoraConfig | dict | None = None, gradient_checkpointing: bool = False,
                 resolution: int | tuple[int, int] | None = None, max_sequence_length: int = 512,
                 guidance_scale: float = 1.0):
        super().__init__(pipeline, ("vae", "text_encoder"), lora=lora, gradient_checkpointing=gradient_checkpointing,
                         max_sequence_length=max_sequence_length)
        transformer = pipeline.transformer
        self.default_guidance = float(guidance_scale)
        self.vae_scale_factor = pipeline.vae_scale_factor
        self.resolution = resolution or 1024
        height, width = latent_hw(self.resolution, self.vae_scale_factor, 2)
        self.latent_shape = (transformer.config.in_channels, height, width)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike = Z_IMAGE_DEFAULT_MODEL, *,
                        dtype: torch.dtype | str | None = None, vae_dtype: torch.dtype | str | None = torch.float32,
                        device: torch.device | str | None = None, lora: LoraConfig | dict | None = None,
                        gradient_checkpointing: bool = False, resolution: int | tuple[int, int] | None = None,
                        max_sequence_length: int = 512, guidance_scale: float = 1.0, revision: str | None = None,
                        variant: str | None = None, cache_dir: str | None = None,
                        trust_remote_code: bool = False) -> "ZImageModel":
        """Load from a local pipeline directory or a hub id (``ZImagePipeline.from_pretrained``).

        Raises:
            ModelLoadError: weights missing (offline, wrong path) or unreadable.
        """
        from diffusers import ZImagePipeline

        pipeline = load_adapter_pipeline(ZImagePipeline, path, components=_COMPONENTS,
                                         hub_id=Z_IMAGE_DEFAULT_MODEL, dtype=dtype, vae_dtype=vae_dtype,
                                         device=device, revision=revision, variant=variant, cache_dir=cache_dir,
                                         trust_remote_code=trust_remote_code)
        return cls(pipeline, lora=lora, gradient_checkpointing=gradient_checkpointing, resolution=resolution,
                   max_sequence_length=max_sequence_length, guidance_scale=guidance_scale)

    # ------------------------------------------------------------------ velocity

    def _predict(self, denoiser: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        dtype = self._compute_dtype
        embeds = cond["prompt_embeds"].to(device=x.device, dtype=dtype)
        mask = cond["prompt_embeds_mask"].to(device=x.device).bool()
        captions = [embeds[i][mask[i]] for i in range(x.shape[0])]  # each prompt's own tokens
        latents = list(x.to(dtype).unsqueeze(2).unbind(dim=0))  # [C, 1, h, w] each
        t = (1.0 - sigma.to(device=x.device, dtype=torch.float32)).to(dtype)  # Z-Image's time: 1 at the data
        out = denoiser(latents, t, captions, return_dict=False)[0]
        return -torch.stack(out, dim=0).squeeze(2)  # it predicts x0 - eps

    # ------------------------------------------------------------------ FlowModel hooks

    def _encode(self, prompts: list[str]) -> Cond:
        device = next(self.pipeline.text_encoder.parameters()).device
        # a copy: _encode_prompt writes the chat-templated text back into the list it is given
        rows = self.pipeline._encode_prompt(prompt=list(prompts), device=device,
                                            max_sequence_length=self.max_sequence_length)
        hidden = rows[0].shape[-1]
        embeds = rows[0].new_zeros(len(rows), self.max_sequence_length, hidden)
        mask = torch.zeros(len(rows), self.max_sequence_length, dtype=torch.long, device=rows[0].device)
        for i, row in enumerate(rows):
            embeds[i, : row.shape[0]] = row
            mask[i, : row.shape[0]] = 1
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def default_lora_targets(self) -> list[str]:
        return list(Z_IMAGE_LORA_TARGETS)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The sigmas ``[num_steps + 1]`` ``ZImagePipeline`` samples with at this resolution."""
        config = self.pipeline.scheduler.config
        _, height, width = self.latent_shape
        mu = resolution_shift(config, (height // 2) * (width // 2)) if config.get("use_dynamic_shifting") else None
        return scheduler_sigmas(config, num_steps, mu=mu, sigmas=np.linspace(1.0, 1 / num_steps, num_steps))
