"""The zoom environment: a low-resolution view and a ``zoom(quadrant)`` tool.

The scene is drawn on a 64 x 64 canvas and the agent first sees it downsampled to 32 x 32, where objects are
5-6 px wide: colours still show, shapes barely. It may call ``zoom(quadrant)`` (``top_left``, ``top_right``,
``bottom_left``, ``bottom_right``) to receive that quadrant at full resolution (32 x 32, objects 9-12 px, as
in single-turn Shapes-VQA) before answering. Reward = correct - 0.05 per tool call (malformed calls
included, so spamming errors does not pay); answering ends the episode.

Task kinds (objects are drawn inside one quadrant, so one zoom shows everything that matters):

- ``count``: a Shapes-VQA count question ("how many red circles are there?") whose distractors all share
  the asked colour (at least one, of another shape): counting the colour is not enough, and at low
  resolution the shapes blur together, so the tool pays.

Baselines for the same held-out tasks (:class:`OverviewEnv`, :class:`CropEnv`; ``shapes_zoom_overview`` and
``shapes_zoom_crop`` in :mod:`flowrl.envs.registry`): one turn on the overview with the plain question (what
the tool must beat), and one turn on the right quadrant at full resolution (what a perfect zoom gives).
- ``color``: "what colour is the square?" with the square alone in the scene: the low-resolution view
  suffices, so a call only costs 0.05.
"""

from __future__ import annotations

import random

import numpy as np
from PIL import Image

from flowrl.data.shapes import COLORS, MAX_SIZE, MIN_SIZE, SHAPES, Scene, SceneObject, render
from flowrl.data.vqa import COUNT_ANSWERS, MAX_OBJECTS, QuestionSpec, _example_seed, split_questions

from .base import Observation, StepResult, Task
from .tools import ToolCallError, ToolSpec, extract_answer, has_tool_call, parse_tool_calls

__all__ = ["ZoomEnv", "OverviewEnv", "CropEnv", "zoom_tasks", "zoom_eval_tasks", "QUADRANTS", "ZOOM_KINDS", "ZOOM_TOOL",
           "zoom_prompt", "local_scene", "demonstration", "TOOL_PENALTY"]

QUADRANTS = ("top_left", "top_right", "bottom_left", "bottom_right")
ZOOM_KINDS = ("count", "color")
ZOOM_TOOL = ToolSpec("zoom", ("quadrant",), {"quadrant": QUADRANTS})
TOOL_PENALTY = 0.05
FULL, VIEW = 64, 32


def zoom_prompt(question: str) -> str:
    """The first user turn's text (the low-resolution image goes before it)."""
    return f"{question} tool : {ZOOM_TOOL.usage()}"


def _offset(scene: Scene, quadrant: str) -> Scene:
    qx, qy = QUADRANTS.index(quadrant) % 2, QUADRANTS.index(quadrant) // 2
    return Scene(tuple(SceneObject(o.shape, o.color, o.cx + 32 * qx, o.cy + 32 * qy, o.size)
                       for o in scene.objects), FULL)


def _task(kind: str, split: str, seed: int, heldout: frozenset[str] | None = None) -> Task:
    rng = random.Random(seed)
    quadrant = rng.choice(QUADRANTS)
    if kind == "count":
        spec = rng.choice(split_questions(split, heldout)["count"])
        local, answer, question = _count_scene(spec, rng), None, spec.text()
        answer = str(sum(o.shape == spec.shape and o.color == spec.color for o in local.objects))
    elif kind == "color":
        shape, color = rng.choice(SHAPES), rng.choice(COLORS)
        size = rng.uniform(MIN_SIZE, MAX_SIZE)
        local = Scene((SceneObject(shape, color, rng.uniform(size / 2 + 1, 31 - size / 2),
                                   rng.uniform(size / 2 + 1, 31 - size / 2), size),), 32)
        answer, question = color, QuestionSpec("color", shape=shape).text()
    else:
        raise ValueError(f"unknown zoom task kind {kind!r}; valid: {', '.join(ZOOM_KINDS)}")
    scene = _offset(local, quadrant)
    spec = spec if kind == "count" else QuestionSpec("color", shape=shape)
    return Task(question, answer, kind, data={"scene": scene, "quadrant": quadrant, "seed": seed, "spec": spec},
                group=(question, seed))


def _count_scene(spec: QuestionSpec, rng: random.Random) -> Scene:
    """A 32 px scene for a count question: 0-3 targets and 1-3 distractors of the asked colour and another
    shape (at most 4 objects)."""
    from flowrl.data.vqa import _scene

    n = rng.choice(COUNT_ANSWERS)
    while True:
        objects = [(spec.shape, spec.color)] * n
        objects += [(rng.choice([s for s in SHAPES if s != spec.shape]), spec.color)
                    for _ in range(rng.randint(1, max(1, MAX_OBJECTS - n)))]
        rng.shuffle(objects)
        scene = _scene(rng, objects, 32)
        if scene is not None:
            return scene


def zoom_tasks(split: str, n: int, seed: int, start: int = 0, kinds: tuple[str, ...] = ZOOM_KINDS,
               heldout: frozenset[str] | None = None) -> list[Task]:
    """``n`` tasks; task ``i`` depends only on ``(seed, start + i)``; kinds cycle. ``heldout``: the count questions
    of a named split (:func:`flowrl.data.vqa.split_questions`; the SFT data of a held-out-combinations base)."""
    return [_task(kinds[i % len(kinds)], split, _example_seed(seed + 7919, i), heldout)
            for i in range(start, start + n)]


def zoom_eval_tasks(n: int = 200, kinds: tuple[str, ...] = ZOOM_KINDS) -> list[Task]:
    """The fixed held-out set (count questions from the eval split)."""
    return zoom_tasks("eval", n, seed=4321, kinds=kinds)


def full_image(task: Task) -> np.ndarray:
    return render(task.data["scene"])


def overview(task: Task) -> np.ndarray:
    """The 64 px scene box-filtered down to 32 px."""
    return np.asarray(Image.fromarray(full_image(task)).resize((VIEW, VIEW), Image.Resampling.BOX))


def crop(task: Task, quadrant: str) -> np.ndarray:
    qx, qy = QUADRANTS.index(quadrant) % 2, QUADRANTS.index(quadrant) // 2
    return full_image(task)[32 * qy: 32 * qy + 32, 32 * qx: 32 * qx + 32].copy()


class ZoomEnv:
    """See the module docstring. One instance plays one episode at a time."""

    tools = {ZOOM_TOOL.name: ZOOM_TOOL}

    def reset(self, task: Task) -> Observation:
        self.task = task
        self.zooms: list[str] = []
        return Observation(text=zoom_prompt(task.question), images=[overview(task)], anchor=("start",))

    def image(self, task: Task):
        return full_image(task)

    def step(self, action_text: str) -> StepResult:
        if not has_tool_call(action_text):
            return StepResult(None, 0.0, True, {"answer": extract_answer(action_text)})
        try:
            calls = parse_tool_calls(action_text, self.tools)
        except ToolCallError as err:
            return StepResult(Observation(text=str(err), role="tool", anchor=("error", tuple(self.zooms), str(err))),
                              -TOOL_PENALTY, False, {"malformed": 1.0, "tool_call": 1.0})
        images = []
        for call in calls:
            quadrant = call.arguments["quadrant"]
            self.zooms.append(quadrant)
            images.append(crop(self.task, quadrant))
        text = "{image}" * len(images)
        return StepResult(Observation(text=text, images=images, role="tool", anchor=("zoom", tuple(self.zooms))),
                          -TOOL_PENALTY * len(calls), False, {"tool_call": float(len(calls))})


class OverviewEnv:
    """Baseline: the plain question on the overview, one answer (no tool offered)."""

    max_turns = 1

    def reset(self, task: Task) -> Observation:
        self.task = task
        return Observation(text=task.question, images=[overview(task)], anchor=("start",))

    def image(self, task: Task):
        return full_image(task)

    def step(self, action_text: str) -> StepResult:
        return StepResult(None, 0.0, True, {"answer": extract_answer(action_text)})


class CropEnv(OverviewEnv):
    """Baseline: the plain question on the quadrant that holds the objects, at full resolution (a perfect zoom
    without the tool call)."""

    def reset(self, task: Task) -> Observation:
        self.task = task
        return Observation(text=task.question, images=[crop(task, task.data["quadrant"])], anchor=("start",))


def local_scene(task: Task, quadrant: str) -> Scene:
    """The objects of ``quadrant`` as a 32 px scene: what :func:`crop` shows."""
    qx, qy = QUADRANTS.index(quadrant) % 2, QUADRANTS.index(quadrant) // 2
    inside = [o for o in task.data["scene"].objects
              if 32 * qx <= o.cx < 32 * qx + 32 and 32 * qy <= o.cy < 32 * qy + 32]
    return Scene(tuple(SceneObject(o.shape, o.color, o.cx - 32 * qx, o.cy - 32 * qy, o.size) for o in inside), 32)


def demonstration(task: Task, use_tool: bool, reasoning: bool = False) -> list:
    """A supervised conversation for ``task``: answer from the overview, or zoom into the quadrant that holds
    the objects first. Used to teach the tool's format before RL decides when it pays.

    With ``reasoning`` the answer is a reasoning turn (:mod:`flowrl.data.vqa_reasoning`) over what the last image
    shows: the crop after a zoom, else the overview (the whole scene, its cells at the overview's resolution)."""
    from types import SimpleNamespace

    from flowrl.data.vqa_reasoning import reasoning_answer
    from flowrl.policies.inputs import Turn

    turns = [Turn("user", zoom_prompt(task.question), [overview(task)])]
    seen = task.data["scene"]
    if use_tool:
        q = task.data["quadrant"]
        turns += [Turn("assistant", f"<tool_call> zoom ( {q} ) </tool_call>"), Turn("tool", "", [crop(task, q)])]
        seen = local_scene(task, q)
    answer = task.answer
    if reasoning:
        answer = reasoning_answer(SimpleNamespace(scene=seen, spec=task.data["spec"], answer=task.answer))
    turns.append(Turn("assistant", answer))
    return turns
