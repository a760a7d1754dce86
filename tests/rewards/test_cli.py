"""``flowrl score`` end to end on temporary folders and shards, and its one-line usage errors."""

from __future__ import annotations

import csv
import io
import json
import tarfile

import pytest

import rewards
from flowrl.cli import main as flowrl_main
from rewards import testing
from rewards.cli import score_main
from rewards.server import serve_main


@pytest.fixture
def image_dir(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    images = rewards.to_pil_images(testing.random_images(4, 32, 32, seed=11))
    for i, image in enumerate(images):
        image.save(folder / f"img_{i}.png")
    (folder / "img_2.png").write_bytes(b"\x89PNG\r\n\x1a\nthis is not really a png")  # corrupt
    (folder / "notes.md").write_text("ignored")
    (tmp_path / "prompts.txt").write_text("a red cow\nthe blue circle\nbroken\na red cow\n")
    return folder


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_score_folder_end_to_end(image_dir, tmp_path, open_clip_dir, clip_reward, capsys):
    out = tmp_path / "scores.jsonl"
    code = score_main(["--reward", "jpeg_incompressibility,clip_score:2", "--images", str(image_dir),
                       "--prompts", str(tmp_path / "prompts.txt"), "--out", str(out), "--batch-size", "2",
                       "--reward-arg", f"clip_score.model_name={open_clip_dir}",
                       "--reward-arg", "clip_score.pretrained=null", "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0
    rows = read_jsonl(out)
    assert [r["file"] for r in rows] == ["img_0.png", "img_1.png", "img_3.png"]
    assert [r["prompt"] for r in rows] == ["a red cow", "the blue circle", "a red cow"]
    for row in rows:
        assert row["score"] == pytest.approx(row["jpeg_incompressibility"] + 2 * row["clip_score"], abs=1e-5)
        assert {"clip_score/cosine", "jpeg_incompressibility/kb"} <= set(row)
    # the clip column equals the reward on the same (uint8) image
    from PIL import Image

    expected = clip_reward([Image.open(image_dir / "img_3.png").convert("RGB")], ["a red cow"]).scores.item()
    assert rows[2]["clip_score"] == pytest.approx(expected, abs=1e-6)
    # summary table and the skipped image
    assert "scored 3 image(s)" in printed
    header = next(line for line in printed.splitlines() if line.startswith("reward"))
    assert header.split() == ["reward", "mean", "std", "min", "max", "n"]
    score_line = next(line for line in printed.splitlines() if line.startswith("score "))
    values = [r["score"] for r in rows]
    assert float(score_line.split()[1]) == pytest.approx(sum(values) / 3, abs=1e-4)
    assert float(score_line.split()[3]) == pytest.approx(min(values), abs=1e-4)
    assert "skipped 1 image(s) that could not be scored:" in printed and "img_2.png" in printed

    out_csv = tmp_path / "scores.csv"
    assert score_main(["--reward", "jpeg_compressibility", "--images", str(image_dir), "--prompts",
                       str(tmp_path / "prompts.txt"), "--out", str(out_csv), "--no-progress"]) == 0
    with open(out_csv, newline="") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == 3 and set(table[0]) == {"file", "prompt", "score", "jpeg_compressibility/kb"}
    assert float(table[0]["score"]) == -float(table[0]["jpeg_compressibility/kb"])


def test_jsonl_prompts_and_sidecars(image_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"file": f"img_{i}.png", "prompt": f"p{i}"}) for i in range(4)))
    out = tmp_path / "a.jsonl"
    assert score_main(["--reward", "jpeg_incompressibility", "--images", str(image_dir), "--prompts", str(prompts),
                       "--out", str(out), "--no-progress"]) == 0
    assert [r["prompt"] for r in read_jsonl(out)] == ["p0", "p1", "p3"]
    for i in range(4):
        (image_dir / f"img_{i}.txt").write_text(f"side {i}\n")
    assert score_main(["--reward", "jpeg_incompressibility", "--images", str(image_dir), "--out", str(out),
                       "--no-progress"]) == 0
    assert [r["prompt"] for r in read_jsonl(out)] == ["side 0", "side 1", "side 3"]


def test_webdataset_shards(tmp_path, capsys):
    shard = tmp_path / "shard-000.tar"
    images = rewards.to_pil_images(testing.random_images(3, 32, 32, seed=12))
    with tarfile.open(shard, "w") as tar:
        def add(name, data):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        for i, image in enumerate(images):
            buffer = io.BytesIO()
            image.save(buffer, format="PNG" if i != 1 else "JPEG")
            add(f"sample{i:03d}.{'png' if i != 1 else 'jpg'}", buffer.getvalue())
            add(f"sample{i:03d}.txt", f"prompt {i}".encode())
        add("sample003.png", b"garbage")
        add("sample003.txt", b"broken")
    out = tmp_path / "shards.jsonl"
    code = score_main(["--reward", "jpeg_incompressibility", "--images", str(tmp_path / "shard-{000..000}.tar"),
                       "--out", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0
    rows = read_jsonl(out)
    assert [r["file"] for r in rows] == ["shard-000.tar:sample000", "shard-000.tar:sample001",
                                         "shard-000.tar:sample002"]
    assert [r["prompt"] for r in rows] == ["prompt 0", "prompt 1", "prompt 2"]
    assert "shard-000.tar:sample003" in printed


@pytest.mark.parametrize("args, needle", [
    (["--reward", "pickscroe"], "unknown reward 'pickscroe' (did you mean 'pickscore'?)"),
    (["--reward", "jpeg_compressibility", "--out", "x.parquet"], "--out must end in .jsonl or .csv"),
    (["--reward", "jpeg_compressibility", "--images", "/nowhere"], "'/nowhere' is not a folder of images"),
    (["--reward", "jpeg_compressibility", "--prompts", "PROMPTS3"], "has 3 prompt line(s) but"),
    (["--reward", "jpeg_compressibility", "NO_EMPTY_PROMPTS"], "no prompts for 4 image(s)"),
    (["--reward", "jpeg_compressibility", "--reward-arg", "pickscore.model=x"],
     "'pickscore' is not one of the rewards"),
    (["--reward", "jpeg_compressibility", "--reward-arg", "oops"], "must look like NAME.KEY=VALUE"),
    (["--reward", "jpeg_compressibility", "--reward-arg", "jpeg_compressibility.qualty=3"], "valid arguments: quality"),
    (["--reward", "aesthetic", "--reward-arg", "aesthetic.mlp_path=/nowhere/m.pth"], "aesthetic: checkpoint not found"),
    (["--reward", "jpeg_compressibility", "--batch-size", "0"], "--batch-size must be >= 1"),
    (["--reward", "jpeg_compressibility", "--batch-size", "many"], "invalid int value"),
    (["--images", "DIR"], "the following arguments are required: --reward"),
    (["--reward", "jpeg_compressibility", "--out", "OUTDIR"], "is a folder"),
])
def test_usage_mistakes_are_one_line_exit_2(image_dir, tmp_path, capsys, args, needle):
    (tmp_path / "three.txt").write_text("a\nb\nc\n")
    defaults = {"--images": str(image_dir), "--out": str(tmp_path / "o.jsonl")}
    if "--prompts" not in args and "NO_EMPTY_PROMPTS" not in args:
        args = args + ["--empty-prompts"]
    placeholders = {"PROMPTS3": str(tmp_path / "three.txt"), "DIR": str(image_dir),
                    "OUTDIR": str(tmp_path / "dir.jsonl")}
    (tmp_path / "dir.jsonl").mkdir()
    args = [placeholders.get(a, a) for a in args if a != "NO_EMPTY_PROMPTS"]
    for flag, value in defaults.items():
        if flag not in args and not (flag == "--out" and args[:1] == ["--images"]):
            args += [flag, value]
    code = score_main(args)
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flowrl score: error: ") and needle in lines[0], err
    assert "Traceback" not in err


def test_flowrl_cli_dispatches(image_dir, tmp_path, capsys):
    out = tmp_path / "via_cli.csv"
    code = flowrl_main(["score", "--reward", "jpeg_incompressibility", "--images", str(image_dir), "--empty-prompts",
                        "--out", str(out), "--no-progress"])
    assert code == 0 and out.exists()
    assert flowrl_main(["serve-reward", "--reward", "nonexistent", "--port", "0"]) == 2
    assert "unknown reward 'nonexistent'" in capsys.readouterr().err


def test_serve_reward_usage_errors(capsys):
    assert serve_main(["--reward", "jpeg_compressibility", "--port", "70000"]) == 2
    assert "--port must be in 0..65535" in capsys.readouterr().err
    assert serve_main([]) == 2
    assert "required: --reward" in capsys.readouterr().err


def test_truncated_shard_is_listed_and_the_next_shard_still_scores(tmp_path, capsys):
    images = rewards.to_pil_images(testing.random_images(2, 32, 32, seed=3))
    for index, image in enumerate(images):
        with tarfile.open(tmp_path / f"part-{index}.tar", "w") as tar:
            for name, data in ((f"s{index}.png", _png(image)), (f"s{index}.txt", b"a prompt")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    broken = (tmp_path / "part-0.tar").read_bytes()
    (tmp_path / "part-0.tar").write_bytes(broken[: len(broken) // 3])  # cut inside the PNG entry
    out = tmp_path / "scores.jsonl"
    code = score_main(["--reward", "jpeg_incompressibility", "--images", str(tmp_path / "part-*.tar"),
                       "--out", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0
    assert [r["file"] for r in read_jsonl(out)] == ["part-1.tar:s1"]
    assert "part-0.tar" in printed


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


# ----------------------------------------------------------------------------------------------- safe scoring


class Recording(rewards.Reward):
    """Mean pixel value; records batch sizes; raises what ``fail(call, prompts)`` returns (if anything)."""

    name = "recording"
    batch_size = 1024

    def __init__(self, fail=lambda call, prompts: None):
        self.calls: list[int] = []
        self.fail = fail

    def score(self, images, prompts, metadata):
        self.calls.append(len(prompts))
        error = self.fail(len(self.calls), prompts)
        if error is not None:
            raise error
        return rewards.RewardOutput(images.mean(dim=(1, 2, 3)))


def solid(value: int, size: int = 32):
    from PIL import Image

    return Image.new("RGB", (size, size), (value, value, value))


def run(reward, items, out, batch_size=16, budget=2 ** 30, per_pixel=100.0):
    from rewards.cli import _run

    return _run(reward, iter(items), None, out, batch_size, budget, per_pixel, False, "flowrl score")


def test_an_unparsable_prompt_is_skipped_and_the_rest_is_scored(image_dir, tmp_path, capsys):
    from PIL import Image

    for i in range(4):
        Image.new("RGB", (32, 32), "white").save(image_dir / f"img_{i}.png")
    (tmp_path / "prompts.txt").write_text("a red circle\na dog\na circle\ntwo blue squares\n")
    out = tmp_path / "scores.jsonl"
    code = score_main(["--reward", "shapes", "--images", str(image_dir), "--prompts", str(tmp_path / "prompts.txt"),
                       "--out", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0
    rows = read_jsonl(out)
    assert [r["file"] for r in rows] == ["img_0.png", "img_2.png", "img_3.png"]
    assert [r["score"] for r in rows] == [0.0, 0.0, 0.0]  # white images: nothing detected
    assert "skipped 1 image(s)" in printed and "img_1.png: shapes reward: cannot parse prompt 'a dog'" in printed


def test_a_failing_batch_is_rescored_one_image_at_a_time(tmp_path, capsys):
    from rewards import RewardError

    reward = Recording(lambda call, prompts: RewardError("recording: bad prompt") if "bad" in prompts else None)
    items = [(f"i{k}", solid(10 * k), "bad" if k == 2 else "ok") for k in range(5)]
    out = tmp_path / "s.jsonl"
    assert run(reward, items, out, batch_size=8) == 0
    assert reward.calls == [5, 1, 1, 1, 1, 1]  # the batch, then each image alone
    assert [r["file"] for r in read_jsonl(out)] == ["i0", "i1", "i3", "i4"]
    assert read_jsonl(out)[3]["score"] == pytest.approx(40 / 255, abs=1e-6)
    assert "i2: recording: bad prompt" in capsys.readouterr().out


def test_batches_are_cut_to_the_memory_budget(tmp_path):
    reward = Recording()
    items = [(f"i{k}", solid(k), "p") for k in range(5)]  # 1,024 pixels each
    assert run(reward, items, tmp_path / "s.jsonl", batch_size=16, budget=2500, per_pixel=1.0) == 0
    assert reward.calls == [2, 2, 1]


def test_huge_images_are_skipped_from_their_header_before_decoding(image_dir, tmp_path, capsys):
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    # An 8000 x 8000 PNG header (the pixels are never decoded: the size check reads the header only).
    header = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 8000, 8000, 8, 2, 0, 0, 0))
    (image_dir / "img_1.png").write_bytes(header + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b""))
    solid(0, 64).save(image_dir / "img_3.png")  # 4,096 pixels: over a 1 MiB budget at 776 bytes per pixel
    out = tmp_path / "scores.jsonl"
    code = score_main(["--reward", "shapes", "--images", str(image_dir), "--empty-prompts", "--out", str(out),
                       "--no-progress", "--max-memory-mb", "1"])
    printed = capsys.readouterr().out
    assert code == 1  # everything else is unreadable or over the budget ...
    assert "img_1.png: 8000x8000 image (64.0 MP) would need 46.3 GiB to score with shapes, over --max-memory-mb 1" \
        in printed
    assert "img_3.png: 64x64 image (0.0 MP) would need 3.0 MiB" in printed and "raise --max-memory-mb" in printed
    assert not out.exists()  # ... and no empty file pretends to be a result
    # A cheap reward (96 bytes per pixel) at the default budget of 4 GiB: the 64 x 64 image is scored, and
    # 8000 x 8000 still needs 5.7 GiB.
    assert score_main(["--reward", "jpeg_compressibility", "--images", str(image_dir), "--empty-prompts", "--out",
                       str(out), "--no-progress"]) == 0
    assert [r["file"] for r in read_jsonl(out)] == ["img_0.png", "img_3.png"]
    assert "img_1.png: 8000x8000 image (64.0 MP) would need 5.7 GiB to score with jpeg_compressibility" \
        in capsys.readouterr().out


def test_an_existing_output_survives_a_failed_run_and_partial_rows_are_kept(tmp_path, capsys):
    from rewards._http import UpstreamError

    out = tmp_path / "scores.jsonl"
    out.write_text('{"file": "earlier", "score": 1.0}\n')
    before = out.read_bytes()
    reward = Recording(lambda call, prompts: UpstreamError("reward server at http://x is unreachable") if call == 2
                       else None)
    items = [(f"i{k}", solid(k), "p") for k in range(4)]
    assert run(reward, items, out, batch_size=2) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flowrl score: error: reward server at http://x is unreachable")
    assert "the 2 row(s) scored are in" in err[0] and f"({out} is unchanged)" in err[0]
    assert out.read_bytes() == before
    assert [r["file"] for r in read_jsonl(tmp_path / "scores.partial.jsonl")] == ["i0", "i1"]
    assert not list(tmp_path.glob(".scores.jsonl.tmp-*"))  # no temporary file left behind

    def interrupted():
        yield "i0", solid(0), "p"
        yield "i1", solid(1), "p"
        raise KeyboardInterrupt

    assert run(Recording(), interrupted(), out, batch_size=1) == 130
    assert "flowrl score: interrupted; the 2 row(s) scored are in" in capsys.readouterr().err
    assert out.read_bytes() == before
    # A complete run replaces the output in one rename.
    assert run(Recording(), [("i9", solid(9), "p")], out) == 0
    assert [r["file"] for r in read_jsonl(out)] == ["i9"]
