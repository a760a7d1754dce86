"""Webdataset I/O: write the shapes world as tar shards, read image-prompt shards back.

A sample of a shard is three files sharing a key::

    <key>.png     the image (RGB PNG)
    <key>.txt     the prompt (UTF-8)
    <key>.json    metadata; for the shapes world the scene json (``resolution``, ``objects``) plus
                  ``kind``, ``split``, ``seed`` and ``index``, so ``Scene.from_json`` reads it as it is

Preference pairs (Diffusion-DPO) are ``<key>.chosen.png``, ``<key>.rejected.png`` and ``<key>.txt``
(:func:`write_pair_shards`, :func:`read_pairs`).

Writing goes through ``webdataset.ShardWriter`` (tar entries get ``mtime=0``, so the same arguments
write byte-identical shards). Reading is :func:`iter_shards`, which the rewards CLI reuses to score a
directory of shards.
"""

from __future__ import annotations

import glob
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from PIL import Image

__all__ = ["ShardError", "SHARD_PATTERN", "shard_paths", "iter_raw_samples", "iter_shards", "write_shapes_shards",
           "PAIR_PATTERN", "PreferencePair", "write_pair_shards", "read_pairs", "decode_image"]

# File names of the shapes shards: shapes-<split>-000000.tar, shapes-<split>-000001.tar, ...
SHARD_PATTERN = "shapes-{split}-%06d.tar"


class ShardError(ValueError):
    """Shards cannot be found or read; the message names the path and what was expected."""


def shard_paths(pattern_or_dir: str | Path) -> list[str]:
    """The shard files named by a directory (its ``*.tar``), a glob (``out/*.tar``), a brace pattern
    (``out/shapes-eval-{000000..000003}.tar``) or one file, sorted.

    Raises:
        ShardError: nothing matches.
    """
    text = str(pattern_or_dir)
    path = Path(text)
    if path.is_dir():
        paths = sorted(str(p) for p in path.glob("*.tar"))
        if not paths:
            raise ShardError(f"no .tar shards in directory {text!r}; write some with "
                             "`flowrl data shapes --split eval --n 600 --out DIR`")
        return paths
    if "{" in text:
        from braceexpand import braceexpand

        paths = list(braceexpand(text))
        missing = [p for p in paths if not Path(p).is_file()]
        if missing:
            raise ShardError(f"shard pattern {text!r}: {len(missing)} of {len(paths)} files are missing "
                             f"(first: {missing[0]!r})")
        return paths
    if glob.has_magic(text):
        paths = sorted(glob.glob(text))
        if not paths:
            raise ShardError(f"no shards match {text!r}")
        return paths
    if path.is_file():
        return [text]
    raise ShardError(f"no shards at {text!r}: give a directory of .tar shards, a glob or a brace pattern")


IMAGE_KEYS = ("png", "jpg", "jpeg", "webp")
PROMPT_KEYS = ("txt", "prompt")


def iter_raw_samples(paths: list[str]) -> Iterator[tuple[str, str, dict[str, bytes]]]:
    """Every sample of the shards, undecoded, in order: ``(key, shard path, {extension: bytes})``.

    Raises:
        ShardError: a shard is missing, truncated or not a tar file (named in the message).
    """
    import webdataset as wds

    for path in paths:
        # No shuffling, no splitting across nodes: every caller gets every sample, in shard order.
        dataset = wds.WebDataset([path], shardshuffle=False, empty_check=False, nodesplitter=None)
        try:
            for sample in dataset:
                entries = {k: v for k, v in sample.items() if not k.startswith("__")}
                yield sample["__key__"], path, entries
        except Exception as err:  # the tar layer raises several types (tarfile, OSError, EOF, ValueError)
            raise ShardError(f"shard {path!r} is unreadable ({type(err).__name__}: {err})") from None


def iter_shards(pattern_or_dir: str | Path) -> Iterator[tuple[str, Image.Image, str, dict]]:
    """Every sample of the shards, in order, as ``(key, image, prompt, metadata)``.

    Args:
        pattern_or_dir: see :func:`shard_paths`.

    Yields:
        ``key`` (str), ``image`` (RGB ``PIL.Image``), ``prompt`` (str, "" when the sample has no
        ``txt``) and ``metadata`` (dict, empty when it has no ``json``).

    Raises:
        ShardError: no shards match, or a sample has no image or an unreadable file.
    """
    for key, path, sample in iter_raw_samples(shard_paths(pattern_or_dir)):
        where = f"sample {key!r} of {path!r}"
        image_bytes = next((sample[k] for k in IMAGE_KEYS if k in sample), None)
        if image_bytes is None:
            raise ShardError(f"{where} has no image (expected a .png, .jpg or .webp entry)")
        try:
            image = Image.open(io.BytesIO(image_bytes)).convert("RGB")
            prompt = sample["txt"].decode("utf-8").strip() if "txt" in sample else ""
            metadata = json.loads(sample["json"]) if "json" in sample else {}
        except (OSError, ValueError) as err:
            raise ShardError(f"{where} is unreadable: {err}") from None
        yield key, image, prompt, metadata


def _png_bytes(array) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def write_shapes_shards(split: str, n: int, out: str | Path, *, seed: int = 0, shard_size: int = 1000,
                        chunk: int = 64, progress: Callable[[int], None] | None = None) -> list[Path]:
    """Write ``n`` rendered examples of the shapes ``split`` as shards in ``out``.

    Example ``i`` is ``sample_examples(split, 1, seed, start=i)`` (the pretraining stream), so shards of
    the same ``(split, seed)`` agree with each other and with training, whatever their size. Shards of
    this split left in ``out`` by an earlier, larger run are removed, so ``out`` then holds exactly
    this dataset (files of other names are left alone).

    Args:
        split: ``"train"`` or ``"eval"``.
        n: number of examples.
        out: the directory (created if missing).
        seed: the stream's seed.
        shard_size: examples per shard.
        chunk: examples rendered per call (memory only; the output does not depend on it).
        progress: optional callable(n_done) for progress bars.

    Returns:
        The shard paths written, in order.
    """
    import webdataset as wds

    from .shapes import sample_examples

    if n < 1 or shard_size < 1:
        raise ValueError(f"n and shard_size must be positive, got n={n}, shard_size={shard_size}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pattern = str(out / SHARD_PATTERN.format(split=split))
    with wds.ShardWriter(pattern, maxcount=shard_size, verbose=0, mtime=0.0) as sink:
        for start in range(0, n, chunk):
            examples = sample_examples(split, min(chunk, n - start), seed=seed, start=start)
            for index, example in enumerate(examples, start=start):
                meta = {**json.loads(example.scene.to_json()), "kind": example.kind, "split": split,
                        "seed": seed, "index": index}
                sink.write({"__key__": f"{split}_{index:08d}", "png": _png_bytes(example.image),
                            "txt": example.prompt, "json": json.dumps(meta)})
            if progress is not None:
                progress(len(examples))
    n_shards = (n + shard_size - 1) // shard_size
    written = [Path(pattern % i) for i in range(n_shards)]
    ours = re.compile(rf"^shapes-{re.escape(split)}-(\d{{6}})\.tar$")
    for stale in out.iterdir():
        match = ours.match(stale.name)
        if match and int(match.group(1)) >= n_shards:
            stale.unlink()
    return written


# ---------------------------------------------------------------------------------------- preference pairs
# A preference pair is one sample of three (or four) files sharing a key:
#     <key>.chosen.png   the preferred image     <key>.rejected.png   the other image
#     <key>.txt          the prompt              <key>.json           optional metadata

PAIR_PATTERN = "pairs-%06d.tar"


@dataclass
class PreferencePair:
    """One pair, undecoded (PNG bytes), so a large set stays small in memory."""

    key: str
    chosen: bytes
    rejected: bytes
    prompt: str
    metadata: dict


def write_pair_shards(pairs, out: str | Path, *, shard_size: int = 1000) -> list[Path]:
    """Write preference pairs as shards ``pairs-000000.tar, ...`` in ``out``.

    Args:
        pairs: iterable of ``(chosen, rejected, prompt, metadata)``; images as ``uint8 [H, W, 3]`` arrays or
            PIL images, ``metadata`` a JSON-able dict (or None).
        out: the directory (created if missing).
        shard_size: pairs per shard.

    Returns:
        The shard paths written, in order.
    """
    import numpy as np
    import webdataset as wds

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pattern = str(out / PAIR_PATTERN)
    count = 0
    with wds.ShardWriter(pattern, maxcount=shard_size, verbose=0, mtime=0.0) as sink:
        for chosen, rejected, prompt, metadata in pairs:
            sample = {"__key__": f"pair_{count:08d}", "chosen.png": _png_bytes(np.asarray(chosen, dtype=np.uint8)),
                      "rejected.png": _png_bytes(np.asarray(rejected, dtype=np.uint8)), "txt": prompt}
            if metadata:
                sample["json"] = json.dumps(metadata)
            sink.write(sample)
            count += 1
    return [Path(pattern % i) for i in range((count + shard_size - 1) // shard_size)]


def read_pairs(pattern_or_dir: str | Path) -> list[PreferencePair]:
    """Every preference pair of the shards, in order (images left as PNG / JPEG bytes).

    Raises:
        ShardError: no shards match, or a sample lacks its chosen or rejected image or its prompt.
    """
    pairs = []
    for key, path, sample in iter_raw_samples(shard_paths(pattern_or_dir)):
        images = {}
        for role in ("chosen", "rejected"):
            images[role] = next((sample[f"{role}.{ext}"] for ext in IMAGE_KEYS if f"{role}.{ext}" in sample), None)
            if images[role] is None:
                raise ShardError(f"sample {key!r} of {path!r} has no {role} image (expected {role}.png); a preference "
                                 "pair holds <key>.chosen.png, <key>.rejected.png and <key>.txt")
        prompt = next((sample[k].decode("utf-8").strip() for k in PROMPT_KEYS if k in sample), None)
        if not prompt:
            raise ShardError(f"sample {key!r} of {path!r} has no prompt (expected <key>.txt)")
        try:
            metadata = json.loads(sample["json"]) if "json" in sample else {}
        except ValueError as err:
            raise ShardError(f"sample {key!r} of {path!r} has unreadable metadata: {err}") from None
        pairs.append(PreferencePair(key, images["chosen"], images["rejected"], prompt, metadata))
    if not pairs:
        raise ShardError(f"no preference pairs in {str(pattern_or_dir)!r}")
    return pairs


def decode_image(data: bytes, where: str = "image") -> Image.Image:
    """An RGB PIL image from PNG / JPEG / WebP bytes.

    Raises:
        ShardError: the bytes are not a readable image (``where`` names it).
    """
    try:
        return Image.open(io.BytesIO(data)).convert("RGB")
    except OSError as err:
        raise ShardError(f"{where} is unreadable: {err}") from None
