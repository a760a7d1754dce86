"""Every trainer of docs/trainers.md end to end through its shipped shapes config on a tiny model: it trains,
logs Flow-GRPO's metric keys where they apply, draws the plots and sample grids, and a run stopped after 2
epochs and resumed equals one that never stopped (weights, snapshots and every logged number)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from flowrl.run.checkpoint_files import latest_checkpoint, load_state
from flowrl.run.metrics import read_metrics
from flowrl.commands.train import load_recipe_config

ROOT = Path(__file__).resolve().parents[2]
TRAINERS = ("crd", "nft", "awm", "dgpo", "dpo", "d3po", "raft")
# Extra state each trainer checkpoints beside the model, the optimizer and its schedule.
SNAPSHOTS = {"crd": ("old", "rollout_snapshot"), "nft": ("old",), "awm": ("ema_snapshot",), "dgpo": ("ema_snapshot",),
             "dpo": (), "d3po": (), "raft": ()}


def tiny_overrides(name: str, model_dir: Path, out: Path, pairs: Path, **extra) -> list[str]:
    settings = {
        "model.path": str(model_dir), "run.output_dir": str(out), "run.max_minutes": "null",
        "run.deterministic": "true", "data.num_eval_prompts": 6, "sampling.num_steps": 4, "sampling.eval_num_steps": 2,
        "sampling.groups_per_epoch": 2, "sampling.group_size": 4, "sampling.batch_size": 8,
        "train.micro_batch_size": 4, "optim.lr": 1e-3, "eval.every_epochs": 2, "eval.every_minutes": "null",
        "checkpoint.every_epochs": 1, "eval.grid_size": 4,
        # The random tiny model draws no shapes; JPEG size varies per image, so advantages are non-zero.
        "reward.train": "{jpeg_incompressibility: 1.0}",
    }
    if name == "d3po":
        settings.update({"sampling.window.max_start": "null", "train.micro_batch_size": 1})
    if name == "dpo":
        settings.update({"pairs.path": str(pairs), "pairs.pairs_per_epoch": 4})
    if name == "awm":
        settings["train.ema_kl_coef"] = 0.1  # exercise the EMA snapshot
    if name == "raft":  # the JPEG reward has no "correct": keep each group's best
        settings["train.select"] = "best"
    if name == "dgpo":
        settings.update({"train.clip_range": 0.01, "train.sample_from_ema_after": 1})  # EMA rollouts from epoch 2
    settings.update(extra)
    return [f"{k}={v}" for k, v in settings.items()]


def run(name: str, model_dir, out, pairs, **extra) -> int:
    recipe, cfg = load_recipe_config(str(ROOT / "configs" / "shapes" / f"{name}.yaml"),
                                     tiny_overrides(name, model_dir, out, pairs, **extra))
    return recipe.main(cfg)


@pytest.fixture(scope="module")
def pairs_dir(tmp_path_factory) -> Path:
    """Six preference pairs of random 32x32 images (the tiny model's resolution)."""
    from flowrl.data.webdataset_io import write_pair_shards

    path = tmp_path_factory.mktemp("pairs")
    rng = np.random.default_rng(0)
    image = lambda: rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)  # noqa: E731
    write_pair_shards(((image(), image(), p, None) for p in ["a red circle", "two blue squares", "a triangle"] * 2),
                      path)
    return path


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINERS)
def test_trains_logs_and_resumes_exactly(name, tiny_shapes_dir, pairs_dir, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run(name, tiny_shapes_dir, straight, pairs_dir, **{"run.max_epochs": 4}) == 0
    run(name, tiny_shapes_dir, resumed, pairs_dir, **{"run.max_epochs": 2})
    run(name, tiny_shapes_dir, resumed, pairs_dir, **{"run.max_epochs": 4, "run.resume": "true"})
    a_rows, b_rows = read_metrics(straight / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    assert [r["epoch"] for r in b_rows] == [0, 1, 2, 3, 4]
    assert comparable(b_rows) == comparable(a_rows)
    a, b = load_state(latest_checkpoint(straight)), load_state(latest_checkpoint(resumed))
    assert a["epoch"] == b["epoch"] == 4
    for part in ("model",) + SNAPSHOTS[name]:
        assert set(a[part]) == set(b[part]) and a[part], part
        for key, value in a[part].items():
            assert torch.equal(value, b[part][key]), (part, key)
    # It trained: the weights moved, and every snapshot is pulled toward them.
    from diffusers import UNet2DConditionModel

    initial = UNet2DConditionModel.from_pretrained(tiny_shapes_dir / "unet").state_dict()
    assert max(float((initial[k] - v).abs().max()) for k, v in a["model"].items()) > 1e-4
    for part in SNAPSHOTS[name]:
        assert max(float((initial[k] - v).abs().max()) for k, v in a[part].items()) > 0, part
    row = a_rows[1]
    keys = ["train/loss", "train/grad_norm", "train/optimizer_steps", "train/lr", "time/training_s", "time/epoch_s"]
    if name != "dpo":
        keys += ["train/reward_mean", "train/reward_std", "train/zero_std_frac", "train/kl_ref", "time/sampling_s",
                 "time/scoring_s"]
    for key in keys:
        assert key in row, key
    assert row["train/optimizer_steps"] == 1 and row["train/grad_norm"] > 0
    assert row["images_sampled"] == (0 if name == "dpo" else 8)
    assert "eval/shapes/accuracy" in a_rows[2] and "eval/shapes/mean" in a_rows[2]
    if name == "dgpo":
        assert [r.get("train/sampled_from_ema") for r in a_rows[1:]] == [0, 1, 1, 1]
    assert (straight / "plots" / "eval.png").is_file() and (straight / "plots" / f"{name}.png").is_file()
    assert (straight / "samples" / "epoch_0004.png").is_file()
