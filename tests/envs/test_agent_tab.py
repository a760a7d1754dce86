"""The demo's Agent tab logic: a held-out task played turn by turn by each chosen VLM policy."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flowrl.demo.agent_tab import AgentModels, handle_agent
from flowrl.demo.limits import DemoInputError


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory) -> Path:
    from flowrl.policies.shapes_vlm import ShapesVLMConfig, build_model

    root = tmp_path_factory.mktemp("runs")
    run = root / "tiny_grpo"
    model, processor = build_model(ShapesVLMConfig(hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate_size=64,
                                                   vision_width=32, vision_layers=1, vision_heads=2))
    model.save_pretrained(run / "model")
    processor.save_pretrained(run / "model")
    (run / "config.yaml").write_text(yaml.safe_dump({"recipe": "vlm_grpo"}))
    (root / "image_run").mkdir()
    (root / "image_run" / "config.yaml").write_text(yaml.safe_dump({"recipe": "flow_grpo"}))
    return root


def test_agent_tab_plays_the_task_for_each_model(runs_dir):
    models = AgentModels(str(runs_dir))
    assert "tiny_grpo" in models.names() and "image_run" not in models.names()
    gallery, transcript, rows = handle_agent(models, ["tiny_grpo"], "shapes_zoom", 3)
    assert gallery and gallery[0][0].shape == (32, 32, 3)  # the low-resolution view
    assert "Task 3" in transcript and "tiny_grpo" in transcript
    (row,) = rows
    assert row[0] == "tiny_grpo" and 1 <= row[5] <= 3 and isinstance(row[2], bool)


def test_agent_tab_rejects_bad_input(runs_dir):
    models = AgentModels(str(runs_dir))
    with pytest.raises(DemoInputError, match="at least one model"):
        handle_agent(models, [], "shapes_vqa", 0)
    with pytest.raises(DemoInputError, match="task index"):
        handle_agent(models, ["tiny_grpo"], "shapes_vqa", 10_000)
    with pytest.raises(DemoInputError, match="unknown agent model"):
        handle_agent(models, ["nope"], "shapes_vqa", 0)


def test_agent_models_load_for_inference_and_a_bounded_number_stay(runs_dir, tmp_path):
    """Each policy is loaded once, frozen and without the reference copy of training (main deep-copied every
    policy); picking more than ``max_loaded`` unloads the least recently used."""
    import shutil

    for name in ("second", "third"):
        shutil.copytree(runs_dir / "tiny_grpo", tmp_path / name)
    models = AgentModels(str(tmp_path))
    models.max_loaded = 2
    policy = models.get("second")
    assert policy._reference is None and not any(p.requires_grad for p in policy.model.parameters())
    assert models.get("second") is policy
    models.get("third")
    models.get("base")
    assert list(models._loaded) == ["third", "base"]  # "second", the least recently used, was unloaded
    assert models.get("second") is not policy  # loads again when chosen again
