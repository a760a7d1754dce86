"""On-policy distillation (``train.teacher`` of Flow-GRPO, flowrl/rl/teacher.py) end to end on tiny models: a teacher
equal to the student adds nothing (KL 0, the policy gradient unchanged), a different teacher pulls the student toward
it (the KL falls epoch after epoch under distillation alone), the teacher is never saved, a teacher of another
architecture is a one-line error, and a LoRA student of a diffusers family (Z-Image) loads its plain teacher."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from flowrl.commands.train import load_recipe_config
from flowrl.config import ConfigError
from flowrl.models.base import ModelLoadError
from flowrl.run.checkpoint_files import latest_checkpoint, load_state
from flowrl.run.metrics import read_metrics
from test_flow_grpo_runs import CONFIG, tiny_overrides

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ONE_STEP = {"run.max_epochs": 1, "train.minibatches": 1, "eval.every_epochs": 100, "checkpoint.every_epochs": 1}


def train(model_dir, out, **extra) -> list[dict]:
    recipe, cfg = load_recipe_config(str(CONFIG), tiny_overrides(model_dir, out, **extra))
    assert recipe.main(cfg) == 0
    return [r for r in read_metrics(out / "metrics.jsonl") if "train/grad_norm" in r]


@pytest.fixture(scope="module")
def other_teacher(tmp_path_factory) -> Path:
    """The tiny shapes model's architecture with other weights (seed 1)."""
    from flowrl.models.shapes import ShapesModel, ShapesModelConfig

    path = tmp_path_factory.mktemp("teacher")
    config = ShapesModelConfig(block_out_channels=[8, 16], head_dim=8, text_hidden_size=16, text_layers=1,
                               text_heads=2)  # tests/conftest.py's tiny_shapes_dir
    ShapesModel.build(config, seed=1).save_pretrained(path)
    return path


@pytest.mark.slow
def test_a_teacher_equal_to_the_student_adds_nothing(tiny_shapes_dir, tmp_path):
    plain = train(tiny_shapes_dir, tmp_path / "plain", **ONE_STEP)[0]
    with_teacher = train(tiny_shapes_dir, tmp_path / "teacher", **ONE_STEP,
                         **{"train.teacher": f"{{path: {tiny_shapes_dir}, coef: 3.0}}"})[0]
    assert with_teacher["train/distill_kl"] == 0.0
    # the KL is quadratic in the mean difference: at 0 its gradient is 0 and the update is Flow-GRPO's
    assert with_teacher["train/grad_norm"] == pytest.approx(plain["train/grad_norm"], rel=1e-6)
    assert with_teacher["train/loss"] == pytest.approx(plain["train/loss"], rel=1e-6, abs=1e-9)
    only = train(tiny_shapes_dir, tmp_path / "only", **ONE_STEP,
                 **{"train.teacher": f"{{path: {tiny_shapes_dir}, policy_loss: false}}"})[0]
    assert only["train/distill_kl"] == 0.0 and only["train/loss"] == 0.0 and only["train/grad_norm"] == 0.0


@pytest.mark.slow
def test_distillation_alone_pulls_the_student_toward_another_teacher(tiny_shapes_dir, other_teacher, tmp_path):
    out = tmp_path / "opd"
    rows = train(tiny_shapes_dir, out, **{"run.max_epochs": 6, "eval.every_epochs": 100, "checkpoint.every_epochs": 6,
                                          "train.teacher": f"{{path: {other_teacher}, policy_loss: false}}"})
    kl = [r["train/distill_kl"] for r in rows]
    assert len(kl) == 6 and all(math.isfinite(v) and v > 0 for v in kl)
    assert kl[-1] < 0.7 * kl[0], kl  # the student moves toward the teacher on its own samples
    assert all(r["train/loss"] == pytest.approx(r["train/distill_kl"], rel=1e-6) for r in rows)  # coef 1, no policy
    # the teacher is never saved: the checkpoint holds the student's tensors only, and they moved
    from flowrl.models.shapes import ShapesModel

    saved = load_state(latest_checkpoint(out))["model"]
    start = ShapesModel.from_pretrained(tiny_shapes_dir).denoiser.state_dict()
    assert set(saved) == set(start)
    assert any(not torch.equal(saved[k], start[k]) for k in saved)


@pytest.mark.slow
def test_a_teacher_of_another_architecture_is_a_one_line_error(tiny_shapes_dir, tmp_path):
    from flowrl.models.shapes import ShapesModel, ShapesModelConfig

    wider = tmp_path / "wider"
    ShapesModel.build(ShapesModelConfig(block_out_channels=[8, 32], head_dim=8, text_hidden_size=16, text_layers=1,
                                        text_heads=2), seed=0).save_pretrained(wider)
    recipe, cfg = load_recipe_config(str(CONFIG), tiny_overrides(tiny_shapes_dir, tmp_path / "run", **ONE_STEP,
                                                                 **{"train.teacher": f"{{path: {wider}}}"}))
    with pytest.raises(ModelLoadError, match="not the student's architecture") as err:
        recipe.main(cfg)
    assert "train.teacher.path" in str(err.value) and "\n" not in str(err.value)


def test_a_teacher_without_a_path_is_a_config_error(tiny_shapes_dir, tmp_path):
    with pytest.raises(ConfigError, match="train.teacher.path"):
        load_recipe_config(str(CONFIG), tiny_overrides(tiny_shapes_dir, tmp_path, **{"train.teacher": "{coef: 2.0}"}))


def test_the_shipped_config_distils_an_rl_fine_tune_into_the_base():
    recipe, cfg = load_recipe_config(str(ROOT / "configs" / "shapes" / "opd.yaml"), [])
    main = load_recipe_config(str(CONFIG), [])[1]
    from flowrl.recipes.flow_grpo import Config

    assert isinstance(cfg, Config) and cfg.train.teacher.policy_loss is False
    assert cfg.train.teacher.path == "runs/shapes_demo_teacher" and cfg.model.path == main.model.path
    assert (cfg.sampling.step, cfg.sampling.window) == (main.sampling.step, main.sampling.window)


@pytest.mark.slow
def test_a_lora_student_of_a_diffusers_family_loads_its_plain_teacher(tmp_path):
    # LoRA B = 0 at init: the student is its teacher, so the KL is exactly 0 and the layouts must match through
    # peft's base_layer level
    from test_families_trainers import overrides

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red apple\na blue car\n")
    out = tmp_path / "run"
    settings = overrides("z_image", "flow_grpo", out, prompts, tmp_path)
    path = next(s.split("=", 1)[1] for s in settings if s.startswith("model.path="))
    settings.append(f"train.teacher={{path: {path}, coef: 1.0}}")
    recipe, cfg = load_recipe_config(str(CONFIG), settings)
    assert recipe.main(cfg) == 0
    row = [r for r in read_metrics(out / "metrics.jsonl") if "train/grad_norm" in r][-1]
    assert row["train/distill_kl"] == pytest.approx(0.0, abs=1e-12) and row["train/grad_norm"] > 0
