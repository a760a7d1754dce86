"""``sampling.precision: bfloat16``: rollouts and training run under bfloat16 autocast (so they differ from
float32), rollout and re-scoring agree (the on-policy ratio stays 1 within Flow-GRPO's clip range), and the
evaluation keeps float32 (its numbers do not depend on the setting) unless ``eval.precision: bfloat16``."""

from pathlib import Path

import pytest

from flowrl.run.metrics import read_metrics
from flowrl.commands.train import load_recipe_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _bfloat16_allowed(monkeypatch):
    """The mechanism is tested on every CPU: where bf16 is emulated the tiny model's runs are slow but correct, and
    training would otherwise refuse bf16 (flowrl.hardware.check_bfloat16, tested in
    tests/commands/test_cli_errors.py)."""
    from flowrl import hardware

    monkeypatch.setattr(hardware, "native_bfloat16", lambda: True)


def run(model_dir, out: Path, precision: str, *extra: str) -> list[dict]:
    settings = {"model.path": model_dir, "run.output_dir": out, "run.max_minutes": "null", "run.max_epochs": 1,
                "data.num_eval_prompts": 4, "sampling.num_steps": 4, "sampling.window.max_start": "null",
                "sampling.eval_num_steps": 2, "sampling.groups_per_epoch": 2, "sampling.group_size": 4,
                "sampling.batch_size": 8, "train.micro_batch_size": 4, "train.clip_range": 1e-3,
                "eval.every_minutes": "null", "eval.grid_size": 0, "sampling.precision": precision,
                "reward.train": "{jpeg_incompressibility: 1.0}", "reward.eval": "[jpeg_incompressibility]"}
    recipe, cfg = load_recipe_config(str(ROOT / "configs" / "shapes" / "flow_grpo.yaml"),
                                     [f"{k}={v}" for k, v in settings.items()] + list(extra))
    recipe.main(cfg)
    return read_metrics(out / "metrics.jsonl")


@pytest.mark.slow
def test_bf16_rollouts_differ_rescore_on_policy_and_leave_the_evaluation_alone(tiny_shapes_dir, tmp_path):
    fp32 = run(tiny_shapes_dir, tmp_path / "fp32", "float32")
    bf16 = run(tiny_shapes_dir, tmp_path / "bf16", "bfloat16")
    assert fp32[0]["eval/jpeg_incompressibility/mean"] == bf16[0]["eval/jpeg_incompressibility/mean"]
    a, b = fp32[1], bf16[1]
    assert a["train/reward_mean"] != b["train/reward_mean"]  # the rollout really ran in bfloat16
    assert b["train/clip_frac"] == 0.0 and abs(b["train/ratio_mean"] - 1.0) < 1e-3
    assert b["train/approx_kl"] < 1e-6 and b["train/grad_norm"] > 0


@pytest.mark.slow
def test_eval_precision_bfloat16_changes_only_the_evaluation(tiny_shapes_dir, tmp_path):
    fp32 = run(tiny_shapes_dir, tmp_path / "fp32", "float32")
    bf16_eval = run(tiny_shapes_dir, tmp_path / "bf16_eval", "float32", "eval.precision=bfloat16")
    key = "eval/jpeg_incompressibility/mean"
    assert fp32[0][key] != bf16_eval[0][key]  # the evaluation really ran under bfloat16
    assert abs(fp32[0][key] - bf16_eval[0][key]) < 0.05 * fp32[0][key]  # ... and drew nearly the same images
    assert fp32[1]["train/reward_mean"] == bf16_eval[1]["train/reward_mean"]  # training untouched
