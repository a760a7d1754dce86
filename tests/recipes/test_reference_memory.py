"""A full fine-tune keeps a frozen copy of its denoiser only when something in the run uses the reference: each recipe
declares whether its objective does (``ImageTraining(..., reference=...)``), and the loop adds the evaluation's and the
sampling's uses (``flowrl.rl.setup.reference_uses``). Checked end to end on the tiny SD3 pipeline (nothing
downloaded), and recipe by recipe on the shipped shapes configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.run.metrics import read_metrics
from flowrl.commands.train import load_recipe_config

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["a red apple", "a blue car"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("a red apple\na blue car\na cat on a mat\na bowl of soup\n")
    return path


def _flow_grpo_full_finetune(tmp_path, prompt_file, *extra):
    """One Flow-GRPO epoch of a full fine-tune of the tiny SD3 pipeline, the model injected so the test sees it."""
    from flowrl.models.config import build_model
    from flowrl.testing import build_tiny_sd3

    overrides = [
        "model.name=sd3", f"model.path={build_tiny_sd3()}", "model.max_sequence_length=16", "model.lora=null",
        f"run.output_dir={tmp_path / 'run'}", "run.max_epochs=1", "run.max_minutes=null",
        f"data.train_prompts={prompt_file}", f"data.eval_prompts={prompt_file}", "data.num_eval_prompts=2",
        "sampling.num_steps=3", "sampling.eval_num_steps=2", "sampling.window.max_start=null",
        "sampling.noise_level=0.5",
        "sampling.group_size=2", "sampling.groups_per_epoch=2", "sampling.batch_size=4", "train.micro_batch_size=4",
        "optim.lr=1e-3", "reward.train={jpeg_incompressibility: 1.0}", "reward.eval=[jpeg_incompressibility]",
        "eval.at_start=false", "eval.every_epochs=1", "eval.every_minutes=null",
        # nothing in the evaluation draws the base model: only the objective can ask for the reference
        "eval.hacking.enabled=false", "eval.grid_size=0", *extra,
    ]
    recipe, cfg = load_recipe_config(str(ROOT / "configs" / "shapes" / "flow_grpo.yaml"), overrides)
    model = build_model(cfg.model, "cpu")
    gen = torch.Generator().manual_seed(0)
    x, sigma = torch.randn(2, *model.latent_shape, generator=gen), torch.tensor(0.6)
    cond = model.encode_prompts(PROMPTS)
    with torch.no_grad():
        before = model.velocity(x, sigma, cond)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert recipe.main(cfg, model=model) == 0
    return model, (x, sigma, cond, before), storages, read_metrics(tmp_path / "run" / "metrics.jsonl")


def test_kl_coef_zero_allocates_no_reference_copy(tmp_path, prompt_file):
    from flowrl.models.base import ReferenceUnavailableError

    model, (x, sigma, cond, before), storages, rows = _flow_grpo_full_finetune(tmp_path, prompt_file,
                                                                               "train.kl_coef=0")
    assert rows[-1]["train/grad_norm"] > 0  # it trained
    assert model.__dict__["_reference"] is None and not model.has_reference
    # no second copy anywhere in the adapter: the same weight storages as before training
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} == storages
    with pytest.raises(ReferenceUnavailableError, match="ImageTraining\\(..., reference=True\\)"):
        with model.reference():
            pass


def test_kl_coef_positive_keeps_the_reference_and_its_values(tmp_path, prompt_file):
    model, (x, sigma, cond, before), storages, rows = _flow_grpo_full_finetune(tmp_path, prompt_file,
                                                                               "train.kl_coef=0.05")
    assert "train/kl_ref" in rows[-1]
    reference = model._reference
    denoiser = list(model.denoiser.parameters())
    assert reference is not None and len(list(reference.parameters())) == len(denoiser)
    copied = {p.untyped_storage().data_ptr() for p in reference.parameters()}
    assert not copied & storages  # a copy, not the live weights
    with torch.no_grad():
        trained = model.velocity(x, sigma, cond)
        with model.reference():
            base = model.velocity(x, sigma, cond)
    assert (trained - before).abs().max() > 1e-5  # the policy moved
    torch.testing.assert_close(base, before, rtol=0, atol=0)  # the reference is the weights before training


def _declaration(monkeypatch, name: str, *overrides: str) -> tuple[bool, list[str]]:
    """What recipe ``name`` declares to its ImageTraining for its shipped shapes config (stopped before the run is
    built), and the loop's resulting uses."""
    import flowrl.run.harness
    from flowrl.rl.setup import recorded_reference_declarations, reference_uses

    class Stop(Exception):
        pass

    def refuse(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(flowrl.run.harness, "Run", refuse)
    recipe, cfg = load_recipe_config(str(ROOT / "configs" / "shapes" / f"{name}.yaml"), list(overrides))
    with recorded_reference_declarations() as declared, pytest.raises(Stop):
        recipe.main(cfg)
    assert len(declared) == 1
    return declared[0], reference_uses(cfg.sampling, cfg.eval, declared[0])


@pytest.mark.parametrize("name", ["flow_grpo", "nft", "awm", "crd", "raft"])
def test_recipes_with_a_kl_term_declare_the_reference_only_with_it(monkeypatch, name):
    extra = ["train.kl_floor=0"] if name == "crd" else []
    assert _declaration(monkeypatch, name, "train.kl_coef=0", *extra)[0] is False
    assert _declaration(monkeypatch, name, "train.kl_coef=0.01", *extra)[0] is True


@pytest.mark.parametrize("name,overrides", [("dgpo", ["train.kl_coef=0"]), ("d3po", []),
                                            ("dpo", ["pairs.path=/nowhere/pairs-*.tar"])])
def test_preference_recipes_always_declare_the_reference(monkeypatch, name, overrides):
    assert _declaration(monkeypatch, name, *overrides)[0] is True


def test_the_evaluation_and_sampling_uses_count(monkeypatch):
    declared, uses = _declaration(monkeypatch, "flow_grpo", "train.kl_coef=0")  # hacking panel and grid: defaults
    assert declared is False
    assert uses == ["eval.hacking (the base model's images and hack/*_to_base)",
                    "eval.grid_size (the base model's column of the sample grid)"]
    _, uses = _declaration(monkeypatch, "flow_grpo", "train.kl_coef=0", "eval.hacking.enabled=false",
                           "eval.grid_size=0")
    assert uses == []
    _, uses = _declaration(monkeypatch, "flow_grpo_artifact", "train.kl_coef=0", "eval.hacking.enabled=false",
                           "eval.grid_size=0")  # the base model takes the last 4 steps of every rollout
    assert uses == ["sampling.base_last_steps"]
