"""The advantage-estimator registry: one place that turns an epoch's rewards into per-step advantages.

Every estimator is a pure function over tensors of the *whole* (gathered) epoch::

    advantages [N, T], metrics = estimator(batch: CreditBatch, **options)

``batch`` holds the ``N`` samples whose reward is finite (the loop leaves the others out and gives them
advantage 0), the trained step indices and, for step-level credit, the extra inputs the estimator declares
in ``estimator.needs`` (the online loop produces them: ODE-completion rewards for TP-GRPO, progress
weights for cosine credit). ``options`` are the ``advantage`` section of a config as keyword arguments;
each estimator documents the ones it reads and ignores the rest. Only the trained columns of the result
are non-zero. ``metrics`` is a flat ``{"credit/...": float}`` dict (empty for outcome credit).

Registered (docs/algorithms.md, "Advantages" and "Step-level credit"):

- ``outcome`` (Flow-GRPO): every trained step gets the sample's normalised reward;
- ``tp_grpo`` (TurningPoint-GRPO): incremental step rewards from ODE completions, turning points;
- ``cosine`` (dense cosine credit, CoCA): the outcome advantage weighted by each step's progress;
- ``gigpo``, ``turn_return`` and ``trloo`` (multi-turn agents, ``T`` = turns): GiGPO's episode + anchor-state
  step advantages, per-turn discounted returns normalised per group and turn, and TRLOO's turn-level
  leave-one-out baseline.

The outcome normalisation (``normalizer``: ``group`` | ``rloo`` | ``per_prompt``) is an option of the
estimators that use it, not a second registry. A new estimator registers here with
``@register_estimator("name", needs=(...))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from flowrl.core.advantages import PerPromptStatTracker, group_advantages, rloo_advantages
from flowrl.core.credit import stepwise_group_advantages, turning_point_rewards
from flowrl.registry import Registry

__all__ = ["ADVANTAGE_ESTIMATORS", "NORMALIZERS", "CreditBatch", "register_estimator", "outcome_advantages",
           "outcome_estimator", "tp_grpo_estimator", "cosine_estimator", "gigpo_estimator", "turn_return_estimator",
           "trloo_estimator"]

NORMALIZERS = ("group", "rloo", "per_prompt")

#: name -> estimator; each carries ``needs``, the optional ``CreditBatch`` fields it reads.
ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")


@dataclass
class CreditBatch:
    """An epoch's samples with a finite reward, gathered over processes (``N`` samples, ``T`` steps).

    Attributes:
        rewards: ``[N]`` float rewards.
        group_ids: ``[N]`` int64 prompt-group ids.
        steps: the trained step indices, ascending (the same for every sample of the epoch).
        num_steps: ``T``, the schedule's steps (columns of the advantages).
        prompts: ``N`` prompt strings (the ``per_prompt`` normaliser keys its history by them).
        completion_rewards: ``[N, n + 1]`` for ``n = len(steps)``: TP-GRPO's ``R_0 .. R_n`` (``R_0`` the reward
            of the pure ODE rollout, ``R_t`` of the ODE completion after trained step ``t``, ``R_n`` the
            rollout's own reward). NaN where a completion could not be scored.
        step_weights: ``[N, n]`` cosine credit's multiplier of the outcome advantage at each trained step
            (``alpha + (1 - alpha) rho_t``, see :func:`flowrl.core.credit.cosine_credit`).
        turn_rewards: ``[N, K]`` per-turn rewards of multi-turn episodes (agents; ``steps`` are the ``K`` turns).
        turn_mask: ``[N, K]`` bool, the turns an episode played (advantages are 0 elsewhere).
        anchor_ids: ``[N, K]`` int state ids for GiGPO's step groups
            (:func:`flowrl.core.turn_credit.anchor_index`).
    """

    rewards: Tensor
    group_ids: Tensor
    steps: list[int]
    num_steps: int
    prompts: Sequence[str] | None = None
    completion_rewards: Tensor | None = None
    step_weights: Tensor | None = None
    turn_rewards: Tensor | None = None
    turn_mask: Tensor | None = None
    anchor_ids: Tensor | None = None


def register_estimator(name: str, *, needs: tuple[str, ...] = ()) -> Callable:
    """Decorator: register an estimator under ``name``; ``needs`` names the optional ``CreditBatch``
    fields it reads, which the online loop then fills in."""

    def decorator(fn: Callable) -> Callable:
        fn.needs = tuple(needs)
        ADVANTAGE_ESTIMATORS.register(name, fn)
        return fn

    return decorator


def outcome_advantages(rewards: Tensor, group_ids: Tensor, *, normalizer: str = "group", std_scope: str = "group",
                       eps: float = 1e-4, clip: float | None = 5.0, prompts: Sequence[str] | None = None,
                       tracker: PerPromptStatTracker | None = None) -> Tensor:
    """One normalised advantage per sample ``[N]`` (docs/algorithms.md, "Advantages").

    Args:
        rewards: ``[N]`` finite rewards.
        group_ids: ``[N]`` prompt groups.
        normalizer: ``group`` (GRPO; ``std_scope``, ``eps``, ``clip`` apply), ``rloo`` (leave-one-out
            baseline, no std, no clip) or ``per_prompt`` (DDPO's per-prompt history: ``tracker`` and
            ``prompts`` required; the tracker's own eps / clip apply).
    """
    if normalizer == "group":
        return group_advantages(rewards, group_ids, std_scope=std_scope, eps=eps, clip=clip)
    if normalizer == "rloo":
        return rloo_advantages(rewards, group_ids)
    if normalizer == "per_prompt":
        if tracker is None or prompts is None:
            raise ValueError("the per_prompt normalizer needs a PerPromptStatTracker and the prompts")
        return tracker.update(list(prompts), rewards)
    raise ValueError(f"unknown normalizer {normalizer!r}; valid: {', '.join(NORMALIZERS)}")


def _placed(step_values: Tensor, steps: list[int], num_steps: int) -> Tensor:
    """``[N, len(steps)]`` -> ``[N, T]`` float32 with zeros at the untrained steps."""
    out = torch.zeros(step_values.shape[0], num_steps, dtype=torch.float32)
    if steps:
        out[:, steps] = step_values.float().cpu()
    return out


def _consecutive(steps: list[int]) -> None:
    if steps and steps != list(range(steps[0], steps[0] + len(steps))):
        raise ValueError(f"step-level credit needs consecutive trained steps (a window); got {steps}")


@register_estimator("outcome")
def outcome_estimator(batch: CreditBatch, *, normalizer: str = "group", std_scope: str = "group",
                      eps: float = 1e-4, clip: float | None = 5.0, tracker: PerPromptStatTracker | None = None,
                      **_: object) -> tuple[Tensor, dict[str, float]]:
    """Flow-GRPO: every trained step of sample ``i`` gets ``A_i`` (:func:`outcome_advantages`).

    Returns:
        ``([N, T], {})``.
    """
    adv = outcome_advantages(batch.rewards, batch.group_ids, normalizer=normalizer, std_scope=std_scope, eps=eps,
                             clip=clip, prompts=batch.prompts, tracker=tracker)
    placed = _placed(adv[:, None].expand(-1, len(batch.steps)), batch.steps, batch.num_steps)
    if batch.turn_mask is not None:  # episodes of different lengths: only the turns they played
        placed = placed * batch.turn_mask.float().cpu()
    return placed, {}


@register_estimator("tp_grpo", needs=("completion_rewards",))
def tp_grpo_estimator(batch: CreditBatch, *, tp_balance: bool = False, eps: float = 1e-4, clip: float | None = 5.0,
                      **_: object) -> tuple[Tensor, dict[str, float]]:
    """TurningPoint-GRPO step advantages (Tong et al. 2026; docs/algorithms.md, "Step-level credit").

    Step rewards from :func:`flowrl.core.credit.turning_point_rewards` on ``batch.completion_rewards``
    (``tp_balance``), normalised per prompt group and step index (``eps``, ``clip``); the outcome
    ``normalizer`` is not used. A sample one of whose completions has a NaN reward gets 0 at every step and
    stays out of the normalisation (``credit/nan_rows``).

    Returns:
        ``([N, T], metrics)`` with ``credit/tp_rate`` (turning points per (sample, trained step)),
        ``credit/tp_positive``, ``credit/tp_negative`` and ``credit/nan_rows``.
    """
    _consecutive(batch.steps)
    R = batch.completion_rewards
    n = len(batch.steps)
    if R is None or R.shape != (batch.rewards.shape[0], n + 1):
        raise ValueError(f"tp_grpo needs completion_rewards [N, n + 1] = [{batch.rewards.shape[0]}, {n + 1}]; "
                         f"got {None if R is None else tuple(R.shape)}")
    ok = torch.isfinite(R).all(dim=1)
    adv = torch.zeros(R.shape[0], n)
    tp_count = positive = negative = 0
    if n and bool(ok.any()):
        step_rewards, turning = turning_point_rewards(R[ok, 1:], R[ok, 0], balance=tp_balance)
        adv[ok] = stepwise_group_advantages(step_rewards, batch.group_ids[ok], eps=eps, clip=clip).float()
        tp_count = int(turning.sum())
        positive = int((turning & (step_rewards > 0)).sum())
        negative = int((turning & (step_rewards < 0)).sum())
    metrics = {"credit/tp_rate": tp_count / max(int(ok.sum()) * n, 1), "credit/tp_positive": positive,
               "credit/tp_negative": negative, "credit/nan_rows": int((~ok).sum())}
    return _placed(adv, batch.steps, batch.num_steps), metrics


@register_estimator("cosine", needs=("step_weights",))
def cosine_estimator(batch: CreditBatch, *, normalizer: str = "group", std_scope: str = "group", eps: float = 1e-4,
                     clip: float | None = 5.0, tracker: PerPromptStatTracker | None = None,
                     **_: object) -> tuple[Tensor, dict[str, float]]:
    """Dense cosine credit: ``A_{i,t} = A_i w_{i,t}`` re-standardised per prompt group and step index.

    ``A_i`` is the outcome advantage (:func:`outcome_advantages`, with ``normalizer`` etc.) and ``w`` is
    ``batch.step_weights`` (the online loop computes them from the predicted clean latents with
    :func:`flowrl.core.credit.cosine_credit`; ``eps`` and ``clip`` also apply to the re-standardisation).

    Returns:
        ``([N, T], {"credit/rho_mean": mean weight over the trained steps})``.
    """
    _consecutive(batch.steps)
    W = batch.step_weights
    if W is None or W.shape != (batch.rewards.shape[0], len(batch.steps)):
        raise ValueError(f"cosine needs step_weights [N, n] = [{batch.rewards.shape[0]}, {len(batch.steps)}]; "
                         f"got {None if W is None else tuple(W.shape)}")
    if not batch.steps:
        return torch.zeros(batch.rewards.shape[0], batch.num_steps), {"credit/rho_mean": 0.0}
    outcome = outcome_advantages(batch.rewards, batch.group_ids, normalizer=normalizer, std_scope=std_scope,
                                 eps=eps, clip=clip, prompts=batch.prompts, tracker=tracker)
    weighted = outcome.float()[:, None] * W.float()
    adv = stepwise_group_advantages(weighted, batch.group_ids, eps=eps, clip=clip).float() if W.numel() else weighted
    return _placed(adv, batch.steps, batch.num_steps), {
        "credit/rho_mean": float(W.float().mean()) if W.numel() else 0.0}


def _turn_std_scope(std_scope: str) -> str:
    """Turn-level credit normalises within groups or only centres (``batch`` falls back to ``group``)."""
    return "none" if std_scope == "none" else "group"


@register_estimator("gigpo", needs=("turn_rewards", "anchor_ids"))
def gigpo_estimator(batch: CreditBatch, *, std_scope: str = "group", eps: float = 1e-4, clip: float | None = 5.0,
                    gamma: float = 0.95, step_weight: float = 1.0, **_: object) -> tuple[Tensor, dict[str, float]]:
    """GiGPO for multi-turn agents (:func:`flowrl.core.turn_credit.gigpo_advantages`): the episode's group
    advantage plus ``step_weight`` times a step advantage among turns of the group that share an anchor
    state. Returns ``([N, K], {})``."""
    from flowrl.core.turn_credit import gigpo_advantages

    adv = gigpo_advantages(batch.turn_rewards, batch.turn_mask, batch.group_ids, batch.anchor_ids, gamma=gamma,
                           step_weight=step_weight, std_scope=_turn_std_scope(std_scope), eps=eps, clip=clip)
    return adv, {}


@register_estimator("turn_return", needs=("turn_rewards",))
def turn_return_estimator(batch: CreditBatch, *, std_scope: str = "group", eps: float = 1e-4,
                          clip: float | None = 5.0, gamma: float = 0.95,
                          **_: object) -> tuple[Tensor, dict[str, float]]:
    """Per-turn discounted returns normalised per group and turn index
    (:func:`flowrl.core.turn_credit.turn_return_advantages`). Returns ``([N, K], {})``."""
    from flowrl.core.turn_credit import turn_return_advantages

    adv = turn_return_advantages(batch.turn_rewards, batch.turn_mask, batch.group_ids, gamma=gamma,
                                 std_scope=_turn_std_scope(std_scope), eps=eps, clip=clip)
    return adv, {}


@register_estimator("trloo", needs=("turn_rewards",))
def trloo_estimator(batch: CreditBatch, *, clip: float | None = 5.0, gamma: float = 1.0,
                    **_: object) -> tuple[Tensor, dict[str, float]]:
    """TRLOO (:func:`flowrl.core.turn_credit.trloo_advantages`): each turn's discounted return minus the mean
    return of the *other* episodes of its group at that turn; no std division (``std_scope`` is ignored).
    Returns ``([N, K], {})``."""
    from flowrl.core.turn_credit import trloo_advantages

    return trloo_advantages(batch.turn_rewards, batch.turn_mask, batch.group_ids, gamma=gamma, clip=clip), {}
