"""The fake accelerator beyond the image trainers: a VLM GRPO epoch (single-turn and the zoom agent's multi-turn
GiGPO), ``flowrl sample`` / ``flowrl eval`` on the device with a device reward, and the demo engine's generation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from flowrl.run.metrics import read_metrics
from flowrl.testing import build_tiny

ROOT = Path(__file__).resolve().parents[2]
REWARD = r"reward.answer={format: {weight: 1.0, kwargs: {pattern: '.*\b(red|blue|green|yellow|purple|cyan)\b.*'}}}"

pytestmark = [pytest.mark.device, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory) -> Path:
    from flowrl.policies.shapes_vlm import ShapesVLMConfig, build_model

    folder = tmp_path_factory.mktemp("tiny_vlm")
    model, processor = build_model(ShapesVLMConfig(hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate_size=64,
                                                   vision_width=32, vision_layers=1, vision_heads=2), seed=0)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("config", ["configs/vlm/shapes_vqa_grpo.yaml", "configs/vlm/shapes_zoom_gigpo.yaml"])
def test_a_vlm_grpo_epoch_evaluates_and_trains_on_the_device(config, device, tiny_vlm, tmp_path):
    from flowrl.commands.train import main

    out = tmp_path / "run"
    args = [str(ROOT / config), f"model.path={tiny_vlm}", f"run.output_dir={out}", "run.max_epochs=1",
            "run.max_minutes=null", "run.device=fakegpu", "sampling.groups_per_epoch=2", "sampling.group_size=4",
            "sampling.batch_size=4", "sampling.max_new_tokens=4", "train.micro_batch_size=4", "optim.lr=1e-3",
            "eval.at_start=true", "eval.every_minutes=null", "eval.num_examples=4", REWARD]
    assert main(args) == 0, (out / "error.log").read_text() if (out / "error.log").is_file() else ""
    rows = read_metrics(out / "metrics.jsonl")
    assert any(k.startswith("eval/") for k in rows[0])
    assert np.isfinite(rows[-1]["train/loss"]) and rows[-1]["train/grad_norm"] > 0


def test_sample_and_eval_run_on_the_device_with_a_device_reward(device, tiny_shapes_dir, tiny_pickscore, tmp_path,
                                                                 capsys):
    from flowrl.cli import main

    model, processor = tiny_pickscore
    grid = tmp_path / "grid.png"
    assert main(["sample", "--model", str(tiny_shapes_dir), "--prompt", "a red circle", "--seeds", "0,1",
                 "--steps", "2", "--device", "fakegpu", "--reward", "shapes", "--out", str(grid)]) == 0
    assert grid.is_file()
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(tiny_shapes_dir), "--reward", "shapes", "--n", "6", "--steps", "2",
                 "--device", "fakegpu", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["n"] == 6
    sd3 = build_tiny("sd3")
    assert main(["sample", "--model", str(sd3), "--prompt", "a red apple", "--seeds", "0", "--steps", "2",
                 "--device", "fakegpu", "--out", str(tmp_path / "sd3.png")]) == 0
    capsys.readouterr()


def test_the_demo_engine_generates_and_scores_on_the_device(device, tiny_shapes_dir, tiny_pickscore):
    from flowrl.demo.engine import RewardSet, compare
    from flowrl.demo.models import load_base
    from rewards import load

    base = load_base(str(tiny_shapes_dir), device=device)
    model, processor = tiny_pickscore
    rewards = RewardSet({"pickscore": load("pickscore", model=model, processor=processor, device=str(device))})
    result = compare({"base": base}, ["a red circle", "two blue squares"], [0, 1], steps=2, guidance=1.0,
                     sampler="ode", noise_level=None, rewards=rewards, reward_names=["pickscore"])
    scores = result.scores["base"]["pickscore"]
    assert scores.device == torch.device("cpu") and torch.isfinite(scores).all()
    assert result.images["base"].shape == (4, 3, 32, 32)
