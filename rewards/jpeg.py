"""``jpeg_compressibility`` / ``jpeg_incompressibility``: DDPO's prompt-free toy rewards.

Each image is rounded to uint8 and saved as JPEG with quality 95 (PIL); the file size in kilobytes
(``bytes / 1000``, as DDPO's ``buffer.tell() / 1000``) is the incompressibility reward, its negation the
compressibility reward. DDPO does not rescale these values further: its trainer standardises rewards
per prompt (per-prompt stat tracking), which removes the kB scale and offset; use flowrl's group or
per-prompt normalisation for the same effect. Details: ``<name>/kb`` (the unsigned size).
"""

from __future__ import annotations

import io

import torch

from .base import Reward, RewardOutput, to_pil_images

__all__ = ["JpegCompressibility", "JpegIncompressibility", "jpeg_sizes_kb"]


def jpeg_sizes_kb(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """JPEG file sizes in kB (1000 bytes) of ``[B, 3, H, W]`` images in [0, 1]."""
    sizes = []
    for image in to_pil_images(images):
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


class JpegIncompressibility(Reward):
    """Reward = JPEG size in kB (bigger files score higher)."""

    name = "jpeg_incompressibility"
    sign = 1.0

    def __init__(self, quality: int = 95, batch_size: int = 64, device: str = "cpu"):
        self.quality = int(quality)
        self.batch_size = int(batch_size)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        kb = jpeg_sizes_kb(images, self.quality)
        return RewardOutput(self.sign * kb, {f"{self.name}/kb": kb})


class JpegCompressibility(JpegIncompressibility):
    """Reward = minus the JPEG size in kB (smaller files score higher)."""

    name = "jpeg_compressibility"
    sign = -1.0
