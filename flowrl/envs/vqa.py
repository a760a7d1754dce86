"""Single-turn Shapes-VQA: the policy sees the scene and the question and answers once.

``reset`` shows the image and the question; ``step`` takes the answer and ends the episode (the answer is
scored by the recipe's answer rewards, e.g. exact match). Tasks come from :mod:`flowrl.data.vqa`.
"""

from __future__ import annotations

from flowrl.data.vqa import QUESTION_KINDS, VQAExample, sample_color_position, sample_vqa, vqa_eval_set

from .base import Observation, StepResult, Task
from .tools import extract_answer

__all__ = ["VQAEnv", "vqa_tasks", "vqa_eval_tasks", "task_from_example"]


def task_from_example(example: VQAExample) -> Task:
    return Task(example.question, example.answer, example.kind, data=example, group=(example.question, example.seed))


def vqa_tasks(split: str, n: int, seed: int, start: int = 0, kinds: tuple[str, ...] = QUESTION_KINDS,
              color_position_fraction: float = 0.0) -> list[Task]:
    """``n`` tasks of ``split``; with ``color_position_fraction`` (training only, and only when ``kinds`` has
    position), that share of them ask position by colour (:func:`flowrl.data.vqa.sample_color_position`)."""
    if color_position_fraction and split != "train":
        raise ValueError("position questions by colour are train-only; color_position_fraction needs split 'train'")
    n_color = round(n * color_position_fraction) if "position" in kinds else 0
    examples = sample_vqa(split, n - n_color, seed=seed, start=start, kinds=kinds)
    examples += sample_color_position(n_color, seed=seed, start=start)
    return [task_from_example(e) for e in examples]


def vqa_eval_tasks(n: int = 500, kinds: tuple[str, ...] = QUESTION_KINDS) -> list[Task]:
    return [task_from_example(e) for e in vqa_eval_set(n, kinds=kinds)]


class VQAEnv:
    """One question, one answer."""

    max_turns = 1

    def reset(self, task: Task) -> Observation:
        self.task = task
        return Observation(text=task.question, images=[task.data.image()], anchor=("start",))

    def image(self, task: Task):
        """The image a judge reward looks at."""
        return task.data.image()

    def step(self, action_text: str) -> StepResult:
        return StepResult(None, 0.0, True, {"answer": extract_answer(action_text)})
