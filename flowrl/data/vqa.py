"""Shapes-VQA: questions about rendered scenes of the shapes world, with exact-match answers.

The embedded task of flowrl's VLM agents. A scene (``flowrl.data.shapes``: coloured circles, squares and
triangles on a white canvas) is drawn *for* a question, so that every question has exactly one right
answer, and the answers are balanced within each kind:

=========  ==========================================  ==========================
kind       question                                    answers
=========  ==========================================  ==========================
count      "how many red circles are there?"           0, 1, 2, 3 (uniform)
color      "what colour is the square?"                the 6 colours (uniform)
shape      "what shape is the blue object?"            circle, square, triangle
position   "is the circle left of the triangle?"       yes / no (half each)
exists     "is there a green triangle?"                yes / no (half each)
=========  ==========================================  ==========================

Distractors make the questions about binding, not detection: a count question's scene holds objects of
the same colour and another shape, or the same shape and another colour; an ``exists`` question whose
answer is no shows an object of the asked colour or of the asked shape. A position question's objects are
separated by at least half an object along the asked axis, so "no" means the opposite relation holds.

**Splits.** What is held out is a *combination*, and a quarter of each kind's combinations (rounded up)
is: 5 of the 18 (colour, shape) pairs, whose ``count`` and ``exists`` questions are all eval-only (a held-out
pair is asked about in neither kind during training), and 3 of the 12 spatial relations between two shapes
(a relation and its mirror, "the triangle above the circle" = "the circle below the triangle", are one
combination: 6 of the 24 ``position`` questions). The choice is a stable ranking by hash, so the split is
fixed. The eval split asks only about held-out combinations, on scenes drawn from their own seeds; every
word of it is known from training questions. ``color`` (3 questions) and ``shape`` (6) have no combination
to hold out; they are in both splits, with fresh scenes, and are reported separately like every kind.
Training scenes still *show* held-out pairs (as distractors, and in the train-only descriptions of
:func:`describe_objects`): what is new at evaluation is the question that binds them.

**Named splits.** Every function that draws questions takes ``heldout``: a set of combination keys
(:func:`parse_combinations` turns a config's ``["red circle", "circle left of triangle"]`` into them) that
replaces the hash-chosen ones above, for experiments on held-out combinations (``env.heldout_combinations`` /
``data.heldout_combinations``). Training never asks one of them; the eval split asks only them, and
:func:`vqa_indist_eval_set` asks fresh scenes of the training questions (in-distribution accuracy).

**Question sets.** :func:`question_set` adds further questions about an example's own scene (the multi-question
episodes of ``env.questions_per_episode``), from the same split.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from flowrl.data.shapes import COLORS, MAX_SIZE, MIN_SIZE, RESOLUTION, SHAPES, Scene, SceneObject, _place, render

__all__ = ["QUESTION_KINDS", "VQAExample", "QuestionSpec", "all_questions", "split_questions", "make_example",
           "sample_vqa", "vqa_eval_set", "normalize_answer", "answer_vocabulary", "question_words",
           "EVAL_FRACTION", "DESCRIBE_QUESTION", "describe_objects", "held_out_combinations", "scene_questions",
           "SCENE_QUESTION_KINDS", "color_position_questions", "sample_color_position", "parse_combinations",
           "heldout_kinds", "vqa_indist_eval_set", "question_set", "FOLLOW_UP_KINDS"]

QUESTION_KINDS = ("count", "color", "shape", "position", "exists")
VQA_RELATIONS = ("left of", "right of", "above", "below")
COUNT_ANSWERS = (0, 1, 2, 3)
EVAL_FRACTION = 0.25
MAX_OBJECTS = 4
_OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
DESCRIBE_QUESTION = "what is there?"
_NUMBER_WORDS = {"zero": "0", "none": "0", "one": "1", "two": "2", "three": "3", "four": "4",
                 "five": "5", "six": "6"}


@dataclass(frozen=True)
class QuestionSpec:
    """A question template filled in: ``kind`` plus its arguments (colour, shape, relation, second shape)."""

    kind: str
    color: str | None = None
    shape: str | None = None
    relation: str | None = None
    other: str | None = None  # position: the second shape
    other_color: str | None = None  # position by colour (train-only, sample_color_position): the second colour

    def text(self) -> str:
        if self.kind == "position" and self.color is not None:
            return f"is the {self.color} object {self.relation} the {self.other_color} object?"
        if self.kind == "count":
            return f"how many {self.color} {self.shape}s are there?"
        if self.kind == "color":
            return f"what colour is the {self.shape}?"
        if self.kind == "shape":
            return f"what shape is the {self.color} object?"
        if self.kind == "position":
            return f"is the {self.shape} {self.relation} the {self.other}?"
        if self.kind == "exists":
            return f"is there a {self.color} {self.shape}?"
        raise ValueError(f"unknown question kind {self.kind!r}; valid: {', '.join(QUESTION_KINDS)}")


@dataclass
class VQAExample:
    """One question about one scene.

    Attributes:
        question: the question text.
        answer: the canonical answer (a digit, a colour, a shape, ``yes`` or ``no``).
        kind: one of :data:`QUESTION_KINDS`.
        scene: the drawn scene (``Scene.to_json`` round-trips it).
        seed: the seed that produced the scene (``make_example(spec, seed)`` rebuilds the example).
    """

    question: str
    answer: str
    kind: str
    scene: Scene
    seed: int
    spec: QuestionSpec = field(repr=False, default=None)

    def image(self, resolution: int | None = None) -> np.ndarray:
        """The scene rendered as ``[H, W, 3]`` uint8 (at ``resolution`` px if given), read-only.

        The native rendering is kept: an episode asks for it twice (the observation and the judge's image),
        and a fixed evaluation set once per evaluation."""
        if resolution is not None:
            return render(_rescale(self.scene, resolution))
        cached = self.__dict__.get("_image")
        if cached is None:
            cached = render(self.scene)
            cached.setflags(write=False)
            self.__dict__["_image"] = cached
        return cached

    def description(self) -> str:
        """The answer to :data:`DESCRIBE_QUESTION` about this scene (:func:`describe_objects`)."""
        return describe_objects(self.scene)


def _rescale(scene: Scene, resolution: int) -> Scene:
    k = resolution / scene.resolution
    return Scene(tuple(SceneObject(o.shape, o.color, o.cx * k, o.cy * k, o.size * k) for o in scene.objects),
                 resolution)


# ----------------------------------------------------------------------------- questions and splits


def all_questions() -> dict[str, list[QuestionSpec]]:
    """Every question, by kind, in a fixed order."""
    pairs = [(c, s) for s in SHAPES for c in COLORS]
    return {
        "count": [QuestionSpec("count", color=c, shape=s) for c, s in pairs],
        "color": [QuestionSpec("color", shape=s) for s in SHAPES],
        "shape": [QuestionSpec("shape", color=c) for c in COLORS],
        "position": [QuestionSpec("position", shape=a, relation=r, other=b)
                     for r in VQA_RELATIONS for a in SHAPES for b in SHAPES if a != b],
        "exists": [QuestionSpec("exists", color=c, shape=s) for c, s in pairs],
    }


def _combination(spec: QuestionSpec) -> str:
    """The combination a question asks about: the unit the split holds out (see the module docstring)."""
    if spec.kind in ("count", "exists"):
        return f"pair:{spec.color} {spec.shape}"
    if spec.kind == "position":  # a relation and its mirror are the same combination
        return "relation:" + min(f"{spec.shape} {spec.relation} {spec.other}",
                                 f"{spec.other} {_OPPOSITE[spec.relation]} {spec.shape}")
    return f"{spec.kind}:{spec.text()}"


@lru_cache(maxsize=1)
def held_out_combinations() -> frozenset[str]:
    """The eval split's combinations: per family (pairs, relations), the ``ceil(EVAL_FRACTION * n)`` with the
    smallest stable hash."""
    families: dict[str, set[str]] = {}
    for kind in ("count", "exists", "position"):
        for spec in all_questions()[kind]:
            key = _combination(spec)
            families.setdefault(key.split(":")[0], set()).add(key)
    held: set[str] = set()
    for keys in families.values():
        ranked = sorted(keys, key=lambda k: hashlib.sha256(f"shapes-vqa-split-v2:{k}".encode()).digest())
        held.update(ranked[:math.ceil(EVAL_FRACTION * len(ranked))])
    return frozenset(held)


def parse_combinations(entries: list[str] | tuple[str, ...]) -> frozenset[str]:
    """The combination keys of a config's list: ``"red circle"`` (a colour-shape pair: its count and exists
    questions) or ``"circle left of triangle"`` (a relation between two shapes, held out with its mirror:
    ``"triangle right of circle"`` names the same one).

    Raises:
        ValueError: an entry that names neither, or an empty list.
    """
    if not entries:
        raise ValueError("name at least one combination to hold out, e.g. ['red circle', 'circle left of triangle']")
    keys = set()
    for entry in entries:
        words = str(entry).split()
        if len(words) == 2 and words[0] in COLORS and words[1] in SHAPES:
            keys.add(_combination(QuestionSpec("count", color=words[0], shape=words[1])))
            continue
        relation = " ".join(words[1:-1])
        if (len(words) >= 3 and words[0] in SHAPES and words[-1] in SHAPES and words[0] != words[-1]
                and relation in VQA_RELATIONS):
            keys.add(_combination(QuestionSpec("position", shape=words[0], relation=relation, other=words[-1])))
            continue
        raise ValueError(f"{entry!r} is not a combination: write a colour-shape pair ('red circle'; colours "
                         f"{', '.join(COLORS)}; shapes {', '.join(SHAPES)}) or a relation between two shapes "
                         f"('circle left of triangle'; relations {', '.join(VQA_RELATIONS)})")
    return frozenset(keys)


def _held(heldout: frozenset[str] | None) -> frozenset[str]:
    return held_out_combinations() if heldout is None else heldout


@lru_cache(maxsize=8)
def split_questions(split: str, heldout: frozenset[str] | None = None) -> dict[str, tuple[QuestionSpec, ...]]:
    """The questions of ``split`` (``train`` or ``eval``) by kind (see the module docstring); ``heldout``: the
    combination keys the eval split asks (:func:`parse_combinations`; None: the hash-chosen ones).

    Raises:
        ValueError: an unknown split, or a ``heldout`` that leaves a kind no training question.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    held = _held(heldout)
    out = {}
    for kind, specs in all_questions().items():
        if kind in ("color", "shape"):
            out[kind] = tuple(specs)
        else:
            out[kind] = tuple(s for s in specs if (_combination(s) in held) == (split == "eval"))
            if split == "train" and not out[kind]:
                raise ValueError(f"the held-out combinations leave no {kind} question to train on; hold out fewer "
                                 f"{'pairs' if kind != 'position' else 'relations'}")
    return out


def heldout_kinds(heldout: frozenset[str] | None = None) -> tuple[str, ...]:
    """The kinds whose questions the eval split holds out by combination (count and exists for pairs, position for
    relations), in :data:`QUESTION_KINDS` order."""
    held = split_questions("eval", heldout)
    return tuple(k for k in QUESTION_KINDS if k not in ("color", "shape") and held[k])


# ----------------------------------------------------------------------------- scenes


def _scene(rng: random.Random, objects: list[tuple[str, str]], resolution: int,
           check=None) -> Scene | None:
    scale = resolution / RESOLUTION
    sizes = [rng.uniform(MIN_SIZE, MAX_SIZE) * scale for _ in objects]
    for _ in range(50):
        centres = _place(rng, sizes, resolution)
        if centres is None:
            continue
        scene = Scene(tuple(SceneObject(s, c, x, y, size) for (s, c), size, (x, y) in zip(objects, sizes, centres)),
                      resolution)
        if check is None or check(scene):
            return scene
    return None


def _other(rng: random.Random, values: tuple[str, ...], *exclude: str) -> str:
    return rng.choice([v for v in values if v not in exclude])


def _holds(a: SceneObject, b: SceneObject, relation: str, margin: float) -> bool:
    dx, dy = b.cx - a.cx, b.cy - a.cy
    return {"left of": dx > margin, "right of": -dx > margin, "above": dy > margin, "below": -dy > margin}[relation]


def _objects_for(spec: QuestionSpec, rng: random.Random) -> tuple[list[tuple[str, str]], str, object]:
    """Objects ``[(shape, colour)]`` to draw for ``spec``, the answer, and an optional scene check."""
    if spec.kind == "count":
        n = rng.choice(COUNT_ANSWERS)
        objects = [(spec.shape, spec.color)] * n
        for _ in range(rng.randint(1 if n == 0 else 0, MAX_OBJECTS - n)):
            # Distractors share the colour or the shape, never both.
            if rng.random() < 0.5:
                objects.append((_other(rng, SHAPES, spec.shape), spec.color))
            else:
                objects.append((spec.shape, _other(rng, COLORS, spec.color)))
        return objects, str(n), None
    if spec.kind == "color":
        color = rng.choice(COLORS)
        objects = [(spec.shape, color)]
        objects += [(_other(rng, SHAPES, spec.shape), rng.choice(COLORS)) for _ in range(rng.randint(0, 2))]
        return objects, color, None
    if spec.kind == "shape":
        shape = rng.choice(SHAPES)
        objects = [(shape, spec.color)]
        objects += [(rng.choice(SHAPES), _other(rng, COLORS, spec.color)) for _ in range(rng.randint(0, 2))]
        return objects, shape, None
    if spec.kind == "position":
        yes = rng.random() < 0.5
        if spec.color is not None:  # by colour: any shapes, the pair's colours once each
            objects = [(rng.choice(SHAPES), spec.color), (rng.choice(SHAPES), spec.other_color)]
            objects += [(rng.choice(SHAPES), _other(rng, COLORS, spec.color, spec.other_color))] * rng.randint(0, 1)
        else:
            third = _other(rng, SHAPES, spec.shape, spec.other)
            objects = [(spec.shape, rng.choice(COLORS)), (spec.other, rng.choice(COLORS))]
            objects += [(third, rng.choice(COLORS))] * rng.randint(0, 1)
        relation = spec.relation if yes else _OPPOSITE[spec.relation]
        margin = MAX_SIZE / 2  # centres half an object apart along the asked axis

        def check(scene: Scene, relation=relation) -> bool:
            k = scene.resolution / RESOLUTION
            return _holds(scene.objects[0], scene.objects[1], relation, margin * k)

        return objects, "yes" if yes else "no", check
    if spec.kind == "exists":
        yes = rng.random() < 0.5
        objects = [(spec.shape, spec.color)] if yes else [
            (_other(rng, SHAPES, spec.shape), spec.color) if rng.random() < 0.5
            else (spec.shape, _other(rng, COLORS, spec.color))]
        for _ in range(rng.randint(0, 2)):
            shape, color = rng.choice(SHAPES), rng.choice(COLORS)
            if (shape, color) != (spec.shape, spec.color):
                objects.append((shape, color))
        return objects, "yes" if yes else "no", None
    raise ValueError(f"unknown question kind {spec.kind!r}; valid: {', '.join(QUESTION_KINDS)}")


def _rng(seed: int) -> random.Random:
    return random.Random(hashlib.sha256(f"shapes-vqa:{seed}".encode()).digest())


def make_example(spec: QuestionSpec, seed: int, resolution: int = RESOLUTION) -> VQAExample:
    """The scene and answer of question ``spec`` drawn from ``seed`` (a pure function of both)."""
    rng = _rng(seed)
    for _ in range(100):
        objects, answer, check = _objects_for(spec, rng)
        if spec.kind != "position":  # a position question's check reads its pair as objects 0 and 1
            rng.shuffle(objects)
        scene = _scene(rng, objects, resolution, check)
        if scene is not None:
            return VQAExample(spec.text(), answer, spec.kind, scene, seed, spec)
    raise RuntimeError(f"could not draw a scene for {spec.text()!r}")  # not reachable at 32 px and up


def _example_seed(seed: int, index: int, stream: str = "") -> int:
    digest = hashlib.sha256(f"{stream}{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:6], "big")


def sample_vqa(split: str, n: int, seed: int = 0, start: int = 0, kinds: tuple[str, ...] = QUESTION_KINDS,
               resolution: int = RESOLUTION, heldout: frozenset[str] | None = None,
               stream: str = "") -> list[VQAExample]:
    """``n`` examples of ``split``; example ``i`` depends only on ``(seed, start + i)``.

    Kinds cycle uniformly; the question is drawn from the split's questions of that kind, and the scene
    from the example's own seed, so any range of the stream can be regenerated on its own (exact resume).
    ``heldout``: a named split (:func:`split_questions`); ``stream``: a name that gives the examples seeds no
    unnamed stream draws (the in-distribution evaluation's).
    """
    questions = split_questions(split, heldout)
    for kind in kinds:
        if kind not in QUESTION_KINDS:
            raise ValueError(f"unknown question kind {kind!r}; valid: {', '.join(QUESTION_KINDS)}")
    out = []
    for index in range(start, start + n):
        example_seed = _example_seed(seed, index, stream)
        kind = kinds[index % len(kinds)]
        spec = random.Random(example_seed).choice(questions[kind])
        out.append(make_example(spec, example_seed, resolution))
    return out


def color_position_questions() -> list[QuestionSpec]:
    """"is the red object left of the blue object?" for every ordered pair of colours and every relation: 120
    train-only position questions. No held-out question names colours in a position question, so every pair can
    be asked in both directions, which the split cannot offer for shapes (a shape relation is held out with its
    mirror): what a model needs to learn that the answer follows the asked word, not the pair."""
    return [QuestionSpec("position", color=a, relation=r, other_color=b)
            for r in VQA_RELATIONS for a in COLORS for b in COLORS if a != b]


def sample_color_position(n: int, seed: int = 0, start: int = 0, resolution: int = RESOLUTION) -> list[VQAExample]:
    """``n`` training examples of :func:`color_position_questions`; example ``i`` depends only on ``(seed,
    start + i)`` (a stream of its own, apart from :func:`sample_vqa`'s)."""
    questions = color_position_questions()
    out = []
    for index in range(start, start + n):
        example_seed = _example_seed(seed, -1 - index)  # negative indices: never one of sample_vqa's seeds
        out.append(make_example(random.Random(example_seed).choice(questions), example_seed, resolution))
    return out


def vqa_eval_set(n: int = 500, seed: int = 4321, kinds: tuple[str, ...] = QUESTION_KINDS,
                 resolution: int = RESOLUTION, heldout: frozenset[str] | None = None) -> list[VQAExample]:
    """The fixed held-out evaluation set: the first ``n`` examples of the eval split's stream (kinds
    balanced: ``n / len(kinds)`` each). Built once per process (with its renderings): every evaluation of a
    run asks for the same set. With a named split (``heldout``) ask only :func:`heldout_kinds` (the others have
    no question of their own to hold out)."""
    return list(_eval_set(n, seed, tuple(kinds), resolution, heldout, "eval", ""))


def vqa_indist_eval_set(n: int = 500, seed: int = 4321, kinds: tuple[str, ...] = QUESTION_KINDS,
                        resolution: int = RESOLUTION, heldout: frozenset[str] | None = None) -> list[VQAExample]:
    """The in-distribution evaluation set: ``n`` training-split questions (of the split ``heldout`` names) on scenes
    of a stream of their own (``indist:``), which no training stream draws: the questions are known, the scenes
    new."""
    return list(_eval_set(n, seed, tuple(kinds), resolution, heldout, "train", "indist:"))


@lru_cache(maxsize=8)
def _eval_set(n: int, seed: int, kinds: tuple[str, ...], resolution: int, heldout, split: str,
              stream: str) -> tuple[VQAExample, ...]:
    return tuple(sample_vqa(split, n, seed=seed, kinds=kinds, resolution=resolution, heldout=heldout, stream=stream))


# ----------------------------------------------------------------------------- descriptions


def describe_objects(scene: Scene) -> str:
    """Every object of ``scene`` as ``colour shape``, in reading order: rows from the top (an object starts a
    new row when its centre is more than half the largest object size below the row's first), left to right
    within a row; comma-separated, e.g. ``"red circle , blue square"``.

    The dense perception target of supervised training (several supervised tokens per image where a
    question has one): it names each object's colour and shape and, through the order, where it is.
    """
    from flowrl.data.vqa_reasoning import reading_order

    return " , ".join(f"{o.color} {o.shape}" for o in reading_order(scene))


SCENE_QUESTION_KINDS = ("exists", "position", "count")


def scene_questions(scene: Scene, kinds: tuple[str, ...], rng: random.Random, split: str = "train",
                    heldout: frozenset[str] | None = None) -> list[tuple[str, str]]:
    """Further ``(question, answer)`` pairs about an already drawn ``scene``, one per kind of ``kinds`` that the
    scene can answer, asking only ``split``'s combinations (so training never asks a held-out one; ``heldout``: a
    named split, :func:`split_questions`).

    Dense supervision for the kinds that bind a colour to a shape or one shape to another: a scene drawn for
    one question answers many others, for the price of a few text tokens (the image is encoded once).

    - ``exists``: yes or no with equal chance; a "no" asks a pair that shares the colour or the shape of an
      object in the scene (the distractor rule of drawn ``exists`` scenes);
    - ``position``: two shapes drawn once each, a relation of the split between them; asked only when one
      relation or its opposite holds by the drawn questions' margin (half the largest object);
    - ``count``: a pair of the split that shares the colour or the shape of an object in the scene (0-3).
    """
    for kind in kinds:
        if kind not in SCENE_QUESTION_KINDS:
            raise ValueError(f"scene questions of kind {kind!r}: use {', '.join(SCENE_QUESTION_KINDS)}")
    return [(spec.text(), answer) for spec, answer in _scene_question_specs(scene, kinds, rng, split, heldout)]


FOLLOW_UP_KINDS = ("exists", "position", "count", "color", "shape")


def _scene_question_specs(scene: Scene, kinds: tuple[str, ...], rng: random.Random, split: str,
                          heldout: frozenset[str] | None,
                          balance_counts: bool = False) -> list[tuple[QuestionSpec, str]]:
    """:func:`scene_questions` as ``(spec, answer)``; ``kinds`` may also hold ``color`` ("what colour is the
    square?", asked of a shape drawn once) and ``shape`` (of a colour drawn once). ``balance_counts``: half the
    count questions ask a pair the scene shows (else 85% of them answer 0)."""
    objects = scene.objects
    present = {(o.color, o.shape) for o in objects}
    specs = split_questions(split, heldout)
    out = []
    for kind in kinds:
        if kind == "exists":
            yes = rng.random() < 0.5
            pool = [q for q in specs["exists"] if ((q.color, q.shape) in present) == yes
                    and any(q.color == c or q.shape == sh for c, sh in present)]
            if pool:
                q = rng.choice(pool)
                out.append((q, "yes" if (q.color, q.shape) in present else "no"))
        elif kind == "position":
            once = {sh for sh in SHAPES if sum(o.shape == sh for o in objects) == 1}
            margin = MAX_SIZE / 2 * scene.resolution / RESOLUTION
            pool = []
            for q in specs["position"]:
                if q.shape in once and q.other in once:
                    a = next(o for o in objects if o.shape == q.shape)
                    b = next(o for o in objects if o.shape == q.other)
                    if _holds(a, b, q.relation, margin):
                        pool.append((q, "yes"))
                    elif _holds(a, b, _OPPOSITE[q.relation], margin):
                        pool.append((q, "no"))
            if pool:
                yes = rng.random() < 0.5  # balance the answers where the scene allows both
                pool = [p for p in pool if (p[1] == "yes") == yes] or pool
                out.append(rng.choice(pool))
        elif kind == "count":
            pool = [q for q in specs["count"] if any(q.color == c or q.shape == sh for c, sh in present)]
            shown = [q for q in pool if (q.color, q.shape) in present]
            if balance_counts and shown and rng.random() < 0.5:
                pool = shown
            if pool:
                q = rng.choice(pool)
                out.append((q, str(sum(o.color == q.color and o.shape == q.shape for o in objects))))
        elif kind == "color":
            pool = [q for q in specs["color"] if sum(o.shape == q.shape for o in objects) == 1]
            if pool:
                q = rng.choice(pool)
                out.append((q, next(o.color for o in objects if o.shape == q.shape)))
        elif kind == "shape":
            pool = [q for q in specs["shape"] if sum(o.color == q.color for o in objects) == 1]
            if pool:
                q = rng.choice(pool)
                out.append((q, next(o.shape for o in objects if o.color == q.color)))
        else:
            raise ValueError(f"scene questions of kind {kind!r}: use {', '.join(FOLLOW_UP_KINDS)}")
    return out


def question_set(example: VQAExample, size: int, split: str = "train",
                 heldout: frozenset[str] | None = None) -> list[VQAExample]:
    """``example`` and ``size - 1`` further questions about its scene (:data:`FOLLOW_UP_KINDS`, a kind at a time in
    an order drawn per example), from ``split``'s questions; a pure function of the example's seed. No two ask about
    one combination ("how many red circles" and "is there a red circle", or a relation and its mirror, answer each
    other) unless the scene offers too few (then only the question texts differ). Each further question is a
    :class:`VQAExample` of the same scene and seed with its own spec and answer.

    Raises:
        RuntimeError: the scene answers fewer than ``size`` distinct questions (not met on training scenes up to 4
            questions: tested).
    """
    if size <= 1:
        return [example]
    rng = random.Random(f"question-set:{example.seed}")
    out = [example]
    for key in (_combination, QuestionSpec.text):  # distinct combinations first, then distinct questions
        asked = {key(q.spec) for q in out}
        for _ in range(12):
            order = list(FOLLOW_UP_KINDS)
            rng.shuffle(order)
            for kind in order:
                for spec, answer in _scene_question_specs(example.scene, (kind,), rng, split, heldout,
                                                          balance_counts=True):
                    if key(spec) not in asked and len(out) < size:
                        asked.add(key(spec))
                        follow = VQAExample(spec.text(), answer, spec.kind, example.scene, example.seed, spec)
                        follow.__dict__["_image"] = example.image()  # one rendering per scene
                        out.append(follow)
            if len(out) == size:
                return out
    raise RuntimeError(f"the scene of {example.question!r} (seed {example.seed}) answers only {len(out)} distinct "
                       f"questions, fewer than {size}")


# ----------------------------------------------------------------------------- answers


_PUNCT = re.compile(r"[\s.,!?;:'\"]+")


def normalize_answer(text: str) -> str:
    """Lower-case, trimmed, punctuation-free form of an answer; number words become digits
    (``"Two."`` -> ``"2"``), ``colour``/``color`` spellings agree. Used by exact-match rewards."""
    words = [w for w in _PUNCT.split(text.strip().lower()) if w]
    words = [_NUMBER_WORDS.get(w, w) if len(words) == 1 else w for w in words]
    return " ".join(words)


def answer_vocabulary() -> list[str]:
    """Every canonical answer."""
    return [str(n) for n in COUNT_ANSWERS] + list(COLORS) + list(SHAPES) + ["yes", "no"]


def question_words() -> list[str]:
    """Every word of every question (for word-level tokenizers), in a fixed order."""
    words: list[str] = []
    for specs in all_questions().values():
        for spec in specs:
            words += re.findall(r"[a-z]+|\?", spec.text())
    return list(dict.fromkeys(words))
