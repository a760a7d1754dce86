"""Question sets (flowrl/data/vqa.py ``question_set``): several questions about one drawn scene, each answered by what
the scene shows (checked against the objects, independently of the generator), no two about one combination, only the
split's questions, a pure function of the example."""

from __future__ import annotations

from collections import Counter

import pytest

from flowrl.data.vqa import (_combination, held_out_combinations, parse_combinations, question_set,
                             sample_color_position, sample_vqa)


def _truth(example) -> str:
    """The answer of ``example``'s question read off its scene's objects."""
    objs, spec = example.scene.objects, example.spec
    if spec.kind == "count":
        return str(sum(o.color == spec.color and o.shape == spec.shape for o in objs))
    if spec.kind == "exists":
        return "yes" if any(o.color == spec.color and o.shape == spec.shape for o in objs) else "no"
    if spec.kind == "color":
        (obj,) = [o for o in objs if o.shape == spec.shape]
        return obj.color
    if spec.kind == "shape":
        (obj,) = [o for o in objs if o.color == spec.color]
        return obj.shape
    key = ("color", spec.color, spec.other_color) if spec.color is not None else ("shape", spec.shape, spec.other)
    (a,) = [o for o in objs if getattr(o, key[0]) == key[1]]
    (b,) = [o for o in objs if getattr(o, key[0]) == key[2]]
    dx, dy = b.cx - a.cx, b.cy - a.cy
    return "yes" if {"left of": dx > 0, "right of": dx < 0, "above": dy > 0, "below": dy < 0}[spec.relation] else "no"


@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_answer_is_what_the_scene_shows(size):
    examples = sample_vqa("train", 300, seed=11) + sample_color_position(60, seed=11)
    kinds, answers = Counter(), Counter()
    for e in examples:
        questions = question_set(e, size)
        assert len(questions) == size and questions[0] is e
        assert len({q.question for q in questions}) == size
        for q in questions[1:]:
            assert q.scene is e.scene and q.seed == e.seed and q.question == q.spec.text()
            assert q.answer == _truth(q), (q.question, q.answer, e.scene)
            assert _combination(q.spec) not in held_out_combinations()  # training questions only
            kinds[q.kind] += 1
            answers[(q.kind, q.answer)] += 1
        assert e.image() is questions[-1].image()  # one rendering per scene
    assert set(kinds) == {"count", "exists", "position", "color", "shape"}
    # Answers are not one guess: yes and no both common, counts not mostly 0.
    for kind in ("exists", "position"):
        share = answers[(kind, "yes")] / kinds[kind]
        assert 0.35 < share < 0.65, (kind, share)
    assert answers[("count", "0")] / kinds["count"] < 0.65


def test_no_two_questions_of_a_set_ask_one_combination_and_sets_are_pure_functions_of_the_example():
    examples = sample_vqa("train", 300, seed=12)
    distinct = sum(len({_combination(q.spec) for q in question_set(e, 3)}) == 3 for e in examples)
    assert distinct == len(examples)
    again = sample_vqa("train", 300, seed=12)
    assert [[q.question for q in question_set(e, 3)] for e in examples[:50]] == \
           [[q.question for q in question_set(e, 3)] for e in again[:50]]


def test_a_named_split_is_honoured_by_the_further_questions():
    held = parse_combinations(["red circle", "green square", "circle above square"])
    for e in sample_vqa("train", 300, seed=13, heldout=held):
        assert not any(_combination(q.spec) in held for q in question_set(e, 3, "train", held))


def test_sft_conversations_ask_question_sets_in_the_episodes_layout():
    """data.questions_per_example: each conversation is the question-set episode's layout (the image once, a question
    per turn), every answer the right reasoning turn of its own question; the default is one question."""
    from pathlib import Path

    from flowrl.commands.train import load_recipe_config
    from flowrl.config import ConfigError
    from flowrl.data.vqa_reasoning import reasoning_answer
    from flowrl.recipes.vlm_sft import batch_conversations

    config = str(Path(__file__).resolve().parents[2] / "configs/vlm/shapes_vqa_sft.yaml")
    _, cfg = load_recipe_config(config, ["data.questions_per_example=3", "data.zoom_fraction=0",
                                         "data.color_position_fraction=0", "data.heldout_combinations=[red circle]"])
    examples = sample_vqa("train", 64, seed=cfg.run.seed, start=64, heldout=parse_combinations(["red circle"]))
    for conversation, e in zip(batch_conversations(cfg, 1), examples):
        questions = question_set(e, 3, "train", parse_combinations(["red circle"]))
        assert [t.role for t in conversation] == ["user", "assistant"] * 3
        assert [t.text for t in conversation[::2]] == [q.question for q in questions]
        assert [len(t.images) for t in conversation[::2]] == [1, 0, 0]
        assert [t.text for t in conversation[1::2]] == [reasoning_answer(q) for q in questions]
        assert not any("red circle" in t.text for t in conversation[::2])
    _, default = load_recipe_config(config, [])
    assert all(len(c) == 2 for c in batch_conversations(default, 1) if not c[0].text.endswith(")"))
    with pytest.raises(ConfigError, match=r"^data.questions_per_example: question sets already ask"):
        load_recipe_config(config, ["data.questions_per_example=2", "data.answer_format=direct", "data.describe=true"])
