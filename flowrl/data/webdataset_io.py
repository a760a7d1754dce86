"""Webdataset I/O: write the shapes world as tar shards, read image-prompt shards back.

A sample of a shard is three files sharing a key::

    <key>.png     the image (RGB PNG)
    <key>.txt     the prompt (UTF-8)
    <key>.json    metadata; for the shapes world the scene json (``resolution``, ``objects``) plus
                  ``kind``, ``split``, ``seed`` and ``index``, so ``Scene.from_json`` reads it as it is

Preference pairs (Diffusion-DPO) are ``<key>.chosen.png``, ``<key>.rejected.png`` and ``<key>.txt``
(:func:`write_pair_shards`, :func:`read_pairs`).

Writing goes through ``webdataset.ShardWriter`` (tar entries get ``mtime=0``, so the same arguments
write byte-identical shards) into a temporary folder beside the output; the shards replace the old ones
(one rename each) only once all of them are written, so a full disk or a Ctrl-C leaves the previous
dataset as it was. Reading is :func:`iter_shards`, which the rewards CLI reuses to score a directory of
shards.

Shard names are paths, never URLs: :func:`shard_paths` returns absolute local paths (a file called
``pipe:cmd #.tar`` in a listed folder is a file, not a shell command), and :func:`iter_raw_samples` opens
each file itself and hands webdataset the open file, so no name ever reaches webdataset's URL opener
(``gopen``, which runs ``pipe:`` names through a shell). Images are decoded as PNG, JPEG or WebP only, and
metadata JSON is read with bounded nesting (:mod:`flowrl.untrusted`).
"""

from __future__ import annotations

from flowrl.errors import FlowrlError

import glob
import io
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from PIL import Image

from flowrl.untrusted import loads_json, local_file, open_image

__all__ = ["ShardError", "SHARD_PATTERN", "shard_paths", "iter_raw_samples", "iter_shards", "write_shapes_shards",
           "PAIR_PATTERN", "PreferencePair", "write_pair_shards", "read_pairs", "decode_image"]

# File names of the shapes shards: shapes-<split>-000000.tar, shapes-<split>-000001.tar, ...
SHARD_PATTERN = "shapes-{split}-%06d.tar"


class ShardError(FlowrlError, ValueError):
    """Shards cannot be found or read; the message names the path and what was expected."""


def shard_paths(pattern_or_dir: str | Path) -> list[str]:
    """The shard files named by a directory (its ``*.tar``), a glob (``out/*.tar``), a brace pattern
    (``out/shapes-eval-{000000..000003}.tar``) or one file, sorted, as absolute local paths.

    Raises:
        ShardError: nothing matches.
    """
    text = str(pattern_or_dir)
    path = Path(text)
    if path.is_dir():
        paths = sorted(local_file(p) for p in path.glob("*.tar") if p.is_file())
        if not paths:
            raise ShardError(f"no .tar shards in directory {text!r}; write some with "
                             "`flowrl data shapes --split eval --n 600 --out DIR`")
        return paths
    if "{" in text:
        from braceexpand import braceexpand

        paths = [local_file(p) for p in braceexpand(text)]
        missing = [p for p in paths if not Path(p).is_file()]
        if missing:
            raise ShardError(f"shard pattern {text!r}: {len(missing)} of {len(paths)} files are missing "
                             f"(first: {missing[0]!r})")
        return paths
    if glob.has_magic(text):
        paths = sorted(local_file(p) for p in glob.glob(text) if Path(p).is_file())
        if not paths:
            raise ShardError(f"no shards match {text!r}")
        return paths
    if path.is_file():
        return [local_file(text)]
    raise ShardError(f"no shards at {text!r}: give a directory of .tar shards, a glob or a brace pattern")


IMAGE_KEYS = ("png", "jpg", "jpeg", "webp")
PROMPT_KEYS = ("txt", "prompt")


def iter_raw_samples(paths: list[str]) -> Iterator[tuple[str, str, dict[str, bytes]]]:
    """Every sample of the shards, undecoded, in order: ``(key, shard path, {extension: bytes})``.

    Each path is opened here as a local file (see the module docstring: a name is never a URL).

    Raises:
        ShardError: a shard is missing, truncated or not a tar file (named in the message).
    """
    from webdataset.tariterators import group_by_keys, tar_file_expander

    for path in paths:
        try:
            stream = open(local_file(path), "rb")
        except OSError as err:
            raise ShardError(f"shard {path!r} is unreadable ({err.strerror or err})") from None
        # No shuffling, no splitting across nodes: every caller gets every sample, in shard order.
        with stream:
            try:
                for sample in group_by_keys(tar_file_expander([{"url": path, "stream": stream}])):
                    entries = {k: v for k, v in sample.items() if not k.startswith("__")}
                    yield sample["__key__"], path, entries
            except Exception as err:  # the tar layer raises several types (tarfile, OSError, EOF, ValueError)
                detail = str(err.args[0]) if err.args else ""
                raise ShardError(f"shard {path!r} is unreadable ({type(err).__name__}: {detail})") from None


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
        image = decode_image(image_bytes, where)
        try:
            prompt = sample["txt"].decode("utf-8").strip() if "txt" in sample else ""
            metadata = loads_json(sample["json"]) if "json" in sample else {}
        except (OSError, ValueError) as err:
            raise ShardError(f"{where} is unreadable: {err}") from None
        yield key, image, prompt, metadata


def _png_bytes(array) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


class _StagedShards:
    """Shards are written into a hidden folder inside ``out`` and moved into ``out`` (one rename each, on
    the same file system) only when all of them are complete; :meth:`publish` also removes shards of
    ``pattern`` left by an earlier, larger dataset. A failure (a full disk, Ctrl-C) removes the staging
    folder and leaves ``out`` as it was."""

    def __init__(self, out: Path, name: str):
        out.mkdir(parents=True, exist_ok=True)
        self.out = Path(local_file(out))
        self.stage = self.out / f".{name}.tmp-{os.getpid()}"
        shutil.rmtree(self.stage, ignore_errors=True)
        self.stage.mkdir()

    def __enter__(self) -> "_StagedShards":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        shutil.rmtree(self.stage, ignore_errors=True)

    def publish(self, names: list[str], ours: re.Pattern) -> list[Path]:
        for name in names:
            os.replace(self.stage / name, self.out / name)
        keep = set(names)
        for stale in self.out.iterdir():
            if ours.match(stale.name) and stale.name not in keep:
                stale.unlink()
        return [self.out / name for name in names]


def write_shapes_shards(split: str, n: int, out: str | Path, *, seed: int = 0, shard_size: int = 1000,
                        chunk: int = 64, progress: Callable[[int], None] | None = None) -> list[Path]:
    """Write ``n`` rendered examples of the shapes ``split`` as shards in ``out``.

    Example ``i`` is ``sample_examples(split, 1, seed, start=i)`` (the pretraining stream), so shards of
    the same ``(split, seed)`` agree with each other and with training, whatever their size. Shards of
    this split left in ``out`` by an earlier, larger run are removed, so ``out`` then holds exactly
    this dataset (files of other names are left alone). Nothing in ``out`` changes until every shard is
    written (see :class:`_StagedShards`).

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
    name = SHARD_PATTERN.format(split=split)
    with _StagedShards(Path(out), f"shapes-{split}") as staged:
        with wds.ShardWriter(str(staged.stage / name), maxcount=shard_size, verbose=0, mtime=0.0) as sink:
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
        return staged.publish([name % i for i in range(n_shards)],
                              re.compile(rf"^shapes-{re.escape(split)}-(\d{{6}})\.tar$"))


# ---------------------------------------------------------------------------------------- preference pairs
# A preference pair is one sample of three (or more) files sharing a key:
#     <key>.chosen.png   the preferred image     <key>.rejected.png   the other image
#     <key>.txt          the prompt              <key>.json           optional metadata
#     <key>.src.png      for an editing model: the source image both edits were made from (optional)

PAIR_PATTERN = "pairs-%06d.tar"


@dataclass
class PreferencePair:
    """One pair, undecoded (PNG bytes), so a large set stays small in memory."""

    key: str
    chosen: bytes
    rejected: bytes
    prompt: str
    metadata: dict
    source: bytes | None = None  # an editing pair's source image


def write_pair_shards(pairs, out: str | Path, *, shard_size: int = 1000) -> list[Path]:
    """Write preference pairs as shards ``pairs-000000.tar, ...`` in ``out`` (staged like
    :func:`write_shapes_shards`: ``out`` then holds exactly these pairs; pair shards of an earlier, larger
    set are removed).

    Args:
        pairs: iterable of ``(chosen, rejected, prompt, metadata)`` or, for an editing model,
            ``(chosen, rejected, prompt, metadata, source)``; images as ``uint8 [H, W, 3]`` arrays or PIL images,
            ``metadata`` a JSON-able dict (or None), ``source`` the image both were edited from (or None).
        out: the directory (created if missing).
        shard_size: pairs per shard.

    Returns:
        The shard paths written, in order.
    """
    import numpy as np
    import webdataset as wds

    count = 0
    with _StagedShards(Path(out), "pairs") as staged:
        with wds.ShardWriter(str(staged.stage / PAIR_PATTERN), maxcount=shard_size, verbose=0, mtime=0.0) as sink:
            for chosen, rejected, prompt, metadata, *source in pairs:
                sample = {"__key__": f"pair_{count:08d}",
                          "chosen.png": _png_bytes(np.asarray(chosen, dtype=np.uint8)),
                          "rejected.png": _png_bytes(np.asarray(rejected, dtype=np.uint8)), "txt": prompt}
                if source and source[0] is not None:
                    sample["src.png"] = _png_bytes(np.asarray(source[0], dtype=np.uint8))
                if metadata:
                    sample["json"] = json.dumps(metadata)
                sink.write(sample)
                count += 1
        return staged.publish([PAIR_PATTERN % i for i in range((count + shard_size - 1) // shard_size)],
                              re.compile(r"^pairs-(\d{6})\.tar$"))


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
            metadata = loads_json(sample["json"]) if "json" in sample else {}
        except ValueError as err:
            raise ShardError(f"sample {key!r} of {path!r} has unreadable metadata: {err}") from None
        source = next((sample[f"src.{ext}"] for ext in IMAGE_KEYS if f"src.{ext}" in sample), None)
        pairs.append(PreferencePair(key, images["chosen"], images["rejected"], prompt, metadata, source))
    if not pairs:
        raise ShardError(f"no preference pairs in {str(pattern_or_dir)!r}")
    return pairs


def decode_image(data: bytes, where: str = "image") -> Image.Image:
    """An RGB PIL image from PNG / JPEG / WebP bytes (no other format is tried).

    Raises:
        ShardError: the bytes are not a readable image of those formats (``where`` names it).
    """
    try:
        with open_image(data) as image:
            return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise ShardError(f"{where} is unreadable: {err}") from None
