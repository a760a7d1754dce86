"""The Flow-GRPO recipe end to end on a tiny shapes model: exact resume, NaN rewards, clear errors."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowrl.run.checkpoint_files import latest_checkpoint, load_state
from flowrl.run.metrics import read_metrics
from flowrl.commands.train import load_recipe_config
from rewards import RewardOutput
from rewards.registry import REWARDS

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "shapes" / "flow_grpo.yaml"


def tiny_overrides(model_dir, out, **extra) -> list[str]:
    settings = {
        "model.path": str(model_dir), "run.output_dir": str(out), "run.max_minutes": "null",
        "run.deterministic": "true", "data.num_eval_prompts": 6, "sampling.num_steps": 4,
        "sampling.window.max_start": "null", "sampling.eval_num_steps": 3, "sampling.groups_per_epoch": 2,
        "sampling.group_size": 4, "sampling.batch_size": 8, "train.micro_batch_size": 4, "train.clip_range": 0.2,
        "optim.lr": 1e-3, "eval.every_epochs": 2, "eval.every_minutes": "null", "checkpoint.every_epochs": 1,
        "eval.grid_size": 4,
        # The random tiny model draws no shapes; JPEG size varies per image, so advantages are non-zero.
        "reward.train": "{jpeg_incompressibility: 1.0}",
    }
    settings.update(extra)
    return [f"{k}={v}" for k, v in settings.items()]


def run(model_dir, out, **extra) -> int:
    recipe, cfg = load_recipe_config(str(CONFIG), tiny_overrides(model_dir, out, **extra))
    return recipe.main(cfg)


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in rows]


@pytest.mark.slow
def test_resume_continues_exactly(tiny_shapes_dir, tmp_path):
    run(tiny_shapes_dir, tmp_path / "straight", **{"run.max_epochs": 4})
    run(tiny_shapes_dir, tmp_path / "resumed", **{"run.max_epochs": 2})
    first_half = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["epoch"] for r in first_half] == [0, 1, 2]
    run(tiny_shapes_dir, tmp_path / "resumed", **{"run.max_epochs": 4, "run.resume": "true"})
    straight = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["epoch"] for r in resumed] == [0, 1, 2, 3, 4]
    assert comparable(resumed) == comparable(straight)
    a = load_state(latest_checkpoint(tmp_path / "straight"))
    b = load_state(latest_checkpoint(tmp_path / "resumed"))
    assert a["epoch"] == b["epoch"] == 4
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    # The run really trained: the weights moved away from the initial model.
    from diffusers import UNet2DConditionModel

    initial = UNet2DConditionModel.from_pretrained(tiny_shapes_dir / "unet").state_dict()
    assert max(float((initial[k] - v).abs().max()) for k, v in a["model"].items()) > 1e-4
    assert (tmp_path / "straight" / "plots" / "reward.png").is_file()
    assert (tmp_path / "straight" / "samples" / "epoch_0004.png").is_file()
    for key in ("train/reward_mean", "train/reward_std", "train/zero_std_frac", "train/clip_frac",
                "train/approx_kl", "train/kl_ref", "train/grad_norm", "time/sampling_s", "time/scoring_s",
                "time/training_s"):
        assert key in straight[1], key
    assert "eval/shapes/accuracy" in straight[2] and "eval/shapes/mean" in straight[2]


class HalfNaN:
    """The shapes reward, with NaN for every other sample."""

    name = "half_nan"

    def __init__(self):
        from rewards.shapes import ShapesReward

        self.inner = ShapesReward()

    def __call__(self, images, prompts, metadata=None):
        out = self.inner(images, prompts, metadata)
        scores = out.scores.clone()
        scores[1::2] = math.nan
        return RewardOutput(scores, out.details)


def test_nan_rewards_are_masked_and_counted(tiny_shapes_dir, tmp_path):
    if "half_nan" not in REWARDS:
        REWARDS.register("half_nan", HalfNaN)
    out = tmp_path / "nan"
    run(tiny_shapes_dir, out, **{"run.max_epochs": 1, "reward.train": "{half_nan: 1.0}", "eval.at_start": "false"})
    (row,) = read_metrics(out / "metrics.jsonl")
    assert row["train/nan_rewards"] == 4  # 8 samples, every other one NaN
    assert math.isfinite(row["train/loss"]) and math.isfinite(row["train/grad_norm"])
    state = load_state(latest_checkpoint(out))
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flowrl", "train", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


@pytest.mark.slow
def test_bad_config_missing_model_and_missing_checkpoint_are_one_line_errors(tiny_shapes_dir, tmp_path):
    bad = cli(str(CONFIG), "sampling.group_sise=4")
    assert bad.returncode == 2
    assert bad.stderr.strip() == ("flowrl train: config error: sampling.group_sise: unknown key (did you mean "
                                  "'group_size'?); valid keys: num_steps, eval_num_steps, step, noise_level, "
                                  "reduction, guidance, eval_guidance, window, group_size, groups_per_epoch, "
                                  "batch_size, precision, base_last_steps")
    missing = cli(str(CONFIG), f"model.path={tmp_path / 'nowhere'}", f"run.output_dir={tmp_path / 'o'}")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "shapes model at" in missing.stderr and "is missing model.json" in missing.stderr
    no_ckpt = cli(str(CONFIG), *tiny_overrides(tiny_shapes_dir, tmp_path / "fresh"), "run.resume=true")
    assert no_ckpt.returncode == 2 and "Traceback" not in no_ckpt.stderr
    assert "holds no checkpoint" in no_ckpt.stderr


def test_window_that_runs_past_the_schedule_fails_at_load_not_mid_run():
    from flowrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"sampling\.window\.max_start: max_start 4 \+ size 2 exceeds the 3 "
                                          r"trainable steps of a 4-step schedule; lower max_start to at most 1"):
        load_recipe_config(str(CONFIG), ["sampling.num_steps=4"])
    # Unset max_start means "the last start that fits", so the same window is valid on a short schedule.
    _, cfg = load_recipe_config(str(CONFIG), ["sampling.num_steps=4", "sampling.window.max_start=null"])
    assert cfg.sampling.window.max_start is None and cfg.sampling.window.size == 2


# ---------------------------------------------------------------------------- GRPO-Guard's RatioNorm and Flow-DPPO


def run_config(name: str, model_dir, out, **extra) -> list[dict]:
    recipe, cfg = load_recipe_config(str(ROOT / "configs" / "shapes" / f"{name}.yaml"),
                                     tiny_overrides(model_dir, out, **extra))
    assert recipe.main(cfg) == 0
    return read_metrics(out / "metrics.jsonl")


@pytest.mark.parametrize("name", ["grpo_guard", "flow_dppo"])
@pytest.mark.slow
def test_ratio_norm_and_flow_dppo_configs_train(name, tiny_shapes_dir, tmp_path):
    rows = run_config(name, tiny_shapes_dir, tmp_path / name, **{"run.max_epochs": 2, "eval.every_epochs": 100,
                                                                 "checkpoint.every_epochs": 100})
    trained = [r for r in rows if "train/grad_norm" in r]
    assert len(trained) == 2 and all(r["train/optimizer_steps"] == 2 and r["train/grad_norm"] > 0 for r in trained)
    # Two minibatches: the second is off-policy, so the exact KL to the rollout's transitions is positive.
    assert all(r["train/kl_old"] > 0 for r in trained)
    assert all(math.isfinite(r["train/loss"]) for r in trained)


@pytest.mark.slow
def test_flow_dppo_on_policy_is_flow_grpo(tiny_shapes_dir, tmp_path):
    # One optimizer step per epoch: the policy equals the sampling one, the KL is 0, nothing is masked, and Flow-DPPO's
    # -A rho is Flow-GRPO's unclipped surrogate: the same loss and gradient.
    one_step = {"run.max_epochs": 1, "train.minibatches": 1, "eval.every_epochs": 100, "checkpoint.every_epochs": 1}
    grpo = run(tiny_shapes_dir, tmp_path / "grpo", **one_step)
    dppo = run_config("flow_dppo", tiny_shapes_dir, tmp_path / "dppo", **one_step)
    assert grpo == 0
    a = [r for r in read_metrics(tmp_path / "grpo" / "metrics.jsonl") if "train/grad_norm" in r][0]
    b = [r for r in dppo if "train/grad_norm" in r][0]
    assert b["train/kl_old"] == 0 and b["train/clip_frac"] == 0
    assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-6)
    assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5, abs=1e-8)
    wa = load_state(latest_checkpoint(tmp_path / "grpo"))["model"]
    wb = load_state(latest_checkpoint(tmp_path / "dppo"))["model"]
    for key, value in wa.items():
        torch.testing.assert_close(wb[key], value, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_ratio_norm_on_policy_scales_the_gradient_by_std_over_dt(tiny_shapes_dir, tmp_path):
    # On-policy the normalised log-ratio (log rho + KL) std has gradient std * grad log rho (the KL is quadratic in the
    # mean shift, so flat at 0), and RatioNorm divides by |dt|: with one trained step the whole gradient is Flow-GRPO's
    # times std_t / |dt_t|.
    from flowrl.models.shapes import ShapesModel
    from samplers import make_step, noise_kwargs

    step = {"run.max_epochs": 1, "train.minibatches": 1, "eval.every_epochs": 100, "checkpoint.every_epochs": 100,
            "sampling.window.mode": "fixed", "sampling.window.start": 1, "sampling.window.size": 1}
    run(tiny_shapes_dir, tmp_path / "grpo", **step)
    guard = run_config("grpo_guard", tiny_shapes_dir, tmp_path / "guard", **step)
    a = [r for r in read_metrics(tmp_path / "grpo" / "metrics.jsonl") if "train/grad_norm" in r][0]
    b = [r for r in guard if "train/grad_norm" in r][0]
    sigmas = ShapesModel.from_pretrained(tiny_shapes_dir).sigmas(4)
    sde = make_step("flow_sde", sigmas, **noise_kwargs("flow_sde", 0.7), reduction="mean")
    x = torch.zeros(1, 1)
    std = float(sde(torch.zeros_like(x), x, 1, x_next=x).std)
    factor = std / float(sigmas[1] - sigmas[2])
    assert factor == pytest.approx(0.7 * math.sqrt(0.75 / 0.25) * math.sqrt(0.25) / 0.25)  # g sqrt(dt) / dt
    assert b["train/ratio_mean"] == pytest.approx(1.0, abs=1e-6) and b["train/kl_old"] == 0
    assert b["train/grad_norm"] == pytest.approx(factor * a["train/grad_norm"], rel=1e-4)
