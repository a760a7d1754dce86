"""Synthetic images of the shapes world for training reward models: random scenes, colour shifts and a
generator of visual artifacts.

Used to build the frozen shapes encoder (:mod:`rewards.backbones`), to train the artifact classifier
(:mod:`rewards.artifact`) and by tests. Every function is a pure function of its inputs and an explicit
``numpy.random.Generator``; nothing global is drawn.

Artifacts (each a function ``(image [H, W, 3] float in [0, 1], scene, rng) -> image``):

- ``blotch``: one or two soft, irregular smudges of a muddy colour (three overlapping Gaussian bumps,
  opacity 0.5-0.85);
- ``broken_edge``: an object with a bite taken out of its outline (a background-coloured disc of radius
  2-3 px centred on its boundary) or torn (a band of 3-5 rows through it shifted sideways by 3-4 px);
- ``stray_fragments``: one to three small pieces of palette colour (specks of radius 1.2-1.8 px or 3-6 px
  strokes) on the background;
- ``colour_cast``: the whole image multiplied by a tint ``1 - s (1 - c)`` for a random hue ``c`` and
  strength ``s`` in [0.12, 0.35], so white turns into a pale colour (the background hack of the main job);
- ``noise``: Gaussian pixel noise of standard deviation 0.05-0.12;
- ``blur``: Gaussian blur of standard deviation 0.9-1.6 px.

Magnitudes are chosen so that each artifact is visible at 32 x 32 to a person looking for it. The clean
class is not the pristine render: it carries the faint imperfections a generator's images have (a colour
cast of strength up to 0.05, noise up to std 0.03, blur up to 0.5 px; :func:`imperfect`), so a classifier
flags artifacts rather than "not rendered by PIL". (Trained on pristine renders only, the classifier called
40% of the shipped model's held-out images artifacts, for their faint background tints.)
"""

from __future__ import annotations

import colorsys
import math

import numpy as np
import torch
from scipy import ndimage

from flowrl.data.shapes import COLORS, MAX_SIZE, MIN_SIZE, PALETTE, RESOLUTION, SHAPES, Scene, SceneObject, render

__all__ = ["ARTIFACTS", "random_scene", "render_scenes", "colour_cast", "apply_artifact", "artifact_dataset",
           "imperfect", "scene_targets"]


# ----------------------------------------------------------------------------------------------- scenes


def _place(rng: np.random.Generator, sizes: list[float], resolution: int, gap: float = 1.0,
           tries: int = 100) -> list[tuple[float, float]]:
    """Centres for objects of ``sizes`` whose boxes keep ``gap`` px apart; objects that do not fit are dropped."""
    centres: list[tuple[float, float]] = []
    kept: list[float] = []
    for size in sizes:
        half = size / 2
        for _ in range(tries):
            cx = float(rng.uniform(half + 1, resolution - half - 1))
            cy = float(rng.uniform(half + 1, resolution - half - 1))
            if all(max(abs(cx - x) - (half + s / 2), abs(cy - y) - (half + s / 2)) >= gap
                   for (x, y), s in zip(centres, kept)):
                centres.append((cx, cy))
                kept.append(size)
                break
    return centres


def random_scene(rng: np.random.Generator, max_objects: int = 5, min_objects: int = 0,
                 resolution: int = RESOLUTION) -> Scene:
    """A scene of ``min_objects..max_objects`` random objects (shape, colour, size, position), none overlapping."""
    n = int(rng.integers(min_objects, max_objects + 1))
    kinds = [(SHAPES[int(rng.integers(len(SHAPES)))], COLORS[int(rng.integers(len(COLORS)))],
              float(rng.uniform(MIN_SIZE, MAX_SIZE)) * resolution / RESOLUTION) for _ in range(n)]
    centres = _place(rng, [k[2] for k in kinds], resolution)
    objects = tuple(SceneObject(s, c, x, y, size) for (s, c, size), (x, y) in zip(kinds, centres))
    return Scene(objects, resolution)


def render_scenes(scenes: list[Scene]) -> np.ndarray:
    """``[B, H, W, 3]`` float32 in [0, 1]."""
    return np.stack([render(s) for s in scenes]).astype(np.float32) / 255.0


def scene_targets(scene: Scene) -> np.ndarray:
    """What a scene holds, as a vector: counts of each (shape, colour) pair ``[18]`` then a 4 x 4
    occupancy grid ``[16]`` (1 where an object's centre falls in the cell)."""
    counts = np.zeros((len(SHAPES), len(COLORS)), dtype=np.float32)
    grid = np.zeros((4, 4), dtype=np.float32)
    for o in scene.objects:
        counts[SHAPES.index(o.shape), COLORS.index(o.color)] += 1
        cell = scene.resolution / 4
        grid[min(int(o.cy // cell), 3), min(int(o.cx // cell), 3)] = 1.0
    return np.concatenate([counts.ravel(), grid.ravel()])


# ----------------------------------------------------------------------------------------------- artifacts


def _random_hue(rng: np.random.Generator, saturation: float = 1.0) -> np.ndarray:
    return np.array(colorsys.hsv_to_rgb(float(rng.uniform()), saturation, 1.0), dtype=np.float32)


def colour_cast(image: np.ndarray, tint: np.ndarray | tuple[float, float, float]) -> np.ndarray:
    """``image * tint`` per channel (white becomes ``tint``); ``image [..., 3]`` in [0, 1]."""
    return np.clip(image * np.asarray(tint, dtype=np.float32), 0.0, 1.0)


def _grid(h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float32)
    return ys + 0.5, xs + 0.5  # pixel centres


def _blend(image: np.ndarray, alpha: np.ndarray, colour: np.ndarray) -> np.ndarray:
    return image * (1 - alpha[..., None]) + alpha[..., None] * colour


def _blotch(image: np.ndarray, scene: Scene, rng: np.random.Generator) -> np.ndarray:
    h, w = image.shape[:2]
    ys, xs = _grid(h, w)
    for _ in range(int(rng.integers(1, 3))):
        cx, cy = rng.uniform(4, w - 4), rng.uniform(4, h - 4)
        mask = np.zeros((h, w), dtype=np.float32)
        for _ in range(3):  # three bumps around one centre: an irregular outline
            bx, by = cx + rng.normal(0, 1.5), cy + rng.normal(0, 1.5)
            radius = rng.uniform(1.5, 3.0)
            mask = np.maximum(mask, np.exp(-((xs - bx) ** 2 + (ys - by) ** 2) / (2 * radius**2)))
        colour = _random_hue(rng, saturation=float(rng.uniform(0.3, 0.8))) * rng.uniform(0.35, 0.8)
        image = _blend(image, float(rng.uniform(0.5, 0.85)) * mask, colour)
    return image


def _broken_edge(image: np.ndarray, scene: Scene, rng: np.random.Generator) -> np.ndarray:
    if not scene.objects:
        return _stray_fragments(image, scene, rng)
    o = scene.objects[int(rng.integers(len(scene.objects)))]
    h, w = image.shape[:2]
    image = image.copy()
    if rng.uniform() < 0.5:  # a bite out of the outline, filled with the background
        angle = rng.uniform(0, 2 * math.pi)
        bx, by = o.cx + o.size / 2 * math.cos(angle), o.cy + o.size / 2 * math.sin(angle)
        ys, xs = _grid(h, w)
        radius = rng.uniform(2.0, 3.0)
        alpha = np.clip(radius + 0.5 - np.sqrt((xs - bx) ** 2 + (ys - by) ** 2), 0.0, 1.0)
        return _blend(image, alpha, np.ones(3, dtype=np.float32))
    # a tear: rows through the object shifted sideways
    band = int(rng.integers(3, 6))
    top = int(np.clip(round(o.cy + rng.uniform(-o.size / 3, o.size / 3)) - band // 2, 0, h - band))
    shift = int(rng.choice([-1, 1]) * rng.integers(3, 5))
    left, right = int(max(0, math.floor(o.cx - o.size / 2) - 4)), int(min(w, math.ceil(o.cx + o.size / 2) + 4))
    image[top:top + band, left:right] = np.roll(image[top:top + band, left:right], shift, axis=1)
    return image


def _stray_fragments(image: np.ndarray, scene: Scene, rng: np.random.Generator) -> np.ndarray:
    h, w = image.shape[:2]
    ys, xs = _grid(h, w)
    for _ in range(int(rng.integers(1, 4))):
        colour = np.array(PALETTE[COLORS[int(rng.integers(len(COLORS)))]], dtype=np.float32) / 255.0
        x0, y0 = rng.uniform(2, w - 2), rng.uniform(2, h - 2)
        if rng.uniform() < 0.5:  # a speck
            radius = rng.uniform(1.2, 1.8)
            distance = np.sqrt((xs - x0) ** 2 + (ys - y0) ** 2) - radius
        else:  # a stroke: distance to a segment of length 3-6 px
            length, angle = rng.uniform(3, 6), rng.uniform(0, math.pi)
            dx, dy = math.cos(angle), math.sin(angle)
            t = np.clip((xs - x0) * dx + (ys - y0) * dy, 0, length)
            distance = np.sqrt((xs - x0 - t * dx) ** 2 + (ys - y0 - t * dy) ** 2) - 0.6
        image = _blend(image, np.clip(0.5 - distance, 0.0, 1.0), colour)
    return image


def _colour_cast(image: np.ndarray, scene: Scene, rng: np.random.Generator) -> np.ndarray:
    strength = rng.uniform(0.12, 0.35)
    return colour_cast(image, 1.0 - strength * (1.0 - _random_hue(rng)))


def _noise(image: np.ndarray, scene: Scene, rng: np.random.Generator) -> np.ndarray:
    return image + rng.normal(0.0, rng.uniform(0.05, 0.12), size=image.shape).astype(np.float32)


def _blur(image: np.ndarray, scene: Scene, rng: np.random.Generator) -> np.ndarray:
    sigma = float(rng.uniform(0.9, 1.6))
    return ndimage.gaussian_filter(image, sigma=(sigma, sigma, 0), mode="nearest")


ARTIFACTS = {
    "blotch": _blotch,
    "broken_edge": _broken_edge,
    "stray_fragments": _stray_fragments,
    "colour_cast": _colour_cast,
    "noise": _noise,
    "blur": _blur,
}


def apply_artifact(kind: str, image: np.ndarray, scene: Scene, rng: np.random.Generator) -> np.ndarray:
    """``image [H, W, 3]`` in [0, 1] with artifact ``kind`` (one of :data:`ARTIFACTS`), clipped to [0, 1]."""
    if kind not in ARTIFACTS:
        raise ValueError(f"unknown artifact {kind!r}; valid: {', '.join(ARTIFACTS)}")
    return np.clip(ARTIFACTS[kind](image.astype(np.float32), scene, rng), 0.0, 1.0).astype(np.float32)


def imperfect(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A clean render with the small imperfections every generated image has, each with probability 1/2: a
    faint colour cast (strength up to 0.05), pixel noise (std up to 0.03), a slight blur (std up to 0.5 px).
    They stay well below the artifacts' magnitudes (cast 0.12, noise 0.05, blur 0.9)."""
    if rng.uniform() < 0.5:
        image = colour_cast(image, 1.0 - rng.uniform(0.0, 0.05) * (1.0 - _random_hue(rng)))
    if rng.uniform() < 0.5:
        sigma = float(rng.uniform(0.0, 0.5))
        image = ndimage.gaussian_filter(image, sigma=(sigma, sigma, 0), mode="nearest")
    if rng.uniform() < 0.5:
        image = image + rng.normal(0.0, rng.uniform(0.0, 0.03), size=image.shape)
    return np.clip(image, 0.0, 1.0).astype(np.float32)


def artifact_dataset(n: int, seed: int, resolution: int = RESOLUTION,
                     kinds: tuple[str, ...] = tuple(ARTIFACTS)) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """``n`` labelled images: even indices clean, odd ones with an artifact (kinds cycle).

    Image ``i`` depends only on ``(seed, i)``, so a held-out set is a different seed.

    Returns:
        images ``[n, 3, H, W]`` float32 in [0, 1], labels ``[n]`` (1 = artifact), and each image's kind
        (``"clean"`` or the artifact's name).
    """
    images, labels, names = [], [], []
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        scene = random_scene(rng, max_objects=4, min_objects=1, resolution=resolution)
        image = render_scenes([scene])[0]
        if i % 2 == 0:
            images.append(imperfect(image, rng))
            labels.append(0.0)
            names.append("clean")
        else:
            kind = kinds[(i // 2) % len(kinds)]
            images.append(apply_artifact(kind, image, scene, rng))
            labels.append(1.0)
            names.append(kind)
    array = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()
    return array, torch.tensor(labels), names
