"""Step-level credit estimators for the Flow-GRPO recipe (MATH.md section 4): ``tp_grpo`` and ``cosine``.

Both are registered lazily in :data:`flowrl.recipes.flow_grpo.ADVANTAGE_MODES` and called by
``compute_advantages`` as ``estimator(outcome_local [n], samples, *, cfg, dist, model, reward, epoch,
global_outcome [N], global_rewards [N], global_group_ids [N]) -> advantages [n, T]`` (only the trained steps,
``samples.train_mask``, are read; the other columns are 0).

**tp_grpo** (TurningPoint-GRPO, Tong et al. 2026, "Alleviating Sparse Rewards by Modeling Step-Wise and
Long-Term Sampling Effects in Flow-Based GRPO"). With the trained window ``s .. s + n - 1``:
``R_0`` is the reward of the ODE completion from ``latents[:, s]`` (the state before the first SDE step;
the steps before the window are ODE steps, so this is the pure ODE rollout from the same initial noise),
``R_t`` (``t = 1 .. n - 1``) that of the ODE completion from ``latents[:, s + t]``, and ``R_n`` the rollout's
own reward. All ``n`` completions of every local sample run in ONE batched ``samplers.ode_complete`` call
(``sum_rows (T - start)`` model evaluations, the minimum), are decoded and scored in batches of
``sampling.batch_size``, gathered, turned into step rewards by
:func:`flowrl.core.credit.turning_point_rewards` (``advantage.tp_balance``) and normalised per prompt group
and step index by :func:`flowrl.core.credit.stepwise_group_advantages` (``advantage.eps`` / ``clip``;
``normalizer`` and ``std_scope`` concern outcome advantages and are not used). Departures and choices:

- the completions use the rollout's velocity (same guidance) with the model in eval mode and no gradients;
  each counted evaluation is one row of a model call (a CFG-doubled batch counts once, as in the rollout);
- a sample whose rollout reward is NaN is masked by the recipe as usual; a sample whose rollout reward is
  finite but one of whose completion rewards is NaN gets advantage 0 at every step and is left out of the
  normalisation (counted in ``credit/nan_rows``);
- the control switches apply as to outcome advantages: ``negate`` negates the step advantages, ``shuffle``
  permutes whole rows with the recipe's permutation of the epoch.

**cosine** (dense cosine credit, CoCA). ``A_{i,t} = A_i (alpha + (1 - alpha) rho_t)`` with ``A_i`` the
recipe's outcome advantage (already normalised, negated / shuffled if asked) and ``rho`` from
:func:`flowrl.core.credit.cosine_credit` on ``samples.x0_preds`` and the final latents
(``advantage.cosine_window``, ``advantage.cosine_alpha``), then re-standardised per prompt group and step
index over the samples with a finite reward. With a window, MATH.md's ``rho`` (defined over the whole
trajectory) is taken on the sub-trajectory that starts at the first trained step ``s``: the steps before it
are deterministic given the initial noise, so no trained decision can take credit for their progress, while
the ODE steps after the window are kept because every trained step influences them. For ``window=1`` this
equals ``rho_t / rho_s`` (falling back to uniform weights from ``s`` on when no step from ``s`` on makes
progress), so the first trained step has weight 1; averaging blocks start at ``s``. With the window starting
at step 0 (the default) it is exactly MATH.md's ``rho``. No extra model evaluations.

Metrics: each call replaces the contents of the module-level dict :data:`last_metrics` (also reachable as
the estimators' ``last_metrics`` attribute), which ``compute_advantages`` merges into the epoch's metrics:
``credit/extra_nfe`` (extra model evaluations of the epoch, summed over processes), ``credit/completion_s``
(seconds spent completing and scoring, max over processes), ``credit/tp_rate`` (turning points per
(sample, trained step) pair), ``credit/tp_positive`` / ``credit/tp_negative`` (counts), ``credit/nan_rows``;
for cosine ``credit/extra_nfe`` (0) and ``credit/rho_mean`` (mean weight over the trained steps).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from flowrl.core.credit import cosine_credit, stepwise_group_advantages, turning_point_rewards

__all__ = ["tp_grpo_advantages", "cosine_advantages", "completion_rewards", "last_metrics"]

#: Metrics of the latest estimator call (replaced in place at every call).
last_metrics: dict[str, float] = {}


def _trained_steps(samples) -> list[int]:
    steps = torch.nonzero(samples.train_mask).flatten().tolist()
    if steps and steps != list(range(steps[0], steps[0] + len(steps))):
        raise ValueError(f"step-level credit needs consecutive trained steps (a window); got {steps}")
    return steps


def _local_slice(dist, n_local: int) -> slice:
    return slice(dist.rank * n_local, (dist.rank + 1) * n_local)


def _place(step_advantages: torch.Tensor, steps: list[int], num_steps: int) -> torch.Tensor:
    """``[n, len(steps)]`` -> ``[n, T]`` with zeros at the untrained steps."""
    out = torch.zeros(step_advantages.shape[0], num_steps, dtype=torch.float32)
    if steps:
        out[:, steps] = step_advantages.float()
    return out


@torch.no_grad()
def completion_rewards(samples, cfg, model, reward) -> tuple[torch.Tensor, int]:
    """``R_0 .. R_n`` of TP-GRPO for this process's samples, completing every row in one batched call.

    Args:
        samples: the epoch's :class:`flowrl.recipes.flow_grpo.EpochSamples` (``n_local`` samples).
        cfg: the recipe config (``sampling.guidance``, ``sampling.batch_size``).
        model: the model adapter.
        reward: the training reward, ``reward(images, prompts, metadata) -> RewardOutput``.

    Returns:
        ``(R [n_local, n + 1] float32, nfe)``: ``R[:, 0] = R_0`` (ODE completion from ``latents[:, s]``),
        ``R[:, t]`` the completion from ``latents[:, s + t]`` for ``t < n``, ``R[:, n] = samples.rewards``;
        ``nfe`` the model evaluations spent, ``sum_rows (T - start)``.
    """
    from samplers import ode_complete

    steps = _trained_steps(samples)
    n_local, n = samples.rewards.numel(), len(steps)
    if n == 0 or n_local == 0:
        return samples.rewards.float()[:, None].clone(), 0
    s = steps[0]
    device = model.device
    sample_of_row = torch.arange(n_local).repeat_interleave(n)  # row r completes sample r // n ...
    start_of_row = (s + torch.arange(n)).repeat(n_local)  # ... from the state before step s + r % n
    x = samples.latents[sample_of_row, start_of_row].to(device)
    # The condition is looked up per model call instead of being repeated n times in memory: ode_complete
    # selects rows of {"row": index}, the wrapper maps them to the samples' own condition.
    cond_local = {k: v.to(device) for k, v in samples.cond.items()}
    velocity = model.velocity_fn(cfg.sampling.guidance)

    def velocity_of_rows(x_rows, sigma, c):
        rows = c["row"]
        return velocity(x_rows, sigma, {k: v[rows] for k, v in cond_local.items()})

    batch = cfg.sampling.batch_size
    was_training = model.training
    model.eval()
    try:
        x0, nfe = ode_complete(velocity_of_rows, x, samples.step.sigmas, start_of_row,
                               cond={"row": sample_of_row.to(device)}, model_dtype=model.dtype, max_batch=batch)
        scores = []
        for start in range(0, x0.shape[0], batch):
            rows = sample_of_row[start:start + batch].tolist()
            images = model.decode(x0[start:start + batch])
            out = reward(images.cpu(), [samples.prompts[i] for i in rows], [samples.metadata[i] for i in rows])
            scores.append(out.scores.detach().float().cpu())
    finally:
        if was_training:
            model.train()
    R = torch.cat(scores).view(n_local, n)
    return torch.cat([R, samples.rewards.float().cpu()[:, None]], dim=1), int(nfe)


def _shuffle_rows(x: torch.Tensor, cfg, epoch: int, valid: torch.Tensor) -> torch.Tensor:
    """The recipe's ``advantage.shuffle`` permutation of the epoch's valid rows, applied to whole rows."""
    from samplers import derive_seed

    generator = torch.Generator().manual_seed(derive_seed(cfg.run.seed, epoch, 0x5F))
    order = torch.nonzero(valid).flatten()
    x = x.clone()
    x[order] = x[order[torch.randperm(order.numel(), generator=generator)]]
    return x


def tp_grpo_advantages(outcome: torch.Tensor, samples, *, cfg, dist, model, reward, epoch: int = 0,
                       global_outcome: torch.Tensor | None = None, global_rewards: torch.Tensor | None = None,
                       global_group_ids: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
    """TP-GRPO step advantages ``[n_local, T]`` (module docstring). ``outcome`` is not used."""
    a = cfg.advantage
    last_metrics.clear()
    T = samples.train_mask.numel()
    n_local = samples.rewards.numel()
    steps = _trained_steps(samples)
    if global_rewards is None:
        global_rewards = dist.gather(samples.rewards)
    if global_group_ids is None:
        global_group_ids = dist.gather(samples.group_ids)
    start = time.perf_counter()
    R_local, nfe = completion_rewards(samples, cfg, model, reward)
    seconds = time.perf_counter() - start
    R = dist.gather(R_local)  # [N, n + 1]
    total_nfe = int(dist.gather(torch.tensor([nfe], dtype=torch.long)).sum())
    n = len(steps)
    rollout_ok = torch.isfinite(global_rewards.float())
    valid = torch.isfinite(R).all(dim=1) & rollout_ok
    adv = torch.zeros(R.shape[0], n)
    tp_count = pos = neg = 0
    if n and bool(valid.any()):
        step_rewards, turning = turning_point_rewards(R[valid, 1:], R[valid, 0], balance=a.tp_balance)
        adv[valid] = stepwise_group_advantages(step_rewards, global_group_ids[valid], eps=a.eps, clip=a.clip).float()
        tp_count = int(turning.sum())
        pos = int((turning & (step_rewards > 0)).sum())
        neg = int((turning & (step_rewards < 0)).sum())
    if a.negate:
        adv = -adv
    if a.shuffle:
        adv = _shuffle_rows(adv, cfg, epoch, rollout_ok)
    last_metrics.update({
        "credit/extra_nfe": total_nfe,
        "credit/completion_s": dist.all_reduce_max(seconds),
        "credit/tp_rate": tp_count / max(int(valid.sum()) * n, 1),
        "credit/tp_positive": pos,
        "credit/tp_negative": neg,
        "credit/nan_rows": int((rollout_ok & ~valid).sum()),
    })
    return _place(adv[_local_slice(dist, n_local)], steps, T)


def cosine_advantages(outcome: torch.Tensor, samples, *, cfg, dist, epoch: int = 0,
                      global_rewards: torch.Tensor | None = None, global_group_ids: torch.Tensor | None = None,
                      **_: Any) -> torch.Tensor:
    """Dense cosine credit ``[n_local, T]`` (module docstring) from the outcome advantages ``outcome [n_local]``."""
    a = cfg.advantage
    last_metrics.clear()
    T = samples.train_mask.numel()
    n_local = samples.rewards.numel()
    steps = _trained_steps(samples)
    if samples.x0_preds is None:
        raise ValueError("the cosine estimator needs the predicted clean latents: roll out with "
                         "rollout_epoch(..., store_x0=True) (flow_grpo.main does so for advantage.estimator=cosine)")
    if global_rewards is None:
        global_rewards = dist.gather(samples.rewards)
    if global_group_ids is None:
        global_group_ids = dist.gather(samples.group_ids)
    if not steps:
        last_metrics.update({"credit/extra_nfe": 0, "credit/rho_mean": 0.0})
        return torch.zeros(n_local, T)
    s = steps[0]
    final = samples.latents[:, -1]
    chunk = 64  # bounds the float64 working copy of x0_preds
    weights = torch.cat([
        cosine_credit(samples.x0_preds[i:i + chunk, s:], final[i:i + chunk], window=a.cosine_window,
                      alpha=a.cosine_alpha)
        for i in range(0, n_local, chunk)
    ]) if n_local else torch.zeros(0, T - s)
    weights = weights[:, [t - s for t in steps]].float()  # [n_local, n]
    A = dist.gather(outcome.float()[:, None] * weights)  # [N, n]
    W = dist.gather(weights)
    valid = torch.isfinite(global_rewards.float())
    adv = torch.zeros_like(A)
    if bool(valid.any()):
        adv[valid] = stepwise_group_advantages(A[valid], global_group_ids[valid], eps=a.eps, clip=a.clip).float()
    last_metrics.update({
        "credit/extra_nfe": 0,
        "credit/rho_mean": float(W[valid].mean()) if bool(valid.any()) else 0.0,
    })
    return _place(adv[_local_slice(dist, n_local)], steps, T)


# The recipe reads an estimator's metrics as ``getattr(estimator, "last_metrics", {})``.
tp_grpo_advantages.last_metrics = last_metrics
cosine_advantages.last_metrics = last_metrics
