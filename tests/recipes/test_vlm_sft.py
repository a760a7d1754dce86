"""The supervised recipe that trains the shipped Shapes-VQA model: a tiny run learns (loss falls), logs held-out
accuracy per kind, saves a model that loads through the policy adapter, and resumes exactly."""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl.checkpoint import latest_checkpoint, load_state
from flowrl.logging import read_metrics
from flowrl.train import load_recipe_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs/vlm/shapes_vqa_sft.yaml")
TINY = ["model.hidden_size=32", "model.layers=1", "model.heads=2", "model.kv_heads=1", "model.intermediate_size=64",
        "model.vision_width=32", "model.vision_layers=1", "model.vision_heads=2", "data.batch_size=8",
        "data.steps_per_epoch=4", "optim.warmup_steps=2", "optim.lr=3e-3", "eval.num_examples=10",
        "eval.num_zoom_examples=4", "eval.every_epochs=1", "run.max_minutes=null", "run.threads=1",
        "run.deterministic=true"]


def _run(out: Path, *extra: str) -> None:
    recipe, cfg = load_recipe_config(CONFIG, [f"run.output_dir={out}", *TINY, *extra])
    assert recipe.main(cfg) == 0


def test_sft_learns_and_saves_a_loadable_policy(tmp_path):
    from flowrl.policies import TokenPolicy

    _run(tmp_path, "run.max_epochs=3")
    rows = read_metrics(tmp_path / "metrics.jsonl")
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert {"eval/vqa/accuracy", "eval/vqa/count", "eval/vqa/position", "eval/zoom/accuracy"} <= set(rows[-1])
    policy = TokenPolicy.from_pretrained(tmp_path / "model")
    assert policy.family.name == "qwen2_vl"


def test_sft_resumes_exactly(tmp_path):
    _run(tmp_path / "a", "run.max_epochs=2", "optim.decay_epochs=2")
    _run(tmp_path / "b", "run.max_epochs=1", "optim.decay_epochs=2")
    _run(tmp_path / "b", "run.max_epochs=2", "optim.decay_epochs=2", "run.resume=true")
    a, b = load_state(latest_checkpoint(tmp_path / "a")), load_state(latest_checkpoint(tmp_path / "b"))
    assert a["step"] == b["step"] == 8
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
