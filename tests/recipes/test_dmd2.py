"""The DMD2 recipe (flowrl/recipes/dmd2.py) through its shipped shapes config on tiny models: on the tiny shapes model
(full fine-tuning) the student and the fake score move, the teacher does not, and the student steps only on the
generator's steps of the two-time-scale rule; the fake score's loss on fixed student samples falls as it trains,
with no gradient reaching the student; a LoRA epoch trains on tiny SD3, FLUX and Z-Image; a run stopped after epoch 1
and resumed equals one that never stopped; the GAN term and a mismatched evaluation schedule are refused with one
line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from flowrl.config import ConfigError
from flowrl.recipes import load_recipe_config
from flowrl.run.checkpoint_files import checkpoints, latest_checkpoint, load_state
from flowrl.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "shapes" / "dmd2.yaml")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def settings(out: Path, model_dir: Path, **extra) -> list[str]:
    values = {
        "model.path": str(model_dir), "run.output_dir": str(out), "run.max_minutes": "null", "run.max_epochs": 3,
        "data.train_prompts": "shapes:train", "data.eval_prompts": "shapes:train", "data.num_eval_prompts": 2,
        "data.kind_weights": "uniform", "sampling.eval_num_steps": 2, "train.student_steps": 2,
        "sampling.groups_per_epoch": 2, "sampling.group_size": 2, "train.micro_batch_size": 2, "train.minibatches": 2,
        "train.dfake_gen_update_ratio": 5, "train.real_guidance": 3.0, "optim.lr": 1e-3,
        "eval.every_epochs": 3, "eval.every_minutes": "null", "eval.grid_size": 0, "eval.hacking.enabled": "false",
        "checkpoint.every_epochs": 1, "checkpoint.keep": 3,
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def train(out: Path, model_dir: Path, *, model=None, **extra):
    recipe, cfg = load_recipe_config(CONFIG, settings(out, model_dir, **extra))
    assert recipe.main(cfg, model=model) == 0
    return read_metrics(out / "metrics.jsonl")


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.slow
def test_a_tiny_shapes_run_moves_the_student_and_the_fake_score_on_their_steps(tiny_shapes_dir, tmp_path):
    """Two steps per epoch, a generator step every 5th: steps 0,1 | 2,3 | 4,5 update the student at 0 and 4 only, so
    epoch 2 leaves the student where epoch 1 left it while the fake score trains at every step."""
    from diffusers import UNet2DConditionModel

    from flowrl.models.shapes import ShapesModel

    model = ShapesModel.from_pretrained(tiny_shapes_dir)
    initial = {k: v.clone() for k, v in UNet2DConditionModel.from_pretrained(tiny_shapes_dir / "unet").state_dict()
               .items()}
    out = tmp_path / "run"
    rows = train(out, tiny_shapes_dir, model=model)
    epochs = [r for r in rows if "train/fake_steps" in r]
    assert [r["train/generator_steps"] for r in epochs] == [1, 0, 1]
    assert [r["train/fake_steps"] for r in epochs] == [2, 2, 2]
    assert math.isnan(epochs[1]["train/dmd_loss"]) and math.isnan(epochs[1]["train/grad_norm"])
    for r in (epochs[0], epochs[2]):  # the teacher's CFG makes the DMD gradient non-zero from the first step
        assert r["train/dmd_loss"] > 0 and r["train/grad_norm"] > 0 and r["train/score_gap"] > 0, r
    assert all(r["train/fake_loss"] > 0 and r["train/fake_grad_norm"] > 0 for r in epochs)

    states = sorted((load_state(c) for c in checkpoints(out)), key=lambda s: s["epoch"])
    assert [s["epoch"] for s in states] == [1, 2, 3]
    students, fakes = [s["model"] for s in states], [s["fake_score"] for s in states]
    assert _max_diff(students[0], initial) > 1e-5  # the student moved at step 0
    assert _max_diff(students[1], students[0]) == 0.0  # no generator step in epoch 2: not a bit changed
    assert _max_diff(students[2], students[1]) > 1e-5  # step 4
    assert _max_diff(fakes[0], initial) > 1e-5 and _max_diff(fakes[1], fakes[0]) > 1e-5
    assert _max_diff(fakes[2], students[2]) > 1e-5  # two networks, not one
    # the teacher (the frozen reference copy the real score runs) is the loaded model, bit for bit
    teacher = model._reference.state_dict()
    assert _max_diff(teacher, initial) == 0.0
    assert _max_diff({k: v for k, v in model.denoiser.state_dict().items()}, students[2]) == 0.0


def test_the_fake_score_learns_the_students_samples_and_only_it(tiny_shapes_dir):
    """Five fake-score updates on fixed student samples, noise and levels: its denoising loss falls; the student's
    weights get no gradient and do not move."""
    from flowrl.models.base import encode_rows
    from flowrl.models.shapes import ShapesModel
    from flowrl.recipes.dmd2 import FakeScore, fake_score_update

    torch.manual_seed(0)
    model = ShapesModel.from_pretrained(tiny_shapes_dir)
    before = {k: v.clone() for k, v in model.denoiser.state_dict().items()}
    fake = FakeScore(model)
    optimizer = torch.optim.Adam(fake.parameters(), lr=3e-3)
    x0 = torch.randn(4, *model.latent_shape)
    cond = encode_rows(model, ["a red circle", "two blue squares", "a green triangle", "a red square"], None)
    sigma = torch.tensor([0.2, 0.4, 0.6, 0.8])
    losses = []
    for _ in range(5):
        optimizer.zero_grad(set_to_none=True)
        with fake.active(model):
            losses.append(fake_score_update(model, fake, x0, cond, sigma, torch.Generator().manual_seed(1),
                                            guidance=1.0, weighting="velocity"))
            fake.take_grads(model)
        assert all(p.grad is None for p in model.denoiser.parameters())
        optimizer.step()
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert _max_diff(model.denoiser.state_dict(), before) == 0.0
    assert _max_diff(fake.state_dict(), before) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sd3", "flux", "z_image"])
def test_a_tiny_lora_epoch_on_sd3_flux_and_z_image(family, tiny_dir, tmp_path):
    from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION

    out = tmp_path / "run"
    extra = {"model.name": family, "model.resolution": TINY_RESOLUTION, "model.lora": "{rank: 4, alpha: 8}",
             "model.max_sequence_length": TINY_MAX_SEQUENCE_LENGTH, "model.dtype": "float32",
             "model.gradient_checkpointing": "true" if family == "sd3" else "false",
             "run.max_epochs": 1, "eval.every_epochs": 1, "eval.at_start": "false", "train.minibatches": 1,
             "train.real_guidance": 4.0, "optim.lr": 1e-2,
             # FLUX: the embedded guidance of the student and the fake score (the teacher's is real_guidance)
             "sampling.guidance": 3.5 if family == "flux" else 1.0}
    rows = train(out, tiny_dir(family), **extra)
    row = rows[-1]
    assert row["train/generator_steps"] == 1 and row["train/fake_steps"] == 1, row
    for key in ("train/dmd_loss", "train/grad_norm", "train/fake_loss", "train/fake_grad_norm"):
        assert math.isfinite(row[key]) and row[key] > 0, (key, row)
    assert "eval/shapes/mean" in row
    state = load_state(latest_checkpoint(out))
    student, fake = state["model"], state["fake_score"]
    assert student and set(student) == set(fake) and all("lora_" in k for k in student)  # the teacher is never trained
    b_keys = [k for k in student if "lora_B" in k]
    assert max(float(student[k].abs().max()) for k in b_keys) > 0  # B starts at 0: the student moved
    assert max(float(fake[k].abs().max()) for k in b_keys) > 0  # and so did the fake score
    assert _max_diff({k: student[k] for k in b_keys}, {k: fake[k] for k in b_keys}) > 0


@pytest.mark.slow
def test_a_resumed_run_equals_one_that_never_stopped(tiny_shapes_dir, tmp_path):
    """Every draw (the simulation level, the DMD and fake-score levels and noise) is a function of (seed, step, sample
    seed), and the fake score and its optimizer are checkpointed: a run stopped after epoch 1 and resumed logs the
    same numbers and ends with the same student and fake score."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    extra = {"run.deterministic": "true", "train.dfake_gen_update_ratio": 3, "eval.every_epochs": 1}
    a_rows = train(straight, tiny_shapes_dir, **extra)
    train(resumed, tiny_shapes_dir, **{**extra, "run.max_epochs": 1})
    b_rows = train(resumed, tiny_shapes_dir, **{**extra, "run.resume": "true"})

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in rows]

    assert [r["epoch"] for r in b_rows] == [0, 1, 2, 3]
    assert str(comparable(b_rows)) == str(comparable(a_rows))  # str: NaN (an epoch without a generator step) == NaN
    a, b = load_state(latest_checkpoint(straight)), load_state(latest_checkpoint(resumed))
    for key in ("model", "fake_score"):
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key]), key


def test_the_config_refuses_the_gan_term_and_another_evaluation_schedule():
    with pytest.raises(ConfigError) as err:
        load_recipe_config(CONFIG, ["train.gan_weight=0.1"])
    assert str(err.value) == ("train.gan_weight: DMD2's GAN term (a classifier head on the fake score's features) is "
                              "not implemented in this recipe; set it to 0")
    with pytest.raises(ConfigError) as err:
        load_recipe_config(CONFIG, ["sampling.eval_num_steps=20"])
    assert str(err.value) == ("sampling.eval_num_steps: the student is a 4-step generator and is evaluated at its own "
                              "schedule: set sampling.eval_num_steps=4 (or train.student_steps=20)")
    _, cfg = load_recipe_config(CONFIG, [])
    assert cfg.train.student_steps == cfg.sampling.eval_num_steps == 4 and cfg.train.gan_weight == 0


@pytest.mark.slow
def test_the_fake_scores_gradient_is_the_same_under_gradient_checkpointing(tiny_dir):
    """A checkpointed block recomputes its forward during the backward: the fake score's tensors must still be in
    place then (a functional call's would not be), so its gradient equals the one without checkpointing."""
    from flowrl.config import from_dict
    from flowrl.models.base import encode_rows
    from flowrl.models.config import ModelConfig, build_model
    from flowrl.recipes.dmd2 import FakeScore, fake_score_update
    from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION

    grads = []
    for checkpointing in (False, True):
        cfg = from_dict(ModelConfig, {"name": "sd3", "path": str(tiny_dir("sd3")), "resolution": TINY_RESOLUTION,
                                      "max_sequence_length": TINY_MAX_SEQUENCE_LENGTH, "dtype": "float32",
                                      "lora": {"rank": 4, "alpha": 8}, "gradient_checkpointing": checkpointing})
        torch.manual_seed(0)
        model = build_model(cfg, "cpu")
        model.train()
        fake = FakeScore(model)
        with torch.no_grad():  # a fake score that differs from the student (whose LoRA B is 0)
            for i, (name, p) in enumerate(fake.params.items()):
                if "lora_B" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(i))
        x0 = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
        cond = encode_rows(model, ["a cat", "a dog"], None)
        with fake.active(model):
            fake_score_update(model, fake, x0, cond, torch.tensor([0.3, 0.7]), torch.Generator().manual_seed(1),
                              guidance=1.0, weighting="velocity")
            fake.take_grads(model)
        assert all(p.grad is None for p in model.trainable_parameters())
        grads.append({k: p.grad for k, p in fake.params.items() if p.grad is not None})
    assert grads[0] and set(grads[0]) == set(grads[1])
    assert all(torch.allclose(grads[0][k], grads[1][k], atol=1e-6) for k in grads[0])
