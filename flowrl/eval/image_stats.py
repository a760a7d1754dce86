"""Statistics of real images that catch the hacks users report on SD3 / FLUX / Qwen-Image: backgrounds erased
to one colour (colour entropy falls), saturation and contrast pushed (saturated and dark pixel fractions rise,
the colour histogram shifts away from the base's), grid textures (high-frequency energy rises). With
``hack/diversity`` (faces made identical) and ``hack/drift_feature`` (:mod:`flowrl.eval.hacking`) they are the part
of the hacking panel that needs no knowledge of the prompts' world. Pure functions of images ``[B, 3, H, W]``
in [0, 1]; :func:`image_stats` gives the panel's ``hack/*`` entries:

- ``hack/color_entropy``: mean per-image entropy (bits) of the colour histogram, ``BINS`` levels per channel
  (``BINS**3`` cells): 0 for a flat image, at most ``3 log2 BINS`` (9 bits);
- ``hack/color_hist_shift``: total-variation distance (0-1) between the pooled colour histograms of the
  tuned and the base images (needs the base's);
- ``hack/dark_frac``: fraction of pixels with luma below ``DARK`` (0.1);
- ``hack/saturated_frac``: fraction of pixels with HSV saturation at least ``SATURATED`` (0.9) and value at
  least 0.25 (a bright, nearly pure colour);
- ``hack/hf_energy``: mean per-image fraction of the luma's spectral energy (mean removed) at spatial
  frequencies above ``HF_CUTOFF`` (0.25 cycles per pixel, half the Nyquist frequency): about 0 for smooth
  images, 1 for a one-pixel checkerboard; 0 for a flat image (no energy).
"""

from __future__ import annotations

import torch

__all__ = ["BINS", "color_histograms", "color_entropy", "histogram_shift", "dark_fraction", "saturated_fraction",
           "high_frequency_energy", "image_stats"]

BINS = 8
DARK = 0.1
SATURATED = 0.9
HF_CUTOFF = 0.25  # cycles per pixel


def _images(images: torch.Tensor) -> torch.Tensor:
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images must be a [B, 3, H, W] tensor in [0, 1], got {shape}")
    return images.detach().float().cpu().clamp(0, 1)


def color_histograms(images: torch.Tensor, bins: int = BINS) -> torch.Tensor:
    """``[B, bins**3]``: each image's normalised joint RGB histogram (``bins`` equal levels per channel)."""
    x = _images(images)
    levels = (x * bins).long().clamp(max=bins - 1)  # [B, 3, H, W]
    cell = (levels[:, 0] * bins + levels[:, 1]) * bins + levels[:, 2]  # [B, H, W]
    counts = torch.zeros(x.shape[0], bins ** 3)
    counts.scatter_add_(1, cell.flatten(1), torch.ones_like(cell.flatten(1), dtype=torch.float32))
    return counts / counts.sum(dim=1, keepdim=True)


def color_entropy(images: torch.Tensor, bins: int = BINS) -> torch.Tensor:
    """``[B]`` entropy in bits of each image's colour histogram."""
    p = color_histograms(images, bins)
    return (-(p * torch.log2(p.clamp_min(1e-12))).sum(dim=1)).clamp_min(0.0)  # +0.0, not -0.0, for a flat image


def histogram_shift(tuned: torch.Tensor, base: torch.Tensor, bins: int = BINS) -> float:
    """Total-variation distance ``0.5 sum |p - q|`` of the pooled colour histograms of two image sets."""
    p, q = color_histograms(tuned, bins).mean(dim=0), color_histograms(base, bins).mean(dim=0)
    return float(0.5 * (p - q).abs().sum())


def _luma(x: torch.Tensor) -> torch.Tensor:
    return 0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]  # [B, H, W], ITU-R BT.601


def dark_fraction(images: torch.Tensor, threshold: float = DARK) -> torch.Tensor:
    """``[B]`` fraction of pixels with luma below ``threshold``."""
    return (_luma(_images(images)) < threshold).float().flatten(1).mean(dim=1)


def saturated_fraction(images: torch.Tensor, saturation: float = SATURATED, value: float = 0.25) -> torch.Tensor:
    """``[B]`` fraction of pixels with HSV saturation ``>= saturation`` and value ``>= value``."""
    x = _images(images)
    high, low = x.max(dim=1).values, x.min(dim=1).values  # [B, H, W]
    sat = torch.where(high > 0, (high - low) / high.clamp_min(1e-12), torch.zeros_like(high))
    return ((sat >= saturation) & (high >= value)).float().flatten(1).mean(dim=1)


def high_frequency_energy(images: torch.Tensor, cutoff: float = HF_CUTOFF) -> torch.Tensor:
    """``[B]`` fraction of the luma's spectral energy (mean removed) above ``cutoff`` cycles per pixel."""
    y = _luma(_images(images)).double()
    y = y - y.mean(dim=(1, 2), keepdim=True)
    power = torch.fft.fft2(y).abs().square()  # [B, H, W]
    fy = torch.fft.fftfreq(y.shape[1], dtype=torch.float64).abs()
    fx = torch.fft.fftfreq(y.shape[2], dtype=torch.float64).abs()
    radius = torch.sqrt(fy[:, None] ** 2 + fx[None, :] ** 2)  # [H, W] cycles per pixel
    total = power.flatten(1).sum(dim=1)
    high = (power * (radius > cutoff)).flatten(1).sum(dim=1)
    return torch.where(total > 1e-12 * y[0].numel(), high / total.clamp_min(1e-300), torch.zeros_like(total)).float()


def image_stats(images: torch.Tensor, base_images: torch.Tensor | None = None) -> dict[str, float]:
    """The panel's image statistics (module docstring) of ``images``; the histogram shift with ``base_images``."""
    out = {"hack/color_entropy": float(color_entropy(images).mean()),
           "hack/dark_frac": float(dark_fraction(images).mean()),
           "hack/saturated_frac": float(saturated_fraction(images).mean()),
           "hack/hf_energy": float(high_frequency_energy(images).mean())}
    if base_images is not None:
        out["hack/color_hist_shift"] = histogram_shift(images, base_images)
    return out
