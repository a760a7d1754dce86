"""The shapes world: coloured circles, squares and triangles on a white canvas, a GenEval-style prompt
grammar, a deterministic anti-aliased renderer and train / eval prompt splits.

It is flowrl's embedded task: small enough that a CPU trains a text-to-image model on it in minutes,
rich enough to have GenEval's task kinds, and verifiable (``rewards/shapes.py`` checks an image against
its prompt).

Task kinds and their prompts::

    single_object      "a circle"
    two_object         "a circle and a square"
    counting           "three green triangles"
    colors             "a red circle"
    position           "a yellow square left of a red circle"
    color_attr         "a red circle and a blue square"

Splits: every prompt of the grammar belongs to exactly one split, chosen by a stable hash, so the eval
split holds combinations (of shapes, colours, counts and relations) that no training prompt names.
The exception is ``single_object``, whose three prompts have no combination to hold out: they belong to
both splits (the eval table reports them separately, so nothing is hidden).
"""

from __future__ import annotations

from flowrl.errors import FlowrlError

import hashlib
import json
import math
import random
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw

__all__ = [
    "SHAPES", "COLORS", "PALETTE", "BACKGROUND", "RELATIONS", "TASK_KINDS", "NUMBER_WORDS",
    "ObjectSpec", "PromptSpec", "SceneObject", "Scene", "PromptParseError",
    "parse_prompt", "all_prompt_specs", "split_prompts", "scene_for_prompt", "render",
    "render_batch", "describe_scene", "sample_examples", "eval_prompt_set", "prompt_rows",
    "RESOLUTION", "MIN_SIZE", "MAX_SIZE",
]

RESOLUTION = 32  # pixels per side of the model's images
MIN_SIZE, MAX_SIZE = 9, 12  # object extent in pixels
SUPERSAMPLE = 8  # drawn at 8x and box-filtered down: anti-aliased edges

SHAPES = ("circle", "square", "triangle")
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 225),
    "yellow": (235, 200, 30),
    "purple": (150, 60, 200),
    "cyan": (30, 190, 210),
}
COLORS = tuple(PALETTE)
BACKGROUND = (255, 255, 255)
RELATIONS = ("left of", "right of", "above", "below")
NUMBER_WORDS = {2: "two", 3: "three", 4: "four"}
TASK_KINDS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
EVAL_FRACTION = 0.25


class PromptParseError(FlowrlError, ValueError):
    """A prompt is outside the shapes grammar; the message shows the grammar's forms."""


# ----------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class ObjectSpec:
    """One object phrase of a prompt: ``count`` objects of ``shape``, optionally of ``color``."""

    shape: str
    color: str | None = None
    count: int = 1

    def phrase(self) -> str:
        color = f"{self.color} " if self.color else ""
        if self.count == 1:
            return f"a {color}{self.shape}"
        return f"{NUMBER_WORDS[self.count]} {color}{self.shape}s"


@dataclass(frozen=True)
class PromptSpec:
    """A parsed prompt: its task kind, its object phrases and (for ``position``) the relation
    ``objects[0] <relation> objects[1]``."""

    kind: str
    objects: tuple[ObjectSpec, ...]
    relation: str | None = None

    @property
    def named_total(self) -> int:
        """How many objects the prompt names: ``"a red circle"`` 1, ``"three green triangles"`` 3, ``"a circle and
        a square"`` 2."""
        return sum(obj.count for obj in self.objects)

    def text(self) -> str:
        if self.kind == "position":
            return f"{self.objects[0].phrase()} {self.relation} {self.objects[1].phrase()}"
        return " and ".join(o.phrase() for o in self.objects)


_NUM = "|".join(NUMBER_WORDS.values())
_COL = "|".join(COLORS)
_SHP = "|".join(SHAPES)
_OBJ = (rf"(?:a (?:(?P<{{p}}c>{_COL}) )?(?P<{{p}}s>{_SHP})"
        rf"|(?P<{{p}}n>{_NUM}) (?:(?P<{{p}}nc>{_COL}) )?(?P<{{p}}ns>{_SHP})s)")
_PROMPT_RE = re.compile(
    rf"^(?P<a>{_OBJ.format(p='a')})"
    rf"(?:(?P<and> and )(?P<b>{_OBJ.format(p='b')})|(?P<rel> (?:{'|'.join(RELATIONS)}) )(?P<c>{_OBJ.format(p='c')}))?$"
)
_WORD_TO_NUM = {w: n for n, w in NUMBER_WORDS.items()}

GRAMMAR_HELP = (
    "prompts of the shapes world look like: 'a circle', 'a red circle', 'three green triangles', "
    "'a circle and a square', 'a red circle and a blue square', 'a yellow square left of a red circle' "
    f"(shapes: {', '.join(SHAPES)}; colours: {', '.join(COLORS)}; counts: {', '.join(NUMBER_WORDS.values())}; "
    f"relations: {', '.join(RELATIONS)})"
)


def _object_from_match(match: re.Match, p: str) -> ObjectSpec:
    if match.group(f"{p}s"):
        return ObjectSpec(match.group(f"{p}s"), match.group(f"{p}c"), 1)
    return ObjectSpec(match.group(f"{p}ns"), match.group(f"{p}nc"), _WORD_TO_NUM[match.group(f"{p}n")])


def parse_prompt(prompt: str) -> PromptSpec:
    """Parse a prompt of the shapes grammar (case, repeated spaces, surrounding space and a final full stop
    ignored).

    Raises:
        PromptParseError: the prompt is not in the grammar (the message lists its forms).
    """
    text = " ".join(prompt.strip().lower().rstrip(".").split())
    try:
        return _parse_normalised(text)
    except _NotInGrammar as why:
        raise PromptParseError(f"cannot parse prompt {prompt[:200]!r}{'...' if len(prompt) > 200 else ''}: "
                               f"{why}") from None


class _NotInGrammar(Exception):
    pass


# Keyed by the normalised text and caching only prompts of the grammar (a finite set of short strings; failures
# are not cached), so requests to a reward server cannot grow it with case or spacing variants of long prompts.
@lru_cache(maxsize=4096)
def _parse_normalised(text: str) -> PromptSpec:
    match = _PROMPT_RE.match(text)
    if match is None:
        raise _NotInGrammar(GRAMMAR_HELP)
    first = _object_from_match(match, "a")
    if match.group("b"):
        second = _object_from_match(match, "b")
        if first.count != 1 or second.count != 1:
            raise _NotInGrammar(f"counts only appear alone ('three green triangles'); {GRAMMAR_HELP}")
        kind = "color_attr" if first.color and second.color else "two_object"
        if bool(first.color) != bool(second.color):
            raise _NotInGrammar("give both objects a colour or neither")
        return PromptSpec(kind, (first, second))
    if match.group("c"):
        second = _object_from_match(match, "c")
        if first.count != 1 or second.count != 1:
            raise _NotInGrammar("relations take single objects")
        return PromptSpec("position", (first, second), match.group("rel").strip())
    if first.count > 1:
        return PromptSpec("counting", (first,))
    return PromptSpec("colors" if first.color else "single_object", (first,))


def all_prompt_specs() -> dict[str, list[PromptSpec]]:
    """Every prompt of the grammar, by task kind, in a fixed order."""
    colored = [(c, s) for s in SHAPES for c in COLORS]
    specs = {
        "single_object": [PromptSpec("single_object", (ObjectSpec(s),)) for s in SHAPES],
        "two_object": [PromptSpec("two_object", (ObjectSpec(a), ObjectSpec(b)))
                       for a in SHAPES for b in SHAPES if a != b],
        "counting": [PromptSpec("counting", (ObjectSpec(s, c, n),)) for n in NUMBER_WORDS for c, s in colored],
        "colors": [PromptSpec("colors", (ObjectSpec(s, c),)) for c, s in colored],
        "position": [PromptSpec("position", (ObjectSpec(s1, c1), ObjectSpec(s2, c2)), rel)
                     for rel in RELATIONS for c1, s1 in colored for c2, s2 in colored if s1 != s2],
        "color_attr": [PromptSpec("color_attr", (ObjectSpec(s1, c1), ObjectSpec(s2, c2)))
                       for c1, s1 in colored for c2, s2 in colored if s1 != s2 and c1 != c2],
    }
    return specs


def _in_eval_split(spec: PromptSpec) -> bool:
    digest = hashlib.sha256(f"shapes-split-v1:{spec.text()}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < EVAL_FRACTION


@lru_cache(maxsize=2)
def split_prompts(split: str) -> dict[str, tuple[PromptSpec, ...]]:
    """The prompts of ``split`` (``train`` or ``eval``) by task kind.

    ``two_object`` has only 6 prompts, so it is split by unordered pair instead of by hash: the eval
    split holds the reversed orders of the train prompts' pairs ("a square and a circle").
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    out = {}
    for kind, specs in all_prompt_specs().items():
        if kind == "single_object":
            chosen = specs
        elif kind == "two_object":
            chosen = [s for s in specs if (SHAPES.index(s.objects[0].shape) < SHAPES.index(s.objects[1].shape))
                      == (split == "train")]
        else:
            chosen = [s for s in specs if _in_eval_split(s) == (split == "eval")]
        out[kind] = tuple(chosen)
    return out


# ----------------------------------------------------------------------------- scenes


@dataclass(frozen=True)
class SceneObject:
    """A drawn object: ``cx, cy`` its centre in pixels, ``size`` its extent in pixels."""

    shape: str
    color: str
    cx: float
    cy: float
    size: float


@dataclass(frozen=True)
class Scene:
    objects: tuple[SceneObject, ...]
    resolution: int = RESOLUTION

    def to_json(self) -> str:
        return json.dumps({"resolution": self.resolution, "objects": [asdict(o) for o in self.objects]})

    @staticmethod
    def from_json(text: str) -> "Scene":
        data = json.loads(text)
        return Scene(tuple(SceneObject(**o) for o in data["objects"]), data["resolution"])


def _relation_holds(a: SceneObject, b: SceneObject, relation: str, margin: float) -> bool:
    """``a <relation> b`` with image coordinates (y grows downwards)."""
    dx, dy = b.cx - a.cx, b.cy - a.cy
    return {"left of": dx > margin, "right of": -dx > margin, "above": dy > margin, "below": -dy > margin}[relation]


def _place(rng: random.Random, sizes: list[float], resolution: int, gap: float = 2.0,
           tries: int = 200) -> list[tuple[float, float]] | None:
    """Random centres for objects of ``sizes`` inside the canvas with at least ``gap`` px between boxes."""
    centres: list[tuple[float, float]] = []
    for size in sizes:
        half = size / 2
        for _ in range(tries):
            cx = rng.uniform(half + 1, resolution - half - 1)
            cy = rng.uniform(half + 1, resolution - half - 1)
            if all(max(abs(cx - x) - (half + s / 2), abs(cy - y) - (half + s / 2)) >= gap
                   for (x, y), s in zip(centres, sizes)):
                centres.append((cx, cy))
                break
        else:
            return None
    return centres


def scene_for_prompt(spec: PromptSpec | str, rng: random.Random, resolution: int = RESOLUTION) -> Scene:
    """A random scene that satisfies ``spec``: exactly the objects it names, colours drawn at random
    where the prompt gives none, positions random but consistent with its relation."""
    if isinstance(spec, str):
        spec = parse_prompt(spec)
    scale = resolution / RESOLUTION
    for _ in range(1000):
        objects = []
        for obj in spec.objects:
            color = obj.color or rng.choice(COLORS)
            for _ in range(obj.count):  # counted objects share one colour, as the prompt says
                objects.append((obj.shape, color, rng.uniform(MIN_SIZE, MAX_SIZE) * scale))
        centres = _place(rng, [o[2] for o in objects], resolution)
        if centres is None:
            continue
        scene = Scene(tuple(SceneObject(s, c, x, y, size) for (s, c, size), (x, y) in zip(objects, centres)),
                      resolution)
        # Rendered relations are unambiguous: the centres differ by at least half an object along the axis.
        if spec.relation and not _relation_holds(scene.objects[0], scene.objects[1], spec.relation,
                                                 margin=MAX_SIZE * scale / 2):
            continue
        return scene
    raise RuntimeError(f"could not place the objects of {spec.text()!r}")  # not reachable for the grammar


def describe_scene(scene: Scene, kind: str, rng: random.Random) -> PromptSpec:
    """A prompt of task ``kind`` that is true of ``scene`` (used for grammar round trips)."""
    objs = scene.objects
    if kind == "single_object":
        return PromptSpec(kind, (ObjectSpec(rng.choice(objs).shape),))
    if kind == "colors":
        o = rng.choice(objs)
        return PromptSpec(kind, (ObjectSpec(o.shape, o.color),))
    if kind == "counting":
        groups: dict[tuple[str, str], int] = {}
        for o in objs:
            groups[(o.shape, o.color)] = groups.get((o.shape, o.color), 0) + 1
        options = [(k, n) for k, n in groups.items() if n >= 2]
        if not options:
            raise ValueError("scene has no group of two or more identical objects to count")
        (shape, color), n = rng.choice(sorted(options))
        return PromptSpec(kind, (ObjectSpec(shape, color, n),))
    pairs = [(a, b) for a in objs for b in objs if a.shape != b.shape]
    if kind in ("two_object", "color_attr"):
        if kind == "color_attr":
            pairs = [(a, b) for a, b in pairs if a.color != b.color]
        if not pairs:
            raise ValueError(f"scene has no pair of objects for {kind}")
        a, b = rng.choice(pairs)
        color = kind == "color_attr"
        return PromptSpec(kind, (ObjectSpec(a.shape, a.color if color else None),
                                 ObjectSpec(b.shape, b.color if color else None)))
    if kind == "position":
        options = [(a, b, r) for a, b in pairs for r in RELATIONS if _relation_holds(a, b, r, margin=MAX_SIZE / 2)]
        if not options:
            raise ValueError("scene has no clear relative position")
        a, b, r = rng.choice(options)
        return PromptSpec(kind, (ObjectSpec(a.shape, a.color), ObjectSpec(b.shape, b.color)), r)
    raise ValueError(f"unknown task kind {kind!r}; valid: {', '.join(TASK_KINDS)}")


# ----------------------------------------------------------------------------- rendering


def _polygon(obj: SceneObject, k: float) -> list[tuple[float, float]] | None:
    cx, cy, h = obj.cx * k, obj.cy * k, obj.size * k / 2
    if obj.shape == "square":
        return [(cx - h, cy - h), (cx + h, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
    if obj.shape == "triangle":  # apex up, base and height both `size`
        return [(cx, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
    return None


def render(scene: Scene) -> np.ndarray:
    """Draw ``scene`` anti-aliased: ``[H, W, 3]`` uint8 (drawn at 8x and box-filtered down)."""
    k = SUPERSAMPLE
    size = scene.resolution * k
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for obj in scene.objects:
        fill = PALETTE[obj.color]
        polygon = _polygon(obj, k)
        if polygon is None:
            h = obj.size * k / 2
            draw.ellipse([obj.cx * k - h, obj.cy * k - h, obj.cx * k + h, obj.cy * k + h], fill=fill)
        else:
            draw.polygon(polygon, fill=fill)
    small = image.resize((scene.resolution, scene.resolution), Image.Resampling.BOX)
    return np.asarray(small, dtype=np.uint8)


def render_batch(scenes: list[Scene]):
    """Render scenes to a ``[B, 3, H, W]`` float32 tensor in [0, 1]."""
    import torch

    array = np.stack([render(s) for s in scenes]).astype(np.float32) / 255.0
    return torch.from_numpy(array).permute(0, 3, 1, 2).contiguous()


# ----------------------------------------------------------------------------- datasets


@dataclass
class Example:
    prompt: str
    kind: str
    scene: Scene
    image: np.ndarray = field(repr=False)  # [H, W, 3] uint8


def _example_rng(seed: int, index: int) -> random.Random:
    return random.Random(hashlib.sha256(f"{seed}:{index}".encode()).digest())


def sample_examples(split: str, n: int, seed: int = 0, start: int = 0,
                    kinds: tuple[str, ...] = TASK_KINDS) -> list[Example]:
    """``n`` rendered (prompt, scene, image) examples of ``split``.

    Example ``i`` depends only on ``(seed, start + i)``: task kinds cycle uniformly, and the prompt,
    colours, sizes and positions are drawn from a generator seeded by the index, so any range of a
    stream can be regenerated on its own (exact resume of pretraining).
    """
    prompts = split_prompts(split)
    out = []
    for index in range(start, start + n):
        rng = _example_rng(seed, index)
        kind = kinds[index % len(kinds)]
        spec = rng.choice(prompts[kind])
        scene = scene_for_prompt(spec, rng)
        out.append(Example(spec.text(), kind, scene, render(scene)))
    return out


def prompt_rows(split: str, n: int = 600, seed: int = 1234) -> list[tuple[str, str, int]]:
    """``n`` fixed (prompt, kind, seed) rows of ``split``, balanced over task kinds (they cycle), each
    prompt drawn by a generator seeded by the row index and given its own sampling seed."""
    prompts = split_prompts(split)  # raises for an unknown split
    rows = []
    for index in range(n):
        rng = _example_rng(seed, index)
        kind = TASK_KINDS[index % len(TASK_KINDS)]
        rows.append((rng.choice(prompts[kind]).text(), kind, index + seed * 100_000))
    return rows


def eval_prompt_set(n: int = 600, seed: int = 1234) -> list[tuple[str, str, int]]:
    """The fixed held-out evaluation set: the first ``n`` rows of the eval split (see :func:`prompt_rows`)."""
    return prompt_rows("eval", n, seed)


def scene_area_fraction(scene: Scene) -> float:
    """Fraction of the canvas the scene's objects cover (diagnostics)."""
    area = {"circle": math.pi / 4, "square": 1.0, "triangle": 0.5}
    return sum(area[o.shape] * o.size**2 for o in scene.objects) / scene.resolution**2
