"""``model.train_text_encoder`` (the shapes model): the text encoder inside the denoiser (TextConditionedUNet) predicts
exactly what the frozen-encoder model predicts from the same weights, takes gradients, is held by the optimizer,
checkpoint and reference copy like the UNet, and a trained run's export writes the trained encoder; the other
families and LoRA refuse it with one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.config import ConfigError
from flowrl.models.shapes import ShapesModel, TextConditionedUNet

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["a red circle left of a blue square", "a red circle right of a blue square", "two green triangles"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_the_text_encoder_inside_the_denoiser_predicts_what_the_frozen_one_does(tiny_shapes_dir):
    frozen = ShapesModel.from_pretrained(tiny_shapes_dir)
    trained = ShapesModel.from_pretrained(tiny_shapes_dir, train_text_encoder=True)
    assert isinstance(trained.denoiser, TextConditionedUNet) and trained.denoiser.text_encoder is trained.text_encoder
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, *frozen.latent_shape, generator=generator)
    sigma = torch.tensor([0.9, 0.5, 0.2])
    for guidance in (1.0, 2.5):
        with torch.no_grad():
            a = frozen.velocity_fn(guidance)(x, sigma, frozen.encode_prompts(PROMPTS))
            b = trained.velocity_fn(guidance)(x, sigma, trained.encode_prompts(PROMPTS))
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # the encoder takes gradients, and the optimizer's parameters hold it
    trained.velocity_fn(2.5)(x, sigma, trained.encode_prompts(PROMPTS)).square().mean().backward()
    grads = [p.grad for p in trained.text_encoder.parameters()]
    assert all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads) > 0
    params = {id(p) for p in trained.trainable_parameters()}
    assert {id(p) for p in trained.text_encoder.parameters()} <= params
    assert len(params) == len(list(frozen.denoiser.parameters())) + len(list(frozen.text_encoder.parameters()))
    assert all(not p.requires_grad for p in frozen.text_encoder.parameters())


def test_the_reference_keeps_the_text_encoder_the_run_started_from(tiny_shapes_dir):
    model = ShapesModel.from_pretrained(tiny_shapes_dir, train_text_encoder=True)
    model.freeze_reference()
    cond = model.encode_prompts(PROMPTS)
    x, sigma = torch.randn(3, *model.latent_shape), torch.full((3,), 0.6)
    with torch.no_grad():
        before = model.velocity_fn(1.0)(x, sigma, cond)
        for p in model.text_encoder.parameters():
            p.add_(0.05 * torch.randn_like(p))  # a trained encoder
        after = model.velocity_fn(1.0)(x, sigma, cond)
        with model.reference():
            reference = model.velocity_fn(1.0)(x, sigma, cond)
    assert not torch.allclose(after, before)  # the cached embeddings are not what the denoiser reads
    torch.testing.assert_close(reference, before)


def test_other_families_and_lora_refuse_it_in_one_line():
    from flowrl.recipes import load_recipe_config

    with pytest.raises(ConfigError, match="model.train_text_encoder: only the shapes model"):
        load_recipe_config(str(ROOT / "configs" / "sd3" / "flow_grpo_pickscore.yaml"),
                           ["model.train_text_encoder=true"])
    with pytest.raises(ConfigError, match="needs full fine-tuning"):
        load_recipe_config(str(ROOT / "configs" / "shapes" / "dgpo.yaml"),
                           ["model.train_text_encoder=true", "model.lora={rank: 4}"])


@pytest.mark.slow
def test_a_run_trains_checkpoints_and_exports_the_text_encoder(tiny_shapes_dir, tmp_path):
    from flowrl.commands.export import main as export
    from flowrl.commands.train import load_recipe_config
    from flowrl.run.checkpoint_files import latest_checkpoint, load_state
    from test_flow_grpo_runs import CONFIG, tiny_overrides

    out = tmp_path / "run"
    recipe, cfg = load_recipe_config(str(CONFIG), tiny_overrides(
        tiny_shapes_dir, out, **{"run.max_epochs": 2, "eval.every_epochs": 100, "checkpoint.every_epochs": 2,
                                 "model.train_text_encoder": "true"}))
    assert recipe.main(cfg) == 0
    state = load_state(latest_checkpoint(out))["model"]
    start = ShapesModel.from_pretrained(tiny_shapes_dir)
    encoder_keys = [k for k in state if k.startswith("text_encoder.")]
    assert encoder_keys and any(k.startswith("unet.") for k in state)
    start_encoder = start.text_encoder.state_dict()
    moved = [k for k in encoder_keys if not torch.equal(state[k], start_encoder[k[len("text_encoder."):]])]
    assert moved  # the encoder trained
    assert export([str(out), "--format", "merged", "--out", str(tmp_path / "merged"), "--no-ema"]) == 0
    exported = ShapesModel.from_pretrained(tmp_path / "merged").text_encoder.state_dict()
    for key in encoder_keys:
        torch.testing.assert_close(exported[key[len("text_encoder."):]], state[key])


@pytest.mark.slow
def test_dgpo_with_the_text_encoder_resumes_exactly(tiny_shapes_dir, tmp_path):
    """DGPO (EMA rollouts, its EMA snapshot) with the text encoder trained: a run stopped after 1 epoch and resumed to
    2 ends with the straight run's weights, the text encoder's included."""
    from flowrl.run.checkpoint_files import latest_checkpoint, load_state
    from test_trainers_runs import run

    extra = {"model.train_text_encoder": "true", "eval.every_epochs": 100}
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run("dgpo", tiny_shapes_dir, straight, tmp_path, **extra, **{"run.max_epochs": 2}) == 0
    assert run("dgpo", tiny_shapes_dir, resumed, tmp_path, **extra, **{"run.max_epochs": 1}) == 0
    assert run("dgpo", tiny_shapes_dir, resumed, tmp_path, **extra,
               **{"run.max_epochs": 2, "run.resume": "true"}) == 0
    a, b = load_state(latest_checkpoint(straight))["model"], load_state(latest_checkpoint(resumed))["model"]
    assert set(a) == set(b) and any(k.startswith("text_encoder.") for k in a)
    for key, value in a.items():
        assert torch.equal(value, b[key]), key


def test_the_shipped_config_is_the_demo_with_the_encoder_trained():
    from flowrl.recipes import load_recipe_config

    _, cfg = load_recipe_config(str(ROOT / "configs" / "shapes" / "dgpo_text_encoder.yaml"), [])
    _, demo = load_recipe_config(str(ROOT / "configs" / "shapes" / "demo.yaml"), [])
    assert cfg.model.train_text_encoder and not demo.model.train_text_encoder and cfg.model.lora is None
    assert (cfg.train, cfg.reward, cfg.sampling, cfg.optim) == (demo.train, demo.reward, demo.sampling, demo.optim)
