"""The ``model`` section of a training config, and the one function that builds an adapter from it.

Every online recipe, the demo and ``flowrl sample`` build models through :func:`build_model`, so a run's
``config.yaml`` is enough to rebuild its model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from flowrl.config import LoraConfig, bounds

__all__ = ["LoraConfig", "ModelConfig", "build_model", "VIDEO_FAMILIES"]

#: Families whose adapters generate videos (latents with a frame axis, decoded to ``[B, F, 3, H, W]``).
VIDEO_FAMILIES = ("wan",)


@dataclass
class ModelConfig:
    name: Literal["shapes", "sd3", "flux", "qwen_image", "z_image", "flux2_klein", "flux2", "flux_kontext",
                  "qwen_image_edit", "wan"] = "shapes"  # flowrl.models.families
    path: str | None = None  # local dir or hub id; None = the shipped shapes model
    # The weights' dtype (the VAE stays float32). Full fine-tuning in bfloat16 / float16 trains float32 master weights
    # and computes in this dtype under autocast, as diffusers' training scripts do
    # (FlowModel.keep_float32_master_weights); LoRA weights are float32 whatever this is. Inference (sample, eval,
    # export) keeps this dtype.
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lora: LoraConfig | None = None  # None: full fine-tuning
    gradient_checkpointing: bool = False
    resolution: int | None = field(default=None, metadata=bounds(ge=64))  # sd3 / flux only
    # T5 tokens of the text conditioning (sd3 / flux); None: the pipeline's default (256 / 512).
    max_sequence_length: int | None = field(default=None, metadata=bounds(ge=1))
    # native: PyTorch SDPA; xformers: xformers' kernel (CUDA, installed to match torch); flash: flash-attn
    # through diffusers' attention dispatcher (FLUX). docs/distributed.md, "Attention backends".
    # Video families (wan) only: pixel frames per video, 4 k + 1 (None: the adapter's 81), and the unconditional
    # prompt of CFG (None: the pipeline's default ""; configs/wan sets Wan's model-card negative prompt).
    num_frames: int | None = field(default=None, metadata=bounds(ge=1))
    negative_prompt: str | None = None
    attention_backend: Literal["native", "xformers", "flash"] = "native"
    # Encoded prompts kept (least recently used evicted), on the CPU (moved to the device per batch) or on
    # the model's device.
    prompt_cache_size: int = field(default=1024, metadata=bounds(ge=0, le=1_000_000))
    prompt_cache_device: Literal["cpu", "model"] = "cpu"
    # Diffusers families (not shapes): keep the frozen text encoders on the CPU and lend them to the device only to
    # encode prompts the cache lacks, so T5-XXL (9.5 GB in bf16) is not resident beside training
    # (flowrl/models/pipeline_model.py; false: resident, no copy per encode call).
    offload_text_encoders: bool = True
    # Diffusers families: the VAE decodes (and encodes) a batch one image at a time (the same images, a batch's worth
    # less memory), and with vae_tiling images larger than its tile size in overlapping tiles (diffusers' threshold:
    # above 1024 px for the SD3 / FLUX.1 VAE, 256 px for Wan's and Qwen-Image's; seams change the images slightly).
    vae_slicing: bool = True
    vae_tiling: bool = False
    # The shapes model only, full fine-tuning: train its text encoder beside the UNet (flowrl.models.shapes
    # .TextConditionedUNet puts it inside the denoiser, so every trainer's optimizer, checkpoint, EMA and reference copy
    # hold it). The shipped encoder gives opposite relations the same vectors (docs/shapes.md), which a UNet-only
    # trainer cannot undo.
    train_text_encoder: bool = False

    def check(self) -> None:
        from flowrl.config import fail

        if self.train_text_encoder and self.name != "shapes":
            fail("train_text_encoder", f"only the shapes model trains its text encoder; {self.name}'s text encoders "
                                       "stay frozen (train its denoiser, with or without LoRA)")
        if self.train_text_encoder and self.lora is not None:
            fail("train_text_encoder", "needs full fine-tuning (model.lora=null): the LoRA targets the UNet only")

        if self.name != "shapes" and self.path is None:
            fail("path", f"{self.name} needs a local directory or hub id")
        if self.name not in VIDEO_FAMILIES:
            for key in ("num_frames", "negative_prompt"):
                if getattr(self, key) is not None:
                    fail(key, f"is a video-model setting ({', '.join(VIDEO_FAMILIES)}); {self.name} makes images, "
                              f"remove model.{key}")


def build_model(cfg: ModelConfig, device: torch.device | str):
    """The model adapter named by ``cfg`` (LoRA or full fine-tuning), on ``device``.

    Raises:
        ModelLoadError: the weights are missing or do not load (the message names the fix).
        ConfigError: ``attention_backend`` cannot run on ``device`` (checked before loading).
    """
    from flowrl.models.base import check_attention_backend

    from flowrl.models.pipeline_model import PipelineModel

    check_attention_backend(cfg.attention_backend, device)  # before any weights load
    model = _build(cfg, device)
    model.set_prompt_cache(cfg.prompt_cache_size, cfg.prompt_cache_device)
    if isinstance(model, PipelineModel):  # the shapes model's 4M-parameter text encoder and VAE stay as they are
        model.set_text_encoder_offload(cfg.offload_text_encoders)
        model.set_vae_memory(slicing=cfg.vae_slicing, tiling=cfg.vae_tiling)
    if cfg.attention_backend != "native":
        model.set_attention_backend(cfg.attention_backend)
    return model


def _build(cfg: ModelConfig, device: torch.device | str):
    dtype = getattr(torch, cfg.dtype)
    lora = cfg.lora
    if cfg.name == "shapes":
        from flowrl.models.shapes import ShapesModel

        return ShapesModel.from_pretrained(cfg.path, device=device, dtype=dtype, lora=lora,
                                           gradient_checkpointing=cfg.gradient_checkpointing,
                                           train_text_encoder=cfg.train_text_encoder)
    from flowrl.models.registry import load_model

    kwargs = {"dtype": dtype, "device": device, "lora": lora, "gradient_checkpointing": cfg.gradient_checkpointing}
    if cfg.resolution is not None:
        kwargs["resolution"] = cfg.resolution
    if cfg.max_sequence_length is not None:
        kwargs["max_sequence_length"] = cfg.max_sequence_length
    for key in ("num_frames", "negative_prompt"):
        if getattr(cfg, key) is not None:
            kwargs[key] = getattr(cfg, key)
    return load_model(cfg.name, cfg.path, **kwargs)
