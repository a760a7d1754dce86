"""Rewards of an agent's final answer: rule-based checks and the ``vlm_judge`` reward model.

Each reward is called as ``reward(answers, tasks, images) -> [B] float tensor`` with the policy's final turn
texts, the :class:`~flowrl.envs.base.Task` of each episode and the task's image (for judges). They compose
by weighted sum (:class:`AnswerRewards`), keeping each component for logging. An episode of several questions is
scored per question (each answer turn against its own question) and each reward combined over its questions
(:data:`EPISODE_COMBINE`: the mean, ``all_right`` the minimum) before the sum.

- ``exact``: 1 when the normalised answer (``flowrl.data.vqa.normalize_answer``: case, punctuation, number
  words) equals the task's answer, else 0.
- ``all_right``: ``exact`` per question; an episode of several questions (``env.questions_per_episode``) gets 1
  only when every answer is right (:meth:`AnswerRewards.by_episode`), where ``exact`` gets the share of right
  answers. A guess then earns nothing unless every other answer is right too.
- ``grounded``: ``exact``, and the answer follows from the turn's own reasoning trace
  (:func:`flowrl.data.vqa_reasoning.answer_from_trace` on the ``<think>`` block, for tasks with a Shapes-VQA
  question spec): a right answer after a trace that says otherwise (a lucky guess) earns 0. Tasks without a spec
  fall back to ``exact``.
- ``scene``: a perception reward on the trace (for Shapes-VQA tasks): the F1 of the objects its first step lists
  against the scene's (:func:`flowrl.data.vqa_reasoning.scene_f1`, a listed object matching a true one of the same
  colour and shape within ``tolerance`` cells, default 1), whatever the question. A dense signal beside
  ``exact``: every object counts, where the answer is one token, so a group whose answers all agree still has
  traces that differ. Like Perception-R1's object-listing reward, it needs the ground truth of the scene.
- ``consistent``: a process reward on the trace's reasoning (for tasks with a Shapes-VQA question spec): the share
  of its checks that hold, each step judged against the trace's own step before it (every lookup keeps exactly the
  listed objects with the looked-up attribute, a position pair and relation follow from what was written) and the
  answer against the trace (:func:`flowrl.data.vqa_reasoning.step_checks` and ``answer_from_trace``). Needs no
  scene: it rewards reasoning right from whatever was seen, where ``scene`` rewards seeing right.
- ``numeric``: 1 when both parse as numbers within ``tolerance`` (absolute), else 0.
- ``format``: 1 when the text matches ``pattern`` (a regular expression, ``re.fullmatch`` after stripping;
  e.g. ``<think>.*</think>\\s*<answer>.*</answer>`` for R1-style outputs), else 0.
- ``vlm_judge``: ``rewards/vlm_judge.py`` asked ``question`` (default: is this answer to this question
  correct?) about the task's image; the score is P(yes). The policy's answer is pasted as a quoted,
  escaped string literal, cut to ``max_answer_chars``, with special-token strings defused
  (:func:`flowrl.untrusted.quote_untrusted`): an answer cannot close the quotes and add its own
  instruction ("... Answer yes."), nor end the judge's turn with ``<|im_end|>`` or ask for an image with
  ``<image>``.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np
import torch

from flowrl.data.vqa import normalize_answer
from flowrl.registry import Registry

from .tools import extract_answer, extract_trace

__all__ = ["ANSWER_REWARDS", "AnswerRewards", "EPISODE_COMBINE", "exact_match", "all_right", "grounded_match",
           "scene_match", "consistent_match", "numeric_match", "format_match", "JudgeReward"]

ANSWER_REWARDS: Registry = Registry("answer reward")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@ANSWER_REWARDS.register("exact")
def exact_match(answers: list[str], tasks: list, images=None) -> torch.Tensor:
    return torch.tensor([float(normalize_answer(extract_answer(a)) == normalize_answer(t.answer))
                         for a, t in zip(answers, tasks)])


@ANSWER_REWARDS.register("all_right")
def all_right(answers: list[str], tasks: list, images=None) -> torch.Tensor:
    """``exact`` per question; :data:`EPISODE_COMBINE` takes the minimum over an episode's questions."""
    return exact_match(answers, tasks)


# How a reward's per-question values combine into an episode's (AnswerRewards.by_episode); unlisted: the mean.
EPISODE_COMBINE = {"all_right": "min"}


def _question_spec(task):
    """The Shapes-VQA question of ``task`` (a VQA example's ``spec``, or the zoom task's ``data["spec"]``)."""
    data = getattr(task, "data", None)
    return data.get("spec") if isinstance(data, dict) else getattr(data, "spec", None)


def _answer_follows_trace(spec, trace: str | None, text: str) -> bool:
    """Whether the answer of ``text`` is the one its reasoning ``trace`` derives for the question ``spec``."""
    from flowrl.data.vqa_reasoning import answer_from_trace

    derived = answer_from_trace(spec, trace) if trace is not None else None
    return derived is not None and normalize_answer(derived) == normalize_answer(extract_answer(text))


@ANSWER_REWARDS.register("grounded")
def grounded_match(answers: list[str], tasks: list, images=None) -> torch.Tensor:
    exact = exact_match(answers, tasks)
    out = []
    for text, task, right in zip(answers, tasks, exact.tolist()):
        spec = _question_spec(task)
        if spec is None or not right:
            out.append(right)
            continue
        out.append(float(_answer_follows_trace(spec, extract_trace(text), text)))
    return torch.tensor(out)


def scene_match(answers: list[str], tasks: list, images=None, *, tolerance: int = 1) -> torch.Tensor:
    from flowrl.data.vqa_reasoning import scene_f1

    out = []
    for text, task in zip(answers, tasks):
        scene = getattr(task.data, "scene", None)
        if scene is None:
            raise ValueError(f"the scene reward needs Shapes-VQA tasks (a VQA example with its scene); task "
                             f"{task.question!r} has none: use it with the shapes_vqa environment, or drop it")
        trace = extract_trace(text)
        out.append(scene_f1(trace, scene, tolerance) if trace is not None else 0.0)
    return torch.tensor(out)


ANSWER_REWARDS.register("scene", scene_match)


@ANSWER_REWARDS.register("consistent")
def consistent_match(answers: list[str], tasks: list, images=None) -> torch.Tensor:
    from flowrl.data.vqa_reasoning import step_checks

    out = []
    for text, task in zip(answers, tasks):
        spec = _question_spec(task)
        if spec is None:
            raise ValueError(f"the consistent reward needs Shapes-VQA questions (a task with its question spec); task "
                             f"{task.question!r} has none: use it with shapes_vqa or shapes_zoom, or drop it")
        trace = extract_trace(text)
        if trace is None:
            out.append(0.0)
            continue
        checks = step_checks(spec, trace) + [_answer_follows_trace(spec, trace, text)]
        out.append(sum(checks) / len(checks))
    return torch.tensor(out)


def _number(text: str) -> float | None:
    match = _NUMBER.search(normalize_answer(text))
    return float(match.group(0)) if match else None


def numeric_match(answers: list[str], tasks: list, images=None, *, tolerance: float = 0.0) -> torch.Tensor:
    out = []
    for a, t in zip(answers, tasks):
        x, y = _number(extract_answer(a)), _number(t.answer)
        out.append(float(x is not None and y is not None and abs(x - y) <= tolerance + 1e-12))
    return torch.tensor(out)


ANSWER_REWARDS.register("numeric", numeric_match)


def format_match(answers: list[str], tasks: list, images=None, *, pattern: str = r".+") -> torch.Tensor:
    regex = re.compile(pattern, re.S)
    return torch.tensor([float(regex.fullmatch(a.strip()) is not None) for a in answers])


ANSWER_REWARDS.register("format", format_match)


class JudgeReward:
    """``rewards/vlm_judge.py`` as an answer reward: the judge sees the task's image and is asked whether
    the policy's answer to the question is right (P(yes) is the score).

    Args:
        question: template with ``{question}`` and ``{answer}``; both are replaced by quoted string literals
            (``"..."``), so the template writes no quotes of its own around them.
        max_answer_chars: the policy's answer is cut to this many characters before it is quoted.
        **judge_kwargs: passed to ``rewards.load("vlm_judge", ...)`` (``model=`` a local VLM folder, or
            ``endpoint=`` an OpenAI-compatible server).
    """

    DEFAULT_QUESTION = "Question: {question} Answer: {answer}. Is the answer correct? Answer yes or no."

    def __init__(self, question: str | None = None, max_answer_chars: int = 200, **judge_kwargs: Any):
        import rewards

        self.template = question or self.DEFAULT_QUESTION
        self.max_answer_chars = int(max_answer_chars)
        # The judge fills {prompt}; each prompt here is the whole question about one answer.
        self.judge = rewards.load("vlm_judge", question="{prompt}", **judge_kwargs)
        tokenizer = getattr(self.judge, "tokenizer", None)  # a local judge: defuse its own special tokens too
        self.special_tokens = tuple(getattr(tokenizer, "all_special_tokens", ())) + tuple(
            tokenizer.get_added_vocab()) if tokenizer is not None else ()

    def prompt(self, answer: str, task) -> str:
        """The judge's question about one answer (the answer quoted, capped and defused)."""
        from flowrl.untrusted import quote_untrusted

        quoted = quote_untrusted(extract_answer(answer), self.max_answer_chars, self.special_tokens)
        # One pass over the template: a {question} or {answer} inside the inserted text stays text.
        parts = {"{question}": quote_untrusted(task.question, 2000, self.special_tokens), "{answer}": quoted}
        return re.sub(r"\{question\}|\{answer\}", lambda m: parts[m.group(0)], self.template)

    def __call__(self, answers: list[str], tasks: list, images=None) -> torch.Tensor:
        if images is None:
            raise ValueError("the vlm_judge answer reward needs the task images")
        prompts = [self.prompt(a, t) for a, t in zip(answers, tasks)]
        pixels = torch.from_numpy(np.stack([np.asarray(im) for im in images])).permute(0, 3, 1, 2).float() / 255.0
        return self.judge(pixels, prompts).scores.float().cpu()


ANSWER_REWARDS.register("vlm_judge", JudgeReward)


class AnswerRewards:
    """A weighted sum of answer rewards.

    Args:
        spec: ``{name: weight}`` or ``{name: {"weight": w, "kwargs": {...}}}`` (names from :data:`ANSWER_REWARDS`).
    """

    def __init__(self, spec: dict[str, Any]):
        if not spec:
            raise ValueError("name at least one answer reward, e.g. {exact: 1.0}")
        self.parts: list[tuple[str, float, Callable]] = []
        for name, entry in spec.items():
            weight, kwargs = (float(entry), {}) if not isinstance(entry, dict) else (
                float(entry.get("weight", 1.0)), dict(entry.get("kwargs", {})))
            target = ANSWER_REWARDS.get(name)
            if isinstance(target, type):
                fn = target(**kwargs)
            elif kwargs:
                fn = (lambda f, kw: (lambda a, t, i=None: f(a, t, i, **kw)))(target, kwargs)
            else:
                fn = target
            self.parts.append((name, weight, fn))

    def __call__(self, answers: list[str], tasks: list, images=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(scores [B], {name: [B]})``."""
        details = {name: fn(answers, tasks, images).float() for name, _, fn in self.parts}
        return self._total(details, len(answers)), details

    def _total(self, details: dict[str, torch.Tensor], n: int) -> torch.Tensor:
        total = torch.zeros(n)
        for name, weight, _ in self.parts:
            total = total + weight * details[name]
        return total

    def by_episode(self, answers: list[list[str]], tasks: list[list], images=None
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(scores [N], {name: [N]})`` of ``N`` episodes of one or more questions each: ``answers[i]`` /
        ``tasks[i]`` the answer texts and single-question tasks of episode ``i`` (``images[i]`` its image). Each
        reward scores every question, then combines an episode's values by :data:`EPISODE_COMBINE` (the mean, or
        the minimum for ``all_right``); the weighted sum is taken after. One question per episode: the same as
        calling the rewards on the answers."""
        if len(answers) != len(tasks) or any(len(a) != len(t) for a, t in zip(answers, tasks)):
            raise ValueError("by_episode needs one task per answer text in every episode")
        flat_answers = [a for episode in answers for a in episode]
        flat_tasks = [t for episode in tasks for t in episode]
        flat_images = None if images is None else [im for im, episode in zip(images, answers) for _ in episode]
        owner = torch.tensor([i for i, episode in enumerate(answers) for _ in episode], dtype=torch.long)
        details = {}
        for name, _, fn in self.parts:
            values = fn(flat_answers, flat_tasks, flat_images).float()
            if EPISODE_COMBINE.get(name) == "min":
                out = torch.full((len(answers),), float("inf")).scatter_reduce(0, owner, values, "amin")
            else:
                count = torch.zeros(len(answers)).index_add(0, owner, torch.ones_like(values))
                out = torch.zeros(len(answers)).index_add(0, owner, values) / count.clamp(min=1)
            details[name] = torch.where(torch.isinf(out), torch.zeros_like(out), out)  # an episode without answers
        return self._total(details, len(answers)), details
