"""Shapes-VQA: every answer is right (checked against the shapes world's own detector on the rendered image),
kinds and answers are balanced, the held-out split names questions no training question names."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from flowrl.data.vqa import (QUESTION_KINDS, normalize_answer, sample_vqa, split_questions, vqa_eval_set)
from rewards.shapes import detect_objects


def _answer_from_detections(example) -> str:
    objs = detect_objects(example.image().astype(np.float32) / 255.0)
    spec = example.spec
    if spec.kind == "count":
        return str(sum(o.shape == spec.shape and o.color == spec.color for o in objs))
    if spec.kind == "color":
        (obj,) = [o for o in objs if o.shape == spec.shape]
        return obj.color
    if spec.kind == "shape":
        (obj,) = [o for o in objs if o.color == spec.color]
        return obj.shape
    if spec.kind == "exists":
        return "yes" if any(o.shape == spec.shape and o.color == spec.color for o in objs) else "no"
    (a,) = [o for o in objs if o.shape == spec.shape]
    (b,) = [o for o in objs if o.shape == spec.other]
    dx, dy = b.cx - a.cx, b.cy - a.cy
    holds = {"left of": dx > 0, "right of": dx < 0, "above": dy > 0, "below": dy < 0}[spec.relation]
    return "yes" if holds else "no"


@pytest.mark.parametrize("split", ["train", "eval"])
def test_every_answer_matches_the_rendered_scene(split):
    examples = sample_vqa(split, 150, seed=3)
    for example in examples:
        assert _answer_from_detections(example) == example.answer, (example.question, example.scene)


def test_kinds_and_answers_are_balanced():
    examples = sample_vqa("train", 1000, seed=0)
    kinds = collections.Counter(e.kind for e in examples)
    assert set(kinds) == set(QUESTION_KINDS) and min(kinds.values()) == 200
    yes = [e.answer == "yes" for e in examples if e.kind in ("position", "exists")]
    assert 0.4 < sum(yes) / len(yes) < 0.6
    counts = collections.Counter(e.answer for e in examples if e.kind == "count")
    assert set(counts) == {"0", "1", "2", "3"} and min(counts.values()) >= 30


def test_split_holds_out_combinations():
    train, held = split_questions("train"), split_questions("eval")
    for kind in ("count", "position", "exists"):
        a, b = {s.text() for s in train[kind]}, {s.text() for s in held[kind]}
        assert a and b and not a & b, kind
    for kind in ("color", "shape"):  # nothing to hold out: in both splits, on fresh scenes
        assert train[kind] == held[kind]
    # A quarter of each family's combinations, rounded up: 5 of 18 (colour, shape) pairs, 3 of 12 relations.
    assert (len(held["count"]), len(held["exists"]), len(held["position"])) == (5, 5, 6)
    assert (len(train["count"]), len(train["exists"]), len(train["position"])) == (13, 13, 18)
    # A held-out pair is asked about by neither count nor exists in training.
    pairs = lambda specs: {(s.color, s.shape) for s in specs}  # noqa: E731
    assert pairs(held["count"]) == pairs(held["exists"])
    assert not pairs(held["count"]) & (pairs(train["count"]) | pairs(train["exists"]))
    # A held-out relation is held out with its mirror ("a above b" is "b below a").
    mirror = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
    relations = lambda specs: {(s.shape, s.relation, s.other) for s in specs}  # noqa: E731
    assert {(b, mirror[r], a) for a, r, b in relations(held["position"])} == relations(held["position"])
    assert not relations(held["position"]) & relations(train["position"])
    # Every relation word is still trained with more than one second shape.
    for relation in mirror:
        assert len({s.other for s in train["position"] if s.relation == relation}) >= 2, relation
    # Every word of a held-out question is known from training questions (it is the combination that is new).
    train_words = {w for specs in train.values() for s in specs for w in s.text().split()}
    assert all(w in train_words for specs in held.values() for s in specs for w in s.text().split())


def test_stream_is_a_pure_function_of_seed_and_index():
    a = sample_vqa("train", 6, seed=5)
    b = sample_vqa("train", 3, seed=5, start=3)
    assert [(e.question, e.scene) for e in a[3:]] == [(e.question, e.scene) for e in b]
    assert np.array_equal(a[4].image(), b[1].image())
    evals = vqa_eval_set(10)
    assert [e.question for e in evals] == [e.question for e in vqa_eval_set(10)]
    assert all(e.question in {s.text() for specs in split_questions("eval").values() for s in specs} for e in evals)


def test_normalize_answer():
    assert normalize_answer(" Two. ") == "2"
    assert normalize_answer("Red!") == "red"
    assert normalize_answer("no") == "no"
    assert normalize_answer("zero") == "0"


def test_descriptions_list_every_object_in_reading_order():
    from flowrl.data.shapes import Scene, SceneObject
    from flowrl.data.vqa import describe_objects

    # Two rows: the top row (centres 5 px apart, under half an object) read left to right, then the bottom.
    scene = Scene((SceneObject("square", "blue", 25, 8, 10), SceneObject("circle", "red", 6, 26, 10),
                   SceneObject("triangle", "green", 5, 11, 10)), 32)
    assert describe_objects(scene) == "green triangle , blue square , red circle"
    # On real examples: one "colour shape" per object, and the words are the tokenizer's.
    from flowrl.policies.shapes_vlm import VOCAB_WORDS

    for e in sample_vqa("train", 20, seed=4):
        parts = e.description().split(" , ")
        assert sorted(parts) == sorted(f"{o.color} {o.shape}" for o in e.scene.objects)
        assert all(w in VOCAB_WORDS for w in e.description().split())


def test_images_are_rendered_once_and_read_only():
    e = sample_vqa("train", 1, seed=6)[0]
    first = e.image()
    assert e.image() is first and not first.flags.writeable
    assert vqa_eval_set(5)[0] is vqa_eval_set(5)[0]  # the fixed set is built once per process


def test_scene_questions_answer_the_drawn_scene_and_ask_only_the_split():
    """Every scene question's answer is what the scene shows (checked against the objects independently), only
    the split's combinations are asked, and exists / position answers are balanced."""
    import random
    from collections import Counter

    from flowrl.data.vqa import _combination, held_out_combinations, sample_vqa, scene_questions

    rng = random.Random(0)
    answers: dict[str, Counter] = {"exists": Counter(), "position": Counter(), "count": Counter()}
    held = held_out_combinations()
    for e in sample_vqa("train", 300, seed=3):
        objs = e.scene.objects
        for kind in ("exists", "position", "count"):
            got = scene_questions(e.scene, (kind,), rng)
            for question, answer in got:
                words = question.rstrip("?").split()
                answers[kind][answer] += 1
                if kind == "exists":  # "is there a <colour> <shape>?"
                    color, shape = words[3], words[4]
                    assert f"pair:{color} {shape}" not in held
                    assert answer == ("yes" if any(o.color == color and o.shape == shape for o in objs) else "no")
                elif kind == "count":  # "how many <colour> <shape>s are there?"
                    color, shape = words[2], words[3][:-1]
                    assert f"pair:{color} {shape}" not in held
                    assert answer == str(sum(o.color == color and o.shape == shape for o in objs))
                else:  # "is the <a> <relation> the <b>?"
                    a, b = words[2], words[-1]
                    relation = " ".join(words[3:-2])
                    from flowrl.data.vqa import QuestionSpec

                    assert _combination(QuestionSpec("position", shape=a, relation=relation, other=b)) not in held
                    oa = [o for o in objs if o.shape == a]
                    ob = [o for o in objs if o.shape == b]
                    assert len(oa) == len(ob) == 1
                    dx, dy = ob[0].cx - oa[0].cx, ob[0].cy - oa[0].cy
                    truth = {"left of": dx > 0, "right of": dx < 0, "above": dy > 0, "below": dy < 0}[relation]
                    assert answer == ("yes" if truth else "no")
    for kind in ("exists", "position"):
        total = sum(answers[kind].values())
        assert total > 100 and 0.35 < answers[kind]["yes"] / total < 0.65, answers[kind]
    assert len(answers["count"]) >= 3  # several counts, not a constant
    with pytest.raises(ValueError, match="use exists, position, count"):
        scene_questions(sample_vqa("train", 1, seed=0)[0].scene, ("colour",), rng)
