"""Tool-call parsing, the zoom environment and the multi-turn rollout loop: malformed calls, empty answers,
cut-off actions and the turn limit are handled and counted, never raised."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowrl.data.shapes import render
from flowrl.envs.rewards import (AnswerRewards, consistent_match, exact_match, format_match, grounded_match,
                                 numeric_match, scene_match)
from flowrl.envs.rollout import SamplingSettings, play_episodes
from flowrl.envs.tools import ToolCallError, ToolSpec, extract_answer, parse_tool_calls
from flowrl.envs.zoom import QUADRANTS, TOOL_PENALTY, ZoomEnv, crop, demonstration, overview, zoom_tasks
from flowrl.policies.policy import Generation

ZOOM = ToolSpec("zoom", ("quadrant",), {"quadrant": QUADRANTS})


# ----------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("text", [
    "<tool_call>zoom(top_left)</tool_call>",
    "<tool_call> zoom ( top_left ) </tool_call>",
    "<tool_call>zoom(quadrant=top_left)</tool_call>",
    '<tool_call>{"name": "zoom", "arguments": {"quadrant": "top_left"}}</tool_call>',
    '<tool_call>{"name": "zoom", "arguments": "{\\"quadrant\\": \\"top_left\\"}"}</tool_call>',
])
def test_tool_call_forms(text):
    (call,) = parse_tool_calls(text, [ZOOM])
    assert call.name == "zoom" and call.arguments == {"quadrant": "top_left"}


@pytest.mark.parametrize("text, message", [
    ("<tool_call>zoom(top_left)", "close the tool call"),
    ("<tool_call></tool_call>", "empty tool call"),
    ("<tool_call>{bad json}</tool_call>", "not valid json"),
    ("<tool_call>pan(left)</tool_call>", "unknown tool pan"),
    ("<tool_call>zoom(middle)</tool_call>", "bad quadrant"),
    ("<tool_call>zoom()</tool_call>", "missing argument quadrant"),
    ("<tool_call>zoom(top_left, top_right)</tool_call>", "too many arguments"),
    ("<tool_call>zoom(size=2)</tool_call>", "unknown argument size"),
    ("<tool_call>zoom top_left</tool_call>", "name ( arguments )"),
])
def test_malformed_tool_calls_say_what_is_wrong(text, message):
    with pytest.raises(ToolCallError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_tool_calls(text, [ZOOM])


def test_answers_and_rule_rewards():
    assert extract_answer("<think>it is red</think> <answer> Blue </answer>") == "Blue"
    assert extract_answer("<think>x</think> red") == "red"

    class T:
        def __init__(self, answer):
            self.answer = answer
    tasks = [T("2"), T("red"), T("3")]
    answers = ["two", "<answer>Red</answer>", "3.4"]
    assert exact_match(answers, tasks).tolist() == [1.0, 1.0, 0.0]
    assert numeric_match(answers, tasks, tolerance=0.5).tolist() == [1.0, 0.0, 1.0]
    assert format_match(answers, tasks, pattern=r"<answer>.*</answer>").tolist() == [0.0, 1.0, 0.0]
    total, details = AnswerRewards({"exact": 1.0, "format": {"weight": 0.5, "kwargs": {"pattern": "<answer>.*"}}})(
        answers, tasks)
    assert total.tolist() == [1.0, 1.5, 0.0] and set(details) == {"exact", "format"}
    assert grounded_match(answers, tasks).tolist() == [1.0, 1.0, 0.0]  # no question spec: exact


def test_grounded_reward_pays_a_right_answer_only_after_a_trace_that_gives_it():
    from flowrl.data.vqa import sample_vqa
    from flowrl.data.vqa_reasoning import reasoning_answer, reasoning_trace
    from flowrl.envs.vqa import task_from_example

    examples = sample_vqa("train", 40, seed=5)
    tasks = [task_from_example(e) for e in examples]
    right = [reasoning_answer(e) for e in examples]
    assert grounded_match(right, tasks).tolist() == [1.0] * 40
    # The answer of another question's trace: right answers after a trace that gives another one earn nothing.
    other = {"yes": "no", "no": "yes", "0": "1", "1": "0", "2": "0", "3": "0", "red": "blue", "blue": "red",
             "green": "red", "yellow": "red", "purple": "red", "cyan": "red", "circle": "square", "square": "circle",
             "triangle": "circle"}
    guesses = []
    for e in examples:  # the trace of a scene whose answer differs, then the right answer
        donor = next(d for d in sample_vqa("train", 400, seed=6, kinds=(e.kind,))
                     if d.spec == e.spec and d.answer != e.answer)
        guesses.append(f"<think> {reasoning_trace(donor)} </think> <answer> {e.answer} </answer>")
    assert grounded_match(guesses, tasks).tolist() == [0.0] * 40
    assert exact_match(guesses, tasks).tolist() == [1.0] * 40
    wrong = [f"<think> {reasoning_trace(e)} </think> <answer> {other[e.answer]} </answer>" for e in examples]
    assert grounded_match(wrong, tasks).tolist() == [0.0] * 40


def test_scene_reward_is_the_f1_of_the_listed_objects():
    from types import SimpleNamespace

    from flowrl.data.shapes import Scene, SceneObject
    from flowrl.data.vqa import sample_vqa
    from flowrl.data.vqa_reasoning import reasoning_answer
    from flowrl.envs.vqa import task_from_example

    # Cells of 4 px on the 32 px canvas: red circle (2, 1) first in reading order, blue square (6, 5).
    scene = Scene((SceneObject("square", "blue", 26, 22, 6), SceneObject("circle", "red", 10, 6, 6)), 32)
    task = SimpleNamespace(question="how many red circles?", data=SimpleNamespace(scene=scene))

    def score(trace, **kwargs):
        return scene_match([f"<think> {trace} ; red : red_circle 2 1 </think> <answer> 1 </answer>"], [task],
                           **kwargs).item()

    assert score("red_circle 2 1 , blue_square 6 5") == 1.0
    assert score("blue_square 6 5, red_circle 2 1") == 1.0  # order and a joined comma do not matter
    assert score("red_circle 3 1 , blue_square 6 5") == 1.0  # one cell off: within the default tolerance
    assert score("red_circle 3 1 , blue_square 6 5", tolerance=0) == 0.5
    assert score("red_circle 4 1 , blue_square 6 5") == 0.5  # two cells off
    assert score("red_square 2 1 , blue_square 6 5") == 0.5  # wrong shape: 2 * 1 / (2 + 2)
    assert score("red_circle 2 1 , blue_square 6 5 , red_circle 2 1") == pytest.approx(0.8)  # extra: 2*2/(3+2)
    assert score("red_circle 2 1 , red_circle 2 2") == 0.5  # one true object matches one listed entry only
    assert score("red_circle , blue_square 6 5") == 0.5  # an entry without its cell matches nothing
    assert score("none") == 0.0
    assert scene_match(["<answer> 1 </answer>"], [task]).item() == 0.0  # no trace
    # The shipped traces list their scenes exactly.
    examples = sample_vqa("train", 40, seed=5)
    assert scene_match([reasoning_answer(e) for e in examples], [task_from_example(e) for e in examples]).tolist() \
        == [1.0] * 40
    with pytest.raises(ValueError, match="Shapes-VQA tasks"):
        scene_match(["<think> none </think>"], zoom_tasks("train", 1, seed=1))


def test_consistent_reward_judges_each_step_against_the_trace_before_it():
    from types import SimpleNamespace

    from flowrl.data.vqa import QuestionSpec, sample_vqa
    from flowrl.data.vqa_reasoning import reasoning_answer
    from flowrl.envs.vqa import task_from_example

    def score(spec, trace, answer):
        task = SimpleNamespace(question=spec.text(), data=SimpleNamespace(spec=spec))
        return consistent_match([f"<think> {trace} </think> <answer> {answer} </answer>"], [task]).item()

    exists = QuestionSpec("exists", color="red", shape="circle")
    listing = "red_circle 2 2, red_triangle 2 6, purple_triangle 5 4"
    # The shipped model's trace (2026-12-05): the circle lookup drops the red circle; the answer follows from it.
    assert score(exists, f"{listing} ; red : red_circle 2 2, red_triangle 2 6 ; circle : none", "no") \
        == pytest.approx(2 / 3)
    assert score(exists, f"{listing} ; red : red_circle 2 2, red_triangle 2 6 ; circle : red_circle 2 2", "yes") == 1
    # Judged against the trace's own listing, not the scene: a consistent trace over a wrong listing scores 1.
    assert score(exists, "red_square 2 2 ; red : red_square 2 2 ; circle : none", "no") == 1
    assert score(exists, f"{listing} ; red : red_circle 2 2 ; circle : red_circle 2 2", "yes") == pytest.approx(2 / 3)
    # a step missing
    assert score(exists, f"{listing} ; red : red_circle 2 2, red_triangle 2 6", "yes") == pytest.approx(1 / 3)
    count = QuestionSpec("count", color="green", shape="circle")
    assert score(count, "green_circle 1 3, green_circle 4 4 ; green : green_circle 1 3, green_circle 4 4 ; "
                        "circle : green_circle 1 3, green_circle 4 4", "2") == 1
    assert score(count, "green_circle 1 3, green_circle 4 4 ; green : green_circle 1 3, green_circle 4 4 ; "
                        "circle : green_circle 1 3, green_circle 4 4", "1") == pytest.approx(2 / 3)
    shape = QuestionSpec("shape", color="blue")
    assert score(shape, "blue_square 1 1, red_circle 5 5 ; blue : blue_square 1 1", "square") == 1
    assert score(shape, "blue_square 1 1, red_circle 5 5 ; blue : red_circle 5 5", "circle") == pytest.approx(0.5)
    assert score(shape, "blue_square 1 1, red_circle 5 5 ; red : red_circle 5 5", "circle") == 0  # another lookup
    # Position: the pair is the first object of each asked shape in the listing; the relation follows the pair's
    # written cells (the shipped model's trace: the pair's cells swapped, the relation and answer follow from them).
    above = QuestionSpec("position", shape="square", relation="above", other="triangle")
    listing = "yellow_circle 5 1, blue_square 2 3, yellow_triangle 5 5"
    assert score(above, f"{listing} ; blue_square 2 3 , yellow_triangle 5 5 ; above above", "yes") == 1
    assert score(above, f"{listing} ; yellow_square 5 5, blue_triangle 2 3 ; below above", "no") \
        == pytest.approx(2 / 3)
    assert score(above, f"{listing} ; blue_square 2 3 , yellow_triangle 5 5 ; below above", "no") \
        == pytest.approx(2 / 3)
    assert score(above, f"{listing} ; blue_square 2 3 , yellow_triangle 5 5 ; above below", "no") \
        == pytest.approx(1 / 3)  # the asked word is not the question's: the answer cannot be read either
    left = QuestionSpec("position", relation="left of", color="red", other_color="blue")
    assert score(left, "blue_square 6 2, red_circle 1 4 ; red_circle 1 4 , blue_square 6 2 ; left left", "yes") == 1
    assert score(left, "red_circle 3 4, blue_square 3 2 ; red_circle 3 4 , blue_square 3 2 ; right left", "no") == 1
    # Every shipped trace is consistent; a task without a question spec is refused.
    examples = sample_vqa("train", 60, seed=5)
    assert consistent_match([reasoning_answer(e) for e in examples],
                            [task_from_example(e) for e in examples]).tolist() == [1.0] * 60
    assert consistent_match(["<answer> 1 </answer>"], [task_from_example(examples[0])]).item() == 0.0  # no trace
    with pytest.raises(ValueError, match="question spec"):
        consistent_match(["<think> none </think>"], [SimpleNamespace(question="q?", data=None)])


# ----------------------------------------------------------------------------- zoom environment


def test_zoom_crop_is_the_full_resolution_quadrant():
    from flowrl.data.shapes import Scene, SceneObject

    task = zoom_tasks("train", 4, seed=1, kinds=("count",))[0]
    q = task.data["quadrant"]
    qx, qy = QUADRANTS.index(q) % 2, QUADRANTS.index(q) // 2
    local = Scene(tuple(SceneObject(o.shape, o.color, o.cx - 32 * qx, o.cy - 32 * qy, o.size)
                        for o in task.data["scene"].objects), 32)
    # The quadrant holding the objects is exactly the 32 px scene of its objects, pixel for pixel.
    assert np.array_equal(crop(task, q), render(local))
    for other in QUADRANTS:
        if other != q:
            assert (crop(task, other) == 255).all()
    assert overview(task).shape == (32, 32, 3)


def test_zoom_count_scenes_need_the_shapes():
    """Every distractor of a count task shares the asked colour (at least one): counting the colour is wrong."""
    tasks = zoom_tasks("train", 60, seed=2, kinds=("count",))
    answers = set()
    for task in tasks:
        words = task.question.split()  # "how many <colour> <shape>s are there?"
        color, shape = words[2], words[3].removesuffix("s")
        objects = task.data["scene"].objects
        targets = [o for o in objects if (o.color, o.shape) == (color, shape)]
        assert str(len(targets)) == task.answer and len(objects) <= 4
        assert len(objects) > len(targets) and all(o.color == color for o in objects)
        answers.add(task.answer)
    assert answers == {"0", "1", "2", "3"}


def test_zoom_baselines_show_the_plain_question_on_the_overview_or_the_right_quadrant():
    from flowrl.envs.registry import get_env

    task = zoom_tasks("eval", 1, seed=3, kinds=("count",))[0]
    over, full = get_env("shapes_zoom_overview"), get_env("shapes_zoom_crop")
    assert over.max_turns == full.max_turns == 1
    assert over.eval_tasks(3)[0].question == get_env("shapes_zoom").eval_tasks(3)[0].question
    a, b = over.make().reset(task), full.make().reset(task)
    assert a.text == b.text == task.question  # no tool offered
    assert np.array_equal(a.images[0], overview(task))
    assert np.array_equal(b.images[0], crop(task, task.data["quadrant"]))
    assert over.make().step("2").done


def test_zoom_environment_steps():
    task = zoom_tasks("train", 2, seed=0, kinds=("count",))[0]
    env = ZoomEnv()
    obs = env.reset(task)
    assert obs.images[0].shape == (32, 32, 3) and "zoom" in obs.text
    step = env.step(f"<tool_call> zoom ( {task.data['quadrant']} ) </tool_call>")
    assert not step.done and step.reward == -TOOL_PENALTY and step.info["tool_call"] == 1
    assert np.array_equal(step.observation.images[0], crop(task, task.data["quadrant"]))
    bad = env.step("<tool_call> zoom ( middle ) </tool_call>")
    assert not bad.done and bad.reward == -TOOL_PENALTY and bad.info["malformed"] == 1
    assert bad.observation.text.startswith("error") and bad.observation.role == "tool"
    done = env.step(task.answer)
    assert done.done and done.info["answer"] == task.answer


# ----------------------------------------------------------------------------- rollout


class ScriptedPolicy:
    """Answers with scripted texts per (episode, turn); ``None`` means an action cut at max tokens."""

    def __init__(self, script):
        self.script = script
        self.calls = 0

    def generate(self, conversations, *, seeds, max_new_tokens, **kwargs):
        out = []
        for conv in conversations:
            episode = int(conv[0].text.split("#")[1].split()[0])
            turn = sum(t.role == "assistant" for t in conv)
            text = self.script[episode][turn]
            finish = "length" if text.endswith("...") else "stop"
            ids = list(range(len(text.split()))) or []
            out.append(Generation(ids, torch.zeros(len(ids)), text.removesuffix("..."), finish))
        self.calls += 1
        return out


def test_rollout_counts_what_goes_wrong_and_never_raises():
    tasks = zoom_tasks("train", 5, seed=2, kinds=("count",))
    for i, t in enumerate(tasks):
        t.question = f"{t.question} #{i}"
    q = [t.data["quadrant"] for t in tasks]
    script = {
        0: [f"<tool_call> zoom ( {q[0]} ) </tool_call>", tasks[0].answer],  # zoom, then right
        1: ["<tool_call> zoom ( middle ) </tool_call>", "<tool_call> zoom ( top_left", "7"],  # 2 malformed, wrong
        2: [""],  # empty answer
        3: ["<tool_call> zoom ( top_left ) </tool_call>"] * 3,  # turn limit
        4: ["a long rambling answer ..."],  # cut off at max tokens
    }
    episodes = play_episodes(ScriptedPolicy(script), ZoomEnv, tasks, list(range(5)), seed=0,
                             sampling=SamplingSettings(), max_turns=3)
    e0, e1, e2, e3, e4 = episodes
    assert e0.answered and e0.turn_rewards == [-TOOL_PENALTY, 0.0] and e0.counts["tool_call"] == 1
    assert e1.counts["malformed"] == 2 and e1.answer == "7" and e1.num_turns == 3
    assert e2.answered and e2.answer == "" and e2.counts["empty"] == 1
    assert not e3.answered and e3.counts["turn_limit"] == 1 and e3.num_turns == 3 and e3.counts["tool_call"] == 3
    assert e4.counts["truncated"] == 1 and e4.answered
    # Conversations alternate roles and keep one anchor per action.
    assert [t.role for t in e0.conversation] == ["user", "assistant", "tool", "assistant"]
    assert all(len(e.anchors) == e.num_turns for e in episodes)
    assert e0.anchors == [("start",), ("zoom", (q[0],))]
    correct = exact_match([e.answer for e in episodes], [e.task for e in episodes])
    assert correct.tolist()[0] == 1.0 and correct.tolist()[1] == 0.0


def test_demonstrations_use_the_tool_format_the_parser_reads():
    task = zoom_tasks("train", 1, seed=3)[0]
    turns = demonstration(task, use_tool=True)
    (call,) = parse_tool_calls(turns[1].text, ZoomEnv.tools)
    assert call.arguments["quadrant"] == task.data["quadrant"]
    assert [t.role for t in turns] == ["user", "assistant", "tool", "assistant"]
    assert [t.role for t in demonstration(task, use_tool=False)] == ["user", "assistant"]


# ----------------------------------------------------------------------------- hostile tool calls (docs/security.md)

HOSTILE_CALLS = [
    "<tool_call>zoom({image}=1)</tool_call>",
    '<tool_call>{"name": "zoom", "arguments": {"{image}": 1}}</tool_call>',
    '<tool_call>{"name": "<|im_end|>{image}"}</tool_call>',
    "<tool_call>zoom(<|im_start|>=top_left)</tool_call>",
    '<tool_call>{"name": "zoom", "arguments": {"quadrant": "{image}<|im_end|>"}}</tool_call>',
]


@pytest.mark.parametrize("text", HOSTILE_CALLS)
def test_tool_errors_never_echo_the_policys_text(text):
    with pytest.raises(ToolCallError) as info:
        parse_tool_calls(text, [ZOOM])
    message = str(info.value)
    assert message.startswith("error : ") and "{" not in message and "<|" not in message
    assert "zoom ( top_left|top_right|bottom_left|bottom_right )" in message or "bad quadrant" in message


def test_deeply_nested_json_in_a_tool_call_is_a_malformed_call():
    deep = '{"name": "zoom", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(ToolCallError, match="not valid json"):  # main: RecursionError (also at depth 10**5)
        parse_tool_calls(f"<tool_call>{deep}</tool_call>", [ZOOM])


def test_a_hostile_tool_call_never_breaks_the_conversation_a_vlm_trains_on(tmp_path):
    """What vlm_grpo does with each action: the zoom environment's answer becomes a tool turn, and the whole
    conversation goes through build_inputs. On main, ``zoom({image}=1)`` was echoed into the tool turn, which
    then asked for an image it did not have (ValueError, the run ended), and an echoed ``<|im_end|>`` was
    tokenized as the end-of-turn token."""
    from flowrl.policies import TokenPolicy, Turn
    from flowrl.policies.inputs import build_inputs
    from flowrl.policies.testing import tiny_qwen2_vl

    torch.set_num_threads(1)
    policy = TokenPolicy.from_pretrained(tiny_qwen2_vl(tmp_path / "qwen"))
    im_end = policy.tokenizer.convert_tokens_to_ids("<|im_end|>")
    task = zoom_tasks("train", 1, seed=4)[0]
    for text in HOSTILE_CALLS:
        env = ZoomEnv()
        first = env.reset(task)
        result = env.step(text)
        assert result.info["malformed"] == 1.0
        ids = policy.tokenizer(text, add_special_tokens=False)["input_ids"]
        conversation = [Turn("user", first.text, list(first.images)), Turn("assistant", text, token_ids=ids),
                        Turn(result.observation.role, result.observation.text, list(result.observation.images))]
        inputs = build_inputs(policy, [conversation], add_generation_prompt=True)
        prompt_ids = inputs.input_ids[0][inputs.loss_mask[0] == 0].tolist()
        assert prompt_ids.count(im_end) == 3  # one per turn (user, assistant's closing text, tool), no more
        assert int(inputs.num_image_tokens[0]) == 4  # the overview only: no image asked for by the echo
