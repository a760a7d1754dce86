"""The reward-gradient recipe (flowrl/recipes/reward_gradient.py: ReFL, DRaFT-K, DRaFT-LV, Direct-Align) through its
shipped shapes configs on tiny models: on the tiny shapes model each method raises a toy differentiable reward on the
prompts it trains on (the evaluation's fixed prompts and seeds are the training set's), and moves the weights;
Direct-Align's shipped config raises a tiny learned proxy, and its SRP scores the control-word prompts in both
branches; on the tiny SD3 and FLUX pipelines a LoRA epoch trains (the LoRA's B, zero at init, moves); a training
reward without a gradient is refused with one line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from flowrl.config import ConfigError
from flowrl.recipes import load_recipe_config
from flowrl.run.checkpoint_files import latest_checkpoint, load_state
from flowrl.run.metrics import read_metrics
from rewards import RewardOutput
from rewards.registry import REWARDS
from rewards.testing import RedMinusBlue, register_red_minus_blue

ROOT = Path(__file__).resolve().parents[2]
TOY = register_red_minus_blue()  # rewards/testing.py: mean red - mean blue, differentiable

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


PROMPTED = "toy_prompted_red_minus_blue"
SEEN: list[list[str]] = []  # the prompts each call of the prompted toy was given


class PromptedRedMinusBlue(RedMinusBlue):
    """The toy, recording its prompts and scoring a prompt with a control word (``"<word>. ..."``) 0.1 higher."""

    name = PROMPTED

    def score(self, images, prompts, metadata=None) -> RewardOutput:
        SEEN.append(list(prompts))
        bonus = torch.tensor([0.1 if ". " in p else 0.0 for p in prompts])
        return RewardOutput(super().score(images, prompts).scores + bonus, {})


if PROMPTED not in REWARDS.names():
    REWARDS.register(PROMPTED, PromptedRedMinusBlue)


def settings(out: Path, model_dir: Path, method: str, **extra) -> list[str]:
    values = {
        "model.path": str(model_dir), "run.output_dir": str(out), "run.max_minutes": "null", "run.max_epochs": 3,
        "data.train_prompts": "shapes:train", "data.eval_prompts": "shapes:train", "data.num_eval_prompts": 4,
        "data.kind_weights": "uniform", "sampling.num_steps": 4, "sampling.eval_num_steps": 4,
        "sampling.groups_per_epoch": 2, "sampling.group_size": 2, "train.micro_batch_size": 2, "optim.lr": 3e-3,
        "train.method": method, "train.k": 2, "train.lv_samples": 2, "reward.train": f"{{{TOY}: 1.0}}",
        "reward.eval": f"[{TOY}]", "eval.every_epochs": 3, "eval.every_minutes": "null", "eval.grid_size": 0,
        "eval.hacking.enabled": "false", "checkpoint.every_epochs": 3,
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def train(config: str, out: Path, model_dir: Path, method: str, **extra):
    recipe, cfg = load_recipe_config(str(ROOT / "configs" / "shapes" / config), settings(out, model_dir, method,
                                                                                        **extra))
    assert recipe.main(cfg) == 0
    return read_metrics(out / "metrics.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["refl", "draft", "draft_lv"])
def test_each_method_raises_the_reward_on_the_trained_prompts(method, tiny_shapes_dir, tmp_path):
    from diffusers import UNet2DConditionModel

    config = "refl.yaml" if method == "refl" else "draft.yaml"
    rows = train(config, tmp_path / "run", tiny_shapes_dir, method, **{"train.refl_low": 0.5})
    before, after = rows[0][f"eval/{TOY}/mean"], rows[-1][f"eval/{TOY}/mean"]
    assert after > before + 0.02, (before, after)  # same prompts and seeds, evaluated before and after 3 epochs
    last = rows[-1]
    assert math.isfinite(last["train/loss"]) and last["train/grad_norm"] > 0 and last["train/optimizer_steps"] == 1
    # the loss is -mean r over the epoch's samples (margin null, scale 1)
    assert last["train/loss"] == pytest.approx(-last["train/reward_mean"], abs=1e-5)
    if method == "refl":  # the gradient step of a 4-step schedule's window [0.5, 1): steps 2 or 3
        assert all(2 <= r["train/refl_step"] <= 3 for r in rows[1:])
    else:
        assert "train/refl_step" not in last
    initial = UNet2DConditionModel.from_pretrained(tiny_shapes_dir / "unet").state_dict()
    trained = load_state(latest_checkpoint(tmp_path / "run"))["model"]
    assert max(float((initial[k] - v).abs().max()) for k, v in trained.items()) > 1e-4


@pytest.mark.slow
def test_direct_align_raises_the_reward_on_the_trained_prompts(tiny_shapes_dir, tmp_path):
    """Without control words the objective is k r(x0_hat, prompt), k the drawn level's discount in [0.1, 0.25]."""
    from diffusers import UNet2DConditionModel

    rows = train("direct_align.yaml", tmp_path / "run", tiny_shapes_dir, "direct_align")
    before, after = rows[0][f"eval/{TOY}/mean"], rows[-1][f"eval/{TOY}/mean"]
    assert after > before + 0.02, (before, after)
    for r in rows[1:]:
        assert math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 and r["train/optimizer_steps"] == 1
        assert r["train/loss"] == pytest.approx(-r["train/srp"], abs=1e-6)  # margin null, scale 1: -mean k r
        assert 0.75 <= r["train/da_sigma"] <= 0.9643  # the shipped window
    initial = UNet2DConditionModel.from_pretrained(tiny_shapes_dir / "unet").state_dict()
    trained = load_state(latest_checkpoint(tmp_path / "run"))["model"]
    assert max(float((initial[k] - v).abs().max()) for k, v in trained.items()) > 1e-4


@pytest.mark.slow
def test_srp_scores_the_control_words_in_both_branches(tiny_shapes_dir, tmp_path):
    """Words cycled per micro-batch (two per epoch here); the denoising branch scores (positive, negative), the
    inversion branch (negative, positive), each back-propagated: the loss is minus the branches' mean objective."""
    SEEN.clear()
    words = {"train.srp_positive": "[Detail, Real]", "train.srp_negative": "[Oil]",
             "train.da_discount_inv": "[0.3, 0.01]", "reward.train": f"{{{PROMPTED}: 1.0}}", "run.max_epochs": 1,
             "eval.every_epochs": 1}
    rows = train("direct_align.yaml", tmp_path / "run", tiny_shapes_dir, "direct_align", **words)
    training = [p for p in SEEN if ". " in p[0]]  # the evaluation scores the plain prompts
    assert len(training) == 8  # 2 micro-batches x 2 branches x (positive, negative)
    firsts = [p[0].split(". ")[0] for p in training]
    # epoch 1, 2 micro-batches per epoch: turns 2 and 3 -> Detail (2 % 2), Real (3 % 2); the negative always Oil
    assert firsts == ["Detail", "Oil", "Oil", "Detail", "Real", "Oil", "Oil", "Real"]
    row = rows[-1]
    assert row["train/loss"] == pytest.approx(-row["train/srp"], abs=1e-6)
    assert math.isfinite(row["train/loss"]) and row["train/grad_norm"] > 0


@pytest.fixture(scope="module")
def tiny_proxy(tmp_path_factory) -> Path:
    """A shapes proxy trained briefly on rendered scenes (as tests/recipes/test_dmdr.py's): even rows draw their
    prompt's scene, odd rows another prompt's; the strict judge labels them."""
    import random

    import numpy as np

    from flowrl.data.shapes import render, scene_for_prompt
    from rewards.shapes_proxy import save_proxy, train_shapes_proxy
    from rewards.shapes_proxy_data import pool_rows, read_pool, write_pool

    root = tmp_path_factory.mktemp("proxy")
    train_rows, held = pool_rows(48, 12, 0)
    rows = train_rows + held
    scenes = [scene_for_prompt(rows[i if i % 2 == 0 else (i + 7) % len(rows)][0], random.Random(i))
              for i in range(len(rows))]
    images = torch.from_numpy(np.stack([render(s) for s in scenes])).permute(0, 3, 1, 2).contiguous()
    write_pool(root / "pool", images, train_rows, held, {"source": "rendered"})
    model, report = train_shapes_proxy(read_pool(root / "pool").prefix(48)[:3], steps=30, seed=0, log=None)
    return save_proxy(model, root / "proxy", {"training": report})


@pytest.mark.slow
def test_the_shipped_direct_align_config_raises_a_learned_proxy(tiny_shapes_dir, tiny_proxy, tmp_path):
    """configs/shapes/direct_align.yaml's objective as shipped (k times the proxy's probability) on a tiny trained
    proxy: the proxy, evaluated on the trained prompts, rises, and the weights move."""
    from diffusers import UNet2DConditionModel

    proxy = f"{{shapes_proxy: {{weight: 1.0, kwargs: {{path: {tiny_proxy}}}}}}}"
    rows = train("direct_align.yaml", tmp_path / "run", tiny_shapes_dir, "direct_align",
                 **{"reward.train": proxy, "reward.eval": "[shapes_proxy]"})
    before, after = rows[0]["eval/shapes_proxy/mean"], rows[-1]["eval/shapes_proxy/mean"]
    assert after > before + 0.02, (before, after)  # 0.41 -> 0.53 (run seeds 1, 2: 0.44, 0.46)
    assert all(0 < r["train/reward_mean"] < 1 and r["train/nan_rewards"] == 0 for r in rows[1:])
    initial = UNet2DConditionModel.from_pretrained(tiny_shapes_dir / "unet").state_dict()
    trained = load_state(latest_checkpoint(tmp_path / "run"))["model"]
    assert max(float((initial[k] - v).abs().max()) for k, v in trained.items()) > 1e-4


@pytest.mark.slow
def test_the_kl_term_and_a_hinge_enter_the_loss(tiny_shapes_dir, tmp_path):
    """ReFL with the authors' hinge relu(2 - r) x 0.5 (r < 1 here, so it is 0.5 (2 - r)) and the reference penalty,
    which is 0 before the first update and positive after it."""
    rows = train("refl.yaml", tmp_path / "run", tiny_shapes_dir, "refl",
                 **{"train.margin": 2.0, "train.loss_scale": 0.5, "train.kl_coef": 1.0, "run.max_epochs": 2})
    first, second = rows[1], rows[2]
    assert first["train/loss"] == pytest.approx(0.5 * (2 - first["train/reward_mean"]), abs=1e-5)
    assert first["train/kl_ref"] == pytest.approx(0.0, abs=1e-10)
    assert second["train/kl_ref"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("family, method", [("sd3", "draft"), ("flux", "refl"), ("sd3", "draft_lv"),
                                            ("sd3", "direct_align"), ("flux", "direct_align")])
def test_a_tiny_lora_epoch_on_sd3_and_flux(family, method, tiny_dir, tmp_path):
    from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION

    out = tmp_path / "run"
    guidance = 3.5 if family == "flux" else 4.0  # FLUX: the guidance embedding; SD3: CFG, both branches trained
    extra = {"model.name": family, "model.resolution": TINY_RESOLUTION, "model.lora": "{rank: 4, alpha: 8}",
             "model.max_sequence_length": TINY_MAX_SEQUENCE_LENGTH, "model.dtype": "float32",
             "sampling.num_steps": 3, "sampling.eval_num_steps": 2, "sampling.guidance": guidance,
             "run.max_epochs": 1, "eval.every_epochs": 1, "eval.at_start": "false", "checkpoint.every_epochs": 1,
             "train.refl_low": 0.3}
    if method == "direct_align" and family == "flux":  # SRP's words and the inversion branch (two backward passes)
        extra.update({"train.srp_positive": "[Real]", "train.srp_negative": "[Painting]",
                      "train.da_discount_inv": "[0.3, 0.01]", "train.margin": 0.7})
    rows = train("draft.yaml", out, tiny_dir(family), method, **extra)
    row = rows[-1]
    assert math.isfinite(row["train/loss"]) and row["train/grad_norm"] > 0, row
    assert f"eval/{TOY}/mean" in row
    state = load_state(latest_checkpoint(out))["model"]
    assert state and all("lora_" in k for k in state)
    assert max(float(v.abs().max()) for k, v in state.items() if "lora_B" in k) > 0  # B starts at 0: it moved


def test_a_training_reward_without_a_gradient_is_refused():
    with pytest.raises(ConfigError) as err:
        load_recipe_config(str(ROOT / "configs" / "shapes" / "draft.yaml"), ["reward.train={shapes: 1.0}"])
    assert str(err.value) == (
        "reward.train: shapes is not differentiable, and draft back-propagates the reward into the images: train on "
        "a differentiable reward (shapes_proxy, pickscore, aesthetic, hpsv2, clip_score) or use a policy-gradient "
        "trainer (flow_grpo, nft)")
    assert "\n" not in str(err.value)


def test_a_reward_known_only_once_built_is_refused_at_setup(tiny_shapes_dir, tmp_path):
    """JPEG size declares nothing in its class (the base's default, False): the built reward is checked."""
    recipe, cfg = load_recipe_config(str(ROOT / "configs" / "shapes" / "draft.yaml"),
                                     settings(tmp_path / "run", tiny_shapes_dir, "draft",
                                              **{"reward.train": "{jpeg_incompressibility: 1.0}"}))
    with pytest.raises(ConfigError) as err:
        recipe.main(cfg)
    message = str(err.value)
    assert message.startswith("reward.train: jpeg_incompressibility built a reward that is not differentiable (")
    assert "train on a differentiable reward (shapes_proxy, pickscore, aesthetic, hpsv2, clip_score)" in message
    assert "\n" not in message


def test_the_config_checks_the_schedule():
    path = str(ROOT / "configs" / "shapes" / "draft.yaml")
    with pytest.raises(ConfigError, match="train.k: 11 steps with gradient exceed the 10 of the schedule"):
        load_recipe_config(path, ["train.k=11"])
    with pytest.raises(ConfigError, match="holds no step of a 10-step schedule"):
        load_recipe_config(path, ["train.method=refl", "train.refl_low=0.91", "train.refl_high=0.95"])
    with pytest.raises(ConfigError, match="train.da_sigma_min: the window needs 0 < sigma_min < sigma_max <= 1"):
        load_recipe_config(path, ["train.method=direct_align", "train.da_sigma_min=0.97"])
    with pytest.raises(ConfigError, match="train.da_discount_inv: the inversion branch ascends the negative"):
        load_recipe_config(path, ["train.method=direct_align", "train.da_discount_inv=[0.3, 0.01]"])
    with pytest.raises(ConfigError, match="train.srp_negative: SRP needs control words on both sides"):
        load_recipe_config(path, ["train.method=direct_align", "train.srp_positive=[Real]"])
    _, sd3 = load_recipe_config(str(ROOT / "configs" / "sd3" / "direct_align_pickscore.yaml"), [])
    assert (sd3.train.srp_positive, sd3.train.srp_negative) == (["Natural-lighting", "Detail", "Detailed", "Real"],
                                                                ["Concept art", "Painting", "Anime", "Flat", "Oil"])
    assert sd3.train.da_discount_inv == (0.6, 0.01) and sd3.train.srp_scale == 0.05
    _, cfg = load_recipe_config(str(ROOT / "configs" / "shapes" / "refl.yaml"), [])
    assert cfg.train.method == "refl" and cfg.reward.train["shapes_proxy"]["kwargs"]["path"]
    from flowrl.core.reward_gradient import refl_step_range

    assert list(refl_step_range(cfg.sampling.num_steps, cfg.train.refl_low, cfg.train.refl_high)) == [8, 9]


@pytest.mark.slow
def test_a_resumed_run_equals_one_that_never_stopped(tiny_shapes_dir, tmp_path):
    """Every draw (ReFL's step, DRaFT-LV's noise) is a function of (seed, epoch, sample seed, micro-batch): a run
    stopped after epoch 1 and resumed logs the same numbers and ends with the same weights."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    extra = {"run.deterministic": "true", "checkpoint.every_epochs": 1, "eval.every_epochs": 1, "train.method": "refl",
             "train.refl_low": 0.5}
    a_rows = train("refl.yaml", straight, tiny_shapes_dir, "refl", **extra)
    train("refl.yaml", resumed, tiny_shapes_dir, "refl", **{**extra, "run.max_epochs": 1})
    b_rows = train("refl.yaml", resumed, tiny_shapes_dir, "refl", **{**extra, "run.resume": "true"})

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in rows]

    assert [r["epoch"] for r in b_rows] == [0, 1, 2, 3]
    assert comparable(b_rows) == comparable(a_rows)
    a, b = load_state(latest_checkpoint(straight))["model"], load_state(latest_checkpoint(resumed))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
