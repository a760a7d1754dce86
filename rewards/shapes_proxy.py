"""``shapes_proxy``: a learned, prompt-conditioned proxy of the shapes world's gold, for over-optimisation studies.

The study follows Gao, Schulman & Hilton 2023 ("Scaling laws for reward model overoptimization"): the **gold** is a
judge the proxy is never trained on (strict accuracy, :func:`rewards.shapes.strict_correct`), the **proxy** a reward
model learned from a limited number ``n`` of gold labels of base-model images (:mod:`rewards.shapes_proxy_data`).
The proxy predicts ``P(strict-correct | image, prompt)``.

**Architecture** (:class:`ShapesProxyNet`, about 50k trained parameters on a frozen 0.2M-parameter encoder):

- Image: the shipped shapes encoder (:mod:`rewards.backbones`, ``rewards/shapes_encoder/``), **frozen**. Its global
  token was trained to predict the scene's count of every (shape, colour), a 4 x 4 occupancy map and the background:
  what strict accuracy needs (exact counts, nothing extra). Its 16 x 16 patch grid, average-pooled to 8 x 8 tokens,
  says where things are. Frozen features keep training to CPU-minutes on 8k images (they are computed once) and
  make small ``n`` meaningful, as Gao et al.'s reward models start from a pretrained network. Its weights are copied
  into the proxy's own file, so a proxy folder is self-contained and a rebuilt encoder never changes a trained proxy.
- Prompt: the grammar's parse (:func:`flowrl.data.shapes.parse_prompt`) as a structured one-hot vector
  (:func:`encode_prompt`, :data:`PROMPT_DIM` = 41): two object slots of (present, shape, colour or none, count 1-4),
  the relation (or none) and the task kind. Chosen over a token embedding because the grammar is finite and parsed
  exactly, and because factors compose: the eval split holds combinations of shapes, colours, counts and relations
  that no training prompt names, and a one-hot per factor sees each factor in training even when the combination is
  new. Two exact symmetries of the gold are applied first, so that equivalent prompts share one code: ``"A and B"``
  lists its objects in a fixed order (the eval split of ``two_object`` is exactly the reversed orders of the train
  split's pairs), and ``"A right of B"`` / ``"A below B"`` become ``"B left of A"`` / ``"B above A"`` (the judge's
  relation test is antisymmetric in this way).
- Head: each object slot's code becomes an attention query over the 8 x 8 tokens (4 heads); each head returns the
  attended feature and the attended (x, y) position. An MLP (2 hidden layers of 128, GELU) reads the global token,
  both slots' features and positions, the prompt code, and per head the signed distance between the two slots'
  positions along the relation's axis (zero without a relation). One logit.

**Score** (``output``): ``"probability"`` (default) is ``sigmoid(logit)`` in [0, 1], on the gold's own scale (a
strict-correct image is 1), so proxy and gold plot on one axis; ``"logit"`` is the raw logit. Details:
``shapes_proxy/p_correct`` (the members' mean probability) and ``shapes_proxy/std`` (their standard deviation). The
proxy never reports a ``correct`` detail: that key is the gold's, and an evaluation reads it as the result.

**Ensembles** (Coste et al. 2024): ``path=[dir1, dir2, ...]`` loads several proxies (e.g. one ``n`` with several
seeds) and ``aggregate`` combines their scores (probabilities or logits, per ``output``): ``"mean"``,
``"mean_minus_std"`` (``mean_k r_k - k std_k r_k`` with the population standard deviation over members: flowrl's
uncertainty-weighted objective, in the reward's own units; Coste et al.'s UWO subtracts ``lambda`` times the
*variance*, so their ``lambda`` does not carry over) or ``"min"`` (their worst-case objective).

Training (:func:`train_shapes_proxy`, ``flowrl train-reward shapes-proxy``): binary cross-entropy without class
weights (weights would shift the probabilities away from calibration), AdamW with a cosine decay, on the first ``n``
examples of a pool and their left-right mirror images (a label-preserving augmentation of this world); the pool's
held-out slice gives accuracy, AUC, expected calibration error (10 bins), Brier score, log loss and per-kind accuracy
(:func:`agreement_metrics`).

Measured on a pilot pool (900 training and 300 held-out base-model images of the shipped model, 20 bf16 ODE steps;
gold rate 0.55), seed 0, held-out AUC / accuracy / ECE: n = 150: 0.61 / 0.64 / 0.31; 300: 0.74 / 0.69 / 0.21;
600: 0.76 / 0.69 / 0.12; 900: 0.78 / 0.68 / 0.12 (seeds 1 and 2: 0.81 / 0.72 / 0.07 and 0.81 / 0.70 / 0.10), about
7 CPU-seconds each. A proxy that improves with ``n`` and stays well short of the gold is what the study needs.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from flowrl.data.shapes import COLORS, NUMBER_WORDS, RELATIONS, SHAPES, TASK_KINDS, PromptParseError, PromptSpec, \
    parse_prompt

from ._loading import require_files, resolve_device
from .backbones import ShapesEncoderNet, rms_normalize, shapes_resize
from .base import Reward, RewardError, RewardOutput

__all__ = ["ShapesProxyReward", "ShapesProxyNet", "encode_prompt", "encode_prompts", "canonical_spec", "PROMPT_DIM",
           "AGGREGATES", "OUTPUTS", "aggregate_members", "save_proxy", "load_proxy", "train_shapes_proxy",
           "mirror_prompt", "default_steps",
           "expected_calibration_error", "brier_score", "roc_auc", "log_loss", "agreement_metrics", "PROXY_FILES"]

PROXY_FILES = ("config.json", "model.safetensors")
AGGREGATES = ("mean", "mean_minus_std", "min")
OUTPUTS = ("probability", "logit")
ARCH = "shapes_proxy"
PROMPT_ENCODING = "shapes_grammar_v1"
TRAIN_FIX = ("Train one with `flowrl train-reward shapes-proxy --data DIR --n N --seed S --out OUT` (the data from "
             "`flowrl train-reward shapes-proxy-data --n N --out DIR`) and pass path=OUT (or a list of such folders "
             "for an ensemble).")

# ----------------------------------------------------------------------------------------------- prompt code

_COUNTS = tuple([1, *NUMBER_WORDS])  # 1, 2, 3, 4
_OBJECT_DIM = 1 + len(SHAPES) + len(COLORS) + 1 + len(_COUNTS)  # present, shape, colour or none, count
PROMPT_DIM = 2 * _OBJECT_DIM + len(RELATIONS) + 1 + len(TASK_KINDS)  # 41
_RELATION_AXIS = {"left of": (1.0, 0.0), "right of": (-1.0, 0.0), "above": (0.0, 1.0), "below": (0.0, -1.0)}
_MIRROR = {"right of": "left of", "below": "above"}


def canonical_spec(spec: PromptSpec) -> PromptSpec:
    """``spec`` rewritten by the gold's symmetries, so that prompts the judge treats alike share one code.

    ``"A and B"`` is judged as ``"B and A"``: the pair is listed with the objects ordered by (shape, colour) in the
    grammar's order. ``"A right of B"`` holds exactly when ``"B left of A"`` does (the judge's signed distance changes
    sign when the objects swap), and likewise ``below`` / ``above``: the relation becomes ``left of`` or ``above``.
    """
    if spec.relation is not None:
        if spec.relation in _MIRROR:
            return PromptSpec(spec.kind, (spec.objects[1], spec.objects[0]), _MIRROR[spec.relation])
        return spec
    if len(spec.objects) == 2:
        def order(obj):
            return SHAPES.index(obj.shape), -1 if obj.color is None else COLORS.index(obj.color)

        return PromptSpec(spec.kind, tuple(sorted(spec.objects, key=order)), None)
    return spec


def encode_prompt(spec: PromptSpec | str) -> torch.Tensor:
    """The structured one-hot code of a prompt (after :func:`canonical_spec`).

    Layout: two object slots of ``[present, shape (3), colour (6) or none (1), count 1-4 (4)]`` (the second slot all
    zeros for a one-phrase prompt), the relation (4) or none (1), the task kind (6).

    Args:
        spec: a parsed prompt, or a prompt of the shapes grammar.

    Returns:
        ``[PROMPT_DIM]`` float32 of zeros and ones.

    Raises:
        PromptParseError: a string outside the grammar.
    """
    if isinstance(spec, str):
        spec = parse_prompt(spec)
    spec = canonical_spec(spec)
    code = torch.zeros(PROMPT_DIM)
    for slot, obj in enumerate(spec.objects):
        base = slot * _OBJECT_DIM
        code[base] = 1.0
        code[base + 1 + SHAPES.index(obj.shape)] = 1.0
        colour = len(COLORS) if obj.color is None else COLORS.index(obj.color)
        code[base + 1 + len(SHAPES) + colour] = 1.0
        code[base + 1 + len(SHAPES) + len(COLORS) + 1 + _COUNTS.index(obj.count)] = 1.0
    relation = len(RELATIONS) if spec.relation is None else RELATIONS.index(spec.relation)
    code[2 * _OBJECT_DIM + relation] = 1.0
    code[2 * _OBJECT_DIM + len(RELATIONS) + 1 + TASK_KINDS.index(spec.kind)] = 1.0
    return code


def _relation_axis(spec: PromptSpec) -> tuple[float, float]:
    """Unit vector along which the second slot must lie beyond the first (y grows downwards); zero if no relation."""
    spec = canonical_spec(spec)
    return _RELATION_AXIS[spec.relation] if spec.relation is not None else (0.0, 0.0)


def encode_prompts(prompts: Sequence[str], reward: str = "shapes_proxy") -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and relation axes of ``B`` prompts.

    Returns:
        ``(codes [B, PROMPT_DIM], axes [B, 2])``.

    Raises:
        RewardError: a prompt outside the shapes grammar (the message shows the grammar).
    """
    try:
        specs = [parse_prompt(p) for p in prompts]
    except PromptParseError as err:
        raise RewardError(f"{reward}: {err}") from None
    if not specs:
        return torch.zeros(0, PROMPT_DIM), torch.zeros(0, 2)
    return torch.stack([encode_prompt(s) for s in specs]), torch.tensor([_relation_axis(s) for s in specs])


# ----------------------------------------------------------------------------------------------- network


class ProxyHead(nn.Module):
    """Prompt-conditioned head: frozen image features and a prompt code -> one logit.

    Args:
        dim: token width ``D`` of the encoder.
        hidden: width of the MLP's hidden layers.
        heads: attention heads per object slot.
        key_dim, value_dim: per-head query/key and value widths.
    """

    def __init__(self, dim: int = 64, hidden: int = 128, heads: int = 4, key_dim: int = 16, value_dim: int = 16):
        super().__init__()
        self.heads, self.key_dim, self.value_dim = heads, key_dim, value_dim
        self.query = nn.Linear(_OBJECT_DIM, heads * key_dim)
        self.key = nn.Linear(dim, heads * key_dim)
        self.value = nn.Linear(dim, heads * value_dim)
        slot = heads * (value_dim + 2)
        self.mlp = nn.Sequential(nn.Linear(dim + 2 * slot + heads + PROMPT_DIM, hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def _attend(self, slot_code: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One object slot: ``slot_code [B, O]`` -> attended features ``[B, h, v]`` and positions ``[B, h, 2]``."""
        b = keys.shape[0]
        q = self.query(slot_code).view(b, self.heads, 1, self.key_dim)
        attention = torch.softmax(q @ keys.transpose(-1, -2) / math.sqrt(self.key_dim), dim=-1)  # [B, h, 1, T]
        return (attention @ values).squeeze(2), (attention @ coords).squeeze(2)

    def forward(self, global_token: torch.Tensor, tokens: torch.Tensor, coords: torch.Tensor, codes: torch.Tensor,
                axes: torch.Tensor) -> torch.Tensor:
        """Logits ``[B]``.

        Args:
            global_token: ``[B, D]``; tokens: ``[B, T, D]``; coords: ``[T, 2]`` token centres (x, y) in [-1, 1].
            codes: ``[B, PROMPT_DIM]`` prompt codes; axes: ``[B, 2]`` relation axes (zero without a relation).
        """
        b, t, _ = tokens.shape
        keys = self.key(tokens).view(b, t, self.heads, self.key_dim).transpose(1, 2)  # [B, h, T, k]
        values = self.value(tokens).view(b, t, self.heads, self.value_dim).transpose(1, 2)  # [B, h, T, v]
        grid = coords.to(tokens.dtype).expand(b, self.heads, t, 2)
        feat_a, pos_a = self._attend(codes[:, :_OBJECT_DIM], keys, values, grid)
        feat_b, pos_b = self._attend(codes[:, _OBJECT_DIM:2 * _OBJECT_DIM], keys, values, grid)
        # How far the second object lies beyond the first along the asked direction, per head: the relation test
        # itself, which an MLP would otherwise have to learn as a product of the relation code and the positions.
        signed = ((pos_b - pos_a) * axes[:, None, :]).sum(-1)  # [B, h]
        features = [global_token, feat_a.flatten(1), pos_a.flatten(1), feat_b.flatten(1), pos_b.flatten(1), signed,
                    codes]
        return self.mlp(torch.cat(features, dim=1)).squeeze(-1)


class ShapesProxyNet(nn.Module):
    """The proxy: ``(images [B, 3, H, W] in [0, 1], prompt codes, axes) -> logits [B]``.

    Args:
        encoder_width, encoder_dim, image_size: the frozen shapes encoder's architecture.
        grid: side of the token grid the head attends over (the encoder's 16 x 16 patch grid, average-pooled).
        hidden, heads, key_dim, value_dim: see :class:`ProxyHead`.
    """

    def __init__(self, *, encoder_width: int = 32, encoder_dim: int = 64, image_size: int = 32, grid: int = 8,
                 hidden: int = 128, heads: int = 4, key_dim: int = 16, value_dim: int = 16):
        super().__init__()
        self.arch = {"encoder_width": encoder_width, "encoder_dim": encoder_dim, "image_size": image_size,
                     "grid": grid, "hidden": hidden, "heads": heads, "key_dim": key_dim, "value_dim": value_dim}
        patch_side = image_size // 2
        if patch_side % grid:
            raise ValueError(f"grid {grid} must divide the encoder's patch grid side {patch_side}")
        self.image_size, self.grid, self.patch_side = image_size, grid, patch_side
        self.encoder = ShapesEncoderNet(width=encoder_width, dim=encoder_dim, image_size=image_size)
        self.encoder.requires_grad_(False)
        self.head = ProxyHead(encoder_dim, hidden, heads, key_dim, value_dim)
        centres = (torch.arange(grid, dtype=torch.float32) + 0.5) / grid * 2 - 1
        ys, xs = torch.meshgrid(centres, centres, indexing="ij")
        self.register_buffer("coords", torch.stack([xs.flatten(), ys.flatten()], dim=1), persistent=False)  # [T, 2]

    def train(self, mode: bool = True) -> "ShapesProxyNet":
        super().train(mode)
        self.encoder.eval()  # frozen: never in training mode
        return self

    def features(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Frozen image features: ``[B, 3, H, W]`` in [0, 1] -> ``(global [B, D], tokens [B, grid^2, D])``.

        The same path as :class:`rewards.backbones.ShapesEncoder` (box-filtered to 32 x 32, mapped to [-1, 1],
        tokens RMS-normalised), then the patch grid average-pooled to ``grid x grid``. Differentiable with respect to
        ``images``.
        """
        pixels = shapes_resize(images.float(), self.image_size) * 2.0 - 1.0
        global_token, patches = self.encoder(pixels)
        patches = rms_normalize(patches)  # [B, P, D]
        b, _, d = patches.shape
        side = self.patch_side
        pooled = F.avg_pool2d(patches.transpose(1, 2).reshape(b, d, side, side), side // self.grid)
        return rms_normalize(global_token), pooled.flatten(2).transpose(1, 2)

    def forward(self, images: torch.Tensor, codes: torch.Tensor, axes: torch.Tensor) -> torch.Tensor:
        global_token, tokens = self.features(images)
        return self.head(global_token, tokens, self.coords, codes, axes)


def save_proxy(model: ShapesProxyNet, out: str | Path, info: dict[str, Any]) -> Path:
    """Write ``out/model.safetensors`` (encoder and head) and ``out/config.json`` (architecture plus ``info``)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    config = {"arch": ARCH, "prompt_encoding": PROMPT_ENCODING, "prompt_dim": PROMPT_DIM, **model.arch, **info}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_proxy(path: str | Path, reward: str = "shapes_proxy") -> tuple[ShapesProxyNet, dict]:
    """The proxy saved in ``path`` (eval mode, no gradients to its weights) and its config.

    Raises:
        RewardError: the folder or one of its files is missing, or they are not a shapes proxy (names the fix).
    """
    from safetensors import SafetensorError

    folder = require_files(path, reward, "shapes proxy", PROXY_FILES, TRAIN_FIX)
    try:
        config = json.loads((folder / "config.json").read_text())
        if not isinstance(config, dict) or config.get("arch") != ARCH:
            raise ValueError(f"arch is {config.get('arch') if isinstance(config, dict) else None!r}, expected {ARCH!r}")
        if config.get("prompt_encoding") != PROMPT_ENCODING:
            raise ValueError(f"prompt_encoding is {config.get('prompt_encoding')!r}, this flowrl reads "
                             f"{PROMPT_ENCODING!r}")
        keys = ("encoder_width", "encoder_dim", "image_size", "grid", "hidden", "heads", "key_dim", "value_dim")
        model = ShapesProxyNet(**{k: int(config[k]) for k in keys})
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(folder / "model.safetensors")))
    except (ValueError, KeyError, TypeError, RuntimeError, OSError, SafetensorError) as err:
        raise RewardError(f"{reward}: could not load the proxy in {str(folder)!r} ({type(err).__name__}: "
                          f"{' '.join(str(err).split())[:200]}). {TRAIN_FIX}") from None
    return model.eval().requires_grad_(False), config


# ----------------------------------------------------------------------------------------------- reward


def aggregate_members(members: torch.Tensor, how: str = "mean", k: float = 1.0) -> torch.Tensor:
    """Combine ``K`` members' scores of ``B`` images.

    Args:
        members: ``[K, B]``.
        how: ``"mean"``; ``"mean_minus_std"``: ``mean - k * std`` with the population standard deviation (divided by
            ``K``; 0 for one member); ``"min"``: the lowest member.
        k: the weight of the standard deviation.

    Returns:
        ``[B]``.
    """
    if how == "mean":
        return members.mean(0)
    if how == "mean_minus_std":
        return members.mean(0) - k * members.std(0, correction=0)
    if how == "min":
        return members.amin(0)
    raise RewardError(f"shapes_proxy: aggregate must be one of {', '.join(AGGREGATES)}; received {how!r}")


class ShapesProxyReward(Reward):
    """The learned proxy of strict accuracy, one model or an ensemble (see the module docstring).

    Args:
        path: a folder written by ``flowrl train-reward shapes-proxy``, or a list of them (an ensemble).
        aggregate: how an ensemble's scores combine: ``"mean"`` (default), ``"mean_minus_std"`` or ``"min"``.
        k: the standard deviation's weight in ``"mean_minus_std"`` (>= 0; default 1).
        output: ``"probability"`` (default; in [0, 1]) or ``"logit"``; an ensemble aggregates in this space.
        device: where the proxies run (``"auto"``: CUDA when available).
        batch_size: images per forward pass.
    """

    name = "shapes_proxy"
    differentiable = True  # frozen encoder and head are both differentiable with respect to the image

    def __init__(self, path: str | Path | Sequence[str | Path] | None = None, aggregate: str = "mean", k: float = 1.0,
                 output: str = "probability", device: str = "cpu", batch_size: int = 256):
        if path is None or (not isinstance(path, (str, Path)) and len(path) == 0):
            raise RewardError(f"shapes_proxy: pass path=<a trained proxy folder> or a list of them. {TRAIN_FIX}")
        paths = [path] if isinstance(path, (str, Path)) else list(path)
        if aggregate not in AGGREGATES:
            raise RewardError(f"shapes_proxy: aggregate must be one of {', '.join(AGGREGATES)}; received {aggregate!r}")
        if output not in OUTPUTS:
            raise RewardError(f"shapes_proxy: output must be one of {', '.join(OUTPUTS)}; received {output!r}")
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not math.isfinite(k) or k < 0:
            raise RewardError(f"shapes_proxy: k must be a number >= 0 (the weight of the members' standard deviation); "
                              f"received {k!r}")
        self.aggregate, self.k, self.output = aggregate, float(k), output
        self.device = resolve_device(device)
        self.batch_size = int(batch_size)
        loaded = [load_proxy(p, self.name) for p in paths]
        self.members = [model.to(self.device) for model, _ in loaded]
        self.configs = [config for _, config in loaded]
        self.paths = [str(p) for p in paths]

    def member_logits(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Every member's logits: ``[B, 3, H, W]`` in [0, 1] -> ``[K, B]`` (gradients flow when ``images`` has them)."""
        codes, axes = encode_prompts(prompts, self.name)
        codes, axes = codes.to(self.device), axes.to(self.device)
        x = images.to(self.device, torch.float32)
        return torch.stack([member(x, codes, axes) for member in self.members])

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        context = torch.enable_grad() if images.requires_grad else torch.no_grad()
        with context:
            logits = self.member_logits(images, prompts)  # [K, B]
            probabilities = torch.sigmoid(logits)
            members = probabilities if self.output == "probability" else logits
            scores = aggregate_members(members, self.aggregate, self.k)
        details = {f"{self.name}/p_correct": probabilities.detach().mean(0),
                   f"{self.name}/std": members.detach().std(0, correction=0)}
        return RewardOutput(scores, details)


# ----------------------------------------------------------------------------------------------- metrics


def _as_arrays(probs, labels) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(torch.as_tensor(probs, dtype=torch.float64).cpu(), dtype=np.float64).ravel()
    y = np.asarray(torch.as_tensor(labels, dtype=torch.float64).cpu(), dtype=np.float64).ravel()
    if p.shape != y.shape:
        raise ValueError(f"{p.size} predictions but {y.size} labels")
    return p, y


def expected_calibration_error(probs, labels, bins: int = 10) -> float:
    """``sum_b (n_b / N) |mean(labels in b) - mean(probs in b)|`` over ``bins`` equal-width bins of [0, 1].

    Bin ``b`` holds ``b / bins <= p < (b + 1) / bins``; ``p = 1`` falls in the last. Empty bins add nothing.

    Args:
        probs: ``[N]`` predicted probabilities of the positive class; labels: ``[N]`` of 0 / 1.
    """
    p, y = _as_arrays(probs, labels)
    if p.size == 0:
        return float("nan")
    index = np.minimum((p * bins).astype(np.int64), bins - 1)
    total = 0.0
    for b in range(bins):
        mask = index == b
        if mask.any():
            total += mask.sum() / p.size * abs(y[mask].mean() - p[mask].mean())
    return float(total)


def brier_score(probs, labels) -> float:
    """``mean (p - y)^2`` over ``[N]`` probabilities and 0 / 1 labels."""
    p, y = _as_arrays(probs, labels)
    return float(np.mean((p - y) ** 2)) if p.size else float("nan")


def log_loss(probs, labels, eps: float = 1e-7) -> float:
    """``-mean(y log p + (1 - y) log(1 - p))``, ``p`` clipped to ``[eps, 1 - eps]``."""
    p, y = _as_arrays(probs, labels)
    p = np.clip(p, eps, 1 - eps)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))) if p.size else float("nan")


def roc_auc(scores, labels) -> float | None:
    """Area under the ROC curve: the chance that a random positive scores above a random negative, ties counted
    half (the Mann-Whitney statistic with mid-ranks). None when a class is absent.

    Args:
        scores: ``[N]`` (any monotone score: probabilities or logits); labels: ``[N]`` of 0 / 1.
    """
    from scipy.stats import rankdata

    s, y = _as_arrays(scores, labels)
    positives, negatives = int((y == 1).sum()), int((y == 0).sum())
    if positives == 0 or negatives == 0:
        return None
    ranks = rankdata(s)  # mid-ranks for ties
    return float((ranks[y == 1].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def agreement_metrics(probs, labels, kinds: Sequence[str] | None = None, bins: int = 10) -> dict[str, Any]:
    """How well predicted probabilities agree with gold labels.

    Args:
        probs: ``[N]`` predicted P(correct); labels: ``[N]`` gold 0 / 1; kinds: ``N`` task kinds (optional).

    Returns:
        ``n``, ``gold_rate`` (share of positives), ``accuracy`` (threshold 0.5), ``auc`` (None with one class),
        ``ece`` (``bins`` bins), ``brier``, ``log_loss``, ``mean_probability``, and with ``kinds`` per kind
        ``{"n", "gold_rate", "accuracy", "mean_probability"}``.
    """
    p, y = _as_arrays(probs, labels)
    out: dict[str, Any] = {
        "n": int(p.size), "gold_rate": float(y.mean()) if p.size else float("nan"),
        "accuracy": float(((p >= 0.5) == (y == 1)).mean()) if p.size else float("nan"),
        "auc": roc_auc(p, y), "ece": expected_calibration_error(p, y, bins), "brier": brier_score(p, y),
        "log_loss": log_loss(p, y), "mean_probability": float(p.mean()) if p.size else float("nan"),
    }
    if kinds is not None:
        kinds = list(kinds)
        if len(kinds) != p.size:
            raise ValueError(f"{len(kinds)} kinds for {p.size} predictions")
        per_kind = {}
        for kind in [k for k in TASK_KINDS if k in kinds] + sorted(set(kinds) - set(TASK_KINDS)):
            mask = np.array([k == kind for k in kinds])
            per_kind[kind] = {"n": int(mask.sum()), "gold_rate": float(y[mask].mean()),
                              "accuracy": float(((p[mask] >= 0.5) == (y[mask] == 1)).mean()),
                              "mean_probability": float(p[mask].mean())}
        out["by_kind"] = per_kind
    return out


# ----------------------------------------------------------------------------------------------- training


@torch.no_grad()
def _frozen_features(model: ShapesProxyNet, images: torch.Tensor, batch_size: int = 256):
    """Features of ``images`` (uint8 or float ``[N, 3, H, W]``) in chunks: ``(global [N, D], tokens [N, T, D])``."""
    globals_, tokens = [], []
    for start in range(0, images.shape[0], batch_size):
        chunk = images[start:start + batch_size]
        chunk = chunk.float() / 255.0 if chunk.dtype == torch.uint8 else chunk.float()
        g, t = model.features(chunk)
        globals_.append(g)
        tokens.append(t)
    return torch.cat(globals_), torch.cat(tokens)


@torch.no_grad()
def _head_logits(model: ShapesProxyNet, features, codes, axes, batch_size: int = 1024) -> torch.Tensor:
    g, t = features
    return torch.cat([model.head(g[i:i + batch_size], t[i:i + batch_size], model.coords, codes[i:i + batch_size],
                                 axes[i:i + batch_size]) for i in range(0, g.shape[0], batch_size)])


def default_steps(n: int, batch_size: int, epochs: float = 20.0, min_steps: int = 300) -> int:
    """Optimizer steps for ``n`` examples: ``epochs`` passes, at least ``min_steps``.

    Chosen on a pilot pool (900 training and 300 held-out base-model images): the head overfits by 40 passes
    (training accuracy 0.99, held-out calibration error 0.2), while 15-30 passes gave the same held-out accuracy.
    """
    return max(min_steps, math.ceil(epochs * n / batch_size))


def mirror_prompt(prompt: str | PromptSpec) -> str:
    """The prompt of the horizontally mirrored image: ``left of`` and ``right of`` swap, nothing else changes."""
    spec = parse_prompt(prompt) if isinstance(prompt, str) else prompt
    swap = {"left of": "right of", "right of": "left of"}
    return PromptSpec(spec.kind, spec.objects, swap.get(spec.relation, spec.relation)).text()


def train_shapes_proxy(train: tuple[torch.Tensor, list[str], torch.Tensor],
                       heldout: tuple[torch.Tensor, list[str], torch.Tensor] | None = None, *,
                       heldout_kinds: Sequence[str] | None = None, steps: int | None = None, batch_size: int = 64,
                       lr: float = 2e-3, weight_decay: float = 0.05, seed: int = 0, mirror: bool = True,
                       encoder_path: str | Path | None = None, hidden: int = 128, heads: int = 4, grid: int = 8,
                       log: Callable[[str], None] | None = print) -> tuple[ShapesProxyNet, dict]:
    """Train a proxy on ``train = (images [N, 3, H, W] uint8 or float in [0, 1], N prompts, gold labels [N] of 0/1)``.

    The encoder (default: the shipped one) is frozen, so its features are computed once; only the head trains.
    Binary cross-entropy (no class weights: they would bias the probabilities), AdamW with a cosine decay,
    minibatches drawn with replacement from a generator seeded by ``seed``, which also seeds the head's initial
    weights (so seeds give ensemble members that differ in initialisation and batch order).

    ``mirror`` adds every training image mirrored left to right, with its prompt's ``left of`` / ``right of``
    swapped (:func:`mirror_prompt`): the shapes world's objects are mirror-symmetric (circle, square, apex-up
    triangle), so the judge's verdict is the same (on a pilot pool of 1,200 base-model images, all but one, a
    borderline detection). It doubles the examples the head sees without another gold label; on the pilot pool
    (900 training images) it raised the held-out AUC from 0.77 to 0.79-0.83 and halved the calibration error.

    Args:
        heldout: the same triple for evaluation (optional); heldout_kinds: its task kinds, for per-kind accuracy.
        steps: optimizer steps (default :func:`default_steps`: 20 passes over ``N``, at least 300).

    Returns:
        The model (eval mode) and a report: ``heldout`` (:func:`agreement_metrics`), ``train`` (the same on the
        training set), sizes, settings and seconds.
    """
    images, prompts, labels = train
    labels = torch.as_tensor(labels, dtype=torch.float32)
    if images.shape[0] != len(prompts) or images.shape[0] != labels.shape[0]:
        raise RewardError(f"shapes_proxy: {images.shape[0]} images, {len(prompts)} prompts and {labels.shape[0]} "
                          "labels; give one prompt and one label per image")
    if images.shape[0] < 2 or labels.min() == labels.max():
        raise RewardError(f"shapes_proxy: the {images.shape[0]} training examples need both gold labels (correct and "
                          "incorrect images); use a larger n")
    steps = steps or default_steps(images.shape[0], batch_size)
    start = time.perf_counter()
    encoder = _encoder_state(encoder_path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ShapesProxyNet(encoder_width=encoder["width"], encoder_dim=encoder["dim"],
                               image_size=encoder["image_size"], grid=grid, hidden=hidden, heads=heads)
    model.encoder.load_state_dict(encoder["state"])
    model.eval()
    features = _frozen_features(model, images)
    codes, axes = encode_prompts(prompts)
    train_features, train_codes, train_axes, train_labels = features, codes, axes, labels
    if mirror:
        mirrored = _frozen_features(model, images.flip(-1))
        mirrored_codes, mirrored_axes = encode_prompts([mirror_prompt(p) for p in prompts])
        train_features = (torch.cat([features[0], mirrored[0]]), torch.cat([features[1], mirrored[1]]))
        train_codes, train_axes = torch.cat([codes, mirrored_codes]), torch.cat([axes, mirrored_axes])
        train_labels = torch.cat([labels, labels])
    optimizer = torch.optim.AdamW(model.head.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    generator = torch.Generator().manual_seed(seed)
    running = None
    model.train()
    for step in range(steps):
        index = torch.randint(0, train_labels.shape[0], (batch_size,), generator=generator)
        logits = model.head(train_features[0][index], train_features[1][index], model.coords, train_codes[index],
                            train_axes[index])
        loss = F.binary_cross_entropy_with_logits(logits, train_labels[index])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if log is not None and (step % 500 == 0 or step == steps - 1):
            log(f"step {step + 1}/{steps}: loss {running:.4f} ({time.perf_counter() - start:.0f} s)")
    model.eval()
    train_probs = torch.sigmoid(_head_logits(model, features, codes, axes))
    report: dict[str, Any] = {"train": agreement_metrics(train_probs, labels)}
    if heldout is not None:
        held_images, held_prompts, held_labels = heldout
        held_codes, held_axes = encode_prompts(held_prompts)
        held_probs = torch.sigmoid(_head_logits(model, _frozen_features(model, held_images), held_codes, held_axes))
        report["heldout"] = agreement_metrics(held_probs, held_labels, heldout_kinds)
    report.update({"n_train": int(labels.shape[0]), "n_heldout": 0 if heldout is None else len(heldout[1]),
                   "steps": steps, "batch_size": batch_size, "lr": lr, "weight_decay": weight_decay, "seed": seed,
                   "mirror": mirror,
                   "encoder": encoder["source"], "seconds": round(time.perf_counter() - start, 1)})
    return model, report


def _encoder_state(path: str | Path | None) -> dict[str, Any]:
    """The frozen encoder's architecture and weights (default: the shipped one), read with the encoder's loader."""
    from .backbones import ShapesEncoder

    encoder = ShapesEncoder(path, reward="shapes_proxy")
    config = encoder.config
    return {"width": int(config["width"]), "dim": int(config["dim"]), "image_size": int(config["image_size"]),
            "state": encoder.net.state_dict(),
            "source": {"path": "shipped" if path is None else str(path),
                       "built_by": config.get("built_by"), "torch": config.get("torch")}}
