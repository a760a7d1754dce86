"""Per-step credit of the consistent checks (flowrl/envs/step_credit.py) on hand-built traces: which tokens belong to
which step, what each check's group-normalised advantage is, which tokens get it (the outcome's alone elsewhere), and
its placement on the trained positions of real model inputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flowrl.data.vqa import QuestionSpec
from flowrl.envs.base import Task
from flowrl.envs.rollout import Episode
from flowrl.envs.step_credit import ANSWER, place_token_credit, step_credit, token_sections, turn_checks
from flowrl.policies import Turn

LISTING = "<think> red_circle 1 1 , red_square 4 1 ; red : red_circle 1 1 , red_square 4 1 ; "
RIGHT = LISTING + "circle : red_circle 1 1 </think> <answer> 1 </answer>"   # every check holds
DROPPED = LISTING + "circle : none </think> <answer> 0 </answer>"         # the circle lookup drops the circle
WRONG = LISTING + "circle : red_circle 1 1 </think> <answer> 2 </answer>"   # the answer does not follow


@pytest.fixture(scope="module")
def tokenizer():
    from flowrl.policies.shapes_vlm import build_tokenizer

    return build_tokenizer()


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def _decode(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _task(color="red", shape="circle"):
    spec = QuestionSpec("count", color=color, shape=shape)
    return Task(spec.text(), "1", "count", data=SimpleNamespace(spec=spec))


def _episode(tokenizer, task, *texts):
    conversation = [Turn("user", task.question)]
    for text in texts:
        conversation += [Turn("assistant", text, token_ids=_ids(tokenizer, text)), Turn("user", "next")]
    return Episode(task, conversation[:-1], turn_rewards=[0.0] * len(texts), final_text=texts[-1], answered=True)


def test_every_token_is_placed_in_its_step(tokenizer):
    sections = token_sections(_ids(tokenizer, RIGHT), _decode(tokenizer))
    # <think> | the listing (7 tokens) | ; | red : ... (9) | ; | circle : red_circle 1 1 (5) | </think> <answer> |
    # 1 | </answer> | end of turn
    assert sections == ([None] + [0] * 7 + [None] + [1] * 9 + [None] + [2] * 5 + [None, None, ANSWER, None, None])
    assert turn_checks(RIGHT, _task()) == [(1, 1.0), (2, 1.0), (ANSWER, 1.0)]
    assert turn_checks(DROPPED, _task()) == [(1, 1.0), (2, 0.0), (ANSWER, 1.0)]
    assert turn_checks(WRONG, _task()) == [(1, 1.0), (2, 1.0), (ANSWER, 0.0)]
    assert turn_checks("<answer> 1 </answer>", _task()) == [(1, 0.0), (2, 0.0), (ANSWER, 0.0)]  # no trace
    assert turn_checks("1", Task("q", "1", "count")) is None  # no question spec: nothing to check


def test_each_check_is_credited_to_its_own_steps_tokens(tokenizer):
    task = _task()
    episodes = [_episode(tokenizer, task, RIGHT), _episode(tokenizer, task, DROPPED), _episode(tokenizer, task, WRONG),
                _episode(tokenizer, _task("blue"), RIGHT)]  # alone in its group: nothing to compare
    extra = step_credit(episodes, torch.tensor([0, 0, 0, 1]), _decode(tokenizer), weight=0.5)
    # Step 2 held in 2 of 3 episodes, the answer check in 2 of 3 (group mean / population std + eps).
    up, down = (1 / 3) / ((2 / 9) ** 0.5 + 1e-4), -(2 / 3) / ((2 / 9) ** 0.5 + 1e-4)
    right, dropped, wrong = (e[0].tolist() for e in extra[:3])
    assert right == pytest.approx([0.0] * 19 + [0.5 * up] * 5 + [0, 0, 0.5 * up, 0, 0])
    # DROPPED: "circle : none" (3 tokens) is the failed step; its answer follows its trace, which WRONG's does not.
    assert dropped == pytest.approx([0.0] * 19 + [0.5 * down] * 3 + [0, 0, 0.5 * up, 0, 0])
    assert wrong == pytest.approx([0.0] * 19 + [0.5 * up] * 5 + [0, 0, 0.5 * down, 0, 0])
    assert not extra[3][0].any()  # the step-1 check held everywhere, and a group of one is constant
    # Without std (Dr.GRPO) the check's centred value.
    plain = step_credit(episodes[:3], torch.tensor([0, 0, 0]), _decode(tokenizer), weight=1.0, std_scope="none")
    assert plain[1][0][19].item() == pytest.approx(-2 / 3) and plain[0][0][26].item() == pytest.approx(1 / 3)


def test_a_question_sets_turns_are_credited_against_their_own_questions(tokenizer):
    from flowrl.data.vqa import make_example
    from flowrl.data.vqa_reasoning import reasoning_answer
    from flowrl.envs.vqa import question_set, question_set_task

    first = make_example(QuestionSpec("count", color="red", shape="circle"), seed=3)
    task = question_set_task(question_set(first, 2))
    good = [reasoning_answer(e) for e in task.data.examples]
    broken = good[1].split("</think>")[0].rsplit(";", 1)[0] + " ; none : none </think> <answer> x </answer>"
    episodes = [_episode(tokenizer, task, *good), _episode(tokenizer, task, good[0], broken)]
    extra = step_credit(episodes, torch.tensor([0, 0]), _decode(tokenizer), weight=1.0)
    assert not extra[0][0].any() and not extra[1][0].any()  # the first turns agree: nothing to credit
    assert extra[0][1].max() > 0 and extra[1][1].min() < 0  # the second turns differ, each against question 2


def test_credit_lands_on_the_trained_positions_in_order():
    turn_index = torch.tensor([[-1, -1, 0, 0, 0, -1, 1, 1],
                               [-1, -1, -1, -1, -1, 0, 0, -1]])
    extra = [[torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0])], [torch.tensor([6.0, 7.0])]]
    assert place_token_credit(turn_index, extra).tolist() == [[0, 0, 1, 2, 3, 0, 4, 5], [0, 0, 0, 0, 0, 6, 7, 0]]
    with pytest.raises(ValueError, match="row 1, action 0: 3 credited tokens but 2 trained"):
        place_token_credit(turn_index, [extra[0], [torch.ones(3)]])
