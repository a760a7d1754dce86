"""Reasoning answers for Shapes-VQA: ``<think> TRACE </think> <answer> ANSWER </answer>``, the layout R1-style
VLM recipes train (EasyR1, verl), where the trace is a short program over the scene that every question kind
shares.

Why a trace. A tiny VLM trained from scratch on one-token answers learns colour and shape (copying an attribute
of the attended object) but never the kinds that *bind* two things: "is there a green triangle?" when the scene
holds a green square and a red triangle, counts of one colour-shape pair among look-alikes, and "left of". On the
shipped model's data their loss stays at chance for 900 steps (2026-12-03, 12-04 diagnostics: exists at ln 2 after
500 steps whatever the layout or learning rate). A trace splits each binding into steps a small transformer learns
quickly, each supervised: perception writes the scene as text, then every step is a single-attribute lookup or a
copy over that text:

1. every object in reading order as one *object token* and its 4-px cell, ``green_triangle 2 6``: perception, with
   the colour-shape binding made by the model's own output vocabulary (one token per pair) and positions as
   digits (the cell of the object's centre on the 32 px canvas, column then row);
2. the objects the question is about, by one attribute at a time:

   - ``count`` / ``exists`` "... green triangle(s)": ``green : <the green objects> ; triangle : <those that are
     triangles>`` (``none`` for an empty step), the answer the number of the last step's objects / whether any;
   - ``shape`` "what shape is the blue object?": ``blue : <the blue object>``;
   - ``color`` "what colour is the square?": ``square : <the square>``;
   - ``position`` "is the circle left of the triangle?": the two objects in the question's order, then the
     relation that holds between them on the asked axis and the asked one, ``blue_circle 2 4 , red_triangle 6 5 ;
     left left``; the answer is yes when the two words agree. The trace never reorders the pair by the relation:
     such a canonical order would be a function of the pair and the relation together, and the held-out split (a
     relation with its mirror) is exactly where a model that learned it per pair inverts (measured: 2% on held-out
     position questions). The asked word is copied next to the one that holds for the same reason: with the asked
     relation only in the question, the model learned the answer per pair and stated relation (each pair's axis
     is asked one way only in training) and said "no" to 91% of the held-out position questions even where the
     relation it wrote was the asked one (2026-12-04); two adjacent words that agree or not is a rule for every
     pair. Alone it was not enough (0.45 held-out, 0.57 on training questions, the second word mostly copying the
     first); with train-only position questions by colour, which ask every pair both ways
     (``flowrl.data.vqa.sample_color_position``), the shipped model answers 0.67 held-out.

Every answer follows from its trace (tested), and the trace from the scene alone.
"""

from __future__ import annotations

from flowrl.data.shapes import COLORS, RESOLUTION, SHAPES, Scene, SceneObject

__all__ = ["CELL", "object_token", "reading_order", "scene_trace", "reasoning_trace", "reasoning_answer",
           "reasoning_words", "answer_from_trace", "scene_entries", "parse_listing", "scene_f1", "step_checks",
           "RELATION_WORD"]

CELL = 4  # pixels per coordinate step on the 32 px canvas: digits 0-7 (position questions' pairs differ by >= 5 px)
RELATION_WORD = {"left of": "left", "right of": "right", "above": "above", "below": "below"}


def object_token(color: str, shape: str) -> str:
    """The one-token name of a colour-shape pair, e.g. ``green_triangle``."""
    return f"{color}_{shape}"


def reading_order(scene: Scene) -> list[SceneObject]:
    """The scene's objects in reading order: rows from the top (an object starts a new row when its centre is more
    than half the largest object size below the row's first), left to right within a row."""
    from flowrl.data.shapes import MAX_SIZE

    band = MAX_SIZE * scene.resolution / RESOLUTION / 2
    rows: list[list[SceneObject]] = []
    for obj in sorted(scene.objects, key=lambda o: (o.cy, o.cx)):
        if rows and obj.cy - rows[-1][0].cy <= band:
            rows[-1].append(obj)
        else:
            rows.append([obj])
    return [o for row in rows for o in sorted(row, key=lambda o: o.cx)]


def _cell(obj: SceneObject, scene: Scene) -> tuple[int, int]:
    """``(column, row)``: the 4-px cell of the object's centre on the 32 px canvas."""
    scale = RESOLUTION / scene.resolution
    last = RESOLUTION // CELL - 1
    column, row = (min(last, int(c * scale // CELL)) for c in (obj.cx, obj.cy))
    return column, row


def _entry(obj: SceneObject, scene: Scene) -> str:
    """``colour_shape column row``: the object's token and its cell."""
    column, row = _cell(obj, scene)
    return f"{object_token(obj.color, obj.shape)} {column} {row}"


def _listing(objects: list[SceneObject], scene: Scene) -> str:
    return " , ".join(_entry(o, scene) for o in objects) or "none"


def scene_trace(scene: Scene) -> str:
    """Step 1 of every trace: all objects in reading order with their cells."""
    return _listing(reading_order(scene), scene)


def reasoning_trace(example) -> str:
    """The trace of a :class:`flowrl.data.vqa.VQAExample` (see the module docstring)."""
    scene, spec = example.scene, example.spec
    objects = reading_order(scene)
    steps = [scene_trace(scene)]
    if spec.kind in ("count", "exists"):
        by_color = [o for o in objects if o.color == spec.color]
        steps.append(f"{spec.color} : {_listing(by_color, scene)}")
        steps.append(f"{spec.shape} : {_listing([o for o in by_color if o.shape == spec.shape], scene)}")
    elif spec.kind == "shape":
        steps.append(f"{spec.color} : {_listing([o for o in objects if o.color == spec.color], scene)}")
    elif spec.kind == "color":
        steps.append(f"{spec.shape} : {_listing([o for o in objects if o.shape == spec.shape], scene)}")
    elif spec.kind == "position":
        if spec.color is not None:  # by colour (train-only questions): the pair's colours are drawn once each
            first = next(o for o in objects if o.color == spec.color)
            second = next(o for o in objects if o.color == spec.other_color)
        else:
            first = next(o for o in objects if o.shape == spec.shape)
            second = next(o for o in objects if o.shape == spec.other)
        if spec.relation in ("left of", "right of"):
            holds = "left" if first.cx < second.cx else "right"
        else:  # rows grow downwards
            holds = "above" if first.cy < second.cy else "below"
        steps.append(f"{_entry(first, scene)} , {_entry(second, scene)}")
        steps.append(f"{holds} {RELATION_WORD[spec.relation]}")
    else:
        raise ValueError(f"no reasoning trace for question kind {spec.kind!r}")
    return " ; ".join(steps)


def reasoning_answer(example) -> str:
    """The assistant's whole reasoning turn: ``<think> TRACE </think> <answer> ANSWER </answer>``."""
    return f"<think> {reasoning_trace(example)} </think> <answer> {example.answer} </answer>"


def answer_from_trace(spec, trace: str) -> str | None:
    """What a reader of ``trace`` alone answers to the question ``spec`` (a :class:`~flowrl.data.vqa.QuestionSpec`):
    the number of the last step's objects, whether there are any, the attribute of its one object, or whether the
    relation that holds is the asked one. ``None`` when the trace does not read the question (a lookup by another
    attribute than the question's, another asked relation) or cannot be parsed; a generated trace may join a comma
    to the word before it, which is accepted."""
    steps = [step.strip() for step in trace.split(";")]
    last = steps[-1]
    if spec.kind == "position":
        words = last.split()
        if len(words) != 2 or words[1] != RELATION_WORD[spec.relation]:
            return None
        return "yes" if words[0] == words[1] else "no"
    labels = {"count": (spec.color, spec.shape), "exists": (spec.color, spec.shape), "shape": (spec.color,),
              "color": (spec.shape,)}.get(spec.kind)
    if labels is None or len(steps) < len(labels) + 1:
        return None
    lookups = [step.split(":", 1) for step in steps[-len(labels):]]
    if any(len(parts) != 2 or parts[0].strip() != label for parts, label in zip(lookups, labels)):
        return None
    listed = lookups[-1][1].strip()
    entries = [] if listed == "none" else [e.split()[0] for e in listed.split(",") if e.split()]
    if spec.kind == "count":
        return str(len(entries))
    if spec.kind == "exists":
        return "yes" if entries else "no"
    if len(entries) != 1 or entries[0].count("_") != 1:  # a colour or shape question is about one object
        return None
    color, shape = entries[0].split("_")
    return shape if spec.kind == "shape" else color


def reasoning_words() -> list[str]:
    """Every word a trace uses beyond the questions' and answers' (for word-level tokenizers)."""
    return ([object_token(c, s) for c in COLORS for s in SHAPES] + [str(i) for i in range(RESOLUTION // CELL)]
            + ["none", ";", ":", ","] + list(RELATION_WORD.values()))


def scene_entries(scene: Scene) -> list[tuple[str, int, int]]:
    """The scene's objects as the trace's first step lists them: ``(token, column, row)`` in reading order."""
    return [(object_token(o.color, o.shape), *_cell(o, scene)) for o in reading_order(scene)]


def parse_listing(text: str) -> list[tuple[str, int | None, int | None]]:
    """The entries of a listing (``"red_circle 2 4 , blue_square 6 5"``) as ``(token, column, row)``; a cell that is
    missing or not a number is ``None``; ``none`` is the empty listing. A comma joined to the word before it (as a
    generated trace may write it) is accepted."""
    entries = []
    for part in text.replace(",", " , ").split(","):
        words = part.split()
        if not words or words == ["none"]:
            continue
        cell = [int(w) if w.isdigit() else None for w in words[1:3]] + [None, None]
        entries.append((words[0], cell[0], cell[1]))
    return entries


def scene_f1(trace: str, scene: Scene, tolerance: int = 1) -> float:
    """How well the trace's first step (the perception step) lists ``scene``: the F1 of its entries against the
    scene's objects, an entry matching an unmatched object of the same colour-shape token whose cell is within
    ``tolerance`` cells on both axes (matched nearest first). 0 for an empty trace; 1 for an exact listing."""
    truth = scene_entries(scene)
    listed = parse_listing(trace.split(";", 1)[0])
    if not truth and not listed:
        return 1.0
    candidates = sorted(
        (max(abs(c - tc), abs(r - tr)), i, j)
        for i, (token, c, r) in enumerate(listed) if c is not None and r is not None
        for j, (true_token, tc, tr) in enumerate(truth)
        if token == true_token and abs(c - tc) <= tolerance and abs(r - tr) <= tolerance)
    used_listed, used_truth = set(), set()
    for _, i, j in candidates:
        if i not in used_listed and j not in used_truth:
            used_listed.add(i)
            used_truth.add(j)
    return 2.0 * len(used_truth) / (len(listed) + len(truth))


def _attribute(token: str, which: int) -> str | None:
    """The colour (``which`` 0) or shape (1) of an object token; None for a word that is not one."""
    parts = token.split("_")
    return parts[which] if len(parts) == 2 else None


def _lookup_step(step: str) -> tuple[str, list] | None:
    """``"green : green_circle 1 3 , ..."`` as ``("green", entries)``; None when the step is not a lookup."""
    label, sep, listed = step.partition(":")
    return (label.strip(), parse_listing(listed)) if sep else None


def step_checks(spec, trace: str) -> list[bool]:
    """The reasoning checks of a trace, each step judged against the trace's *own* step before it (not the scene:
    :func:`scene_f1` judges perception): every lookup keeps exactly the objects of the previous step that have the
    looked-up attribute; a position trace's pair is the first object of each asked shape (or colour) in its listing,
    and its relation word the one the pair's written cells give. 2 checks for count / exists / position, 1 for shape /
    colour; a missing step fails its check. The ``consistent`` reward adds whether the answer is what the trace says
    (:func:`answer_from_trace`): a process reward for the steps after perception (the shipped model lists 60% of the
    held-out scenes exactly and still answers a fifth of those wrong, from lookups that drop or swap objects;
    2026-12-05)."""
    steps = [step.strip() for step in trace.split(";")]
    listing = parse_listing(steps[0])
    checks: list[bool] = []
    if spec.kind in ("count", "exists", "shape", "color"):
        lookups = {"count": [(spec.color, 0), (spec.shape, 1)], "exists": [(spec.color, 0), (spec.shape, 1)],
                   "shape": [(spec.color, 0)], "color": [(spec.shape, 1)]}[spec.kind]
        previous = listing
        for index, (label, which) in enumerate(lookups, start=1):
            step = _lookup_step(steps[index]) if index < len(steps) else None
            expected = [e for e in previous if _attribute(e[0], which) == label]
            checks.append(step is not None and step == (label, expected))
            previous = step[1] if step is not None else expected
    elif spec.kind == "position":
        def first(value, which):
            return next((e for e in listing if _attribute(e[0], which) == value), None)

        which = 0 if spec.color is not None else 1
        pair = [first(spec.color, 0), first(spec.other_color, 0)] if which == 0 else \
            [first(spec.shape, 1), first(spec.other, 1)]
        written = parse_listing(steps[1]) if len(steps) > 1 else []
        checks.append(None not in pair and written == pair)
        words = steps[2].split() if len(steps) > 2 else []
        asked = RELATION_WORD[spec.relation]
        axis = 1 if asked in ("left", "right") else 2
        holds = None
        if len(written) == 2 and None not in (written[0][axis], written[1][axis]):
            low, high = ("left", "right") if axis == 1 else ("above", "below")
            a, b = written[0][axis], written[1][axis]
            holds = {low, high} if a == b else {low if a < b else high}  # one cell: either word is consistent
        checks.append(len(words) == 2 and holds is not None and words[0] in holds and words[1] == asked)
    else:
        raise ValueError(f"no reasoning trace for question kind {spec.kind!r}")
    return checks
