"""``flowrl score`` end to end on temporary folders and shards, and its one-line usage errors."""

from __future__ import annotations

import csv
import io
import json
import tarfile

import pytest
import torch

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
    assert "skipped 1 unreadable image(s):" in printed and "img_2.png" in printed

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
    assert [r["file"] for r in rows] == ["shard-000.tar:sample000", "shard-000.tar:sample001", "shard-000.tar:sample002"]
    assert [r["prompt"] for r in rows] == ["prompt 0", "prompt 1", "prompt 2"]
    assert "shard-000.tar:sample003" in printed


@pytest.mark.parametrize("args, needle", [
    (["--reward", "pickscroe"], "unknown reward 'pickscroe' (did you mean 'pickscore'?)"),
    (["--reward", "jpeg_compressibility", "--out", "x.parquet"], "--out must end in .jsonl or .csv"),
    (["--reward", "jpeg_compressibility", "--images", "/nowhere"], "'/nowhere' is not a folder of images"),
    (["--reward", "jpeg_compressibility", "--prompts", "PROMPTS3"], "has 3 prompt line(s) but"),
    (["--reward", "jpeg_compressibility", "NO_EMPTY_PROMPTS"], "no prompts for 4 image(s)"),
    (["--reward", "jpeg_compressibility", "--reward-arg", "pickscore.model=x"], "'pickscore' is not one of the rewards"),
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
    placeholders = {"PROMPTS3": str(tmp_path / "three.txt"), "DIR": str(image_dir), "OUTDIR": str(tmp_path / "dir.jsonl")}
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
