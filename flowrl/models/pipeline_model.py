"""What every adapter of a diffusers pipeline shares (SD3, FLUX.1 / Kontext, FLUX.2, Qwen-Image / Edit, Z-Image,
Wan): the pipeline's text encoders and VAE frozen and registered, its transformer trained (fully or through LoRA
kept in float32), VAE decoding and encoding, and the resolution-dependent schedule shift of its scheduler."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import FlowModel, LoraSettings, unwrap
from .loading import as_lora_settings, freeze_, upcast_trainable_, vae_decode, vae_encode

__all__ = ["PipelineModel", "resolution_shift"]


class PipelineModel(FlowModel):
    """A :class:`FlowModel` around a built diffusers pipeline.

    Args:
        pipeline: the pipeline; kept as ``self.pipeline`` (not an ``nn.Module``: tokenizers, scheduler,
            ``encode_prompt``), its progress bar off.
        frozen: the pipeline's parts that are never trained (e.g. ``("vae", "text_encoder")``); missing ones (an
            SD3 pipeline without its T5) are skipped. They are frozen and registered in ``self.frozen``, so that
            ``.to(device)`` moves them and ``train()`` keeps them in eval mode.
        denoiser: what trains (default ``pipeline.transformer``; Wan 2.2 passes its two experts).
        compute_dtype: the dtype the transformer computes in (default: its first parameter's, taken before
            float32 LoRA weights exist).
        lora, gradient_checkpointing: as for :class:`FlowModel`; LoRA weights are kept in float32.
        max_sequence_length: text tokens the prompt encoder keeps.
    """

    def __init__(self, pipeline, frozen: tuple[str, ...], *, denoiser: nn.Module | None = None,
                 compute_dtype: torch.dtype | None = None, lora: LoraSettings | dict | None = None,
                 gradient_checkpointing: bool = False, max_sequence_length: int = 512):
        parts = {name: getattr(pipeline, name, None) for name in frozen}
        freeze_(*parts.values())
        compute_dtype = compute_dtype or next(pipeline.transformer.parameters()).dtype
        super().__init__(denoiser if denoiser is not None else pipeline.transformer, lora=as_lora_settings(lora),
                         gradient_checkpointing=gradient_checkpointing)
        self._compute_dtype = compute_dtype
        self.pipeline = pipeline
        self.pipeline.set_progress_bar_config(disable=True)
        self.frozen = nn.ModuleDict({k: m for k, m in parts.items() if m is not None})
        self.max_sequence_length = int(max_sequence_length)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return vae_decode(self.pipeline.vae, latents)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in [0, 1] at the model's resolution -> latents ``[B, *latent_shape]``
        (the VAE posterior's mean; Diffusion-DPO's offline pairs)."""
        return vae_encode(self.pipeline.vae, images)

    def _add_lora(self, lora: LoraSettings) -> None:
        super()._add_lora(lora)
        upcast_trainable_(unwrap(self.denoiser))

    def train(self, mode: bool = True):
        super().train(mode)
        self.frozen.eval()  # text encoders and VAE never use dropout
        return self


def resolution_shift(scheduler_config: Any, image_seq_len: int, *, max_shift: float = 1.15) -> float:
    """The schedule shift ``mu`` a diffusers pipeline computes for ``image_seq_len`` image tokens, from its
    scheduler config's ranges (``base_image_seq_len`` 256, ``max_image_seq_len`` 4096, ``base_shift`` 0.5,
    ``max_shift``: the defaults where the config has none)."""
    from samplers import calculate_shift

    config = scheduler_config
    return calculate_shift(image_seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                           config.get("base_shift", 0.5), config.get("max_shift", max_shift))
