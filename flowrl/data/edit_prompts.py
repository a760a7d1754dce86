"""Editing prompts: a source image beside each instruction, from webdataset shards.

A sample is ``<key>.src.png`` (or ``.jpg`` / ``.jpeg`` / ``.webp``), the source image, and ``<key>.txt``, the
instruction (the prompt an editing model is conditioned on); optionally ``<key>.src.txt``, a caption of the source
(what ``clip_directional`` compares the target caption with), and ``<key>.json``, metadata such as a
``target_caption``. Images are opened with an explicit format allow-list and kept as bytes until used, so a large set
stays small in memory::

    write_edit_shards([(source_uint8_hwc, "make the cow blue", "a red cow", {"target_caption": "a blue cow"})], DIR)
    items = read_edit_prompts(DIR)
    metadata = edit_metadata(items[0], resolution=512)   # {"source_image": [3, 512, 512] in [0, 1], ...}
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from flowrl.untrusted import loads_json

from .webdataset_io import (IMAGE_KEYS, PROMPT_KEYS, ShardError, _png_bytes, _StagedShards, decode_image,
                            iter_raw_samples, shard_paths)

__all__ = ["EditPrompt", "write_edit_shards", "read_edit_prompts", "edit_metadata", "EDIT_PATTERN"]

EDIT_PATTERN = "edits-%06d.tar"


@dataclass(frozen=True)
class EditPrompt:
    """One editing prompt, its source image undecoded."""

    key: str
    source: bytes
    prompt: str
    source_caption: str | None
    metadata: dict


def write_edit_shards(samples, out: str | Path, *, shard_size: int = 1000) -> list[Path]:
    """Write ``(source image, instruction, source caption or None, metadata or None)`` samples as shards
    ``edits-000000.tar, ...`` in ``out`` (staged: ``out`` then holds exactly these; a failure leaves it as it was).
    Images are ``uint8 [H, W, 3]`` arrays or PIL images. Returns the shard paths."""
    import numpy as np
    import webdataset as wds

    count = 0
    with _StagedShards(Path(out), "edits") as staged:
        with wds.ShardWriter(str(staged.stage / EDIT_PATTERN), maxcount=shard_size, verbose=0, mtime=0.0) as sink:
            for source, prompt, caption, metadata in samples:
                sample = {"__key__": f"edit_{count:08d}", "src.png": _png_bytes(np.asarray(source, dtype=np.uint8)),
                          "txt": prompt}
                if caption:
                    sample["src.txt"] = caption
                if metadata:
                    sample["json"] = json.dumps(metadata)
                sink.write(sample)
                count += 1
        return staged.publish([EDIT_PATTERN % i for i in range((count + shard_size - 1) // shard_size)],
                              re.compile(r"^edits-(\d{6})\.tar$"))


def read_edit_prompts(pattern_or_dir: str | Path) -> list[EditPrompt]:
    """Every editing prompt of the shards, in order.

    Raises:
        ShardError: no shards match, or a sample lacks its source image or its instruction.
    """
    items = []
    for key, path, sample in iter_raw_samples(shard_paths(pattern_or_dir)):
        source = next((sample[f"src.{ext}"] for ext in IMAGE_KEYS if f"src.{ext}" in sample), None)
        if source is None:
            raise ShardError(f"sample {key!r} of {path!r} has no source image (expected <key>.src.png); an editing "
                             "prompt holds <key>.src.png and <key>.txt")
        prompt = next((sample[k].decode("utf-8").strip() for k in PROMPT_KEYS if k in sample), None)
        if not prompt:
            raise ShardError(f"sample {key!r} of {path!r} has no instruction (expected <key>.txt)")
        caption = sample["src.txt"].decode("utf-8").strip() if "src.txt" in sample else None
        try:
            metadata = loads_json(sample["json"]) if "json" in sample else {}
        except ValueError as err:
            raise ShardError(f"sample {key!r} of {path!r} has unreadable metadata: {err}") from None
        items.append(EditPrompt(key, source, prompt, caption or None, metadata))
    if not items:
        raise ShardError(f"no editing prompts in {str(pattern_or_dir)!r}")
    return items


def edit_metadata(item: EditPrompt, resolution: int | tuple[int, int] | None) -> dict:
    """The metadata a reward (and an editing model) sees for ``item``: its own ``json`` fields plus ``source_image``
    (``[3, H, W]`` float32 in [0, 1], resized to ``resolution`` with bicubic resampling; None: its own size) and
    ``source_caption`` (the instruction when the shard has no ``src.txt``)."""
    import numpy as np
    from PIL import Image

    image = decode_image(item.source, where=f"the source image of {item.key!r}")
    if resolution is not None:
        height, width = (resolution, resolution) if isinstance(resolution, int) else resolution
        if image.size != (width, height):
            image = image.resize((width, height), Image.Resampling.BICUBIC)
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()
    return {**item.metadata, "source_image": pixels, "source_caption": item.source_caption or item.prompt}
