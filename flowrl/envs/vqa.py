"""Shapes-VQA episodes: the policy sees the scene and a question and answers; with several questions per episode it
answers each in its own turn.

``reset`` shows the image and the (first) question; ``step`` takes the answer and ends the episode, or, for a
question set, asks the next question. Answers are scored by the recipe's answer rewards (e.g. exact match). Tasks
come from :mod:`flowrl.data.vqa`.

**Several questions per episode** (``env.questions_per_episode``, :func:`vqa_tasks` ``questions``): a task is a
:class:`QuestionSet`, the drawn question and ``questions - 1`` further ones about the same scene
(:func:`flowrl.data.vqa.question_set`), asked one per turn: the image and the first question, the answer, the next
question (a user turn), ... Multi-turn rather than one prompt listing the questions, because every turn then has
exactly the layout the policy was trained and evaluated in (one question, one ``<think> ... </think> <answer> ...
</answer>`` turn; the tiny model's word-level vocabulary has no words to number answers), the rollout and the token
layout already play and train multi-turn episodes (every action's tokens are trained, the episode's advantage on
each), and each answer is read from its own turn as the single-question rewards read it. The episode's answer
rewards score every turn against its own question (:func:`episode_questions`) and combine them
(:meth:`flowrl.envs.rewards.AnswerRewards.by_episode`): ``all_right`` is 1 only when every answer is right, so a
guess at a yes / no question pays only when the others are right too.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from flowrl.data.vqa import (QUESTION_KINDS, VQAExample, heldout_kinds, question_set, sample_color_position,
                             sample_vqa, vqa_eval_set, vqa_indist_eval_set)

from .base import Observation, StepResult, Task
from .tools import extract_answer

__all__ = ["VQAEnv", "QuestionSet", "vqa_tasks", "vqa_eval_tasks", "task_from_example", "question_set_task",
           "sub_tasks", "episode_questions", "vqa_eval_sets"]


@dataclass
class QuestionSet:
    """Several questions about one scene: ``examples[0]`` is the question the scene was drawn for."""

    examples: list[VQAExample]

    @property
    def scene(self):
        return self.examples[0].scene

    def image(self):
        return self.examples[0].image()


def task_from_example(example: VQAExample) -> Task:
    return Task(example.question, example.answer, example.kind, data=example, group=(example.question, example.seed))


def question_set_task(examples: list[VQAExample]) -> Task:
    """One episode's task of several questions: ``question`` / ``answer`` joined with `` ; `` (for logs), ``kind`` the
    first question's (the kind the scene was drawn for)."""
    return Task(" ; ".join(e.question for e in examples), " ; ".join(e.answer for e in examples), examples[0].kind,
                data=QuestionSet(list(examples)), group=(tuple(e.question for e in examples), examples[0].seed))


def sub_tasks(task: Task) -> list[Task]:
    """The single-question tasks of ``task``: one per question of a :class:`QuestionSet`, else ``[task]``."""
    if isinstance(task.data, QuestionSet):
        return [task_from_example(e) for e in task.data.examples]
    return [task]


def episode_questions(episode) -> tuple[list[str], list[Task]]:
    """``(texts, tasks)``: what answer rewards score in an episode. A question set's episode: each assistant turn's
    text and its own question (a turn never played is an empty answer); any other: the final turn and the task."""
    if not isinstance(episode.task.data, QuestionSet):
        return [episode.final_text], [episode.task]
    texts = [t.text for t in episode.conversation if t.role == "assistant"]
    tasks = sub_tasks(episode.task)
    return (texts + [""] * len(tasks))[:len(tasks)], tasks


def vqa_tasks(split: str, n: int, seed: int, start: int = 0, kinds: tuple[str, ...] = QUESTION_KINDS,
              color_position_fraction: float = 0.0, questions: int = 1,
              heldout: frozenset[str] | None = None) -> list[Task]:
    """``n`` tasks of ``split``; with ``color_position_fraction`` (training only, and only when ``kinds`` has
    position), that share of them ask position by colour (:func:`flowrl.data.vqa.sample_color_position`).

    Args:
        questions: questions per task; above 1 each task is a :class:`QuestionSet` (its first question as drawn
            here, then further ones about the same scene from the same split).
        heldout: a named split's held-out combinations (:func:`flowrl.data.vqa.parse_combinations`).
    """
    if color_position_fraction and split != "train":
        raise ValueError("position questions by colour are train-only; color_position_fraction needs split 'train'")
    n_color = round(n * color_position_fraction) if "position" in kinds else 0
    examples = sample_vqa(split, n - n_color, seed=seed, start=start, kinds=kinds, heldout=heldout)
    examples += sample_color_position(n_color, seed=seed, start=start)
    if questions > 1:
        return [question_set_task(question_set(e, questions, split, heldout)) for e in examples]
    return [task_from_example(e) for e in examples]


def vqa_eval_tasks(n: int = 500, kinds: tuple[str, ...] = QUESTION_KINDS) -> list[Task]:
    return [task_from_example(e) for e in vqa_eval_set(n, kinds=kinds)]


def vqa_eval_sets(questions: int = 1, heldout: frozenset[str] | None = None) -> tuple:
    """``(main, {name: builder})``: the evaluation task builders ``(n) -> tasks`` of a Shapes-VQA environment.

    The main set is the held-out split (:func:`vqa_eval_tasks`), or with a named split (``heldout``) the
    in-distribution set (training questions on new scenes, :func:`flowrl.data.vqa.vqa_indist_eval_set`), and then
    ``heldout`` is the named split's held-out combinations (:func:`flowrl.data.vqa.heldout_kinds` only). With
    ``questions`` above 1, ``multi`` asks the main set's first ``ceil(n / questions)`` questions as question sets
    (as many questions as the main set), each followed by training questions about its scene: the eval split's
    combinations are too few to ask several about one scene, and what this set measures is answering them all."""
    def first(n: int) -> list[VQAExample]:
        return vqa_eval_set(n) if heldout is None else vqa_indist_eval_set(n, heldout=heldout)

    def main(n: int) -> list[Task]:
        return [task_from_example(e) for e in first(n)]

    def held(n: int) -> list[Task]:
        return [task_from_example(e) for e in vqa_eval_set(n, kinds=heldout_kinds(heldout), heldout=heldout)]

    def multi(n: int) -> list[Task]:
        return [question_set_task(question_set(e, questions, "train", heldout)) for e in first(ceil(n / questions))]

    extra = {"heldout": held} if heldout is not None else {}
    if questions > 1:
        extra["multi"] = multi
    return main, extra


class VQAEnv:
    """One question, one answer; a :class:`QuestionSet` asks its questions in turn (see the module docstring)."""

    max_turns = 1

    def reset(self, task: Task) -> Observation:
        self.task = task
        self.questions = sub_tasks(task)
        self.asked = 1
        return Observation(text=self.questions[0].question, images=[task.data.image()], anchor=("start",))

    def image(self, task: Task):
        """The image a judge reward looks at."""
        return task.data.image()

    def step(self, action_text: str) -> StepResult:
        info = {"answer": extract_answer(action_text)}
        if self.asked < len(self.questions):  # the next question: a user turn without the image (shown once)
            self.asked += 1
            question = self.questions[self.asked - 1].question
            return StepResult(Observation(question, role="user", anchor=("question", self.asked - 1)), 0.0, False, info)
        return StepResult(None, 0.0, True, info)
