"""The ``shapes`` reward: a verifiable reward for the shapes world, and its gold judge.

It parses the prompt into constraints, detects the objects in the image (colour, shape, count,
position) and scores the fraction of constraints met.

**The gold: strict accuracy** (``details["correct"]``, :func:`strict_correct`; ``eval/shapes/accuracy``). An image is
correct when every constraint of its prompt is met, each object phrase is matched by exactly its count of
detections (by shape, and colour where given), nothing else is drawn, and for a ``position`` prompt the relation
holds between the one A and the one B. This is the rule a person applies ("a red triangle" drawn as three red
triangles is wrong), and what the project ranks trainers and chooses ``make demo`` by.

**The lenient rule** (``details["lenient"]``, ``eval/shapes/lenient_accuracy``): every constraint met, read as
"exists": a colour holds if *any* object of that shape has it, a relation if *any* (A, B) pair satisfies it, and
objects the prompt did not ask for are ignored. It has two loopholes a policy learns to use: duplicates satisfy
relations (random layouts pass a relation 0.43 of the time with one A and one B, 0.88 with two of each) and
colours (draw every colour and one is right), and extra objects cost nothing. It is reported beside the gold as a
proxy, never as the result.

Constraints per object phrase of the prompt: the shape is present; if the phrase has a colour, an
object of that shape has that colour; if it has a count, exactly that many objects of that shape and
colour. A ``position`` prompt adds the relation between its two objects.

``count_mode`` chooses how a wrong count is scored. ``partial`` (default) counts each constraint on its
own, so "three green triangles" drawn as one green triangle still earns 2/3: a policy can trade the count
away for the easier shape and colour credit. ``strict`` fails every constraint of an object phrase
whose count is wrong, so a wrong count is never worth more than a right one (counts only appear in
``counting`` prompts, whose score becomes all-or-nothing; other prompts score as in ``partial``).
``details["correct"]`` is the same in both modes.

``no_extra_objects=True`` adds one constraint to every prompt: the image has no object beyond the ones the prompt
names (``"a red circle"`` names 1, ``"three green triangles"`` 3). Without it the reward pays in full for two red
circles drawn for "a red circle", and policies learn to add objects (the hacking panel's ``hack/extra_object_rate``).
With it, a score of 1 is exactly a strict-correct image: the reward's optimum is the gold. A list of task kinds
(e.g. ``[counting]``) adds it to those kinds' prompts only, and ``extra_objects_weight`` sets how many constraints it
counts as (default 1; 0.5 makes it half a constraint, a softer guard).

``all_met_share`` pays that share of the score only when every scored constraint is met (the guard included), and
the rest as the fraction met: 0 (default) is the fraction alone, 1 the all-or-nothing accuracy itself. Fractions
give a policy credit for the easy constraints of a prompt (shapes and colours) and little for the hard ones (a
relation is 1 of 5 constraints of a position prompt); the all-or-nothing share pays for the whole prompt.

``relation_weight`` (default 1) sets how many constraints a position prompt's relation counts as: the relation is one
constraint of five (six with the guard), so a policy can earn most of a position prompt's score while ignoring it.

``relation_ramp`` (pixels; default None) makes the relation constraint dense when exactly one A and one B are
detected: instead of 0 or 1 it earns ``clip((d - POSITION_MARGIN + ramp) / ramp, 0, 1)``, ``d`` the signed distance
between their centres along the asked axis (positive in the asked direction). A relation that holds still earns
1; one that fails earns credit for moving the objects the right way, which a 0/1 relation never pays.

**Touching objects merge.** Two objects of one colour that touch form one connected blob and are detected as one
object (of whichever shape the blob's cumulants say). Measured 2026-12-07 on 300 rendered, correct counting scenes of
the eval split whose closest two bounding boxes are less than 1 px apart: 0.497 judged strict-correct, against 1.000
for 300 with the world's gap of at least 2 px (:func:`flowrl.data.shapes.scene_for_prompt`). A policy that draws
touching objects is under-counted, never paid for it.

Detection (no learned model): every pixel is explained as a blend ``bg + alpha (c - bg)`` of the white
background and the palette colour ``c`` that fits it best; pixels with ``alpha > 0.5`` form connected
components per colour. A component's shape comes from blur-robust soft measurements over the pixels
nearest to it: cumulants of the soft mask, which a Gaussian blur changes only in the second order.
The apex-up triangle has a strongly skewed vertical profile; a square's fourth cumulant along the
diagonals is half that along the axes, a circle's is the same in every direction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy import ndimage

from flowrl.data.shapes import BACKGROUND, PALETTE, TASK_KINDS, PromptParseError, PromptSpec, parse_prompt

from .base import Reward, RewardError, RewardOutput
from .registry import register_reward

__all__ = ["COUNT_MODES", "Detection", "detect_objects", "constraints_met", "extra_objects", "strict_correct",
           "relation_distance", "ShapesReward"]

COUNT_MODES = ("partial", "strict")

_COLOR_NAMES = list(PALETTE)
_COLOR_VECTORS = (np.array([PALETTE[c] for c in _COLOR_NAMES], dtype=np.float32) - np.array(BACKGROUND)) / 255.0
_COLOR_NORM2 = (_COLOR_VECTORS**2).sum(1)  # [K]
_BG = np.array(BACKGROUND, dtype=np.float32) / 255.0

# Shape thresholds, midway between the classes' measured ranges on 300 eval scenes, clean and with
# pixel noise (std 0.05) plus a Gaussian blur of 1 px: triangle skew -0.59..-0.37 vs -0.05..0.06 for
# the others; diagonal ratio 0.45..0.61 for squares vs 0.90..1.17 for circles.
TRIANGLE_MAX_SKEW = -0.2
SQUARE_MAX_DIAGONAL_RATIO = 0.75
MIN_AREA = 12.0  # px^2 of soft area; smaller specks are noise
MIN_CORE_PIXELS = 15  # connected pixels of one colour at alpha > 0.5 (a 9 px triangle has about 35)
MAX_CELL_RESIDUAL = 0.02  # mean squared misfit of the cell as white blended with the object's colour
MIN_CORE_ALPHA = 0.75  # mean blend weight over the core: objects are solid
MIN_COMPACTNESS = 3.5  # area / (var_x + var_y): 6 for a square, 2 pi for a circle, 5.1 for the triangle
POSITION_MARGIN = 3.0  # px between centres for a relation to hold
REACH = 2.5  # px around a component whose pixels count toward its soft measurements


@dataclass(frozen=True)
class Detection:
    """One detected object: shape and colour names, soft centre ``(cx, cy)`` in pixels, soft area."""

    shape: str
    color: str
    cx: float
    cy: float
    area: float


def _alpha_and_label(image: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per pixel: the blend weight of each palette colour ``[K, H, W]``, the best colour ``[H, W]`` and
    each colour's misfit ``[K, H, W]`` (squared distance from white blended with it, weight in [0, 1])."""
    offset = image - _BG  # [H, W, 3]
    alpha = np.einsum("hwc,kc->khw", offset, _COLOR_VECTORS) / _COLOR_NORM2[:, None, None]  # [K, H, W]
    residual = (offset[None] - alpha[..., None] * _COLOR_VECTORS[:, None, None, :]) ** 2  # [K, H, W, 3]
    # A colour can only explain a pixel with a non-negative weight.
    cost = residual.sum(-1) + np.where(alpha < 0, 1e3, 0.0)
    clipped = np.clip(alpha, 0.0, 1.0)
    misfit = ((offset[None] - clipped[..., None] * _COLOR_VECTORS[:, None, None, :]) ** 2).sum(-1)
    return alpha, cost.argmin(0), misfit


def _cumulants(weights: np.ndarray, coords: np.ndarray) -> tuple[float, float, float]:
    """Second, third and fourth cumulants of ``coords`` under the (unnormalised) ``weights``."""
    total = weights.sum()
    d = coords - (weights * coords).sum() / total
    k2 = (weights * d**2).sum() / total
    k3 = (weights * d**3).sum() / total
    k4 = (weights * d**4).sum() / total - 3 * k2**2
    return float(k2), float(k3), float(k4)


def _classify(alpha: np.ndarray, cell: np.ndarray, misfit: np.ndarray,
              core: np.ndarray) -> tuple[str, float, float, float] | None:
    """Shape, soft area and soft centre of the object whose soft mask is ``alpha`` on ``cell``.

    Uses cumulants of the soft mask because a Gaussian blur adds to the second cumulant only: the
    third (the triangle's vertical skew) and fourth (square vs circle) survive it. Returns None for
    a blob too faint to measure.
    """
    # An object is a solid patch of one colour on white: its pixels fit "white blended with that colour"
    # closely and its core is nearly opaque. Scattered noise or colour mixtures fail here.
    if misfit[cell].mean() > MAX_CELL_RESIDUAL or alpha[core].mean() < MIN_CORE_ALPHA:
        return None
    ys, xs = np.nonzero(cell)
    w = alpha[ys, xs].astype(np.float64)  # unclipped: background noise averages out instead of adding area
    area = float(w.sum())
    if area < MIN_AREA:
        return None
    ys, xs = ys.astype(np.float64), xs.astype(np.float64)
    cx, cy = float((w * xs).sum() / area), float((w * ys).sum() / area)
    k2y, k3y, k4y = _cumulants(w, ys)
    _, _, k4x = _cumulants(w, xs)
    _, _, k4d1 = _cumulants(w, (xs + ys) / np.sqrt(2))
    _, _, k4d2 = _cumulants(w, (xs - ys) / np.sqrt(2))
    k2x = _cumulants(w, xs)[0]
    # Not a solid convex blob: scattered pixels (noise) have a small area for their spread.
    if k2y <= 0 or k4x + k4y >= 0 or area / (k2x + k2y) < MIN_COMPACTNESS:
        return None
    # Apex-up triangle: skewness -0.57 (mass at the base, y grows downwards); circle and square: 0.
    skew = k3y / k2y**1.5
    # Diagonal vs axis-aligned fourth cumulants: 1/2 for a square, 1 for a circle (isotropic).
    diagonal_ratio = (k4d1 + k4d2) / (k4x + k4y)
    if skew < TRIANGLE_MAX_SKEW:
        shape = "triangle"
    elif diagonal_ratio < SQUARE_MAX_DIAGONAL_RATIO:
        shape = "square"
    else:
        shape = "circle"
    return shape, area, cx, cy


def detect_objects(image: np.ndarray | torch.Tensor) -> list[Detection]:
    """Objects in one image.

    Args:
        image: ``[H, W, 3]`` float in [0, 1] (numpy) or ``[3, H, W]`` tensor in [0, 1].

    Returns:
        The detected objects, in no particular order.
    """
    if isinstance(image, torch.Tensor):
        image = image.detach().float().cpu().permute(1, 2, 0).numpy()
    image = np.asarray(image, dtype=np.float32)
    alpha, label, misfit = _alpha_and_label(image)
    best_alpha = np.take_along_axis(alpha, label[None], 0)[0]
    foreground = best_alpha > 0.5
    components = np.zeros(label.shape, dtype=np.int32)
    colors: list[int] = []
    for k in range(len(_COLOR_NAMES)):
        mask = foreground & (label == k)
        if not mask.any():
            continue
        labelled, count = ndimage.label(mask, structure=np.ones((3, 3)))
        sizes = np.bincount(labelled.ravel(), minlength=count + 1)
        for i in range(1, count + 1):
            if sizes[i] >= MIN_CORE_PIXELS:
                colors.append(k)
                components[labelled == i] = len(colors)
    if not colors:
        return []
    # Every pixel within REACH of a component belongs to the nearest one: blurred edges are counted,
    # neighbours are not.
    distance, (iy, ix) = ndimage.distance_transform_edt(components == 0, return_indices=True)
    owner = np.where(distance <= REACH, components[iy, ix], 0)
    detections = []
    for index, k in enumerate(colors, start=1):
        cell = owner == index
        measured = _classify(alpha[k], cell, misfit[k], components == index)
        if measured is not None:
            shape, area, cx, cy = measured
            detections.append(Detection(shape, _COLOR_NAMES[k], cx, cy, area))
    return detections


def relation_distance(a: Detection, b: Detection, relation: str) -> float:
    """Signed distance (px) from ``a``'s centre to ``b``'s along the relation's axis, positive in the asked direction
    ("a left of b": how far b's centre lies to the right of a's; y grows downwards)."""
    dx, dy = b.cx - a.cx, b.cy - a.cy
    return {"left of": dx, "right of": -dx, "above": dy, "below": -dy}[relation]


def _holds(a: Detection, b: Detection, relation: str) -> bool:
    return relation_distance(a, b, relation) > POSITION_MARGIN


def extra_objects(spec: PromptSpec, detections: list[Detection]) -> int:
    """Detected objects beyond the number the prompt names (0 if none)."""
    return max(0, len(detections) - spec.named_total)


def constraints_met(spec: PromptSpec, detections: list[Detection], count_mode: str = "partial") -> list[bool]:
    """Which of the prompt's constraints the detected objects satisfy (see the module docstring).

    With ``count_mode="strict"`` an object phrase whose count is wrong fails all its constraints.
    """
    if count_mode not in COUNT_MODES:
        raise RewardError(f"shapes reward: count_mode must be one of {', '.join(COUNT_MODES)}; received {count_mode!r}")
    met = []
    for obj in spec.objects:
        phrase = [any(d.shape == obj.shape for d in detections)]
        matching = [d for d in detections if d.shape == obj.shape and (obj.color is None or d.color == obj.color)]
        if obj.color is not None:
            phrase.append(bool(matching))
        if obj.count > 1:
            phrase.append(len(matching) == obj.count)
            if count_mode == "strict" and not phrase[-1]:
                phrase = [False] * len(phrase)
        met += phrase
    if spec.relation is not None:
        first, second = spec.objects
        candidates = [(a, b) for a in detections if a.shape == first.shape and a.color == first.color
                      for b in detections if b.shape == second.shape and b.color == second.color and b is not a]
        met.append(any(_holds(a, b, spec.relation) for a, b in candidates))
    return met


def strict_correct(spec: PromptSpec, detections: list[Detection], lenient: bool | None = None) -> bool:
    """The gold (module docstring): every constraint met, each object phrase matched by exactly its count of
    detections (by shape, and colour where given), and no other object, so the relation is between the one A and the
    one B. ``lenient``, when given, is ``all(constraints_met(spec, detections))`` already computed."""
    if lenient is None:
        lenient = all(constraints_met(spec, detections))
    if not lenient or len(detections) != spec.named_total:
        return False
    for obj in spec.objects:
        matching = [d for d in detections if d.shape == obj.shape and (obj.color is None or d.color == obj.color)]
        if len(matching) != obj.count:
            return False
    return True


def _dense_relation(spec: PromptSpec, detections: list[Detection], ramp: float) -> float | None:
    """The relation's dense credit in [0, 1] when exactly one A and one B are detected (None otherwise)."""
    first, second = spec.objects
    a = [d for d in detections if d.shape == first.shape and d.color == first.color]
    b = [d for d in detections if d.shape == second.shape and d.color == second.color]
    if len(a) != 1 or len(b) != 1 or a[0] is b[0]:
        return None
    d = relation_distance(a[0], b[0], spec.relation)
    return float(min(1.0, max(0.0, (d - POSITION_MARGIN + ramp) / ramp)))


def _guarded_kinds(no_extra_objects) -> frozenset[str]:
    """The task kinds whose prompts get the no-extra-objects constraint (``True``: all of them)."""
    if isinstance(no_extra_objects, bool):
        return frozenset(TASK_KINDS if no_extra_objects else ())
    if (isinstance(no_extra_objects, (list, tuple)) and no_extra_objects
            and all(isinstance(k, str) and k in TASK_KINDS for k in no_extra_objects)):
        return frozenset(no_extra_objects)
    raise RewardError(f"shapes reward: no_extra_objects must be true, false or a list of task kinds from "
                      f"{', '.join(TASK_KINDS)} (e.g. [counting]); received {no_extra_objects!r}")


def _is_number(value) -> bool:
    """A finite int or float (not a bool, a string or NaN)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@register_reward("shapes")
class ShapesReward(Reward):
    """Verifiable reward of the shapes world.

    ``scores`` is the fraction of the prompt's constraints met; ``details`` holds ``correct`` (the gold, strict
    accuracy, 1/0), ``lenient`` (the lenient rule's accuracy, 1/0), ``extra`` (1 when more objects are drawn than the
    prompt names) and ``objects`` (the number of detected objects).

    Args:
        device: kept for the common reward interface (detection runs in numpy on the CPU).
        count_mode: ``"partial"`` (default) scores each constraint on its own; ``"strict"`` gives an
            object phrase with a wrong count no credit at all (see the module docstring).
        no_extra_objects: one more constraint per prompt, met when no object beyond those it names is drawn:
            ``True`` for every prompt, or a list of task kinds (``flowrl.data.shapes.TASK_KINDS``) whose prompts get it.
        extra_objects_weight: how many constraints that one counts as (> 0; default 1).
        all_met_share: the share of the score (in [0, 1]) paid only when every scored constraint is met; the rest
            is the fraction met (default 0: the fraction alone).
        relation_ramp: pixels over which a failed relation earns partial credit when exactly one A and one B are
            detected (None, default: the relation is 0 or 1; see the module docstring).
        relation_weight: how many constraints the relation of a position prompt counts as (> 0; default 1).
    """

    name = "shapes"
    differentiable = False
    batch_size = 256

    def __init__(self, device: str = "cpu", count_mode: str = "partial",
                 no_extra_objects: bool | list[str] | tuple[str, ...] = False, extra_objects_weight: float = 1.0,
                 all_met_share: float = 0.0, relation_ramp: float | None = None, relation_weight: float = 1.0):
        if count_mode not in COUNT_MODES:
            raise RewardError(f"shapes reward: count_mode must be one of {', '.join(COUNT_MODES)}; received "
                              f"{count_mode!r} (strict: a wrong count earns nothing for its object)")
        self.device = torch.device(device)
        self.count_mode = count_mode
        self.no_extra_objects = no_extra_objects
        self.guarded_kinds = _guarded_kinds(no_extra_objects)
        if not _is_number(extra_objects_weight) or not extra_objects_weight > 0:
            raise RewardError(f"shapes reward: extra_objects_weight must be a number above 0 (how many constraints the "
                              f"no_extra_objects guard counts as); received {extra_objects_weight!r}")
        if not _is_number(all_met_share) or not 0 <= all_met_share <= 1:
            raise RewardError(f"shapes reward: all_met_share must be a number from 0 to 1 (the share of the score paid "
                              f"only when every constraint is met); received {all_met_share!r}")
        if relation_ramp is not None and (not _is_number(relation_ramp) or not relation_ramp > 0):
            raise RewardError(f"shapes reward: relation_ramp must be null or a number of pixels above 0 (how far from "
                              f"holding a relation still earns credit); received {relation_ramp!r}")
        self.relation_ramp = None if relation_ramp is None else float(relation_ramp)
        if not _is_number(relation_weight) or not relation_weight > 0:
            raise RewardError("shapes reward: relation_weight must be a number above 0 (how many constraints a "
                              f"position prompt's relation counts as); received {relation_weight!r}")
        self.relation_weight = float(relation_weight)
        self.extra_objects_weight = float(extra_objects_weight)
        self.all_met_share = float(all_met_share)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        try:
            specs = [parse_prompt(p) for p in prompts]
        except PromptParseError as err:
            raise RewardError(f"shapes reward: {err}") from None
        array = images.detach().float().cpu().permute(0, 2, 3, 1).numpy()
        scores, correct, lenient, extra, counts = [], [], [], [], []
        for spec, image in zip(specs, array):
            detections = detect_objects(image)
            met = constraints_met(spec, detections, self.count_mode)
            lenient.append(float(all(met)))  # the same in both count modes
            correct.append(float(strict_correct(spec, detections, lenient=bool(lenient[-1]))))
            extra.append(float(extra_objects(spec, detections) > 0))
            credit = [float(ok) for ok in met]  # per constraint, in [0, 1]
            if self.relation_ramp is not None and spec.relation is not None and not met[-1]:
                dense = _dense_relation(spec, detections, self.relation_ramp)
                credit[-1] = dense if dense is not None else 0.0
            weights = [1.0] * len(credit)
            if spec.relation is not None:  # the relation is the last constraint of a position prompt
                weights[-1] = self.relation_weight
            if spec.kind in self.guarded_kinds:
                met.append(extra[-1] == 0)
                credit.append(float(met[-1]))
                weights.append(self.extra_objects_weight)
            fraction = sum(w * c for w, c in zip(weights, credit)) / sum(weights)
            scores.append((1 - self.all_met_share) * fraction + self.all_met_share * float(all(met)))
            counts.append(float(len(detections)))
        as_tensor = lambda values: torch.tensor(values, dtype=torch.float32)  # noqa: E731
        return RewardOutput(as_tensor(scores), {"correct": as_tensor(correct), "lenient": as_tensor(lenient),
                                                "extra": as_tensor(extra), "objects": as_tensor(counts)})
