"""The DMDR recipe (flowrl/recipes/dmdr.py) through its shipped shapes config on tiny models, with a toy
differentiable reward: with the reward off its step is DMD2's bit for bit (the composition), and the cold start keeps
it so until its last generator step; with the reward on, the reward's gradient moves the student and raises the
reward on the prompts it trains on; DynaDG's mix and DynaRS's levels follow their schedules, and FakeScore.mixed is
the teacher at 0 and the fake score at 1 (full fine-tuning and LoRA); a LoRA epoch trains on tiny SD3, FLUX and
Z-Image; a resumed run equals one that never stopped; a reward without a gradient is refused with one line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from flowrl.config import ConfigError
from flowrl.recipes import load_recipe_config
from flowrl.run.checkpoint_files import checkpoints, latest_checkpoint, load_state
from flowrl.run.metrics import read_metrics
from rewards.testing import register_red_minus_blue

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "shapes" / "dmdr.yaml")
DMD2_CONFIG = str(ROOT / "configs" / "shapes" / "dmd2.yaml")
TOY = register_red_minus_blue()  # rewards/testing.py: mean red - mean blue, differentiable

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def settings(out: Path, model_dir: Path, **extra) -> list[str]:
    values = {
        "model.path": str(model_dir), "run.output_dir": str(out), "run.max_minutes": "null", "run.max_epochs": 3,
        "data.train_prompts": "shapes:train", "data.eval_prompts": "shapes:train", "data.num_eval_prompts": 2,
        "data.kind_weights": "uniform", "sampling.eval_num_steps": 2, "train.student_steps": 2,
        "sampling.groups_per_epoch": 2, "sampling.group_size": 2, "train.micro_batch_size": 2, "train.minibatches": 2,
        "train.dfake_gen_update_ratio": 2, "train.real_guidance": 3.0, "optim.lr": 1e-3,
        "train.reward_loss": "negative", "reward.train": f"{{{TOY}: 1.0}}", "reward.eval": f"[{TOY}]",
        "eval.every_epochs": 3, "eval.every_minutes": "null", "eval.grid_size": 0, "eval.hacking.enabled": "false",
        "checkpoint.every_epochs": 1, "checkpoint.keep": 3, "run.deterministic": "true",
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items() if v is not None]  # None: leave the config's (DMD2's has no reward)


def train(out: Path, model_dir: Path, *, config: str = CONFIG, model=None, **extra):
    recipe, cfg = load_recipe_config(config, settings(out, model_dir, **extra))
    assert recipe.main(cfg, model=model) == 0
    return read_metrics(out / "metrics.jsonl")


def states(out: Path) -> list[dict]:
    return sorted((load_state(c) for c in checkpoints(out)), key=lambda s: s["epoch"])


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _comparable(rows: list[dict], keys: tuple[str, ...]) -> list[dict]:
    return [{k: r.get(k) for k in keys} for r in rows if "train/fake_steps" in r]


@pytest.mark.slow
def test_the_reward_term_composes_with_dmd2(tiny_shapes_dir, tmp_path):
    """Two steps per epoch, a generator step every 2nd: steps 0,1 | 2,3 | 4,5 update the student at 0, 2 and 4, which
    follow 0, 1 and 2 generator updates. With the reward weight 0, DMDR is DMD2 bit for bit (student, fake score and
    the logged DMD numbers). With a weight and a cold start of 1 generator step, epoch 1 (step 0) is still DMD2's; the
    reward enters at step 2, its gradient moves the student off DMD2's path and raises the reward."""
    common = {"run.max_epochs": 3, "eval.every_epochs": 3}
    dmd2_rows = train(tmp_path / "dmd2", tiny_shapes_dir, config=DMD2_CONFIG,
                      **{**common, "train.reward_loss": None, "reward.train": None, "reward.eval": "[shapes]"})
    off_rows = train(tmp_path / "off", tiny_shapes_dir, **{**common, "train.reward_weight": 0.0,
                                                           "reward.eval": "[shapes]"})
    on_rows = train(tmp_path / "on", tiny_shapes_dir, **{**common, "train.reward_weight": 5.0,
                                                         "train.cold_start_steps": 1})
    dmd2_states, off_states, on_states = states(tmp_path / "dmd2"), states(tmp_path / "off"), states(tmp_path / "on")
    keys = ("train/dmd_loss", "train/grad_norm", "train/fake_loss", "train/score_gap", "train/generator_steps")
    assert str(_comparable(off_rows, keys)) == str(_comparable(dmd2_rows, keys))
    for a, b in zip(dmd2_states, off_states):
        assert _equal(a["model"], b["model"]) and _equal(a["fake_score"], b["fake_score"])

    epochs = [r for r in on_rows if "train/fake_steps" in r]
    assert [r["train/reward_steps"] for r in epochs] == [0, 1, 1]  # steps 2 and 4, after the cold start
    assert "train/reward_mean" not in epochs[0] and "train/reward_loss" not in epochs[0]  # no reward yet
    for r in epochs[1:]:
        assert r["train/reward_loss"] == pytest.approx(-r["train/reward_mean"], abs=1e-6)  # "negative": -mean r
        assert r["train/generator_loss"] == pytest.approx(r["train/dmd_loss"] + 5.0 * r["train/reward_loss"],
                                                          abs=1e-5)
        assert r["train/nan_rewards"] == 0
    # the cold start: step 0's update is DMD2's, to the bit
    assert _equal(on_states[0]["model"], dmd2_states[0]["model"])
    assert epochs[0]["train/dmd_loss"] == _comparable(dmd2_rows, keys)[0]["train/dmd_loss"]
    # from step 2 on, the reward's gradient moves the student elsewhere
    assert _max_diff(on_states[1]["model"], dmd2_states[1]["model"]) > 1e-4
    assert epochs[2]["train/reward_mean"] > epochs[1]["train/reward_mean"]  # the same prompts each epoch
    before, after = on_rows[0][f"eval/{TOY}/mean"], on_rows[-1][f"eval/{TOY}/mean"]
    assert after > before + 0.01, (before, after)  # evaluated on the trained prompts before and after


@pytest.fixture(scope="module")
def tiny_proxy(tmp_path_factory) -> Path:
    """A shapes proxy trained briefly on rendered scenes (as tests/rewards/test_shapes_proxy.py's ``proxy_dirs``):
    even rows draw their prompt's scene, odd rows another prompt's; the strict judge labels them."""
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
def test_the_shipped_config_trains_on_a_learned_proxy(tiny_shapes_dir, tiny_proxy, tmp_path):
    """configs/shapes/dmdr.yaml's reward as shipped (a shapes proxy's probability, the loss -log r at weight 0.05) on
    a tiny trained proxy: the reward is a probability, its loss is positive, and its gradient moves the student off
    the path it takes with the reward weight 0."""
    proxy = f"{{shapes_proxy: {{weight: 1.0, kwargs: {{path: {tiny_proxy}}}}}}}"
    common = {"run.max_epochs": 1, "eval.every_epochs": 1, "reward.train": proxy, "reward.eval": "[shapes]",
              "train.reward_loss": None}  # the config's: log
    rows = train(tmp_path / "on", tiny_shapes_dir, **common)
    train(tmp_path / "off", tiny_shapes_dir, **{**common, "train.reward_weight": 0.0})
    row = [r for r in rows if "train/fake_steps" in r][-1]
    assert row["train/reward_steps"] == 1 and 0 < row["train/reward_mean"] < 1 and row["train/nan_rewards"] == 0
    assert row["train/reward_loss"] > -math.log(1 - 1e-6)  # -mean log r of probabilities below 1
    assert row["train/generator_loss"] == pytest.approx(row["train/dmd_loss"] + 0.05 * row["train/reward_loss"],
                                                        abs=1e-5)
    assert _max_diff(states(tmp_path / "on")[0]["model"], states(tmp_path / "off")[0]["model"]) > 0


@pytest.mark.slow
def test_the_cold_start_schedules_follow_the_generator_steps(tiny_shapes_dir, tmp_path):
    """Ratio 1 (every step a generator step), 2 steps per epoch, a horizon of 2 generator steps: DynaDG's mix is
    0.5 c(0) = 0.5 and 0.5 c(1) = 0.25 in epoch 1 (logged mean 0.375), 0 from then on; DynaRS's Beta levels train."""
    rows = train(tmp_path / "run", tiny_shapes_dir, **{"run.max_epochs": 2, "train.dfake_gen_update_ratio": 1,
                                                       "train.time_sampling": "beta", "train.dynamic_steps": 2,
                                                       "train.real_fake_mix": 0.5, "train.reward_weight": 1.0})
    epochs = [r for r in rows if "train/fake_steps" in r]
    assert [r["train/real_mix"] for r in epochs] == pytest.approx([0.375, 0.0])
    assert [r["train/generator_steps"] for r in epochs] == [2, 2]
    for r in epochs:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("train/dmd_loss", "train/grad_norm", "train/fake_loss",
                                                               "train/score_gap")), r


def test_fake_score_mixed_is_the_teacher_at_0_and_the_fake_score_at_1(tiny_shapes_dir):
    from flowrl.models.base import encode_rows
    from flowrl.models.shapes import ShapesModel
    from flowrl.recipes.dmd2 import FakeScore

    model = ShapesModel.from_pretrained(tiny_shapes_dir)
    model.freeze_reference()
    fake = FakeScore(model)
    with torch.no_grad():  # a student and a fake score that differ from the teacher, and from each other
        for i, p in enumerate(model.trainable_parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
        for i, p in enumerate(fake.parameters()):
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + i)))
    student = {k: v.clone() for k, v in model.denoiser.state_dict().items()}
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    sigma, cond = torch.tensor([0.3, 0.7]), encode_rows(model, ["a red circle", "two blue squares"], None)

    def velocity():
        with torch.no_grad():
            return model.velocity_fn(1.0)(x, sigma, cond)

    with model.reference():
        v_teacher = velocity()
    with fake.active(model):
        v_fake = velocity()
    with fake.mixed(model, 0.0):
        assert torch.equal(velocity(), v_teacher)
    with fake.mixed(model, 1.0):
        torch.testing.assert_close(velocity(), v_fake, rtol=0, atol=1e-6)
    name, f = next(iter(fake.params.items()))
    with model.reference():
        t = dict(model.denoiser.named_parameters())[name].detach().clone()
    with fake.mixed(model, 0.25):
        live = dict(model.denoiser.named_parameters())[name]
        torch.testing.assert_close(live, t + 0.25 * (f.detach() - t))
        v_mix = velocity()
    assert not torch.allclose(v_mix, v_teacher) and not torch.allclose(v_mix, v_fake)
    assert _equal(model.denoiser.state_dict(), student)  # the student is back


@pytest.mark.slow
def test_fake_score_mixed_scales_a_loras_b(tiny_dir):
    """A LoRA's update is linear in its B: the mix runs the fake score's A and m times its B."""
    from flowrl.config import from_dict
    from flowrl.models.base import encode_rows
    from flowrl.models.config import ModelConfig, build_model
    from flowrl.recipes.dmd2 import FakeScore
    from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION

    cfg = from_dict(ModelConfig, {"name": "sd3", "path": str(tiny_dir("sd3")), "resolution": TINY_RESOLUTION,
                                  "max_sequence_length": TINY_MAX_SEQUENCE_LENGTH, "dtype": "float32",
                                  "lora": {"rank": 4, "alpha": 8}})
    torch.manual_seed(0)
    model = build_model(cfg, "cpu")
    fake = FakeScore(model)
    with torch.no_grad():
        for i, (name, p) in enumerate(fake.params.items()):
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(i))
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    sigma, cond = torch.tensor([0.3, 0.7]), encode_rows(model, ["a cat", "a dog"], None)

    def velocity():
        with torch.no_grad():
            return model.velocity_fn(1.0)(x, sigma, cond)

    with model.reference():
        v_teacher = velocity()
    with fake.active(model):
        v_fake = velocity()
    with fake.mixed(model, 1.0):
        torch.testing.assert_close(velocity(), v_fake, rtol=0, atol=1e-6)
    with fake.mixed(model, 0.0):
        assert torch.equal(velocity(), v_teacher)
    from flowrl.models.base import unwrap

    with fake.mixed(model, 0.5):
        live = dict(unwrap(model.denoiser).named_parameters())
        for name, f in fake.params.items():
            torch.testing.assert_close(live[name], 0.5 * f if "lora_B" in name else f)
        assert not torch.allclose(velocity(), v_teacher)
    live = dict(unwrap(model.denoiser).named_parameters())
    assert all(float(live[n].detach().abs().max()) == 0 for n in fake.params if "lora_B" in n)  # the student's B


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sd3", "flux", "z_image"])
def test_a_tiny_lora_epoch_on_sd3_flux_and_z_image(family, tiny_dir, tmp_path):
    from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION

    out = tmp_path / "run"
    guidance = {"sd3": 1.0, "flux": 3.5, "z_image": 1.0}[family]  # FLUX: the embedded guidance of both networks
    extra = {"model.name": family, "model.resolution": TINY_RESOLUTION, "model.lora": "{rank: 4, alpha: 8}",
             "model.max_sequence_length": TINY_MAX_SEQUENCE_LENGTH, "model.dtype": "float32",
             "model.gradient_checkpointing": "true" if family == "sd3" else "false", "sampling.guidance": guidance,
             "run.max_epochs": 1, "eval.every_epochs": 1, "eval.at_start": "false", "train.minibatches": 1,
             "train.real_guidance": 4.0, "optim.lr": 1e-2, "train.reward_weight": 1.0}  # FLUX: the teacher's embedding
    # differs from the student's and the fake score's 3.5, so the DMD term is not 0 at the start
    rows = train(out, tiny_dir(family), **extra)
    row = rows[-1]
    assert row["train/generator_steps"] == 1 and row["train/fake_steps"] == 1 and row["train/reward_steps"] == 1, row
    for key in ("train/dmd_loss", "train/grad_norm", "train/fake_loss", "train/fake_grad_norm"):
        assert math.isfinite(row[key]) and row[key] > 0, (key, row)
    assert math.isfinite(row["train/reward_mean"]) and row["train/nan_rewards"] == 0
    assert f"eval/{TOY}/mean" in row
    state = load_state(latest_checkpoint(out))
    student, fake = state["model"], state["fake_score"]
    assert student and set(student) == set(fake) and all("lora_" in k for k in student)  # the teacher is never trained
    b_keys = [k for k in student if "lora_B" in k]
    assert max(float(student[k].abs().max()) for k in b_keys) > 0  # B starts at 0: the student moved
    assert max(float(fake[k].abs().max()) for k in b_keys) > 0  # and so did the fake score


@pytest.mark.slow
def test_a_resumed_run_equals_one_that_never_stopped(tiny_shapes_dir, tmp_path):
    """Every draw (the simulation level, DynaRS's Beta levels, the noise) is a function of (seed, step, sample seed)
    and the schedules of the generator step: a run stopped after epoch 1 and resumed logs the same numbers and ends
    with the same student and fake score."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    extra = {"train.time_sampling": "beta", "train.dynamic_steps": 3, "train.real_fake_mix": 0.5,
             "train.cold_start_steps": 1, "eval.every_epochs": 1}
    a_rows = train(straight, tiny_shapes_dir, **extra)
    train(resumed, tiny_shapes_dir, **{**extra, "run.max_epochs": 1})
    b_rows = train(resumed, tiny_shapes_dir, **{**extra, "run.resume": "true"})

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in rows]

    assert [r["epoch"] for r in b_rows] == [0, 1, 2, 3]
    assert str(comparable(b_rows)) == str(comparable(a_rows))  # str: NaN (an epoch without a generator step) == NaN
    a, b = load_state(latest_checkpoint(straight)), load_state(latest_checkpoint(resumed))
    for key in ("model", "fake_score"):
        assert _equal(a[key], b[key]), key


def test_the_config_refuses_a_reward_without_a_gradient_and_a_mix_without_a_horizon():
    with pytest.raises(ConfigError) as err:
        load_recipe_config(CONFIG, ["reward.train={shapes: 1.0}"])
    assert str(err.value) == (
        "reward.train: shapes is not differentiable, and DMDR back-propagates the reward into the student's samples: "
        "train on a differentiable reward (shapes_proxy, pickscore, aesthetic, hpsv2, clip_score), or set "
        "train.reward_weight: 0 (DMD2)")
    _, cfg = load_recipe_config(CONFIG, ["reward.train={shapes: 1.0}", "train.reward_weight=0"])  # DMD2 alone
    with pytest.raises(ConfigError) as err:
        load_recipe_config(CONFIG, ["train.real_fake_mix=0.3"])
    assert str(err.value) == ("train.real_fake_mix: 0.3 mixes the fake score into the real one over "
                              "train.dynamic_steps generator steps, which is 0: set dynamic_steps > 0 (or "
                              "real_fake_mix: 0)")
    with pytest.raises(ConfigError, match="sampling.eval_num_steps: the student is a 4-step generator"):
        load_recipe_config(CONFIG, ["sampling.eval_num_steps=20"])  # DMD2's checks hold
    _, cfg = load_recipe_config(CONFIG, [])
    assert cfg.train.student_steps == cfg.sampling.eval_num_steps == 4
    assert cfg.train.reward_loss == "log" and cfg.reward.train["shapes_proxy"]["kwargs"]["path"]
    assert cfg.reward.eval == ["shapes"]
