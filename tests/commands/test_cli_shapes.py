"""`flowrl data shapes`, `flowrl sample` and `flowrl eval` end to end on a tiny saved model."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from flowrl.cli import main
from flowrl.data.shapes import Scene, eval_prompt_set, sample_examples, split_prompts
from flowrl.data.webdataset_io import ShardError, iter_shards
from flowrl.data.shapes import prompt_rows
from flowrl.eval.grid import HEADER, LINE_HEIGHT, PAD
from flowrl.commands.sample import parse_seeds

TINY = dict(block_out_channels=[32, 32], head_dim=16, text_hidden_size=32, text_layers=1, text_heads=2)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from flowrl.models.shapes import ShapesModel, ShapesModelConfig

    path = tmp_path_factory.mktemp("tiny_shapes_cli")
    ShapesModel.build(ShapesModelConfig(**TINY), seed=0).save_pretrained(path)
    return str(path)


# ----------------------------------------------------------------------------- flowrl data


def test_data_shapes_writes_shards_that_read_back(tmp_path, capsys):
    out = tmp_path / "shards"
    args = ["data", "shapes", "--split", "eval", "--n", "7", "--out", str(out), "--shard-size", "3", "--seed", "2"]
    assert main(args) == 0
    assert "wrote 7 examples" in capsys.readouterr().out
    shards = sorted(p.name for p in out.iterdir())
    assert shards == [f"shapes-eval-00000{i}.tar" for i in range(3)]
    expected = sample_examples("eval", 7, seed=2)
    rows = list(iter_shards(out))
    assert [r[2] for r in rows] == [e.prompt for e in expected]
    for (key, image, _, meta), example in zip(rows, expected):
        assert image.size == (32, 32) and image.mode == "RGB"
        assert image.tobytes() == example.image.tobytes()  # PNG is lossless
        assert meta["kind"] == example.kind and meta["split"] == "eval" and key.startswith("eval_")
        assert Scene.from_json(json.dumps(meta)) == example.scene
    # The same arguments write byte-identical shards; a smaller rerun leaves no stale shard behind.
    before = (out / "shapes-eval-000001.tar").read_bytes()
    assert main(args) == 0 and (out / "shapes-eval-000001.tar").read_bytes() == before
    assert main(args[:5] + ["2"] + args[6:]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["shapes-eval-000000.tar"]
    assert len(list(iter_shards(str(out / "*.tar")))) == 2


def test_iter_shards_patterns_and_errors(tmp_path):
    assert main(["data", "shapes", "--split", "train", "--n", "4", "--out", str(tmp_path), "--shard-size", "2",
                 "--no-progress"]) == 0
    brace = str(tmp_path / "shapes-train-{000000..000001}.tar")
    assert [r[0] for r in iter_shards(brace)] == [f"train_{i:08d}" for i in range(4)]
    assert len(list(iter_shards(tmp_path / "shapes-train-000001.tar"))) == 2
    for missing in (tmp_path / "nothing", str(tmp_path / "*.zip"), str(tmp_path / "x-{0..2}.tar")):
        with pytest.raises(ShardError):
            list(iter_shards(missing))
    with pytest.raises(ShardError, match="no .tar shards"):
        list(iter_shards((tmp_path / "empty").mkdir() or tmp_path / "empty"))


# ----------------------------------------------------------------------------- flowrl sample


@pytest.mark.parametrize("text, seeds", [("0-7", list(range(8))), ("0,3,5", [0, 3, 5]), ("4", [4]),
                                         ("0-2, 9", [0, 1, 2, 9]), ("7-7", [7])])
def test_parse_seeds(text, seeds):
    assert parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["", "a", "0-x", "3-1", "1,,2", "-2", "0-", "1.5"])
def test_parse_seeds_rejects(text):
    with pytest.raises(ValueError, match="range"):
        parse_seeds(text)


def test_sample_writes_a_labelled_grid(model_dir, tmp_path, capsys):
    out = tmp_path / "new" / "dir" / "grid.png"  # missing parents are created
    assert main(["sample", "--model", model_dir, "--prompt", "a red circle", "--prompt",
                 "a yellow square left of a red circle", "--seeds", "0,3,5", "--steps", "2",
                 "--reward", "shapes", "--out", str(out)]) == 0
    assert "2 prompts x 3 seeds" in capsys.readouterr().out
    grid = Image.open(out)
    cell = 32 * 4
    assert grid.height == HEADER + 2 * (cell + LINE_HEIGHT + 4 + PAD) + PAD  # one caption line under each image
    assert grid.width == 170 + 3 * (cell + PAD) + PAD  # row labels on the left
    # Without a reward: no strip under the cells; one seed.
    assert main(["sample", "--model", model_dir, "--prompt", "a circle", "--seeds", "4", "--steps", "1",
                 "--scale", "2", "--out", str(out), "--no-progress"]) == 0
    assert Image.open(out).height == HEADER + 64 + 2 * PAD


# ----------------------------------------------------------------------------- flowrl eval


def test_eval_writes_json_and_prints_the_table(model_dir, tmp_path, capsys):
    out = tmp_path / "results" / "eval.json"
    assert main(["eval", "--model", model_dir, "--reward", "shapes", "--split", "eval", "--n", "12",
                 "--steps", "2", "--batch-size", "8", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "overall" in table and "color_attr" in table and "accuracy" in table
    result = json.loads(out.read_text())
    assert 0.0 <= result["overall"] <= 1.0 and result["n"] == 12
    assert set(result["kinds"]) == {"single_object", "two_object", "counting", "colors", "position", "color_attr"}
    assert all(v["n"] == 2 and 0.0 <= v["accuracy"] <= 1.0 for v in result["kinds"].values())
    assert result["settings"]["steps"] == 2 and result["settings"]["split"] == "eval"
    assert result["settings"]["guidance"] == 1.0 and result["timing"]["eval_s"] > 0


def test_bfloat16_generation_is_close_to_float32_and_recorded(model_dir, tmp_path, monkeypatch):
    """--precision bfloat16 runs the model calls under autocast: images near float32's (not equal: the precision
    is really used), float32 output, and the setting in the eval JSON (on every CPU: where bf16 is emulated the
    command would refuse it, tests/commands/test_cli_errors.py)."""
    from flowrl import hardware
    from flowrl.eval.generate import generate

    monkeypatch.setattr(hardware, "native_bfloat16", lambda: True)
    from flowrl.models.shapes import ShapesModel

    model = ShapesModel.from_pretrained(model_dir)
    full = generate(model, ["a red circle"] * 2, [0, 1], steps=3)
    half = generate(model, ["a red circle"] * 2, [0, 1], steps=3, precision="bfloat16")
    assert half.dtype == torch.float32 and half.shape == full.shape
    difference = (half - full).abs().max().item()
    assert 0 < difference < 0.1
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        generate(model, ["a red circle"], [0], steps=1, precision="float16")
    out = tmp_path / "bf16.json"
    assert main(["eval", "--model", model_dir, "--n", "6", "--steps", "1", "--precision", "bfloat16", "--out",
                 str(out), "--no-progress"]) == 0
    assert json.loads(out.read_text())["settings"]["precision"] == "bfloat16"


def test_eval_on_train_prompts(model_dir, tmp_path):
    out = tmp_path / "train.json"
    assert main(["eval", "--model", model_dir, "--split", "train", "--n", "6", "--steps", "1", "--out", str(out),
                 "--no-progress"]) == 0
    assert json.loads(out.read_text())["settings"]["split"] == "train"


def test_prompt_rows_keep_the_eval_set_and_balance_train():
    assert prompt_rows("eval", 30) == eval_prompt_set(30)
    rows = prompt_rows("train", 60)
    train = {kind: {s.text() for s in specs} for kind, specs in split_prompts("train").items()}
    assert all(prompt in train[kind] for prompt, kind, _ in rows)
    assert [kind for _, kind, _ in rows[:6]] == list(train)  # kinds cycle
    assert len({seed for *_, seed in rows}) == 60


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("args, needle", [
    (["sample", "--model", "{tmp}/no_such_model", "--prompt", "a circle"], "no model"),
    (["eval", "--model", "{tmp}", "--n", "6"], "missing model.json"),
    (["sample", "--model", "{model}", "--prompt", "a dog", "--reward", "shapes"], "cannot parse prompt 'a dog'"),
    (["eval", "--model", "{model}", "--prompts", "{tmp}/prompts.txt"], "cannot parse prompt 'a photo of a cat'"),
    (["sample", "--model", "{model}", "--prompt", "a circle", "--seeds", "0-x"], "bad seeds '0-x'"),
    (["sample", "--model", "{model}", "--prompt", "a circle", "--seeds", "5-2"], "bad seeds '5-2'"),
    (["eval", "--model", "{model}", "--reward", "shapez"], "unknown reward 'shapez' (did you mean 'shapes'?)"),
    (["sample", "--model", "{model}", "--prompt", "a circle", "--reward", "nope"], "unknown reward 'nope'"),
    (["eval", "--model", "{model}", "--n", "0"], "positive integer"),
    (["eval", "--model", "{model}", "--out", "{tmp}/eval.txt"], "must end in .json"),
    (["sample", "--model", "{model}", "--prompt", "a circle", "--out", "{tmp}"], "is a directory"),
    (["sample", "--model", "{model}"], "required: --prompt"),
    (["eval", "--model", "{model}", "--device", "tpu:x"], "not a torch device"),
    (["data", "shapes", "--split", "test", "--n", "3", "--out", "{tmp}"], "invalid choice: 'test'"),
    (["data", "shapes", "--split", "eval", "--n", "-1", "--out", "{tmp}"], "positive integer"),
    (["data", "shapes", "--split", "eval", "--n", "3", "--out", "{tmp}/prompts.txt"], "is a file"),
    (["data", "pictures"], "invalid choice: 'pictures'"),
])
def test_bad_input_exits_2_with_one_line(args, needle, model_dir, tmp_path, capsys):
    (tmp_path / "prompts.txt").write_text("a circle\na photo of a cat\n")
    args = [a.format(tmp=tmp_path, model=model_dir) for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"flowrl {args[0]}") and "error:" in lines[0] and needle in lines[0], lines[0]
