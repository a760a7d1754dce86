"""Turn-level credit for multi-turn agents: discounted turn returns, GiGPO, per-turn return advantages.

Episodes are ``[B, K]`` tensors over their turns (actions): ``turn_rewards[i, k]`` is the reward the
environment gave action ``k`` of episode ``i`` (the answer reward sits on the last action), and
``turn_mask[i, k]`` marks the turns that exist (episodes have different lengths; valid turns form a
prefix). Episodes of one task form a group (``group_ids [B]``), as in GRPO. Everything is pure torch and
gradient-free; a recipe spreads a turn's advantage over that turn's tokens.

- :func:`discounted_turn_returns`: ``G_k = r_k + gamma * G_{k+1}`` within each episode.
- :func:`gigpo_advantages` (GiGPO, Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent
  Training"): ``A_ik = A^E_i + w * A^S_ik``. The episode part ``A^E`` normalises each episode's total
  reward within its group; the step part ``A^S`` normalises the discounted return ``G_ik`` among all steps
  *of the same group taken from the same anchor state* (equal ``anchor_ids``). A step whose state no other
  episode of its group visited gets step part exactly 0. Defaults: ``gamma = 0.95``, ``w = 1``.
- :func:`turn_return_advantages`: ``G_ik`` normalised within (group, turn index): per-turn discounted
  returns with a group baseline, for environments without repeated states.
- :func:`trloo_advantages` (TRLOO, Liu et al. 2026, "Dr. Kernel: Reinforcement Learning Done Right for
  Triton Kernel Generations", KernelGYM): turn-level REINFORCE leave-one-out. Among the ``n`` episodes of a
  group that played turn ``k``, ``A_ik = G_ik - mean_{j != i} G_jk = n / (n - 1) (G_ik - mean_j G_jk)``: the
  baseline leaves the episode itself out, so it does not shrink its own signal by ``(n - 1) / n`` as a
  group mean does (GRPO's self-inclusion bias), and there is no std division. A (group, turn) cell with a
  single episode keeps its return as it is (no baseline), as in the authors' code; default ``gamma = 1``.

Departures from the GiGPO code (verl-agent), following flowrl's conventions (docs/vlm.md): standard
deviations are population stds (``unbiased=False``) with ``eps`` added, as everywhere in
``flowrl.core.advantages``; the episode statistics are taken over episodes (verl-agent's default takes them
over the step rows, which weighs long episodes more); a constant group gets exactly 0.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch
from torch import Tensor

from flowrl.core.advantages import group_advantages

__all__ = ["discounted_turn_returns", "gigpo_advantages", "turn_return_advantages", "trloo_advantages", "anchor_index"]


def _check(turn_rewards: Tensor, turn_mask: Tensor | None) -> tuple[Tensor, Tensor]:
    if turn_rewards.ndim != 2:
        raise ValueError(f"turn_rewards must have shape [B, K]; received {tuple(turn_rewards.shape)}")
    r = turn_rewards.float() if not turn_rewards.is_floating_point() else turn_rewards
    if turn_mask is None:
        m = torch.ones_like(r, dtype=torch.bool)
    else:
        if tuple(turn_mask.shape) != tuple(r.shape):
            raise ValueError(f"turn_mask must have the shape of turn_rewards {list(r.shape)}; "
                             f"received {list(turn_mask.shape)}")
        m = turn_mask.to(r.device) != 0
    if bool((~torch.isfinite(r[m])).any()):
        raise ValueError("turn_rewards has non-finite values at valid turns; drop or replace those episodes first")
    return r, m


def discounted_turn_returns(turn_rewards: Tensor, turn_mask: Tensor | None = None, *, gamma: float = 0.95) -> Tensor:
    """``G_ik = r_ik + gamma * G_i(k+1)`` over each episode's valid turns (masked turns are skipped).

    Args:
        turn_rewards: ``[B, K]`` per-turn rewards.
        turn_mask: ``[B, K]`` bool/float, nonzero = the turn exists; None = all.
        gamma: discount in ``[0, 1]``.

    Returns:
        ``[B, K]`` returns, 0 at masked turns.
    """
    if not (isinstance(gamma, (int, float)) and 0.0 <= gamma <= 1.0):
        raise ValueError(f"gamma must be a number in [0, 1]; received {gamma!r}")
    r, m = _check(turn_rewards, turn_mask)
    with torch.no_grad():
        out = torch.zeros_like(r)
        running = r.new_zeros(r.shape[0])
        for k in range(r.shape[1] - 1, -1, -1):
            running = torch.where(m[:, k], r[:, k] + gamma * running, running)
            out[:, k] = torch.where(m[:, k], running, torch.zeros_like(running))
    return out


def _group_index(group_ids: Tensor | Sequence[Hashable], batch: int, device: torch.device) -> Tensor:
    """Contiguous group indices ``[B]`` for integer or hashable group ids."""
    if isinstance(group_ids, Tensor):
        ids = group_ids.to(device).long()
    else:
        lookup: dict = {}
        ids = torch.tensor([lookup.setdefault(g, len(lookup)) for g in group_ids], dtype=torch.long, device=device)
    if ids.shape != (batch,):
        raise ValueError(f"group_ids must have shape [B] = [{batch}]; received {tuple(ids.shape)}")
    return torch.unique(ids, return_inverse=True)[1]


def anchor_index(anchors: Sequence[Sequence[Hashable]], group_ids: Sequence[Hashable]) -> Tensor:
    """Integer ids ``[B, K]`` for hashable anchor states (``-1`` past an episode's end): equal ids mean the
    same state *within the same group*; ids are numbered in order of first appearance."""
    B = len(anchors)
    K = max((len(a) for a in anchors), default=0)
    out = torch.full((B, K), -1, dtype=torch.long)
    lookup: dict = {}
    for i, (row, group) in enumerate(zip(anchors, group_ids)):
        for k, anchor in enumerate(row):
            out[i, k] = lookup.setdefault((group, anchor), len(lookup))
    return out


def gigpo_advantages(turn_rewards: Tensor, turn_mask: Tensor | None, group_ids: Tensor | Sequence[Hashable],
                     anchor_ids: Tensor, *, gamma: float = 0.95, step_weight: float = 1.0, std_scope: str = "group",
                     eps: float = 1e-4, clip: float | None = 5.0) -> Tensor:
    """GiGPO advantages ``A_ik = A^E_i + step_weight * A^S_ik`` (see the module docstring).

    Args:
        turn_rewards: ``[B, K]`` per-turn rewards of the whole batch (gathered across processes).
        turn_mask: ``[B, K]`` valid turns; None = all.
        group_ids: ``[B]`` episode groups (episodes of the same task and initial state).
        anchor_ids: ``[B, K]`` integer state ids; steps of one group with equal ids form a step group.
            Ids need only be unique within a group (``anchor_index`` builds them from hashable keys).
        gamma: discount of the step returns (default 0.95).
        step_weight: ``w`` (default 1).
        std_scope: ``"group"`` divides both parts by their group's population std (+ ``eps``), ``"none"``
            only centres them (GiGPO's ``mean_norm``).
        eps: added to the std.
        clip: the sum is clamped to ``[-clip, clip]``; None disables.

    Returns:
        ``[B, K]`` advantages, 0 at masked turns.
    """
    if std_scope not in ("group", "none"):
        raise ValueError(f"std_scope must be 'group' or 'none'; received {std_scope!r}")
    r, m = _check(turn_rewards, turn_mask)
    if tuple(anchor_ids.shape) != tuple(r.shape):
        raise ValueError(f"anchor_ids must have shape {list(r.shape)}; received {list(anchor_ids.shape)}")
    B, K = r.shape
    with torch.no_grad():
        episode_return = torch.where(m, r, torch.zeros_like(r)).sum(dim=1)
        a_episode = group_advantages(episode_return, group_ids, std_scope=std_scope, eps=eps, clip=None)
        returns = discounted_turn_returns(r, m, gamma=gamma)
        inverse = _group_index(group_ids, B, r.device)
        # One step group per (episode group, anchor state).
        key = inverse[:, None] * (int(anchor_ids.max()) + 2 if anchor_ids.numel() else 1) + anchor_ids.to(r.device) + 1
        a_step = torch.zeros_like(r)
        if bool(m.any()):
            a_step[m] = group_advantages(returns[m], key[m], std_scope=std_scope, eps=eps, clip=None)
        adv = a_episode[:, None] + step_weight * a_step
        if clip is not None:
            adv = adv.clamp(-clip, clip)
        return torch.where(m, adv, torch.zeros_like(adv))


def turn_return_advantages(turn_rewards: Tensor, turn_mask: Tensor | None, group_ids: Tensor | Sequence[Hashable], *,
                           gamma: float = 0.95, std_scope: str = "group", eps: float = 1e-4,
                           clip: float | None = 5.0) -> Tensor:
    """Per-turn discounted returns ``G_ik`` normalised among the turns of the same group and turn index ``k``.

    Returns:
        ``[B, K]`` advantages, 0 at masked turns; a (group, turn) cell with one valid turn gets 0.
    """
    if std_scope not in ("group", "none"):
        raise ValueError(f"std_scope must be 'group' or 'none'; received {std_scope!r}")
    r, m = _check(turn_rewards, turn_mask)
    B, K = r.shape
    with torch.no_grad():
        returns = discounted_turn_returns(r, m, gamma=gamma)
        inverse = _group_index(group_ids, B, r.device)
        key = inverse[:, None] * K + torch.arange(K, device=r.device)[None, :]
        adv = torch.zeros_like(r)
        if bool(m.any()):
            adv[m] = group_advantages(returns[m], key[m], std_scope=std_scope, eps=eps, clip=clip)
        return adv


def trloo_advantages(turn_rewards: Tensor, turn_mask: Tensor | None, group_ids: Tensor | Sequence[Hashable], *,
                     gamma: float = 1.0, clip: float | None = None) -> Tensor:
    """TRLOO: ``A_ik = G_ik - mean_{j != i} G_jk`` over the episodes of ``i``'s group that played turn ``k``
    (see the module docstring).

    Args:
        turn_rewards: ``[B, K]`` per-turn rewards.
        turn_mask: ``[B, K]`` valid turns; None = all.
        group_ids: ``[B]`` episode groups.
        gamma: discount of the turn returns ``G`` (the authors' default 1).
        clip: the advantages are clamped to ``[-clip, clip]``; None (default) disables.

    Returns:
        ``[B, K]`` advantages, 0 at masked turns; a cell with one episode gets its return ``G_ik``.
    """
    r, m = _check(turn_rewards, turn_mask)
    B, K = r.shape
    with torch.no_grad():
        returns = discounted_turn_returns(r, m, gamma=gamma)
        inverse = _group_index(group_ids, B, r.device)
        cell = (inverse[:, None] * K + torch.arange(K, device=r.device)[None, :])[m]
        values = returns[m]
        n_cells = int(cell.max()) + 1 if cell.numel() else 0
        sums = torch.zeros(n_cells, dtype=values.dtype, device=r.device).index_add_(0, cell, values)
        counts = torch.zeros(n_cells, dtype=values.dtype, device=r.device).index_add_(0, cell, torch.ones_like(values))
        n = counts[cell]
        # Leave-one-out mean of the others; a lone episode has no others and keeps its return.
        others = torch.where(n > 1, (sums[cell] - values) / (n - 1).clamp(min=1), torch.zeros_like(values))
        adv = torch.zeros_like(r)
        adv[m] = values - others
        if clip is not None:
            adv = adv.clamp(-clip, clip)
        return torch.where(m, adv, torch.zeros_like(adv))
