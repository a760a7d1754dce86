"""Editing prompts from webdataset shards (src.png + txt, optional src.txt and json): written and read back exactly,
turned into the metadata an editing reward sees, and bad shards are one-line errors."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
import torch

from flowrl.data.edit_prompts import edit_metadata, read_edit_prompts, write_edit_shards
from flowrl.data.webdataset_io import ShardError


def test_round_trip_and_metadata(tmp_path):
    rng = np.random.default_rng(0)
    sources = [rng.integers(0, 256, (16, 24, 3), dtype=np.uint8) for _ in range(3)]
    write_edit_shards([(sources[0], "make the cow blue", "a red cow", {"target_caption": "a blue cow"}),
                       (sources[1], "add a hat", None, None), (sources[2], "remove the tree", "a tree", None)],
                      tmp_path, shard_size=2)
    assert sorted(p.name for p in tmp_path.glob("*.tar")) == ["edits-000000.tar", "edits-000001.tar"]
    items = read_edit_prompts(tmp_path)
    assert [i.prompt for i in items] == ["make the cow blue", "add a hat", "remove the tree"]
    assert [i.source_caption for i in items] == ["a red cow", None, "a tree"]
    meta = edit_metadata(items[0], resolution=(16, 24))  # the source's own size: pixels exact
    assert meta["target_caption"] == "a blue cow" and meta["source_caption"] == "a red cow"
    torch.testing.assert_close(meta["source_image"], torch.from_numpy(sources[0]).permute(2, 0, 1) / 255.0)
    resized = edit_metadata(items[1], resolution=32)
    assert resized["source_image"].shape == (3, 32, 32) and resized["source_caption"] == "add a hat"
    assert 0 <= resized["source_image"].min() and resized["source_image"].max() <= 1


def _tar(path, members: dict[str, bytes]):
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_bad_shards_are_one_line_errors(tmp_path):
    _tar(tmp_path / "a.tar", {"k1.txt": b"make it blue"})
    with pytest.raises(ShardError, match="has no source image .*src.png"):
        read_edit_prompts(tmp_path / "a.tar")
    _tar(tmp_path / "b.tar", {"k1.src.png": b"not a png", "k1.txt": b"make it blue"})
    (item,) = read_edit_prompts(tmp_path / "b.tar")
    with pytest.raises(ShardError, match="the source image of 'k1' is unreadable"):
        edit_metadata(item, 32)
