"""Composing rewards: weighted sums, a gated base-and-bonus combination, and score transforms.

Formulas (``r`` a reward's scores ``[B]``):

- **Weighted sum**: ``score = sum_k w_k * T_k(r_k)`` where ``T_k`` is term ``k``'s transform chain
  (identity by default). ``details[key_k]`` holds ``T_k(r_k)`` (the value that was weighted), and each
  reward's own details appear as ``"key_k/..."`` (``"pickscore/cosine"``); a transformed term also logs
  its untransformed score as ``"key_k/raw"``.
- **Gated** (a quality reward modulates an alignment reward):
  ``score = a * (1 + bonus * sigmoid((q - ref) / temperature))``, with ``a`` the alignment score and ``q``
  the quality score. Quality can raise the alignment reward by at most a factor ``1 + bonus`` (images
  at ``q = ref`` get ``1 + bonus / 2``) and never creates reward where alignment is zero, so a
  beautiful but wrong image cannot win. Meant for non-negative alignment rewards (OCR accuracy,
  P(yes), CLIP-S); for signed ones, shift them first with a ``centre``/``clip`` transform.
  Details: ``"alignment"``, ``"quality"``, ``"gate"`` (the sigmoid) plus each side's details
  prefixed ``"alignment/"`` and ``"quality/"``.
- **Transforms**, applied in the order given: ``centre: c`` -> ``r - c``; ``clip: [lo, hi]`` ->
  ``min(max(r, lo), hi)``; ``sigmoid: c`` (or ``{ref: c, temperature: t}``) -> ``sigmoid((r - c) / t)``,
  a bounded (0, 1) version of a reward with an arbitrary scale.

Specs (:func:`build_reward`), e.g. in YAML::

    reward:                      # a mapping: name -> weight, or name -> options
      pickscore: 1.0
      aesthetic:
        weight: 0.5
        kwargs: {mlp_path: /models/sac+logos+ava1-l14-linearMSE.pth}
        transform: {centre: 5.5, clip: [-2, 2]}
      judge_text:                # an alias: two instances of one reward need different keys
        reward: vlm_judge
        kwargs: {endpoint: "http://127.0.0.1:8000", question: 'Is the text "{prompt}" legible? Answer yes or no.'}
      gated:                     # reserved key: the gated combination (alignment/quality are specs too)
        alignment: ocr
        quality: {aesthetic: {kwargs: {mlp_path: ...}}}
        bonus: 0.5
        ref: 5.5

or a string ``"pickscore,aesthetic"`` (weights 1) / ``"pickscore:1.0,aesthetic:0.5"``.
"""

from __future__ import annotations

import inspect
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from .base import Reward, RewardError, RewardOutput
from .registry import REWARDS

__all__ = ["Transform", "Centre", "Clip", "Sigmoid", "parse_transforms", "TransformedReward", "WeightedSum",
           "GatedReward", "RewardTermSpec", "GatedSpec", "build_reward", "check_reward_spec", "parse_reward_string",
           "check_kwargs"]


# ----------------------------------------------------------------------------------------------- transforms


class Transform:
    """A function ``[B] -> [B]`` applied to a reward's scores (differentiable)."""

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class Centre(Transform):
    """``r - ref``."""

    ref: float

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        return scores - self.ref


@dataclass(frozen=True)
class Clip(Transform):
    """``clamp(r, lo, hi)`` (either bound may be None)."""

    lo: float | None = None
    hi: float | None = None

    def __post_init__(self) -> None:
        if self.lo is not None and self.hi is not None and self.lo > self.hi:
            raise RewardError(f"transform clip: lo={self.lo} is greater than hi={self.hi}")

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.clamp(self.lo, self.hi)


@dataclass(frozen=True)
class Sigmoid(Transform):
    """``sigmoid((r - ref) / temperature)``, in (0, 1)."""

    ref: float = 0.0
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise RewardError(f"transform sigmoid: temperature must be > 0, got {self.temperature}")

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid((scores - self.ref) / self.temperature)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardError(f"transform {what}: expected a number, got {value!r}")
    return float(value)


def _one_transform(kind: str, value: Any) -> Transform:
    if kind in ("centre", "center"):
        return Centre(_number(value, kind))
    if kind == "clip":
        if isinstance(value, Mapping):
            lo, hi = value.get("lo"), value.get("hi")
        elif isinstance(value, (list, tuple)) and len(value) == 2:
            lo, hi = value
        else:
            raise RewardError(f"transform clip: expected [lo, hi] or {{lo:, hi:}}, got {value!r}")
        return Clip(None if lo is None else _number(lo, "clip"), None if hi is None else _number(hi, "clip"))
    if kind == "sigmoid":
        if isinstance(value, Mapping):
            unknown = set(value) - {"ref", "temperature"}
            if unknown:
                raise RewardError(f"transform sigmoid: unknown key(s) {sorted(unknown)}; valid: ref, temperature")
            return Sigmoid(_number(value.get("ref", 0.0), kind), _number(value.get("temperature", 1.0), kind))
        return Sigmoid(_number(value, kind))
    raise RewardError(f"unknown transform {kind!r}; valid transforms: centre, clip, sigmoid")


def parse_transforms(spec: Any) -> list[Transform]:
    """``None``, a Transform, a mapping ``{kind: value, ...}`` (applied in order) or a list of those."""
    if spec is None:
        return []
    if isinstance(spec, Transform):
        return [spec]
    if isinstance(spec, Mapping):
        return [_one_transform(str(kind), value) for kind, value in spec.items()]
    if isinstance(spec, (list, tuple)):
        return [t for item in spec for t in parse_transforms(item)]
    raise RewardError(f"a transform must be a mapping like {{centre: 5.0}} or a list of them, got {spec!r}")


# ----------------------------------------------------------------------------------------------- rewards


def _prefixed(details: Mapping[str, torch.Tensor], key: str, inner_name: str) -> dict[str, torch.Tensor]:
    """Inner details under ``key/``: ``pickscore/cosine`` stays, ``x`` becomes ``key/x``."""
    out = {}
    for name, value in details.items():
        if name.startswith(f"{key}/"):
            out[name] = value
        elif inner_name and name.startswith(f"{inner_name}/"):
            out[f"{key}/{name[len(inner_name) + 1:]}"] = value
        else:
            out[f"{key}/{name}"] = value
    return out


class TransformedReward(Reward):
    """A reward whose scores pass through transforms; the raw score is logged as ``"<name>/raw"``."""

    accepts_video = True  # videos go on to the terms, which score frames or clips themselves

    def __init__(self, reward: Reward, transforms: Sequence[Transform]):
        self.reward = reward
        self.transforms = list(transforms)
        self.name = reward.name
        self.differentiable = reward.differentiable
        self.batch_size = reward.batch_size
        self.device = reward.device

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        out = self.reward(images, prompts, metadata)
        scores = out.scores
        for transform in self.transforms:
            scores = transform(scores)
        details = dict(out.details)
        details[f"{self.name}/raw"] = out.scores.detach()
        return RewardOutput(scores, details)


class WeightedSum(Reward):
    """``sum_k w_k * r_k`` over named rewards (see the module docstring for the details keys).

    Args:
        terms: ``(key, reward, weight)`` triples; keys must be distinct.
    """

    accepts_video = True  # videos go on to the terms, which score frames or clips themselves

    def __init__(self, terms: Sequence[tuple[str, Reward, float]]):
        if not terms:
            raise RewardError("a weighted sum needs at least one reward")
        keys = [key for key, _, _ in terms]
        if len(set(keys)) != len(keys):
            raise RewardError(f"duplicate reward keys {keys}; give aliases with the 'reward:' field")
        self.terms = [(key, reward, float(weight)) for key, reward, weight in terms]
        self.name = "+".join(keys)
        self.differentiable = all(reward.differentiable for _, reward, _ in terms)
        self.batch_size = min(reward.batch_size for _, reward, _ in terms)
        self.device = terms[0][1].device

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        total = None
        details: dict[str, torch.Tensor] = {}
        for key, reward, weight in self.terms:
            out = reward(images, prompts, metadata)
            scores = out.scores.float().to(images.device)
            total = weight * scores if total is None else total + weight * scores
            details[key] = scores.detach()
            details.update({k: v.detach().float().to(images.device)
                            for k, v in _prefixed(out.details, key, reward.name).items()})
        return RewardOutput(total, details)


class GatedReward(Reward):
    """``alignment * (1 + bonus * sigmoid((quality - ref) / temperature))`` (see the module docstring)."""

    accepts_video = True  # videos go on to the terms, which score frames or clips themselves

    name = "gated"

    def __init__(self, alignment: Reward, quality: Reward, bonus: float = 0.5, ref: float = 0.0,
                 temperature: float = 1.0):
        if not temperature > 0:
            raise RewardError(f"gated: temperature must be > 0, got {temperature}")
        if bonus < 0:
            raise RewardError(f"gated: bonus must be >= 0, got {bonus}")
        self.alignment, self.quality = alignment, quality
        self.bonus, self.ref, self.temperature = float(bonus), float(ref), float(temperature)
        self.differentiable = alignment.differentiable and quality.differentiable
        self.batch_size = min(alignment.batch_size, quality.batch_size)
        self.device = alignment.device

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        a_out = self.alignment(images, prompts, metadata)
        q_out = self.quality(images, prompts, metadata)
        a = a_out.scores.float().to(images.device)
        q = q_out.scores.float().to(images.device)
        gate = torch.sigmoid((q - self.ref) / self.temperature)
        scores = a * (1.0 + self.bonus * gate)
        details = {"alignment": a.detach(), "quality": q.detach(), "gate": gate.detach()}
        for key, out, reward in (("alignment", a_out, self.alignment), ("quality", q_out, self.quality)):
            details.update({k: v.detach().float().to(images.device)
                            for k, v in _prefixed(out.details, key, reward.name).items()})
        return RewardOutput(scores, details)


# ----------------------------------------------------------------------------------------------- specs


@dataclass
class RewardTermSpec:
    """One entry of a reward mapping (typed, for :mod:`flowrl.config`).

    Attributes:
        weight: its weight in the sum.
        kwargs: keyword arguments of the reward (model paths, device, ...).
        transform: transform chain (see :func:`parse_transforms`).
        reward: registry name when the mapping key is an alias (default: the key).
    """

    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    transform: Any = None
    reward: str | None = None


@dataclass
class GatedSpec:
    """The ``gated`` entry: ``alignment``/``quality`` are reward specs themselves."""

    alignment: Any
    quality: Any
    bonus: float = 0.5
    ref: float = 0.0
    temperature: float = 1.0
    weight: float = 1.0
    transform: Any = None


def _typed(cls, value: Any, path: str):
    from flowrl.config import ConfigError, from_dict

    try:
        return from_dict(cls, value)
    except ConfigError as err:
        message = str(err)[len(err.path) + 2:] if str(err).startswith(f"{err.path}: ") else str(err)
        where = f"{path}.{err.path}" if err.path and err.path != "<config>" else path
        raise RewardError(f"reward spec {where}: {message}") from None


def parse_reward_string(text: str) -> list[tuple[str, float]]:
    """``"a,b:0.5"`` -> ``[("a", 1.0), ("b", 0.5)]``."""
    items = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        name, _, weight = part.partition(":")
        try:
            value = float(weight) if weight.strip() else 1.0
        except ValueError:
            raise RewardError(f"bad weight {weight!r} in reward spec {text!r}; use name:weight, e.g. "
                              f"pickscore:1.0,aesthetic:0.5") from None
        if not math.isfinite(value):
            raise RewardError(f"weight of {name!r} must be finite, got {weight!r}")
        items.append((name.strip(), value))
    if not items:
        raise RewardError(f"empty reward spec {text!r}; valid names: {', '.join(REWARDS.names())}")
    return items


def _parameters(factory) -> tuple[dict[str, inspect.Parameter], dict[str, Any], bool]:
    """``(parameters, type hints, takes **kwargs)`` of a reward factory (a class: its ``__init__``)."""
    try:
        params = dict(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        return {}, {}, True
    params.pop("self", None)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    target = factory.__init__ if isinstance(factory, type) else factory
    try:
        hints = typing.get_type_hints(target)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: check names only
        hints = {}
    return params, hints, takes_any


def check_kwargs(name: str, kwargs: Mapping[str, Any], path: str) -> dict[str, Any]:
    """``kwargs`` of the reward registered as ``name`` checked against its signature, without building it:
    every key must be a parameter (unless it takes ``**kwargs``), and a value whose parameter has a plain type
    (int, float, bool, str, Literal, Optional, lists of those) must fit it. Returns the kwargs converted as
    config fields are (ints to floats, "1e-4" to 1e-4).

    Raises:
        RewardError: one line naming ``path.key``, the value and what is expected (or the valid arguments).
    """
    from flowrl.config import ConfigError, checkable_type, convert_value

    params, hints, takes_any = _parameters(REWARDS.get(name))
    out = {}
    for key, value in kwargs.items():
        key = str(key)
        if key not in params or params[key].kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            if takes_any:
                out[key] = value
                continue
            valid = [p for p, v in params.items() if v.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                                    inspect.Parameter.VAR_KEYWORD)]
            raise RewardError(f"reward spec {path}.{key}: {name} takes no argument {key!r}; valid arguments: "
                              f"{', '.join(valid)}")
        hint = hints.get(key)
        if hint is not None and checkable_type(hint):
            try:
                value = convert_value(value, hint, f"{path}.{key}")
            except ConfigError as err:
                raise RewardError(f"reward spec {err}") from None
        out[key] = value
    return out


def _load(name: str, kwargs: Mapping[str, Any], device: str | None, path: str = "") -> Reward:
    factory = REWARDS.get(name)  # unknown names: UnknownNameError listing the valid ones
    kwargs = check_kwargs(name, kwargs, f"{path or 'reward.' + name}.kwargs")
    if device is not None and "device" not in kwargs:
        try:
            accepts = "device" in inspect.signature(factory).parameters
        except (TypeError, ValueError):
            accepts = False
        if accepts:
            kwargs["device"] = device
    try:
        reward = factory(**kwargs)
    except TypeError as err:
        if "argument" in str(err):  # a misspelt keyword
            params = [p for p in inspect.signature(factory).parameters if p != "self"]
            raise RewardError(f"{name}: {err}; valid arguments: {', '.join(params)}") from None
        raise
    return reward


def _parse_term(key: str, value: Any) -> GatedSpec | RewardTermSpec:
    """The typed spec of one entry of a reward mapping (no model is loaded)."""
    path = f"reward.{key}"
    if key == "gated":
        if not isinstance(value, Mapping):
            raise RewardError(f"reward spec {path}: expected a mapping with alignment, quality, bonus, ref, "
                              f"temperature")
        spec = _typed(GatedSpec, dict(value), path)
    else:
        if value is None:
            value = {}
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            value = {"weight": value}
        elif not isinstance(value, Mapping):
            raise RewardError(f"reward spec {path}: expected a weight or a mapping with weight, kwargs, "
                              f"transform, reward; got {value!r}")
        spec = _typed(RewardTermSpec, dict(value), path)
    if not math.isfinite(spec.weight):
        raise RewardError(f"reward spec {path}.weight must be finite, got {spec.weight}")
    return spec


def _term(key: str, value: Any, device: str | None) -> tuple[Reward, float]:
    spec = _parse_term(key, value)
    if isinstance(spec, GatedSpec):
        reward: Reward = GatedReward(build_reward(spec.alignment, device=device),
                                     build_reward(spec.quality, device=device),
                                     bonus=spec.bonus, ref=spec.ref, temperature=spec.temperature)
    else:
        reward = _load(spec.reward or key, spec.kwargs, device, f"reward.{key}")
    transforms = parse_transforms(spec.transform)
    if transforms:
        reward = TransformedReward(reward, transforms)
    return reward, spec.weight


def _items(spec: Any) -> list[tuple[str, Any]]:
    """``(key, value)`` entries of a string, list or mapping spec."""
    if isinstance(spec, str):
        items: list[tuple[str, Any]] = [(name, weight) for name, weight in parse_reward_string(spec)]
    elif isinstance(spec, (list, tuple)) and all(isinstance(s, str) for s in spec):
        items = [(name, 1.0) for name in spec]
    elif isinstance(spec, Mapping):
        items = [(str(k), v) for k, v in spec.items()]
    else:
        raise RewardError(f"a reward spec must be a name, 'a,b', a list of names or a mapping; got {spec!r}")
    if not items:
        raise RewardError(f"empty reward spec; valid names: {', '.join(REWARDS.names())}")
    return items


def check_reward_spec(spec: Any) -> None:
    """Validate a reward spec without loading a model: its shape, every entry's fields and transforms, that
    every reward name is registered and that its kwargs fit the reward's signature (:func:`check_kwargs`), so
    a config fails at load time, not after the model loaded.

    Raises:
        RewardError: the first problem, in one line naming the entry and the valid choices.
    """
    if isinstance(spec, Reward):
        return
    for key, value in _items(spec):
        term = _parse_term(key, value)
        parse_transforms(term.transform)
        if isinstance(term, GatedSpec):
            check_reward_spec(term.alignment)
            check_reward_spec(term.quality)
        else:
            REWARDS.get(term.reward or key)  # unknown names: UnknownNameError listing the valid ones
            check_kwargs(term.reward or key, term.kwargs, f"reward.{key}.kwargs")


def build_reward(spec: Any, device: str | None = None) -> Reward:
    """One Reward from a spec (see the module docstring).

    Args:
        spec: a Reward; a string ``"a,b:0.5"``; a list of names; or a mapping name -> weight/options.
        device: default ``device`` for every reward that takes one and has none in its kwargs.

    A single term with weight 1 and no transform returns that reward itself (no wrapper).
    """
    if isinstance(spec, Reward):
        return spec
    terms = []
    for key, value in _items(spec):
        reward, weight = _term(key, value, device)
        terms.append((key, reward, weight))
    if len(terms) == 1 and terms[0][2] == 1.0:
        return terms[0][1]
    return WeightedSum(terms)
