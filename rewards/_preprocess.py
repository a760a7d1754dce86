"""Differentiable image preprocessing for CLIP-style encoders, done in torch on the ``[B, 3, H, W]`` tensor.

The libraries' own processors (open_clip's torchvision ``Compose`` on PIL images, transformers'
``CLIPImageProcessor``) round to uint8 after resizing and, for open_clip, resize with PIL's bicubic
kernel, so they neither pass gradients nor accept a batch tensor. :class:`ImagePreprocess` reproduces
their geometry exactly (same output size, same crop offsets, same mean/std) with
``torch.nn.functional.interpolate(..., antialias=True)``; the remaining difference is the resampling
kernel and the uint8 rounding, a few thousandths on average (tests bound it against each library's own
processor). When the input already has the target size no resampling happens and the result is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

__all__ = ["ImagePreprocess", "from_open_clip", "from_hf_image_processor"]

_MODES = {"bicubic", "bilinear", "nearest"}


@dataclass(frozen=True)
class ImagePreprocess:
    """Resize, crop and normalise ``[B, 3, H, W]`` images in [0, 1].

    Attributes:
        size: ``(height, width)`` of the output.
        resize_mode: ``"shortest"`` (shortest edge to the target, keep ratio, centre crop: CLIP's
            default), ``"longest"`` (longest edge to the target, keep ratio, centre pad with
            ``fill``), or ``"squash"`` (resize to ``size`` ignoring the ratio).
        mean, std: per-channel normalisation.
        interpolation: ``"bicubic"``, ``"bilinear"`` or ``"nearest"``.
        crop_round: crop offsets rounded (torchvision's ``CenterCrop``, used by open_clip) rather than
            floored (transformers' ``center_crop``); the two differ by a pixel on odd margins.
        fill: padding value in [0, 1] for ``"longest"``.
    """

    size: tuple[int, int]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    resize_mode: str = "shortest"
    interpolation: str = "bicubic"
    crop_round: bool = True
    fill: float = 0.0

    def __post_init__(self) -> None:
        if self.interpolation not in _MODES:
            raise ValueError(f"interpolation must be one of {sorted(_MODES)}, got {self.interpolation!r}")
        if self.resize_mode not in ("shortest", "longest", "squash"):
            raise ValueError(f"resize_mode must be shortest, longest or squash, got {self.resize_mode!r}")

    def _resize(self, images: torch.Tensor, out_hw: tuple[int, int]) -> torch.Tensor:
        if tuple(images.shape[-2:]) == tuple(out_hw):
            return images
        kwargs = {} if self.interpolation == "nearest" else {"align_corners": False, "antialias": True}
        return F.interpolate(images, size=out_hw, mode=self.interpolation, **kwargs)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` in [0, 1] -> normalised ``[B, 3, size[0], size[1]]`` (differentiable)."""
        h, w = images.shape[-2:]
        th, tw = self.size
        if self.resize_mode == "squash":
            out = self._resize(images, (th, tw))
        elif self.resize_mode == "shortest":
            if th == tw:  # torchvision Resize(int): short edge -> size, long edge truncated
                short, long = (h, w) if h <= w else (w, h)
                new_long = int(th * long / short)
                out_hw = (th, new_long) if h <= w else (new_long, th)
            else:  # open_clip ResizeKeepRatio: the scale that covers both target dims
                scale = max(th / h, tw / w)
                out_hw = (round(h * scale), round(w * scale))
            out = self._resize(images, out_hw)
            out = _center_crop(out, (th, tw), self.crop_round, self.fill)
        else:  # longest
            scale = min(th / h, tw / w)
            out = self._resize(images, (round(h * scale), round(w * scale)))
            out = _center_crop(out, (th, tw), self.crop_round, self.fill)
        # bicubic overshoots; the libraries clamp when they round to uint8
        if self.interpolation == "bicubic":
            out = out.clamp(0.0, 1.0)
        mean = torch.tensor(self.mean, dtype=out.dtype, device=out.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, dtype=out.dtype, device=out.device).view(1, 3, 1, 1)
        return (out - mean) / std


def _center_crop(images: torch.Tensor, size: tuple[int, int], rounded: bool, fill: float) -> torch.Tensor:
    th, tw = size
    h, w = images.shape[-2:]
    if th > h or tw > w:  # pad like torchvision / transformers: left/top get the floor
        pad_l, pad_t = max(tw - w, 0) // 2, max(th - h, 0) // 2
        pad_r, pad_b = max(tw - w, 0) - pad_l, max(th - h, 0) - pad_t
        images = F.pad(images, (pad_l, pad_r, pad_t, pad_b), value=fill)
        h, w = images.shape[-2:]
    if rounded:
        top, left = int(round((h - th) / 2.0)), int(round((w - tw) / 2.0))
    else:
        top, left = int((h - th) / 2.0), int((w - tw) / 2.0)
    return images[..., top:top + th, left:left + tw]


def _triple(values: Sequence[float] | float) -> tuple[float, float, float]:
    if isinstance(values, (int, float)):
        return (float(values),) * 3
    values = tuple(float(v) for v in values)
    return values if len(values) == 3 else (values[0],) * 3


def from_open_clip(model) -> ImagePreprocess:
    """The eval-time preprocessing open_clip attached to ``model`` (``open_clip.get_model_preprocess_cfg``)."""
    import open_clip

    cfg = open_clip.get_model_preprocess_cfg(model)
    size = cfg.get("size", 224)
    size = (size, size) if isinstance(size, int) else (int(size[-2]), int(size[-1]))
    interpolation = cfg.get("interpolation", "bicubic")
    return ImagePreprocess(
        size=size,
        mean=_triple(cfg.get("mean", open_clip.OPENAI_DATASET_MEAN)),
        std=_triple(cfg.get("std", open_clip.OPENAI_DATASET_STD)),
        resize_mode=cfg.get("resize_mode", "shortest"),
        interpolation="bilinear" if interpolation == "bilinear" else "bicubic",
        crop_round=True,
        fill=float(cfg.get("fill_color", 0)) / 255.0,
    )


def from_hf_image_processor(processor) -> ImagePreprocess:
    """The preprocessing of a transformers ``CLIPImageProcessor`` (or a processor holding one)."""
    ip = getattr(processor, "image_processor", processor)

    def get(key, default=None):
        value = getattr(ip, key, default)
        return default if value is None else value

    size, crop = get("size", {}), get("crop_size", {})
    size = dict(size) if not isinstance(size, int) else {"shortest_edge": size}
    crop = dict(crop) if not isinstance(crop, int) else {"height": crop, "width": crop}
    do_resize, do_crop = bool(get("do_resize", True)), bool(get("do_center_crop", True))
    if do_resize and size.get("shortest_edge"):
        mode = "shortest"
        target = int(size["shortest_edge"])
        out = (int(crop.get("height", target)), int(crop.get("width", target))) if do_crop else None
        if out is None or out[0] != out[1]:
            raise ValueError(f"unsupported image processor geometry: size={size}, crop_size={crop}")
    elif do_resize and size.get("height") and size.get("width"):
        mode = "squash"
        out = (int(size["height"]), int(size["width"]))
        if do_crop and (int(crop.get("height", out[0])), int(crop.get("width", out[1]))) != out:
            raise ValueError(f"unsupported image processor geometry: size={size}, crop_size={crop}")
    else:
        raise ValueError(f"unsupported image processor settings: do_resize={do_resize}, size={size}")
    resample = int(get("resample", 3))  # PIL: 0 nearest, 2 bilinear, 3 bicubic
    interpolation = {0: "nearest", 2: "bilinear", 3: "bicubic"}.get(resample, "bicubic")
    if not (get("do_rescale", True) and abs(float(get("rescale_factor", 1 / 255)) - 1 / 255) < 1e-9):
        raise ValueError("unsupported image processor: expects do_rescale with rescale_factor 1/255")
    mean = _triple(get("image_mean", (0.0, 0.0, 0.0))) if get("do_normalize", True) else (0.0, 0.0, 0.0)
    std = _triple(get("image_std", (1.0, 1.0, 1.0))) if get("do_normalize", True) else (1.0, 1.0, 1.0)
    return ImagePreprocess(size=out, mean=mean, std=std, resize_mode=mode, interpolation=interpolation,
                           crop_round=False)
