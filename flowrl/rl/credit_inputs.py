"""The inputs step-level credit estimators need beyond the rewards, produced from an epoch's rollouts.

The estimators themselves (:mod:`flowrl.core.estimators`) are pure functions of gathered tensors; what
they need from the model or the images is computed here, on each process's own samples:

- :func:`completion_rewards` (TP-GRPO): complete every trained state with the ODE, decode and score;
- :func:`progress_weights` (cosine credit): each trained step's share of the progress toward the final
  image, from the predicted clean latents the rollout recorded.
"""

from __future__ import annotations

import torch

from flowrl.core.credit import cosine_credit

__all__ = ["completion_rewards", "progress_weights"]


@torch.no_grad()
def completion_rewards(rollouts, model, reward, *, guidance: float, batch_size: int) -> tuple[torch.Tensor, int]:
    """TP-GRPO's ``R_0 .. R_n`` for this process's samples, completing every row in one batched call.

    With the trained window ``s .. s + n - 1``: ``R_0`` is the reward of the ODE completion from the state
    before step ``s`` (the steps before the window are ODE steps, so this is the pure ODE rollout from the
    same initial noise), ``R_t`` (``t < n``) that of the completion from the state after trained step
    ``t``, and ``R_n`` the rollout's own reward. All ``n`` completions of every sample run in ONE batched
    ``samplers.ode_complete`` call (``sum_rows (T - start)`` model evaluations, the minimum) with the
    rollout's velocity (same guidance), in eval mode; they are decoded and scored in batches.

    Args:
        rollouts: the epoch's :class:`flowrl.rl.collect.EpochRollouts` (``n_local`` samples).
        model: the model adapter.
        reward: ``reward(images, prompts, metadata) -> RewardOutput``.
        guidance: the rollout's guidance scale.
        batch_size: rows per model call and per reward call.

    Returns:
        ``(R [n_local, n + 1] float32, nfe)`` with ``nfe`` the model evaluations spent (rows x calls).
    """
    from rewards.base import checked_reward
    from samplers import ode_complete

    traj = rollouts.trajectory
    steps = traj.trained_steps
    n_local, n = len(rollouts), len(steps)
    if n == 0 or n_local == 0:
        return rollouts.rewards.float()[:, None].clone(), 0
    s = steps[0]
    device = model.device
    sample_of_row = torch.arange(n_local).repeat_interleave(n)  # row r completes sample r // n ...
    start_of_row = (s + torch.arange(n)).repeat(n_local)  # ... from the state before step s + r % n
    x = traj.latents[sample_of_row, start_of_row].to(device)
    # The condition is looked up per model call instead of being repeated n times in memory: ode_complete
    # selects rows of {"row": index}, the wrapper maps them to the samples' own condition.
    cond_local = {k: v.to(device) for k, v in rollouts.cond.items()}
    velocity = model.velocity_fn(guidance)

    def velocity_of_rows(x_rows, sigma, c):
        return velocity(x_rows, sigma, {k: v[c["row"]] for k, v in cond_local.items()})

    was_training = model.training
    model.eval()
    try:
        x0, nfe = ode_complete(velocity_of_rows, x, traj.sigmas, start_of_row, cond={"row": sample_of_row.to(device)},
                               model_dtype=model.dtype, max_batch=batch_size)
        scores = []
        for start in range(0, x0.shape[0], batch_size):
            rows = sample_of_row[start:start + batch_size].tolist()
            images = model.decode(x0[start:start + batch_size])
            out = checked_reward(reward, images.cpu(), [rollouts.prompts[i] for i in rows],
                                 [rollouts.metadata[i] for i in rows])
            scores.append(out.scores.detach().float().cpu())
    finally:
        if was_training:
            model.train()
    R = torch.cat(scores).view(n_local, n)
    return torch.cat([R, rollouts.rewards.float().cpu()[:, None]], dim=1), int(nfe)


def progress_weights(rollouts, *, window: int = 1, alpha: float = 0.0) -> torch.Tensor:
    """Cosine credit's multiplier of the outcome advantage at each trained step, ``[n_local, n]``.

    The weights of :func:`flowrl.core.credit.cosine_credit` are taken on the sub-trajectory that starts at
    the first trained step ``s``: the steps before it are deterministic given the initial noise, so no
    trained decision can take credit for their progress, while the ODE steps after the window are kept
    because every trained step influences them. For ``window = 1`` this equals ``rho_t / rho_s``; with the
    window starting at step 0 it is the definition in docs/algorithms.md exactly. No model evaluations.

    Raises:
        ValueError: the rollouts were collected without ``store_x0``.
    """
    traj = rollouts.trajectory
    if traj.x0_preds is None:
        raise ValueError("cosine credit needs the predicted clean latents: collect the epoch with store_x0=True")
    steps = traj.trained_steps
    n_local = len(rollouts)
    if not steps:
        return torch.zeros(n_local, 0)
    s = steps[0]
    final = traj.latents[:, -1]
    chunk = 64  # bounds the float64 working copy of x0_preds
    weights = torch.cat([cosine_credit(traj.x0_preds[i:i + chunk, s:], final[i:i + chunk], window=window, alpha=alpha)
                         for i in range(0, n_local, chunk)]) if n_local else torch.zeros(0, traj.num_steps - s)
    return weights[:, [t - s for t in steps]].float()
