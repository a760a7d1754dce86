"""docs/security.md, checked: names from listings are paths (never ``pipe:`` commands), images are decoded only in
the allowed formats, keys go only to approved hosts and never through a proxy to a loopback server, and the
JSON flowrl reads has bounded nesting. Each attack below runs for real against the code that reads the data;
the test asserts it has no effect (no marker file, no request at the proxy, a one-line error)."""

from __future__ import annotations

import io
import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

PIPE_NAME = "pipe:touch PWNED #.tar"  # webdataset's gopen would run `touch PWNED` through a shell


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """One real shard of 3 shapes samples (png, txt, json)."""
    from flowrl.data.webdataset_io import write_shapes_shards

    (path,) = write_shapes_shards("eval", 3, tmp_path_factory.mktemp("shard"), shard_size=10)
    return path


@pytest.fixture
def hostile_dir(tmp_path, shard, monkeypatch):
    """A downloaded data set whose shard is called ``pipe:touch PWNED #.tar``, as the current directory."""
    folder = tmp_path / "download"
    folder.mkdir()
    shutil.copy(shard, folder / PIPE_NAME)
    monkeypatch.chdir(folder)
    return folder


# ----------------------------------------------------------------------------------------------- names are paths


@pytest.mark.parametrize("spec", [".", "*.tar", "{pipe:touch PWNED #,nothing-else}.tar"])
def test_shard_names_from_listings_globs_and_braces_are_local_paths(hostile_dir, spec):
    from flowrl.data.webdataset_io import ShardError, iter_shards, shard_paths

    if "{" in spec:
        (hostile_dir / "nothing-else.tar").write_bytes((hostile_dir / PIPE_NAME).read_bytes())
    try:
        samples = list(iter_shards(spec))
    except ShardError as err:  # what main did after running the command: "shard 'pipe:...' is unreadable"
        samples = err
    assert not (hostile_dir / "PWNED").exists()
    paths = shard_paths(spec)
    assert str(hostile_dir / PIPE_NAME) in paths and all(p.startswith("/") for p in paths)
    assert len(samples) == 3 * len(paths) and samples[0][2]  # read as the local tar it is: prompts and images
    assert samples[0][1].size == (32, 32)


def test_flowrl_score_on_a_folder_with_a_pipe_named_shard(hostile_dir, capsys):
    from flowrl.cli import main

    out = hostile_dir.parent / "scores.jsonl"
    code = main(["score", "--reward", "jpeg_compressibility", "--images", ".", "--empty-prompts", "--out", str(out),
                 "--no-progress"])
    assert not (hostile_dir / "PWNED").exists()
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and all(row["file"].startswith(PIPE_NAME + ":") for row in rows)


def test_adversarial_references_and_dpo_pairs_from_a_pipe_named_shard(hostile_dir):
    from flowrl.data.webdataset_io import ShardError, read_pairs
    from rewards.adversarial_refs import load_references

    from rewards import RewardError

    try:
        references = load_references(".")
    except RewardError as err:
        references = err
    assert not (hostile_dir / "PWNED").exists()
    assert len(references) == 3
    with pytest.raises(ShardError, match="has no chosen image"):  # a shapes shard holds no pairs: read, refused
        read_pairs(".")
    assert not (hostile_dir / "PWNED").exists()


# ----------------------------------------------------------------------------------------------- images by allow-list

EPS = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n%%EndComments\n"
       b"newpath 0 0 moveto 8 8 lineto stroke\nshowpage\n%%EOF\n")


@pytest.fixture
def ghostscript_spy(monkeypatch):
    """Stands in for Ghostscript: records every file PIL hands to its EPS decoder (which would run
    Ghostscript on it when installed)."""
    from PIL import EpsImagePlugin

    seen = []
    original = EpsImagePlugin.EpsImageFile._open

    def spy(self):
        seen.append(self.fp)
        return original(self)

    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "_open", spy)
    return seen


def _tar_with_eps(path):
    import tarfile

    with tarfile.open(path, "w") as tar:
        for name, data in (("s0.png", EPS), ("s0.txt", b"a red circle")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_an_eps_file_named_png_never_reaches_the_eps_decoder(tmp_path, ghostscript_spy, capsys):
    """``flowrl score`` on a folder, shards, DPO pairs, adversarial references and the demo's Score tab."""
    from flowrl.cli import main
    from flowrl.data.webdataset_io import ShardError, decode_image, iter_shards
    from flowrl.demo.engine import _open_image
    from flowrl.demo.limits import DemoInputError, Limits
    from rewards import RewardError
    from rewards.adversarial_refs import load_references

    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "x.png").write_bytes(EPS)
    (folder / "x.txt").write_text("a red circle")
    assert main(["score", "--reward", "jpeg_compressibility", "--images", str(folder), "--out",
                 str(tmp_path / "s.jsonl"), "--no-progress"]) == 1  # nothing scorable
    assert "x.png: not a PNG, JPEG, WEBP or BMP image" in capsys.readouterr().out
    _tar_with_eps(tmp_path / "eps.tar")
    with pytest.raises(ShardError, match="not a PNG, JPEG or WEBP image"):
        list(iter_shards(str(tmp_path / "eps.tar")))
    with pytest.raises(ShardError, match="chosen image of pair 0 is unreadable: not a PNG"):
        decode_image(EPS, "chosen image of pair 0")  # the DPO recipe decodes pairs with this
    with pytest.raises(RewardError, match="reference image 0 of .* is unreadable: not a PNG"):
        load_references(str(folder)).draw(["a red circle"], __import__("torch").tensor([0]), False, lambda x: x)
    with pytest.raises(DemoInputError, match="x.png is not a readable image"):
        _open_image(folder / "x.png", Limits())
    assert ghostscript_spy == []


def test_the_spy_sees_what_an_unrestricted_open_would_hand_to_ghostscript(ghostscript_spy):
    """The check above can fail: ``Image.open`` without ``formats=`` identifies the bytes as EPS."""
    with Image.open(io.BytesIO(EPS)) as image:
        assert image.format == "EPS"
    assert len(ghostscript_spy) == 1


# ----------------------------------------------------------------------------------------------- bounded JSON


def test_deeply_nested_shard_metadata_is_an_error_not_a_recursion_error(tmp_path):
    import tarfile

    from flowrl.data.webdataset_io import ShardError, iter_shards, read_pairs

    png = io.BytesIO()
    Image.new("RGB", (4, 4), "red").save(png, format="PNG")
    deep = b"[" * 200_000 + b"]" * 200_000
    with tarfile.open(tmp_path / "deep.tar", "w") as tar:
        for name, data in (("s0.png", png.getvalue()), ("s0.chosen.png", png.getvalue()),
                           ("s0.rejected.png", png.getvalue()), ("s0.txt", b"a red circle"), ("s0.json", deep)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ShardError, match="nested more than 64 levels"):
        list(iter_shards(str(tmp_path / "deep.tar")))
    with pytest.raises(ShardError, match="unreadable metadata: JSON nested more than 64 levels"):
        read_pairs(str(tmp_path / "deep.tar"))


def test_json_depth_counts_brackets_outside_strings_only():
    from flowrl.untrusted import JSONNestingError, json_depth, loads_json

    assert json_depth('{"a": [1, {"b": "[[[[{{"}]}') == 3
    assert json_depth('"\\"[[["') == 0
    assert loads_json('{"a": [1, 2]}') == {"a": [1, 2]}
    with pytest.raises(JSONNestingError):
        loads_json("[" * 65 + "]" * 65)
    assert loads_json("[" * 64 + "]" * 64, max_depth=64)
