"""The supervised recipe that trains the shipped Shapes-VQA model: a tiny run learns (loss falls), logs held-out
accuracy per kind, saves a model that loads through the policy adapter, and resumes exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.run.checkpoint_files import latest_checkpoint, load_state
from flowrl.run.metrics import read_metrics
from flowrl.commands.train import load_recipe_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs/vlm/shapes_vqa_sft.yaml")
TINY = ["model.hidden_size=32", "model.layers=1", "model.heads=2", "model.kv_heads=1", "model.intermediate_size=64",
        "model.vision_width=32", "model.vision_layers=1", "model.vision_heads=2", "data.batch_size=8",
        "data.steps_per_epoch=4", "optim.warmup_steps=2", "optim.lr=3e-3", "eval.num_examples=10",
        "eval.num_zoom_examples=4", "eval.every_epochs=1", "run.max_minutes=null", "run.threads=1",
        "run.deterministic=true"]


def _run(out: Path, *extra: str) -> None:
    recipe, cfg = load_recipe_config(CONFIG, [f"run.output_dir={out}", *TINY, *extra])
    assert recipe.main(cfg) == 0


@pytest.mark.slow
def test_sft_learns_and_saves_a_loadable_policy(tmp_path):
    from flowrl.policies import TokenPolicy

    _run(tmp_path, "run.max_epochs=3")
    rows = read_metrics(tmp_path / "metrics.jsonl")
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert {"eval/vqa/accuracy", "eval/vqa/count", "eval/vqa/position", "eval/zoom/accuracy",
            "eval/vqa/top_answer_share/shape", "eval/zoom_overview/accuracy", "eval/zoom_crop/count"} <= set(rows[-1])
    # What the policy answered, per kind, at every evaluation (3: none at start, the shipped config's
    # eval.at_start is off; the shares agree with the metric).
    import json

    answers = [json.loads(line) for line in (tmp_path / "eval_answers.jsonl").read_text().splitlines()]
    assert [a["epoch"] for a in answers] == [1, 2, 3]
    assert set(answers[-1]["vqa"]) == {"count", "color", "shape", "position", "exists"}
    shape = answers[-1]["vqa"]["shape"]
    assert abs(max(shape.values()) / sum(shape.values()) - rows[-1]["eval/vqa/top_answer_share/shape"]) < 1e-9
    policy = TokenPolicy.from_pretrained(tmp_path / "model")
    assert policy.family.name == "qwen3_vl"


@pytest.mark.slow
def test_sft_resumes_exactly(tmp_path):
    _run(tmp_path / "a", "run.max_epochs=2", "optim.decay_epochs=2")
    _run(tmp_path / "b", "run.max_epochs=1", "optim.decay_epochs=2")
    _run(tmp_path / "b", "run.max_epochs=2", "optim.decay_epochs=2", "run.resume=true")
    a, b = load_state(latest_checkpoint(tmp_path / "a")), load_state(latest_checkpoint(tmp_path / "b"))
    assert a["step"] == b["step"] == 8
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key


def test_batches_hold_a_description_turn_and_count_demonstrations_zoom():
    from flowrl.data.vqa import DESCRIBE_QUESTION
    from flowrl.recipes.vlm_sft import batch_conversations

    _, cfg = load_recipe_config(CONFIG, ["data.batch_size=20", "data.zoom_fraction=0.5", "data.answer_format=direct",
                                         "data.describe=true"])
    conversations = batch_conversations(cfg, step=3)
    vqa, zoom = conversations[:10], conversations[10:]
    for turns in vqa:  # the question first (the layout of evaluation), then the train-only description
        assert [t.role for t in turns] == ["user", "assistant", "user", "assistant"]
        assert turns[2].text == DESCRIBE_QUESTION and not turns[2].images and " " in turns[3].text
    for turns in zoom:
        calls = [t for t in turns if t.role == "assistant" and "<tool_call>" in t.text]
        is_count = turns[0].text.startswith("how many")
        assert bool(calls) == is_count  # counts zoom; colour demonstrations answer from the overview
    assert {t[0].text.startswith("how many") for t in zoom} == {True, False}


def test_the_shipped_recipe_answers_with_a_reasoning_trace():
    """The shipped config: every question and every zoom demonstration ends in ``<think> TRACE </think> <answer> A
    </answer>`` whose answer is the task's; describing turns with it are refused (the trace describes already)."""
    import re

    import pytest

    from flowrl.config import ConfigError
    from flowrl.data.vqa import sample_color_position, sample_vqa
    from flowrl.recipes.vlm_sft import batch_conversations

    _, cfg = load_recipe_config(CONFIG, ["data.batch_size=20", "data.zoom_fraction=0.5"])
    assert cfg.data.answer_format == "reasoning" and cfg.model.family == "qwen3_vl" and cfg.eval.max_new_tokens >= 64
    conversations = batch_conversations(cfg, step=3)
    assert cfg.data.color_position_fraction == 0.2  # 2 of the 10 questions ask position by colour
    examples = (sample_vqa("train", 8, seed=cfg.run.seed, start=3 * 20)
                + sample_color_position(2, seed=cfg.run.seed, start=3 * 20))
    for turns, example in zip(conversations[:10], examples):
        assert [t.role for t in turns] == ["user", "assistant"] and turns[0].text == example.question
        assert re.fullmatch(r"<think> .+ </think> <answer> (\S+) </answer>", turns[1].text).group(1) == example.answer
    for turns in conversations[10:]:
        assert re.fullmatch(r"<think> .+ </think> <answer> \S+ </answer>", turns[-1].text)
    with pytest.raises(ConfigError, match="data.answer_format: reasoning answers already describe the scene"):
        load_recipe_config(CONFIG, ["data.describe=true"])


def test_mrope_sections_must_fill_half_the_head():
    import pytest

    from flowrl.config import ConfigError

    with pytest.raises(ConfigError, match="model.mrope_section.*adding up to half the head dimension"):
        load_recipe_config(CONFIG, ["model.mrope_section=[4, 4, 4]"])
    _, cfg = load_recipe_config(CONFIG, ["model.family=qwen2_vl", "model.mrope_section=[2, 7, 7]"])
    from flowrl.policies.shapes_vlm import build_model

    model, _ = build_model(cfg.model)
    assert model.config.text_config.rope_parameters["mrope_section"] == [2, 7, 7]
    assert model.config.text_config.rope_parameters["rope_theta"] == cfg.model.rope_theta


def test_the_model_family_is_a_checked_choice():
    import pytest

    from flowrl.config import ConfigError

    with pytest.raises(ConfigError, match="model.family: got 'qwen4_vl'; expected one of 'qwen2_vl', 'qwen3_vl'"):
        load_recipe_config(CONFIG, ["model.family=qwen4_vl"])
    # Sections that Qwen2-VL takes but Qwen3-VL's interleaved layout cannot hold (width 6 needs index 17 of 16).
    load_recipe_config(CONFIG, ["model.family=qwen2_vl", "model.mrope_section=[4, 6, 6]"])
    with pytest.raises(ConfigError, match=r"model.mrope_section: \[4, 6, 6\]: qwen3_vl interleaves .* height can be at "
                                          "most 5 and width at most 5"):
        load_recipe_config(CONFIG, ["model.family=qwen3_vl", "model.mrope_section=[4, 6, 6]"])
    _, cfg = load_recipe_config(CONFIG, ["model.family=qwen3_vl"])
    from flowrl.policies.shapes_vlm import build_model

    model, processor = build_model(cfg.model)
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration" and type(processor).__name__ == "Qwen3VLProcessor"
    assert model.config.text_config.rope_parameters["rope_theta"] == cfg.model.rope_theta


def test_a_share_of_the_batch_asks_position_by_colour():
    import re

    from flowrl.recipes.vlm_sft import batch_conversations

    by_colour = re.compile(r"is the \w+ object (left of|right of|above|below) the \w+ object\?")
    _, cfg = load_recipe_config(CONFIG, ["data.batch_size=40", "data.color_position_fraction=0.25"])
    conversations = batch_conversations(cfg, step=3)
    asked = [c[0].text for c in conversations if by_colour.fullmatch(c[0].text)]
    assert len(conversations) == 40 and len(asked) == round((40 - 4) * 0.25)  # zoom_fraction 0.1: 4 of 40
    assert all(c[1].text.startswith("<think>") for c in conversations if by_colour.fullmatch(c[0].text))
    # Without it (the recipe's default; the shipped config asks 0.2), no batch asks them.
    _, plain = load_recipe_config(CONFIG, ["data.batch_size=40", "data.color_position_fraction=0"])
    assert not any(by_colour.fullmatch(c[0].text) for c in batch_conversations(plain, step=3))
