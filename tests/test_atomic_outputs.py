"""Outputs appear whole or not at all (docs/security.md, "Outputs"): ``flowrl export``, ``flowrl data``,
``flowrl score`` and ``flowrl train-reward`` write beside their destination and rename; a write that fails
half-way (a full disk, simulated by the real writer raising ENOSPC after it wrote part of its file) leaves the
previous output byte for byte, ends in one line, and the same command then succeeds. An output that is also
an input is refused."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from PIL import Image

from flowrl.cli import main

ROOT = Path(__file__).resolve().parents[1]


def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_error_line(capsys, prog: str) -> str:
    err = capsys.readouterr().err  # (progress bars of model loading may precede it)
    lines = [line for line in err.splitlines() if line.startswith(f"{prog}:")]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error:") and "Traceback" not in err, err
    return lines[0]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ----------------------------------------------------------------------------------------------- flowrl export


def test_export_that_fails_half_way_leaves_nothing_and_the_retry_succeeds(tiny_shapes_dir, tmp_path, capsys,
                                                                           monkeypatch):
    from flowrl.models.shapes import ShapesModel
    from flowrl.commands.train import load_recipe_config

    settings = {"model.path": str(tiny_shapes_dir), "run.output_dir": str(tmp_path / "run"), "run.max_minutes": "null",
                "run.max_epochs": 1, "data.num_eval_prompts": 2, "sampling.num_steps": 3,
                "sampling.window.max_start": "null", "sampling.eval_num_steps": 2, "sampling.groups_per_epoch": 1,
                "sampling.group_size": 2, "sampling.batch_size": 2, "train.micro_batch_size": 2,
                "eval.at_start": "false", "eval.every_epochs": 10, "eval.grid_size": 0, "checkpoint.every_epochs": 1,
                "reward.train": "{jpeg_compressibility: 1.0}", "reward.eval": "[jpeg_compressibility]"}
    recipe, cfg = load_recipe_config(str(ROOT / "configs/shapes/flow_grpo.yaml"),
                                     [f"{k}={v}" for k, v in settings.items()])
    assert recipe.main(cfg) == 0
    out = tmp_path / "merged"
    real_save = ShapesModel.save_pretrained

    def save_then_fill_the_disk(self, path, **kwargs):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "model.json").write_text("{}")  # part of the folder is written, then the disk is full
        disk_full()

    monkeypatch.setattr(ShapesModel, "save_pretrained", save_then_fill_the_disk)
    capsys.readouterr()
    try:
        code = main(["export", str(tmp_path / "run"), "--format", "merged", "--out", str(out)])
    except OSError as err:  # main: the traceback
        code = f"traceback: {err}"
    assert code == 2
    assert "No space left on device" in one_error_line(capsys, "flowrl export")
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    monkeypatch.setattr(ShapesModel, "save_pretrained", real_save)
    assert main(["export", str(tmp_path / "run"), "--format", "merged", "--out", str(out)]) == 0  # the same command
    assert (out / "model.json").is_file() and (out / "flowrl_export.json").is_file()
    ShapesModel.from_pretrained(out)


# ----------------------------------------------------------------------------------------------- flowrl data


def test_data_that_fails_half_way_keeps_the_previous_shards(tmp_path, capsys, monkeypatch):
    import flowrl.data.webdataset_io as io_module

    out = tmp_path / "shards"
    assert main(["data", "shapes", "--split", "eval", "--n", "6", "--shard-size", "3", "--out", str(out),
                 "--no-progress"]) == 0
    before = files_of(out)
    assert sorted(before) == ["shapes-eval-000000.tar", "shapes-eval-000001.tar"]
    real_png, calls = io_module._png_bytes, []

    def png_until_the_disk_is_full(array):
        calls.append(1)
        if len(calls) == 5:  # the first shard of the new set is complete, the second half-written
            disk_full()
        return real_png(array)

    monkeypatch.setattr(io_module, "_png_bytes", png_until_the_disk_is_full)
    capsys.readouterr()
    assert main(["data", "shapes", "--split", "eval", "--n", "6", "--shard-size", "3", "--seed", "1", "--out",
                 str(out), "--no-progress"]) == 2
    assert "No space left on device" in one_error_line(capsys, "flowrl data")
    assert files_of(out) == before  # byte for byte, and no staging folder left behind
    monkeypatch.setattr(io_module, "_png_bytes", real_png)
    assert main(["data", "shapes", "--split", "eval", "--n", "3", "--shard-size", "3", "--seed", "1", "--out",
                 str(out), "--no-progress"]) == 0
    after = files_of(out)
    assert sorted(after) == ["shapes-eval-000000.tar"]  # exactly the new set: the stale second shard is gone
    assert after["shapes-eval-000000.tar"] != before["shapes-eval-000000.tar"]


# ----------------------------------------------------------------------------------------------- flowrl score


def test_score_refuses_an_output_that_is_its_prompts_file(tmp_path, capsys):
    images = tmp_path / "images"
    images.mkdir()
    for name in ("a.png", "b.png"):
        Image.new("RGB", (16, 16), "red").save(images / name)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"file": n, "prompt": "a red square"}) + "\n" for n in ("a.png", "b.png")))
    before = prompts.read_bytes()
    code = main(["score", "--reward", "jpeg_compressibility", "--images", str(images), "--prompts", str(prompts),
                 "--out", str(prompts), "--no-progress"])
    assert prompts.read_bytes() == before
    assert code == 2
    assert "is also the --prompts file" in one_error_line(capsys, "flowrl score")


# ----------------------------------------------------------------------------------------------- flowrl train-reward

TRAIN = ["train-reward", "artifact", "--synthetic", "shapes", "--n", "16", "--heldout-n", "8", "--steps", "2",
         "--batch-size", "8", "--width", "4"]


def test_train_reward_that_fails_while_saving_keeps_the_previous_model(tmp_path, capsys, monkeypatch):
    import safetensors.torch

    import rewards

    out = tmp_path / "artifact"
    assert main(TRAIN + ["--out", str(out)]) == 0
    before = files_of(out)
    real_save = safetensors.torch.save_file

    def save_half_then_fill_the_disk(tensors, filename, *args, **kwargs):
        Path(filename).write_bytes(b"\x00" * 100)  # a truncated file, as a full disk leaves it
        disk_full()

    monkeypatch.setattr(safetensors.torch, "save_file", save_half_then_fill_the_disk)
    capsys.readouterr()
    try:
        code = main(TRAIN + ["--seed", "1", "--out", str(out)])
    except OSError as err:  # main: the traceback, and a truncated model.safetensors in --out
        code = f"traceback: {err}"
    assert files_of(out) == before
    assert code == 2
    assert "No space left on device" in one_error_line(capsys, "flowrl train-reward")
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    rewards.load("artifact", path=str(out))  # the previous model still loads
    assert main(TRAIN + ["--seed", "1", "--out", str(out)]) == 0  # and the same command replaces it
    assert files_of(out)["model.safetensors"] != before["model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["artifact"]  # no staging folder left


def test_train_reward_refuses_an_output_that_is_an_input_or_holds_other_files(tmp_path, capsys):
    clean = tmp_path / "clean"
    clean.mkdir()
    for i in range(4):
        Image.new("RGB", (16, 16), (60 * i, 0, 0)).save(clean / f"{i}.png")
    before = files_of(clean)
    assert main(["train-reward", "artifact", "--clean", str(clean), "--artifact", str(clean), "--steps", "1",
                 "--out", str(clean)]) == 2
    assert "is (or holds) the --clean input" in one_error_line(capsys, "flowrl train-reward")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    assert main(TRAIN + ["--out", str(tmp_path / "notes")]) == 2
    assert "holds other files (todo.txt)" in one_error_line(capsys, "flowrl train-reward")
    assert files_of(clean) == before and (tmp_path / "notes" / "todo.txt").read_text() == "mine"
