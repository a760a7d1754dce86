"""Reasoning answers for Shapes-VQA (flowrl/data/vqa_reasoning.py): every answer follows from its trace, the trace
from the scene alone, and the tiny model's tokenizer knows every word of it."""

import re

import pytest

from flowrl.data.shapes import Scene, SceneObject
from flowrl.data.vqa import QUESTION_KINDS, QuestionSpec, sample_vqa
from flowrl.data.vqa_reasoning import (answer_from_trace, reading_order, reasoning_answer, reasoning_trace,
                                       scene_trace)


@pytest.mark.parametrize("split", ["train", "eval"])
@pytest.mark.parametrize("kind", QUESTION_KINDS)
def test_every_answer_follows_from_its_trace(kind, split):
    for example in sample_vqa(split, 300, seed=11, kinds=(kind,)):
        trace = reasoning_trace(example)
        assert answer_from_trace(example.spec, trace) == example.answer, (example.question, trace)
        assert reasoning_answer(example) == f"<think> {trace} </think> <answer> {example.answer} </answer>"


def test_a_trace_that_does_not_read_the_question_answers_nothing():
    scene = "green_square 6 1 , red_triangle 3 6"
    count = QuestionSpec("count", color="green", shape="square")
    # As a model writes it (the comma joined to the word before): still read.
    assert answer_from_trace(count, f"{scene} ; green : green_square 6 1, red_square 2 2 ; square : green_square 6 1, "
                                    "green_square 2 2") == "2"
    assert answer_from_trace(count, f"{scene} ; red : none ; square : none") is None  # looked up another colour
    assert answer_from_trace(count, f"{scene} ; square : none") is None  # a step missing
    shape = QuestionSpec("shape", color="red")
    assert answer_from_trace(shape, f"{scene} ; red : red_triangle 3 6") == "triangle"
    assert answer_from_trace(shape, f"{scene} ; red : red_triangle 3 6 , red_square 1 1") is None  # two objects
    assert answer_from_trace(shape, f"{scene} ; red : red 3 6") is None
    position = QuestionSpec("position", shape="square", relation="left of", other="triangle")
    assert answer_from_trace(position, f"{scene} ; green_square 6 1 , red_triangle 3 6 ; right left") == "no"
    assert answer_from_trace(position, f"{scene} ; green_square 6 1 , red_triangle 3 6 ; left left") == "yes"
    assert answer_from_trace(position, f"{scene} ; green_square 6 1 , red_triangle 3 6 ; right right") is None


def test_the_trace_lists_the_scene_in_reading_order_with_each_centres_cell():
    # Two objects in a row (centres 4 px apart vertically, under half the largest size) and one below them.
    scene = Scene((SceneObject("circle", "red", 25.0, 6.0, 10.0), SceneObject("square", "blue", 5.0, 9.0, 10.0),
                   SceneObject("triangle", "green", 15.9, 28.0, 10.0)), 32)
    assert [o.color for o in reading_order(scene)] == ["blue", "red", "green"]
    assert scene_trace(scene) == "blue_square 1 2 , red_circle 6 1 , green_triangle 3 7"
    # The same scene on a 64 px canvas (the zoom environment's) gives the cells of its 32 px view.
    big = Scene(tuple(SceneObject(o.shape, o.color, 2 * o.cx, 2 * o.cy, 2 * o.size) for o in scene.objects), 64)
    assert scene_trace(big) == scene_trace(scene)


def test_the_steps_look_up_one_attribute_at_a_time():
    scene = Scene((SceneObject("triangle", "green", 6.0, 6.0, 10.0), SceneObject("square", "green", 24.0, 6.0, 10.0),
                   SceneObject("triangle", "red", 14.0, 24.0, 10.0)), 32)

    def trace(spec):
        return reasoning_trace(type("E", (), {"scene": scene, "spec": spec})())

    listed = "green_triangle 1 1 , green_square 6 1 , red_triangle 3 6"
    assert trace(QuestionSpec("exists", color="green", shape="circle")) == (
        f"{listed} ; green : green_triangle 1 1 , green_square 6 1 ; circle : none")
    assert trace(QuestionSpec("count", color="green", shape="triangle")) == (
        f"{listed} ; green : green_triangle 1 1 , green_square 6 1 ; triangle : green_triangle 1 1")
    assert trace(QuestionSpec("shape", color="red")) == f"{listed} ; red : red_triangle 3 6"
    assert trace(QuestionSpec("color", shape="square")) == f"{listed} ; square : green_square 6 1"
    # The pair in the question's order, never reordered by the relation; the relation that holds on its axis, then
    # the asked one.
    assert trace(QuestionSpec("position", shape="square", relation="left of", other="triangle")) == (
        f"{listed} ; green_square 6 1 , green_triangle 1 1 ; right left")


def test_the_tiny_models_tokenizer_knows_every_word_of_every_trace():
    from flowrl.policies.shapes_vlm import build_tokenizer

    tokenizer = build_tokenizer()
    unknown = tokenizer.unk_token_id
    for example in sample_vqa("train", 200, seed=3):
        ids = tokenizer(reasoning_answer(example))["input_ids"]
        assert unknown not in ids, reasoning_answer(example)
        assert len(ids) <= 64  # eval.max_new_tokens of the shipped config (80) holds the longest


def test_zoom_demonstrations_reason_over_what_the_last_image_shows():
    from flowrl.envs.zoom import crop, demonstration, local_scene, zoom_tasks

    for task in zoom_tasks("train", 40, seed=5):
        turns = demonstration(task, use_tool=task.kind == "count", reasoning=True)
        final = turns[-1].text
        trace = re.search(r"<think> (.*) </think>", final).group(1)
        assert final.endswith(f"<answer> {task.answer} </answer>")
        assert answer_from_trace(task.data["spec"], trace) == task.answer
        if task.kind == "count":  # the crop's objects, at the crop's cells
            local = local_scene(task, task.data["quadrant"])
            assert trace.startswith(scene_trace(local)) and len(local.objects) >= 1
            assert turns[-2].role == "tool" and (turns[-2].images[0] == crop(task, task.data["quadrant"])).all()
        assert demonstration(task, use_tool=False)[-1].text == task.answer  # direct answers stay as they were


def test_position_by_colour_asks_every_pair_both_ways_and_never_an_evaluated_question():
    from flowrl.data.vqa import all_questions, color_position_questions, sample_color_position
    from flowrl.policies.shapes_vlm import build_tokenizer

    questions = color_position_questions()
    assert len(questions) == 120 and len({q.text() for q in questions}) == 120
    asked = {q.text() for specs in all_questions().values() for q in specs}
    assert not asked & {q.text() for q in questions}  # no held-out (or any shape) question is one of them
    tokenizer = build_tokenizer()
    examples = sample_color_position(300, seed=3)
    assert [e.question for e in examples] == [e.question for e in sample_color_position(300, seed=3)]
    assert {e.answer for e in examples} == {"yes", "no"}
    for e in examples:
        first, second = e.scene.objects[0], e.scene.objects[1]
        assert (first.color, second.color) == (e.spec.color, e.spec.other_color)
        assert sum(o.color in (first.color, second.color) for o in e.scene.objects) == 2  # each colour once
        dx, dy = second.cx - first.cx, second.cy - first.cy
        holds = {"left of": dx > 0, "right of": dx < 0, "above": dy > 0, "below": dy < 0}[e.spec.relation]
        assert e.answer == ("yes" if holds else "no")
        assert answer_from_trace(e.spec, reasoning_trace(e)) == e.answer
        assert tokenizer.unk_token_id not in tokenizer(e.question)["input_ids"]
