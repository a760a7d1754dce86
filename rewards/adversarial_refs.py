"""Reference ("real") images for the adversarial reward: drawn per prompt or unpaired.

A source answers :meth:`ReferenceSource.draw` ``(prompts, seeds, paired, resize) -> (images, matched)``:
reference ``b`` is a pure function of ``(prompts[b], seeds[b])``, so the discriminator's real batch does
not depend on how a global batch is split across processes.

- :class:`ShapesReferences`: the shapes world renders a fresh scene that satisfies the prompt (paired),
  or a scene of a random prompt of a split (unpaired).
- :class:`ImageReferences`: a folder of images (``.png/.jpg/.jpeg/.webp``, prompts from ``.txt``
  sidecars) or webdataset shards (``png``/``jpg`` + ``txt``). Files are kept encoded in memory and
  decoded when drawn. Paired: a random reference among those whose prompt equals the sample's (case and
  spaces ignored); a prompt without references falls back to an unpaired draw and is counted
  (``matched`` False). Unpaired (GAN-RM mode: a few hundred target images, no prompts needed): any
  reference.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from .base import RewardError

__all__ = ["ReferenceSource", "ShapesReferences", "ImageReferences", "load_references", "normalize_prompt"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
Resize = Callable[[torch.Tensor], torch.Tensor]


def normalize_prompt(prompt: str) -> str:
    return " ".join(str(prompt).lower().split())


class ReferenceSource:
    """Where real images come from."""

    def draw(self, prompts: Sequence[str], seeds: torch.Tensor, paired: bool,
             resize: Resize) -> tuple[torch.Tensor, torch.Tensor]:
        """One reference per sample.

        Args:
            prompts: ``B`` prompts of the generated samples.
            seeds: ``[B]`` int64, one per sample (drawn by the caller's generator).
            paired: match each prompt (True) or draw any reference (False).
            resize: the backbone's resize to its input size, applied to each image.

        Returns:
            images ``[B, 3, S, S]`` float32 in [0, 1] and matched ``[B]`` bool (a reference of the prompt).
        """
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


class ShapesReferences(ReferenceSource):
    """Rendered scenes of the shapes world (``flowrl.data.shapes``).

    Args:
        split: prompts of the unpaired draw (``train`` or ``eval``).
        resolution: rendered image side.
    """

    def __init__(self, split: str = "train", resolution: int = 32):
        from flowrl.data.shapes import split_prompts

        if split not in ("train", "eval"):
            raise RewardError(f"adversarial: reference_split must be 'train' or 'eval', got {split!r}")
        self.prompts = [spec for specs in split_prompts(split).values() for spec in specs]
        self.resolution = int(resolution)

    def __len__(self) -> int:
        return len(self.prompts)

    def draw(self, prompts, seeds, paired, resize):
        from flowrl.data.shapes import PromptParseError, parse_prompt, render, scene_for_prompt

        images = []
        for prompt, seed in zip(prompts, seeds.tolist()):
            rng = random.Random(int(seed))
            if paired:
                try:
                    spec = parse_prompt(prompt)
                except PromptParseError as err:
                    raise RewardError(f"adversarial: shapes references need shapes-world prompts: {err}") from None
            else:
                spec = self.prompts[rng.randrange(len(self.prompts))]
            scene = scene_for_prompt(spec, rng, resolution=self.resolution)
            images.append(torch.from_numpy(render(scene).copy()).permute(2, 0, 1).float() / 255.0)
        batch = resize(torch.stack(images)) if images else torch.zeros(0, 3, self.resolution, self.resolution)
        return batch, torch.ones(len(images), dtype=torch.bool)


class ImageReferences(ReferenceSource):
    """Encoded reference images with optional prompts.

    Args:
        files: encoded images (PNG/JPEG/WebP bytes).
        prompts: one prompt per image, or None (unpaired only).
        where: description for messages (the path they came from).
    """

    def __init__(self, files: list[bytes], prompts: list[str] | None, where: str = "references"):
        if not files:
            raise RewardError(f"adversarial: no reference images in {where}")
        self.files = files
        self.prompts = prompts
        self.where = where
        self.by_prompt: dict[str, list[int]] = {}
        for index, prompt in enumerate(prompts or []):
            if prompt:
                self.by_prompt.setdefault(normalize_prompt(prompt), []).append(index)

    def __len__(self) -> int:
        return len(self.files)

    def _decode(self, index: int) -> torch.Tensor:
        from flowrl.untrusted import open_image

        try:
            with open_image(self.files[index]) as image:
                image = image.convert("RGB")
        except (OSError, ValueError) as err:
            raise RewardError(f"adversarial: reference image {index} of {self.where} is unreadable: {err}") from None
        array = np.asarray(image, dtype=np.float32) / 255.0
        return torch.from_numpy(array).permute(2, 0, 1)[None]

    def draw(self, prompts, seeds, paired, resize):
        if paired and not self.by_prompt:
            raise RewardError(f"adversarial: pairing='prompt' needs reference prompts (.txt sidecars or shard txt "
                              f"entries) in {self.where}; pass pairing='unpaired' to use the images without prompts")
        images, matched = [], []
        for prompt, seed in zip(prompts, seeds.tolist()):
            candidates = self.by_prompt.get(normalize_prompt(prompt)) if paired else None
            pool = candidates if candidates else range(len(self.files))
            images.append(resize(self._decode(pool[int(seed) % len(pool)])))
            matched.append(bool(candidates) or not paired)
        return torch.cat(images), torch.tensor(matched, dtype=torch.bool)


def _from_folder(folder: Path, max_images: int) -> ImageReferences:
    files = sorted(p for p in folder.absolute().iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not files:
        raise RewardError(f"adversarial: no images ({', '.join(IMAGE_SUFFIXES)}) in {str(folder)!r}")
    files = files[:max_images]
    sidecars = [p.with_suffix(".txt") for p in files]
    prompts = [s.read_text(encoding="utf-8").strip() if s.is_file() else "" for s in sidecars]
    return ImageReferences([p.read_bytes() for p in files], prompts if any(prompts) else None, str(folder))


def _from_shards(pattern: str, max_images: int) -> ImageReferences:
    from flowrl.data.webdataset_io import IMAGE_KEYS, ShardError, iter_raw_samples, shard_paths

    files, prompts = [], []
    try:
        for _, _, entries in iter_raw_samples(shard_paths(pattern)):
            key = next((k for k in IMAGE_KEYS if k in entries), None)
            if key is None:
                continue
            files.append(entries[key])
            text = entries.get("txt", entries.get("prompt", b""))
            prompts.append(text.decode("utf-8", "replace").strip())
            if len(files) >= max_images:
                break
    except ShardError as err:
        raise RewardError(f"adversarial: references: {err}") from None
    return ImageReferences(files, prompts if any(prompts) else None, pattern)


def load_references(spec: str, *, max_images: int = 4096, split: str = "train",
                    resolution: int = 32) -> ReferenceSource:
    """``"shapes"`` (rendered), a folder of images, or webdataset shards (a ``.tar``, a glob, a brace
    pattern or a folder of ``.tar`` files); at most ``max_images`` images are kept."""
    if spec == "shapes":
        return ShapesReferences(split, resolution)
    path = Path(str(spec)).expanduser()
    if path.is_dir() and any(p.suffix.lower() in IMAGE_SUFFIXES for p in path.iterdir()):
        return _from_folder(path, max_images)
    if path.is_dir() or path.suffix == ".tar" or any(c in str(spec) for c in "*?{"):
        return _from_shards(str(spec), max_images)
    raise RewardError(f"adversarial: references {spec!r} is neither 'shapes', a folder of images nor webdataset "
                      f"shards (a .tar file, a glob, a brace pattern or a folder of .tar files)")
