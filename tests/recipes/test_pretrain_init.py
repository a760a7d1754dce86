"""Continued pretraining (``init`` of flowrl/recipes/pretrain.py): the run starts from the saved weights, and a model
section that contradicts them is a config error naming the fields."""

from pathlib import Path

import pytest
import torch

from flowrl.config import ConfigError
from flowrl.models.shapes import ShapesModel
from flowrl.commands.train import load_recipe_config

ROOT = Path(__file__).resolve().parents[2]
TINY = {"model.block_out_channels": "[8, 16]", "model.head_dim": 8, "model.text_hidden_size": 16,
        "model.text_layers": 1, "model.text_heads": 2}


def overrides(out: Path, **extra) -> list[str]:
    settings = {**TINY, "run.output_dir": str(out), "run.max_epochs": 1, "run.max_minutes": "null", "run.seed": 1,
                "data.batch_size": 4, "data.steps_per_epoch": 2, "optim.warmup_steps": 1, "eval.at_start": "false",
                "eval.every_epochs": 1, "eval.every_minutes": "null", "eval.num_prompts": 2, "eval.steps": 2,
                **extra}
    return [f"{k}={v}" for k, v in settings.items()]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return ShapesModel.from_pretrained(path, use_ema=False).denoiser.state_dict()


def test_continued_pretraining_starts_from_the_saved_weights(tiny_shapes_dir, tmp_path):
    start = weights(tiny_shapes_dir)
    for init, out in ((str(tiny_shapes_dir), tmp_path / "continued"), ("null", tmp_path / "fresh")):
        recipe, cfg = load_recipe_config(str(ROOT / "configs/shapes/continued_pretrain.yaml"),
                                         overrides(out, init=init, **{"optim.lr": 1e-9}))
        assert recipe.main(cfg) == 0
    # At a learning rate of 1e-9 two steps leave the weights where they started: the loaded ones, or a seed-1 model.
    continued, fresh = weights(tmp_path / "continued" / "model"), weights(tmp_path / "fresh" / "model")
    assert max(float((continued[k] - v).abs().max()) for k, v in start.items()) < 1e-6
    assert max(float((fresh[k] - v).abs().max()) for k, v in start.items()) > 1e-2


def test_a_model_section_other_than_the_saved_models_is_a_config_error(tiny_shapes_dir, tmp_path):
    recipe, cfg = load_recipe_config(str(ROOT / "configs/shapes/continued_pretrain.yaml"),
                                     overrides(tmp_path / "run", init=str(tiny_shapes_dir),
                                               **{"model.text_layers": 2}))
    with pytest.raises(ConfigError, match=r"init: the model at .* has another architecture .*text_layers"):
        recipe.main(cfg)


def test_data_kinds_weights_the_batches_by_kind_and_refuses_an_unknown_one(tmp_path):
    """``data.kinds`` cycles through its list: a kind listed twice fills twice the share of every batch, and a kind
    not listed never appears; an unknown or empty list is a one-line config error."""
    from flowrl.data.shapes import sample_examples
    from flowrl.recipes.pretrain import _batch

    kinds = ["position", "position", "counting"]
    _, cfg = load_recipe_config(str(ROOT / "configs/shapes/pretrain.yaml"),
                                overrides(tmp_path / "run", **{"data.kinds": "[" + ", ".join(kinds) + "]",
                                                               "data.batch_size": 6}))
    assert cfg.data.kinds == kinds
    drawn = [e.kind for e in sample_examples("train", 6, seed=cfg.run.seed, start=6, kinds=tuple(cfg.data.kinds))]
    assert drawn == ["position", "position", "counting"] * 2

    class Tokens:  # what _batch needs of the model: prompts in, tokens out; images through unchanged
        def tokenize(self, prompts):
            return prompts

        def encode_images(self, images):
            return images

    _, prompts, _, _ = _batch(cfg, Tokens(), step=1)  # step 1: examples 6-11 of the stream
    texts = [p for p in prompts if p]  # cond_dropout empties some prompts
    assert texts and all(any(w in p for w in (" left of ", " right of ", " above ", " below ")) or
                         p.split()[0] in ("two", "three", "four") for p in texts)
    for bad, message in (("[position, colour]", "unknown task kinds 'colour'"), ("[]", "empty")):
        with pytest.raises(ConfigError, match=rf"^data.kinds: {message}"):
            load_recipe_config(str(ROOT / "configs/shapes/pretrain.yaml"),
                               overrides(tmp_path / "bad", **{"data.kinds": bad}))
