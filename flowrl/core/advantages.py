"""Advantage estimators (docs/algorithms.md, section 3).

Every estimator here is a pure function over reward tensors of one *whole* batch: the recipe gathers
rewards across processes first (advantages need complete prompt groups) and keeps its own slice of the
result afterwards, so neither world size nor gradient accumulation enters these functions.

Conventions shared by all estimators:

- ``rewards`` is a float tensor ``[B]``; ``group_ids`` an integer tensor ``[B]`` (or a list of hashable
  ids) that marks which samples were generated from the same prompt. Ids are arbitrary: they need not
  be contiguous, sorted or start at zero.
- Standard deviations are population standard deviations (``unbiased=False``).
- A group whose rewards are all equal (including a group of one sample) gets advantage exactly 0. The
  group mean of equal floats is not always bit-identical to them, so this is enforced explicitly rather
  than left to ``(r - mean) / (0 + eps)``, which would otherwise turn rounding noise into advantages of
  order ``1e-8 / eps``.
- Non-finite rewards are rejected with a ``ValueError``: one NaN would silently poison its whole group.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Hashable, Sequence

import torch
from torch import Tensor


__all__ = [
    "STD_SCOPES",
    "COMBINE_MODES",
    "PerPromptStatTracker",
    "combine_rewards",
    "gae",
    "group_advantages",
    "rloo_advantages",
    "zero_std_fraction",
]

STD_SCOPES = ("group", "batch", "none")
COMBINE_MODES = ("reward_sum", "advantage_sum")

# --------------------------------------------------------------------------------------------------
# argument checking and group bookkeeping


def _as_rewards(rewards: Any, name: str = "rewards") -> Tensor:
    """Return ``rewards`` as a floating tensor ``[B]``; reject other ranks and non-finite values."""
    if not isinstance(rewards, Tensor):
        rewards = torch.as_tensor(rewards)
    if rewards.ndim != 1:
        raise ValueError(f"{name} must be a 1-D tensor [B]; received shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    bad = ~torch.isfinite(rewards)
    if bool(bad.any()):
        idx = bad.nonzero().flatten()[:8].tolist()
        raise ValueError(
            f"{name} contains {int(bad.sum())} non-finite value(s) (NaN or inf), first at indices {idx}; "
            "drop or replace those samples before computing advantages"
        )
    return rewards


def _as_group_index(group_ids: Any, batch_size: int, device: torch.device) -> tuple[Tensor, int]:
    """Map arbitrary group ids to contiguous indices.

    Returns:
        ``(inverse [B] long, n_groups)`` with ``inverse[i]`` in ``[0, n_groups)``.
    """
    if isinstance(group_ids, Tensor):
        ids = group_ids
    else:
        ids_list = list(group_ids)
        if all(isinstance(g, (int, bool)) for g in ids_list):
            ids = torch.as_tensor(ids_list, dtype=torch.long)
        else:
            # Arbitrary hashables (e.g. prompt strings): number them in order of first appearance.
            lookup: dict[Hashable, int] = {}
            ids = torch.as_tensor([lookup.setdefault(g, len(lookup)) for g in ids_list], dtype=torch.long)
    if ids.ndim != 1 or ids.shape[0] != batch_size:
        raise ValueError(
            f"group_ids must have shape [B] = [{batch_size}] to match rewards; received shape {tuple(ids.shape)}"
        )
    if ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"group_ids must be integers (or a list of hashable ids); received dtype {ids.dtype}")
    _, inverse = torch.unique(ids.to(device), return_inverse=True)
    n_groups = int(inverse.max()) + 1 if batch_size > 0 else 0
    return inverse, n_groups


class _Groups:
    """Per-group statistics of a reward vector, computed with scatter ops (no loop over samples).

    Attributes (``G`` = number of groups):
        inverse: ``[B]`` group index of each sample.
        count: ``[G]`` samples per group.
        mean: ``[G]`` group mean.
        std: ``[G]`` population std of the group.
        constant: ``[G]`` bool, True where all rewards of the group are equal (also for groups of one).
    """

    def __init__(self, rewards: Tensor, group_ids: Any):
        self.inverse, n = _as_group_index(group_ids, rewards.shape[0], rewards.device)
        zeros = rewards.new_zeros(n)
        self.count = zeros.index_add(0, self.inverse, torch.ones_like(rewards))
        self.mean = zeros.index_add(0, self.inverse, rewards) / self.count
        # Two-pass variance: E[(r - mean)^2] is accurate where E[r^2] - mean^2 cancels catastrophically.
        dev = rewards - self.mean[self.inverse]
        self.std = (zeros.index_add(0, self.inverse, dev * dev) / self.count).sqrt()
        gmax = zeros.scatter_reduce(0, self.inverse, rewards, reduce="amax", include_self=False)
        gmin = zeros.scatter_reduce(0, self.inverse, rewards, reduce="amin", include_self=False)
        self.constant = gmax == gmin

    def centred(self, rewards: Tensor) -> Tensor:
        """``r_i - mean_g(r)``, exactly 0 in constant groups. Shape ``[B]``."""
        dev = rewards - self.mean[self.inverse]
        return torch.where(self.constant[self.inverse], torch.zeros_like(dev), dev)


def _check_eps_clip(eps: float, clip: float | None) -> None:
    if not (isinstance(eps, (int, float)) and eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a finite number >= 0; received {eps!r}")
    if clip is not None and not (isinstance(clip, (int, float)) and clip > 0):
        raise ValueError(f"clip must be a number > 0, or None to disable clipping; received {clip!r}")


def _check_choice(name: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; received {value!r}")


def _clip(adv: Tensor, clip: float | None) -> Tensor:
    return adv if clip is None else adv.clamp(-clip, clip)


# --------------------------------------------------------------------------------------------------
# outcome advantages


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor | Sequence[Hashable],
    *,
    std_scope: str = "group",
    eps: float = 1e-4,
    clip: float | None = 5.0,
) -> Tensor:
    """Group-relative (GRPO) advantages: ``A_i = (r_i - mean_g(r)) / (std + eps)``, then clipped.

    Args:
        rewards: ``[B]`` rewards of the whole batch (gathered across processes).
        group_ids: ``[B]`` integer tensor or list of hashable ids; samples sharing an id form a group.
        std_scope: which population std divides the centred rewards: ``"group"`` (the sample's group,
            GRPO / Flow-GRPO), ``"batch"`` (the std of all ``B`` rewards, a "global std"), or ``"none"``
            (no division, Dr.GRPO: ``A_i = r_i - mean_g(r)``, and ``eps`` is unused).
        eps: added to the std, so near-constant groups do not explode. Default 1e-4.
        clip: advantages are clamped to ``[-clip, clip]``; ``None`` disables. Default 5.

    Returns:
        ``[B]`` advantages, dtype of ``rewards`` (float32 for integer rewards). A group whose rewards are
        all equal (in particular a group of one sample) gets exactly 0.
    """
    rewards = _as_rewards(rewards)
    _check_choice("std_scope", std_scope, STD_SCOPES)
    _check_eps_clip(eps, clip)
    if rewards.shape[0] == 0:
        return rewards.clone()
    groups = _Groups(rewards, group_ids)
    centred = groups.centred(rewards)
    if std_scope == "group":
        adv = centred / (groups.std[groups.inverse] + eps)
    elif std_scope == "batch":
        adv = centred / (rewards.std(unbiased=False) + eps)
    else:
        adv = centred
    # With eps = 0 a constant group would be 0 / 0; its advantage is 0 by definition.
    adv = torch.where(groups.constant[groups.inverse], torch.zeros_like(adv), adv)
    return _clip(adv, clip)


def zero_std_fraction(rewards: Tensor, group_ids: Tensor | Sequence[Hashable]) -> float:
    """Fraction of groups whose rewards are all equal (zero std), a logged health metric.

    Such groups carry no learning signal under group-relative advantages; a fraction near 1 means the
    task is too easy or too hard for the current policy. Groups of one sample count as zero-std.

    Args:
        rewards: ``[B]`` rewards.
        group_ids: ``[B]`` group ids, as for :func:`group_advantages`.

    Returns:
        A Python float in ``[0, 1]`` (0.0 for an empty batch).
    """
    rewards = _as_rewards(rewards)
    if rewards.shape[0] == 0:
        return 0.0
    groups = _Groups(rewards, group_ids)
    return float(groups.constant.float().mean())


def rloo_advantages(rewards: Tensor, group_ids: Tensor | Sequence[Hashable]) -> Tensor:
    """REINFORCE leave-one-out advantages: ``A_i = r_i - sum_{j != i} r_j / (G - 1)``.

    Computed as the algebraically equal ``G / (G - 1) * (r_i - mean_g(r))``. No std normalisation and no
    clipping (docs/algorithms.md defines neither for RLOO).

    Args:
        rewards: ``[B]`` rewards of the whole batch.
        group_ids: ``[B]`` group ids, as for :func:`group_advantages`; groups may differ in size ``G``.

    Returns:
        ``[B]`` advantages; a group of one sample (no baseline exists) and a constant group get 0.
    """
    rewards = _as_rewards(rewards)
    if rewards.shape[0] == 0:
        return rewards.clone()
    groups = _Groups(rewards, group_ids)
    count = groups.count[groups.inverse]
    # clamp only guards the G = 1 division; those samples are constant groups and already 0.
    return groups.centred(rewards) * count / (count - 1).clamp(min=1)


# --------------------------------------------------------------------------------------------------
# per-prompt history (DDPO)


class PerPromptStatTracker:
    """DDPO-style advantages from a per-prompt history of recent rewards.

    ``update`` first appends the batch's rewards to each prompt's history (a deque of the last
    ``buffer_size`` rewards), then normalises each sample with the mean and population std of its
    prompt's history if that holds at least ``min_count`` rewards, and with the mean and std of the whole
    current batch otherwise (so the current rewards are always part of the statistics, as in DDPO).
    ``eps``, ``clip`` and the "all equal -> 0" rule follow :func:`group_advantages`.

    The history is kept on the CPU in float64 Python lists; ``state_dict`` is plain JSON-able data and
    belongs in checkpoints (docs/algorithms.md, section 3) so a resumed run continues with the same statistics.

    Args:
        buffer_size: rewards kept per prompt. Default 32 (DDPO).
        min_count: rewards a prompt needs before its own statistics replace the batch's. Default 16 (DDPO).
        eps: added to the std. Default 1e-4.
        clip: advantages are clamped to ``[-clip, clip]``; ``None`` disables. Default 5.
    """

    def __init__(self, buffer_size: int = 32, min_count: int = 16, *, eps: float = 1e-4, clip: float | None = 5.0):
        if not (isinstance(buffer_size, int) and buffer_size >= 1):
            raise ValueError(f"buffer_size must be an integer >= 1; received {buffer_size!r}")
        if not (isinstance(min_count, int) and 1 <= min_count <= buffer_size):
            raise ValueError(
                f"min_count must be an integer in [1, buffer_size={buffer_size}] (a history never holds more "
                f"than buffer_size rewards); received {min_count!r}"
            )
        _check_eps_clip(eps, clip)
        self.buffer_size = buffer_size
        self.min_count = min_count
        self.eps = eps
        self.clip = clip
        self._history: dict[str, deque[float]] = {}
        self._last_fallback_frac = 0.0

    def update(self, prompts: Sequence[str], rewards: Tensor) -> Tensor:
        """Record the batch's rewards and return their advantages.

        Args:
            prompts: ``B`` prompt strings, one per sample.
            rewards: ``[B]`` rewards.

        Returns:
            ``[B]`` advantages on the device and dtype of ``rewards``.
        """
        rewards_t = _as_rewards(rewards)
        prompts = list(prompts)
        if len(prompts) != rewards_t.shape[0]:
            raise ValueError(
                f"prompts must have one entry per reward: received {len(prompts)} prompts for "
                f"{rewards_t.shape[0]} rewards"
            )
        if rewards_t.shape[0] == 0:
            return rewards_t.clone()
        r = rewards_t.detach().to("cpu", torch.float64)
        batch_mean, batch_std = r.mean(), r.std(unbiased=False)
        batch_constant = bool(r.max() == r.min())
        inverse, n = _as_group_index(prompts, len(prompts), r.device)
        adv = torch.zeros_like(r)
        fallback = 0
        for g in range(n):  # a loop over distinct prompts; the history is a dict of deques
            sel = inverse == g
            prompt = prompts[int(sel.nonzero()[0])]
            hist = self._history.setdefault(prompt, deque(maxlen=self.buffer_size))
            hist.extend(r[sel].tolist())
            if len(hist) >= self.min_count:
                h = torch.tensor(list(hist), dtype=torch.float64)
                mean, std, constant = h.mean(), h.std(unbiased=False), bool(h.max() == h.min())
            else:
                mean, std, constant = batch_mean, batch_std, batch_constant
                fallback += int(sel.sum())
            adv[sel] = 0.0 if constant else (r[sel] - mean) / (std + self.eps)
        self._last_fallback_frac = fallback / len(prompts)
        return _clip(adv, self.clip).to(rewards_t.device, rewards_t.dtype)

    def clear(self) -> None:
        """Forget every prompt's history (Flow-GRPO clears it once per epoch)."""
        self._history.clear()

    def stats(self) -> dict[str, float]:
        """Scalars for logging.

        Returns:
            ``num_prompts`` tracked, mean / min / max history length, ``ready_frac`` (prompts whose history
            reached ``min_count``) and ``batch_fallback_frac`` (samples of the last update normalised with
            batch statistics).
        """
        lens = [len(h) for h in self._history.values()]
        return {
            "num_prompts": float(len(lens)),
            "history_len_mean": float(sum(lens) / len(lens)) if lens else 0.0,
            "history_len_min": float(min(lens)) if lens else 0.0,
            "history_len_max": float(max(lens)) if lens else 0.0,
            "ready_frac": float(sum(n >= self.min_count for n in lens) / len(lens)) if lens else 0.0,
            "batch_fallback_frac": float(self._last_fallback_frac),
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state: ``{"buffer_size", "min_count", "history": {prompt: [float, ...]}}``."""
        return {
            "buffer_size": self.buffer_size,
            "min_count": self.min_count,
            "history": {p: list(h) for p, h in self._history.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the history saved by :meth:`state_dict`.

        The constructor's ``buffer_size`` and ``min_count`` stay in force (a config change on resume
        wins); a history longer than ``buffer_size`` keeps its most recent rewards.
        """
        if not isinstance(state, dict) or not isinstance(state.get("history"), dict):
            raise ValueError(
                "state must be a dict with a 'history' mapping of prompt -> list of rewards, as returned by "
                f"PerPromptStatTracker.state_dict(); received {type(state).__name__}"
            )
        self._history = {
            str(p): deque((float(x) for x in h), maxlen=self.buffer_size) for p, h in state["history"].items()
        }


# --------------------------------------------------------------------------------------------------
# several rewards


def combine_rewards(
    rewards: dict[str, Tensor],
    weights: dict[str, float],
    group_ids: Tensor | Sequence[Hashable],
    *,
    mode: str = "reward_sum",
    std_scope: str = "group",
    eps: float = 1e-4,
    clip: float | None = 5.0,
) -> Tensor:
    """Advantages from several named rewards.

    - ``reward_sum``: ``A = group_advantages(sum_k w_k r_k)``.
    - ``advantage_sum`` (GDPO-style): ``A = clip(sum_k w_k group_advantages(r_k, clip=None))``; each
      reward is normalised within its group first, so a reward with a large scale or spread cannot drown
      the others, and a reward that is constant within a group contributes nothing to that group.
      Only the final sum is clipped.

    Args:
        rewards: name -> ``[B]`` rewards.
        weights: name -> weight; must name exactly the keys of ``rewards`` (a weight may be 0).
        group_ids: ``[B]`` group ids, as for :func:`group_advantages`.
        mode: ``"reward_sum"`` (default) or ``"advantage_sum"``.
        std_scope, eps, clip: as for :func:`group_advantages` (defaults ``"group"``, 1e-4, 5).

    Returns:
        ``[B]`` advantages.
    """
    _check_choice("mode", mode, COMBINE_MODES)
    if not rewards:
        raise ValueError("rewards must name at least one reward; received an empty dict")
    missing = sorted(set(rewards) - set(weights))
    unknown = sorted(set(weights) - set(rewards))
    if missing:
        raise ValueError(f"weights has no entry for reward(s) {missing}; weights given for {sorted(weights)}")
    if unknown:
        raise ValueError(f"weights names unknown reward(s) {unknown}; the rewards are {sorted(rewards)}")
    checked = {k: _as_rewards(v, f"rewards[{k!r}]") for k, v in rewards.items()}
    shapes = {k: tuple(v.shape) for k, v in checked.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"all rewards must have the same shape [B]; received {shapes}")
    if mode == "reward_sum":
        total = sum(float(weights[k]) * v for k, v in checked.items())
        return group_advantages(total, group_ids, std_scope=std_scope, eps=eps, clip=clip)
    _check_eps_clip(eps, clip)
    total = sum(
        float(weights[k]) * group_advantages(v, group_ids, std_scope=std_scope, eps=eps, clip=None)
        for k, v in checked.items()
    )
    return _clip(total, clip)


# --------------------------------------------------------------------------------------------------
# GAE


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor | None,
    *,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over masked sequences (language policies with a value model).

    ``delta_t = r_t + gamma V_next - V_t`` and ``A_t = delta_t + gamma lam A_next``, where "next" is the
    next *unmasked* position: masked positions (e.g. tool or environment observation tokens) are skipped,
    so they neither count as a discount step nor break the recursion. Past the last unmasked position,
    ``V_next`` is the bootstrap value ``V_T`` and ``A_next = 0``.

    Rewards and values at masked positions are ignored; put a turn's reward on its last unmasked
    position. No whitening is applied (that is a separate, explicit choice of the recipe).

    Args:
        rewards: ``[B, T]`` per-position rewards.
        values: ``[B, T]`` value estimates, or ``[B, T + 1]`` with the bootstrap value ``V_T`` in the last
            column; with ``[B, T]``, ``V_T = 0`` (the episode ended).
        mask: ``[B, T]`` bool or float, nonzero = a position the policy acted at; ``None`` = all ones.
        gamma: discount in ``[0, 1]``.
        lam: GAE lambda in ``[0, 1]``.

    Returns:
        ``(advantages [B, T], returns [B, T])``, both 0 at masked positions; ``returns = advantages + V``.
        Computed without gradients (targets for the policy and the value model).
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must have shape [B, T]; received {tuple(rewards.shape)}")
    B, T = rewards.shape
    if values.ndim != 2 or values.shape[0] != B or values.shape[1] not in (T, T + 1):
        raise ValueError(
            f"values must have shape [B, T] = [{B}, {T}] or [B, T + 1] = [{B}, {T + 1}]; "
            f"received {tuple(values.shape)}"
        )
    if mask is None:
        mask = torch.ones(B, T, dtype=torch.bool, device=rewards.device)
    if tuple(mask.shape) != (B, T):
        raise ValueError(f"mask must have shape [B, T] = [{B}, {T}]; received {tuple(mask.shape)}")
    for name, v in (("gamma", gamma), ("lam", lam)):
        if not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0):
            raise ValueError(f"{name} must be a number in [0, 1]; received {v!r}")
    with torch.no_grad():
        dtype = torch.promote_types(rewards.dtype, values.dtype)
        if not dtype.is_floating_point:
            dtype = torch.float32
        r, v = rewards.to(dtype), values.to(dtype)
        m = mask.to(device=r.device) != 0
        next_value = v[:, T] if v.shape[1] == T + 1 else r.new_zeros(B)
        next_adv = r.new_zeros(B)
        adv = torch.zeros_like(r)
        for t in range(T - 1, -1, -1):  # a loop over time, vectorised over the batch
            a_t = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * next_adv
            mt = m[:, t]
            adv[:, t] = torch.where(mt, a_t, torch.zeros_like(a_t))
            next_value = torch.where(mt, v[:, t], next_value)
            next_adv = torch.where(mt, a_t, next_adv)
        returns = torch.where(m, adv + v[:, :T], torch.zeros_like(adv))
    return adv, returns
