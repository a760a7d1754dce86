"""Step-level credit assignment for denoising trajectories (docs/algorithms.md, section 4).

Pure functions over tensors of one *whole* batch (the recipe gathers across processes first and keeps its
own slice afterwards), like :mod:`flowrl.core.advantages`:

- :func:`turning_point_rewards`: TP-GRPO's incremental step rewards with turning points;
- :func:`cosine_credit`: CoCA-style dense weights (a step's progress toward the final image) as a
  reward-to-go multiplier of the outcome advantage;
- :func:`stepwise_group_advantages`: group normalisation per prompt group *and* per step index, which
  turns ``[B, n]`` step rewards into ``[B, n]`` advantages.

Indexing: the ``n`` columns of a ``[B, n]`` matrix are the trained (SDE) steps ``1..n`` of docs/algorithms.md in
order; column ``t - 1`` holds step ``t``. Outcome credit (Flow-GRPO) needs no function here: every
trained step of a sample gets the sample's advantage.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch
from torch import Tensor

from flowrl.core.advantages import _as_group_index, group_advantages

__all__ = ["turning_point_rewards", "cosine_credit", "stepwise_group_advantages"]


def _check_matrix(x: Tensor, name: str) -> Tensor:
    if not isinstance(x, Tensor):
        x = torch.as_tensor(x)
    if x.ndim != 2:
        raise ValueError(f"{name} must be a 2-D tensor [B, n]; received shape {tuple(x.shape)}")
    if not x.is_floating_point():
        x = x.float()
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        rows = bad.any(1).nonzero().flatten()[:8].tolist()
        raise ValueError(f"{name} contains {int(bad.sum())} non-finite value(s) (NaN or inf), in rows {rows}; "
                         "drop those samples before computing step credit")
    return x


# --------------------------------------------------------------------------------------------------
# TP-GRPO


def turning_point_rewards(R: Tensor, R_ode: Tensor, *, balance: bool = False) -> tuple[Tensor, Tensor]:
    """TP-GRPO step rewards: incremental rewards, with turning points given their long-term gain.

    For each rollout with SDE steps ``1..n`` (docs/algorithms.md, section 4): ``R_t`` is the reward of the image reached
    by completing the trajectory with the ODE from the state after SDE step ``t`` (``R_n`` is the rollout's
    own reward) and ``R_0`` that of a pure ODE rollout from the same initial noise. Then

    - ``d_t = R_t - R_{t-1}`` (incremental reward), ``Delta = R_n - R_0`` (global trend),
      ``s_t = sign(d_t) sign(Delta)``;
    - step ``t > 1`` is a turning point when ``s_{t-1} < 0``, ``s_t > 0`` and
      ``sign(d_t) sign(R_n - R_t) > 0`` (the step flips a locally opposite trend back to the global one, and
      the rest of the trajectory keeps moving its way); step 1 is one when ``sign(d_1) sign(R_n - R_1) > 0``;
    - a turning point's reward is the aggregated long-term gain ``R_n - R_{t-1}``; any other step's is ``d_t``.

    Since ``R_n - R_t = 0`` at ``t = n``, the last step is never a turning point. A turning point's reward
    ``R_n - R_{t-1} = d_t + (R_n - R_t)`` has the (non-zero) sign of ``d_t``.

    Balancing (``balance=True``): with ``P`` positive and ``N`` negative turning points in the batch, only the
    ``min(P, N)`` largest-magnitude ones of each sign stay turning points (ties broken by position, row-major,
    first kept); the demoted ones revert to the incremental reward ``d_t`` and are no longer flagged. A batch
    with turning points of one sign only therefore keeps none.

    Args:
        R: ``[B, n]`` with ``R[:, t - 1] = R_t`` for ``t = 1..n`` (the last column is the rollout's reward).
        R_ode: ``[B]``, ``R_0``.
        balance: keep equal numbers of positive and negative turning points in the batch.

    Returns:
        ``(step_rewards [B, n], is_turning_point [B, n] bool)``, in the dtype of ``R`` (float32 for integers).
    """
    R = _check_matrix(R, "R")
    R_ode = torch.as_tensor(R_ode, device=R.device)
    if R_ode.shape != (R.shape[0],):
        raise ValueError(f"R_ode must have shape [B] = [{R.shape[0]}]; received {tuple(R_ode.shape)}")
    R_ode = _check_matrix(R_ode[:, None].to(R.dtype), "R_ode")[:, 0]
    B, n = R.shape
    if n == 0:
        return R.clone(), torch.zeros_like(R, dtype=torch.bool)
    full = torch.cat([R_ode[:, None], R], dim=1)  # [B, n + 1], full[:, t] = R_t
    before = full[:, :-1]  # R_{t-1}
    d = R - before  # d_t
    R_n = R[:, -1:]
    sign_d = torch.sign(d)
    s = sign_d * torch.sign(R_n - R_ode[:, None])  # s_t
    consistent = sign_d * torch.sign(R_n - R) > 0  # sign(d_t) sign(R_n - R_t) > 0
    turning = torch.zeros_like(consistent)
    turning[:, 0] = consistent[:, 0]
    turning[:, 1:] = (s[:, :-1] < 0) & (s[:, 1:] > 0) & consistent[:, 1:]
    long_term = R_n - before  # R_n - R_{t-1}
    if balance and bool(turning.any()):
        turning = _balance(turning, long_term)
    return torch.where(turning, long_term, d), turning


def _balance(turning: Tensor, value: Tensor) -> Tensor:
    """Keep the ``min(P, N)`` largest-magnitude turning points of each sign (ties: first in row-major order)."""
    flat_tp, flat_v = turning.flatten(), value.flatten()
    pos = torch.nonzero(flat_tp & (flat_v > 0)).flatten()
    neg = torch.nonzero(flat_tp & (flat_v < 0)).flatten()
    k = min(pos.numel(), neg.numel())
    keep = torch.zeros_like(flat_tp)
    for idx in (pos, neg):
        order = torch.sort(flat_v[idx].abs(), descending=True, stable=True).indices
        keep[idx[order[:k]]] = True
    return keep.view_as(turning)


# --------------------------------------------------------------------------------------------------
# dense cosine credit (CoCA)


def cosine_credit(x0_preds: Tensor, x_final: Tensor, *, window: int = 1, alpha: float = 0.0) -> Tensor:
    """Reward-to-go weights of dense cosine credit, as the multiplier of a sample's outcome advantage.

    With ``x0_hat_t = x0_preds[:, t - 1]`` (``t = 1..T``) and ``x_fin = x_final`` (docs/algorithms.md, section 4):
    ``c_t = cos(flatten(x0_hat_t), flatten(x_fin))``, ``c_{T+1} = 1``; contributions
    ``g_t = max(c_{t+1} - c_t, 0)``; with ``window = W > 1`` each ``g_t`` is replaced by the mean of its block of
    ``W`` consecutive steps (blocks ``[1, W], [W+1, 2W], ...``; the last block may be shorter and is averaged
    over its own length); weights ``w_t = g_t / sum_k g_k`` (uniform ``1 / T`` when every ``g_t`` is 0);
    reward-to-go ``rho_t = sum_{k >= t} w_k``, so ``rho_1 = 1`` (exactly) and ``rho`` does not increase.

    ``x0_preds[:, t]`` is the clean-image prediction ``x - sigma v`` at the state that step ``t`` starts from
    (what ``samplers.rollout(store_x0=True)`` records), so ``g_t`` is the progress toward the final image made
    by the transition of step ``t``.

    ``alpha`` is applied here: the function returns ``alpha + (1 - alpha) * rho_t``, the factor docs/algorithms.md's
    step advantage multiplies the outcome advantage by, ``A_{i,t} = A_i (alpha + (1 - alpha) rho_t)``. With the
    default ``alpha = 0`` it returns ``rho`` itself; for any ``alpha`` it is 1 at the first step and
    non-increasing. The recipe re-standardises ``A_{i,t}`` per prompt group and step index afterwards.

    Computed without gradients, in float64.

    Args:
        x0_preds: ``[B, T, ...]`` predicted clean samples along each trajectory.
        x_final: ``[B, ...]`` final samples.
        window: ``W >= 1``, steps per averaging block (CoCA uses 5 on 50 steps).
        alpha: in ``[0, 1]``, the share of plain outcome credit mixed in.

    Returns:
        ``[B, T]`` weights, in the dtype of ``x0_preds`` (float32 for non-float inputs).
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an integer >= 1; received {window!r}")
    if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha must be a number in [0, 1]; received {alpha!r}")
    if x0_preds.ndim < 2:
        raise ValueError(f"x0_preds must have shape [B, T, ...]; received {tuple(x0_preds.shape)}")
    B, T = x0_preds.shape[:2]
    if tuple(x_final.shape) != (B,) + tuple(x0_preds.shape[2:]):
        raise ValueError(f"x_final must have shape [B, ...] = {(B,) + tuple(x0_preds.shape[2:])} to match "
                         f"x0_preds {tuple(x0_preds.shape)}; received {tuple(x_final.shape)}")
    out_dtype = x0_preds.dtype if x0_preds.is_floating_point() else torch.float32
    with torch.no_grad():
        if T == 0:
            return torch.zeros(B, 0, dtype=out_dtype, device=x0_preds.device)
        p = x0_preds.detach().reshape(B, T, -1).to(torch.float64)
        f = x_final.detach().reshape(B, 1, -1).to(device=p.device, dtype=torch.float64)
        c = torch.nn.functional.cosine_similarity(p, f, dim=-1, eps=1e-12)  # [B, T]
        c_next = torch.cat([c[:, 1:], c.new_ones(B, 1)], dim=1)  # c_{t+1}, with c_{T+1} = 1
        g = (c_next - c).clamp(min=0)
        if window > 1:
            blocks = torch.arange(T, device=g.device) // window
            n_blocks = int(blocks[-1]) + 1
            sums = g.new_zeros(B, n_blocks).index_add(1, blocks, g)
            sizes = g.new_zeros(n_blocks).index_add(0, blocks, g.new_ones(T))
            g = (sums / sizes)[:, blocks]
        total = g.sum(dim=1, keepdim=True)
        w = torch.where(total > 0, g / torch.where(total > 0, total, torch.ones_like(total)),
                        torch.full_like(g, 1.0 / T))
        rho = w.flip(1).cumsum(1).flip(1)
        rho = rho / rho[:, :1]  # rho_1 = 1 exactly (the sum of w is 1 only up to rounding)
        return (alpha + (1.0 - alpha) * rho).to(out_dtype)


# --------------------------------------------------------------------------------------------------
# normalisation


def stepwise_group_advantages(step_rewards: Tensor, group_ids: Tensor | Sequence[Hashable], *,
                              eps: float = 1e-4, clip: float | None = 5.0) -> Tensor:
    """Group-relative advantages computed separately for every step index.

    Column ``j`` of the result is ``group_advantages(step_rewards[:, j], group_ids, std_scope="group")``: the
    step rewards of the same step index are compared within each prompt group (population std, ``eps``
    added, clipped to ``[-clip, clip]``, a group whose rewards at that step are all equal gets 0), as
    :func:`flowrl.core.advantages.group_advantages` does for outcome rewards.

    Args:
        step_rewards: ``[B, n]`` per-step rewards of the whole batch (finite).
        group_ids: ``[B]`` group ids (integer tensor or list of hashable ids).
        eps: added to the std. Default 1e-4.
        clip: clamp bound; ``None`` disables. Default 5.

    Returns:
        ``[B, n]`` advantages.
    """
    x = _check_matrix(step_rewards, "step_rewards")
    B, n = x.shape
    if B == 0 or n == 0:
        return x.clone()
    inverse, _ = _as_group_index(group_ids, B, x.device)
    # One group per (prompt group, step index): id = group * n + step.
    ids = inverse[:, None] * n + torch.arange(n, device=x.device)[None, :]
    return group_advantages(x.flatten(), ids.flatten(), std_scope="group", eps=eps, clip=clip).view(B, n)
