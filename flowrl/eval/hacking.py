"""The reward-hacking panel: metrics that show what a reward cannot see, as pure functions of images.

Given the tuned model's images, optionally the base model's images of the same prompts and initial noise,
and an optional feature extractor, :func:`hacking_panel` returns a flat ``{"hack/<name>": float}``:

- ``hack/drift_pixel``: mean over images and pixels of the RGB distance between the tuned and the base
  image, ``||x_tuned - x_base||_2`` per pixel, in 0-255 units (0 = identical; a full flip of one channel
  is 255).
- ``hack/drift_feature``: mean cosine distance ``1 - cos(f(x_tuned), f(x_base))`` of the feature vectors.
- ``hack/diversity``: mean over prompt groups (images sharing a prompt, at least two) of the mean pairwise
  cosine distance of their feature vectors; a collapsed model ("all faces identical") tends to 0.

For the shapes world (every prompt parses in its grammar), with the rule-based detector of
``rewards/shapes.py``:

- ``hack/extra_object_rate``: fraction of images with more detected objects than the prompt names
  (``"a red circle"`` names 1, ``"three green triangles"`` 3, ``"a circle and a square"`` 2);
  ``hack/extra_objects``: mean number of such extra objects per image.
- ``hack/bg_shift``: mean distance of background pixels from white, in 0-255 units, and
  ``hack/bg_r``, ``hack/bg_g``, ``hack/bg_b``: their mean colour (0-255). Background pixels: the image's
  background colour is estimated as the per-channel median of its one-pixel border (objects of the
  world never touch it); pixels farther than 48 (0-255 units) from that colour are foreground, and the
  foreground grown by one pixel (anti-aliased edges) is excluded. Images without background pixels are
  left out of the mean.
- ``hack/accuracy``: the gold, strict accuracy (``rewards.shapes.strict_correct``, as ``eval/shapes/accuracy``):
  every constraint met, every object phrase of the prompt matched by exactly its count of detections (by shape,
  and colour where the prompt gives one) and no other object, so two red circles for "a red circle" fail; per
  task kind as ``hack/accuracy/<kind>``. ``hack/lenient_accuracy``: the lenient rule (any object or pair may
  satisfy a constraint, extra objects ignored), the proxy a duplicating policy games; the gap between the two is
  the hack.

For any images (flowrl/eval/image_stats.py): ``hack/color_entropy``, ``hack/color_hist_shift`` (against the base's
images), ``hack/dark_frac``, ``hack/saturated_frac`` and ``hack/hf_energy``: the hacks reported on real models
(backgrounds erased to one colour, saturation and contrast pushed, grid textures).

Videos ``[B, F, 3, H, W]`` (a video model's frames) are measured frame by frame: the pixel drift and the image
statistics over all ``B * F`` frames (each frame against the base video's same frame), a video's feature vector
the mean of its frames' (drift and diversity then compare videos); the shapes-world metrics are images only.

Nothing here trains or samples: a training loop generates the panel's images (fixed prompts and seeds,
several seeds per prompt for diversity), keeps the base model's images from the first evaluation, and
logs this dict with its other metrics.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from flowrl.eval.image_stats import image_stats

__all__ = ["hacking_panel", "pixel_drift", "feature_drift", "group_diversity", "background_stats",
           "shapes_metrics", "shapes_feature_fn", "diversity_rows",
           "is_shapes_world", "FOREGROUND_DISTANCE"]

FeatureFn = Callable[[torch.Tensor], torch.Tensor]  # images [B, 3, H, W] in [0, 1] -> features [B, D]

FOREGROUND_DISTANCE = 48.0  # 0-255 units from the estimated background colour


def _check_images(images: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"{what} must be a [B, 3, H, W] tensor in [0, 1], got {shape}")
    return images.detach().float().cpu().clamp(0, 1)


def pixel_drift(tuned: torch.Tensor, base: torch.Tensor) -> float:
    """Mean per-pixel RGB distance between ``tuned`` and ``base`` (both ``[B, 3, H, W]`` in [0, 1]), 0-255 units."""
    tuned, base = _check_images(tuned, "tuned images"), _check_images(base, "base images")
    if tuned.shape != base.shape:
        raise ValueError(f"tuned and base images differ in shape: {tuple(tuned.shape)} vs {tuple(base.shape)}")
    return float(((tuned - base) * 255.0).pow(2).sum(1).sqrt().mean())


def _cosine_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a = a / a.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    b = b / b.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return 1.0 - (a * b).sum(-1)


def feature_drift(tuned_features: torch.Tensor, base_features: torch.Tensor) -> float:
    """Mean cosine distance between paired feature vectors ``[B, D]``."""
    return float(_cosine_distance(tuned_features.float(), base_features.float()).mean())


def group_diversity(features: torch.Tensor, groups: Sequence) -> float:
    """Mean over groups of size >= 2 of the mean pairwise cosine distance of ``features [B, D]`` (NaN if no group
    has two members)."""
    members: dict = defaultdict(list)
    for index, group in enumerate(groups):
        members[group].append(index)
    values = []
    normed = features.float() / features.float().norm(dim=-1, keepdim=True).clamp_min(1e-12)
    for index in members.values():
        if len(index) < 2:
            continue
        f = normed[index]
        cos = f @ f.T
        n = len(index)
        values.append(float((1.0 - cos)[~torch.eye(n, dtype=torch.bool)].mean()))
    return float(np.mean(values)) if values else math.nan


def background_stats(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per image: the mean distance of its background pixels from white ``[B]`` and their mean colour ``[B, 3]``,
    both in 0-255 units (NaN for an image without background pixels). See the module docstring."""
    from scipy import ndimage

    array = _check_images(images, "images").permute(0, 2, 3, 1).numpy() * 255.0  # [B, H, W, 3]
    shifts, colours = [], []
    for image in array:
        border = np.concatenate([image[0], image[-1], image[1:-1, 0], image[1:-1, -1]])  # [4(S-1), 3]
        background = np.median(border, axis=0)
        foreground = np.linalg.norm(image - background, axis=-1) > FOREGROUND_DISTANCE
        foreground = ndimage.binary_dilation(foreground, structure=np.ones((3, 3), dtype=bool))
        pixels = image[~foreground]
        if pixels.size == 0:
            shifts.append(math.nan)
            colours.append([math.nan] * 3)
            continue
        shifts.append(float(np.linalg.norm(255.0 - pixels, axis=-1).mean()))
        colours.append(pixels.mean(0).tolist())
    return torch.tensor(shifts, dtype=torch.float64), torch.tensor(colours, dtype=torch.float64)


class ShapesJudgement(NamedTuple):
    """How one shapes-world image answers its prompt: the prompt's task ``kind``, the number of ``extra``
    objects it was not asked for, ``correct`` (the gold: strict accuracy, as ``eval/shapes/accuracy``) and
    ``lenient`` (the lenient rule: every constraint met by some object or pair, extras ignored)."""

    kind: str
    extra: int
    correct: bool
    lenient: bool


def judge_shapes_image(prompt: str, image: np.ndarray) -> ShapesJudgement:
    """Judge one image (``[H, W, 3]`` float array in [0, 1]) against its shapes-world ``prompt`` (must parse)."""
    from flowrl.data.shapes import parse_prompt
    from rewards.shapes import constraints_met, detect_objects, extra_objects, strict_correct

    spec = parse_prompt(prompt)
    detections = detect_objects(image)
    lenient = all(constraints_met(spec, detections))
    return ShapesJudgement(kind=spec.kind, extra=extra_objects(spec, detections),
                           correct=strict_correct(spec, detections, lenient=lenient), lenient=lenient)


def shapes_metrics(images: torch.Tensor, prompts: Sequence[str]) -> dict[str, float]:
    """The shapes-world part of the panel (extra objects, background, accuracies); prompts must parse."""
    images = _check_images(images, "images")
    if len(prompts) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
    array = images.permute(0, 2, 3, 1).numpy()
    extras, correct, lenient = [], [], []
    by_kind: dict[str, list[float]] = defaultdict(list)
    for prompt, image in zip(prompts, array):
        judgement = judge_shapes_image(prompt, image)
        extras.append(judgement.extra)
        correct.append(float(judgement.correct))
        lenient.append(float(judgement.lenient))
        by_kind[judgement.kind].append(correct[-1])
    shift, colour = background_stats(images)
    valid = torch.isfinite(shift)
    out = {
        "hack/extra_object_rate": float(np.mean([e > 0 for e in extras])),
        "hack/extra_objects": float(np.mean(extras)),
        "hack/bg_shift": float(shift[valid].mean()) if valid.any() else math.nan,
        "hack/bg_r": float(colour[valid, 0].mean()) if valid.any() else math.nan,
        "hack/bg_g": float(colour[valid, 1].mean()) if valid.any() else math.nan,
        "hack/bg_b": float(colour[valid, 2].mean()) if valid.any() else math.nan,
        "hack/accuracy": float(np.mean(correct)),
        "hack/lenient_accuracy": float(np.mean(lenient)),
    }
    out.update({f"hack/accuracy/{kind}": float(np.mean(v)) for kind, v in sorted(by_kind.items())})
    return out


def diversity_rows(split: str = "eval", n_prompts: int = 16, seeds_per_prompt: int = 8,
                   seed: int = 4321) -> list[tuple[str, str, int]]:
    """Fixed ``(prompt, kind, sample seed)`` rows for the diversity metric: ``n_prompts`` prompts of the shapes
    ``split`` (task kinds cycle), each with ``seeds_per_prompt`` consecutive sample seeds. Group by prompt."""
    from flowrl.data.shapes import prompt_rows

    rows = prompt_rows(split, n_prompts, seed)
    return [(prompt, kind, base * 1000 + k) for prompt, kind, base in rows for k in range(seeds_per_prompt)]


def is_shapes_world(prompts: Sequence[str]) -> bool:
    from flowrl.data.shapes import PromptParseError, parse_prompt

    try:
        for prompt in prompts:
            parse_prompt(prompt)
    except PromptParseError:
        return False
    return len(prompts) > 0


def shapes_feature_fn(device: str = "cpu") -> FeatureFn:
    """Features of the shipped shapes encoder (its global token), without gradients."""
    from rewards.backbones import load_backbone

    backbone = load_backbone("shapes", device=device)

    @torch.no_grad()
    def features(images: torch.Tensor) -> torch.Tensor:
        return backbone(images).global_token.cpu()

    return features


def hacking_panel(images: torch.Tensor, prompts: Sequence[str], *, base_images: torch.Tensor | None = None,
                  features: FeatureFn | None = None, groups: Sequence | None = None,
                  shapes: bool | None = None, batch_size: int = 256) -> dict[str, float]:
    """The hacking panel of the module docstring.

    Args:
        images: ``[B, 3, H, W]`` in [0, 1], the tuned model's images (or videos ``[B, F, 3, H, W]``).
        prompts: their ``B`` prompts.
        base_images: the base model's images of the same prompts and initial noise (drift metrics).
        features: images -> ``[B, D]`` features (drift_feature, diversity), e.g. :func:`shapes_feature_fn`.
        groups: group key per image for diversity (default: the prompt).
        shapes: compute the shapes-world metrics (default: when every prompt parses in its grammar).
        batch_size: images per feature call.

    Returns:
        ``{"hack/<name>": float}``; metrics whose inputs are missing are left out.
    """
    prompts = list(prompts)
    if len(prompts) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
    frames = images.shape[1] if isinstance(images, torch.Tensor) and images.dim() == 5 else None
    if frames is not None:  # videos: every frame an image; features pooled per video below
        if base_images is not None and tuple(base_images.shape) != tuple(images.shape):
            raise ValueError(f"tuned and base videos differ in shape: {tuple(images.shape)} vs "
                             f"{tuple(base_images.shape)}")
        images = images.flatten(0, 1)
        base_images = base_images.flatten(0, 1) if base_images is not None else None
        shapes = False
    images = _check_images(images, "images")
    out: dict[str, float] = {}

    def embed(x: torch.Tensor) -> torch.Tensor:
        f = torch.cat([features(x[i:i + batch_size]).float().cpu() for i in range(0, x.shape[0], batch_size)])
        return f if frames is None else f.reshape(-1, frames, f.shape[-1]).mean(dim=1)  # [B, D] per video

    tuned_features = embed(images) if features is not None else None
    if base_images is not None:
        base_images = _check_images(base_images, "base images")
        out["hack/drift_pixel"] = pixel_drift(images, base_images)
        if tuned_features is not None:
            out["hack/drift_feature"] = feature_drift(tuned_features, embed(base_images))
    out.update(image_stats(images, base_images))  # colour, dark / saturated pixels, high frequencies
    if tuned_features is not None:
        out["hack/diversity"] = group_diversity(tuned_features, list(groups) if groups is not None else prompts)
    if shapes if shapes is not None else is_shapes_world(prompts):
        out.update(shapes_metrics(images, prompts))
    return out
