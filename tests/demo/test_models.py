"""load_finetuned rebuilds the run's model (full fine-tuning or LoRA) and loads exactly its weights."""

import shutil

import pytest
import torch
import yaml

from flowrl.run.checkpoint_files import latest_checkpoint, load_state
from flowrl.demo.models import ModelBank, discover_runs, load_finetuned
from flowrl.models.base import ModelLoadError
from flowrl.models.shapes import ShapesModel


def _same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_loads_the_runs_trained_weights(finetuned_runs, tiny_shapes_dir, kind):
    run = finetuned_runs[kind]
    checkpoint = latest_checkpoint(run)
    state = load_state(checkpoint)
    model = load_finetuned(run, use_ema=False)
    assert _same(model.trainable_state_dict(), state["model"])
    assert (model.lora is not None) == (kind == "lora")
    assert model.finetune_info["checkpoint"] == str(checkpoint) and model.finetune_info["epoch"] == 1
    # The run really trained, so the fine-tuned model is not the base model.
    base = ShapesModel.from_pretrained(tiny_shapes_dir)
    x = torch.randn(2, *base.latent_shape)
    sigma = torch.full((2,), 0.5)
    cond = base.encode_prompts(["a red circle", "a blue square"])
    with torch.no_grad():
        assert not torch.allclose(model.velocity(x, sigma, cond), base.velocity(x, sigma, cond))
    # A checkpoint directory and its state.pt load the same weights.
    for path in (checkpoint, checkpoint / "state.pt"):
        assert _same(load_finetuned(path, use_ema=False).trainable_state_dict(), state["model"])


def test_ema_weights_are_used_when_the_run_kept_them(finetuned_runs):
    state = load_state(latest_checkpoint(finetuned_runs["full"]))
    model = load_finetuned(finetuned_runs["full"])
    assert model.finetune_info["ema"] is True
    for param, shadow in zip(model.trainable_parameters(), state["ema"]["shadow_params"]):
        assert torch.equal(param.detach(), shadow)
    assert not _same(model.trainable_state_dict(), state["model"])  # EMA differs from the raw weights


def test_errors_name_the_cause(tmp_path, finetuned_runs):
    with pytest.raises(ModelLoadError, match="no checkpoint at"):
        load_finetuned(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="neither a run directory"):
        load_finetuned(tmp_path / "empty")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copy(finetuned_runs["full"] / "config.yaml", fresh / "config.yaml")
    with pytest.raises(ModelLoadError, match="has no checkpoint yet"):
        load_finetuned(fresh)
    moved = tmp_path / "moved"
    shutil.copytree(finetuned_runs["lora"], moved)
    config = yaml.safe_load((moved / "config.yaml").read_text())
    config["model"]["path"] = str(tmp_path / "deleted_base")
    (moved / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ModelLoadError, match="the base model of run .* does not load"):
        load_finetuned(moved)
    config["model"]["lora"] = None  # weights saved with LoRA, config without: a clear mismatch
    config["model"]["path"] = yaml.safe_load((finetuned_runs["lora"] / "config.yaml").read_text())["model"]["path"]
    (moved / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ModelLoadError, match="same model and LoRA settings"):
        load_finetuned(moved)


def test_discover_runs_and_lazy_bank(finetuned_runs, tmp_path):
    found = {r.name: r for r in discover_runs(finetuned_runs["root"])}
    assert set(found) == {"flow_grpo_full", "flow_grpo_lora"}
    assert found["flow_grpo_full"].recipe == "flow_grpo"
    assert discover_runs(tmp_path / "missing") == [] and discover_runs(None) == []
    # A VLM run (a config and a complete checkpoint) is the Agent tab's, not an image model.
    vlm = tmp_path / "runs" / "vlm_run"
    shutil.copytree(found["flow_grpo_lora"].path / "checkpoints", vlm / "checkpoints")
    (vlm / "config.yaml").write_text("recipe: vlm_grpo\n")
    assert latest_checkpoint(vlm) is not None and discover_runs(tmp_path / "runs") == []
    bank = ModelBank()
    calls = []
    bank.add("run", lambda: calls.append(1) or load_finetuned(found["flow_grpo_lora"].path), source="x", kind="run")
    assert not bank.is_loaded("run") and calls == []
    assert bank.get("run") is bank.get("run") and calls == [1]  # loaded once, on first use
    assert "LoRA" in bank.describe()[0]["state"]
    with pytest.raises(ModelLoadError, match="unknown model 'nope'"):
        bank.get("nope")


def test_the_bank_keeps_a_bounded_number_of_models_loaded(finetuned_runs):
    """Visitors picking run after run: beyond ``max_loaded`` the least recently used model is unloaded (main
    kept every one); the base model always stays."""
    bank = ModelBank()
    bank.max_loaded = 2
    bank.add("base", lambda: torch.nn.Linear(1, 1), source="base", kind="base", load_now=True)
    loads = []
    for name in ("a", "b", "c"):
        bank.add(name, lambda n=name: loads.append(n) or load_finetuned(finetuned_runs["lora"]), source=name,
                 kind="run")
    first = bank.get("a")
    bank.get("b")
    assert bank.get("a") is first  # still loaded; now the most recent
    bank.get("c")
    assert [n for n in bank.names() if bank.is_loaded(n)] == ["base", "a", "c"]  # "b" was unloaded
    assert "loads when selected" in {row["name"]: row["state"] for row in bank.describe()}["b"]
    bank.get("b")
    assert loads == ["a", "b", "c", "b"] and not bank.is_loaded("a")
