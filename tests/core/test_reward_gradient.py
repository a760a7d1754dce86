"""Reward-gradient losses (flowrl/core/reward_gradient.py) against hand-derived values.

The exact cases use the linear velocity field ``v(x, s) = theta x`` (one scalar parameter): an Euler step multiplies
by ``a_k = 1 + h_k theta`` (``h_k = s_{k+1} - s_k``), so ``x_N = prod_k a_k x_0`` and every gradient in
``d/dtheta`` is a closed form."""

from __future__ import annotations

import math
import random

import pytest
import torch

from flowrl.core.reward_gradient import (draft_loss, lv_rewards, refl_loss, refl_sample, refl_step_range, renoise,
                                         truncated_sample)

SIGMAS = torch.tensor([1.0, 0.8, 0.55, 0.3, 0.1, 0.0], dtype=torch.float64)
X0 = torch.tensor([[0.7, -1.3, 2.0], [0.4, 0.9, -0.5]], dtype=torch.float64)
THETA = 0.6


def _linear():
    theta = torch.tensor(THETA, dtype=torch.float64, requires_grad=True)
    return theta, lambda x, s: theta * x


def _factors():
    return [1 + float(SIGMAS[k + 1] - SIGMAS[k]) * THETA for k in range(len(SIGMAS) - 1)]


def _hand_truncated_grad(k: int) -> float:
    """d/dtheta of sum(x_N) when x_{N-K} is a constant: sum over the last K steps of h_j prod_{i != j} a_i."""
    a, n = _factors(), len(SIGMAS) - 1
    total = 0.0
    for j in range(n - k, n):
        h = float(SIGMAS[j + 1] - SIGMAS[j])
        total += h * math.prod(a[i] for i in range(n) if i != j)
    return total * float(X0.sum())


# ---------------------------------------------------------------------------------------------------- ReFL


def test_refl_loss_is_the_authors_hinge_times_the_scale():
    rewards = torch.tensor([0.5, 2.5, -1.0, 1.9])
    # relu(-r + 2).mean() * grad_scale, the authors' line, by hand: (1.5 + 0 + 3 + 0.1) / 4 * 1e-3
    assert float(refl_loss(rewards, margin=2.0, scale=1e-3)) == pytest.approx(4.6 / 4 * 1e-3, rel=1e-6)
    assert float(refl_loss(rewards, margin=None, scale=0.5)) == pytest.approx(-0.5 * 3.9 / 4, rel=1e-6)
    r = rewards.clone().requires_grad_(True)
    refl_loss(r, margin=2.0, scale=2.0).backward()  # the hinge passes gradient only where r < margin
    assert r.grad.tolist() == pytest.approx([-0.5, 0.0, -0.5, -0.5])
    assert float(draft_loss(rewards, scale=2.0)) == pytest.approx(-2 * 3.9 / 4)


def test_refl_window_is_the_authors_for_40_steps():
    assert refl_step_range(40) == range(30, 40)  # random.randint(30, 39)
    random.seed(0)
    assert {random.randint(30, 39) for _ in range(2000)} == set(refl_step_range(40))
    assert refl_step_range(10) == range(8, 10)
    assert refl_step_range(20, 0.5, 0.75) == range(10, 15)
    assert refl_step_range(4, 0.0, 1.0) == range(0, 4)
    with pytest.raises(ValueError, match="holds no step"):
        refl_step_range(2, 0.6, 0.9)
    with pytest.raises(ValueError, match="0 <= low < high <= 1"):
        refl_step_range(10, 0.8, 0.5)


def test_refl_sample_is_one_grad_step_at_the_latents_own_level():
    theta, velocity = _linear()
    step = 3
    out = refl_sample(velocity, X0, SIGMAS, step=step)
    a = _factors()
    x_k = math.prod(a[:step]) * X0
    s = float(SIGMAS[step])
    torch.testing.assert_close(out.x, (1 - s * THETA) * x_k)  # x_k - s v(x_k, s)
    assert len(out.grad_points) == 1 and out.grad_points[0].sigma == pytest.approx(s)
    out.x.sum().backward()
    # only the last call carries gradient: d/dtheta (x_k - s theta x_k) with x_k a constant
    assert float(theta.grad) == pytest.approx(-s * float(x_k.sum()), rel=1e-12)


# ---------------------------------------------------------------------------------------------------- DRaFT


@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_draft_k_gradient_flows_only_through_the_last_k_steps(k):
    theta, velocity = _linear()
    out = truncated_sample(velocity, X0, SIGMAS, grad_steps=k)
    torch.testing.assert_close(out.x, math.prod(_factors()) * X0)  # the sample itself is the full chain's
    assert len(out.grad_points) == k
    if k == 0:
        assert not out.x.requires_grad
        return
    out.x.sum().backward()
    assert float(theta.grad) == pytest.approx(_hand_truncated_grad(k), rel=1e-12)


def test_draft_with_k_equal_to_the_steps_is_full_backprop():
    theta, velocity = _linear()
    truncated_sample(velocity, X0, SIGMAS, grad_steps=5).x.sum().backward()
    full = float(theta.grad)
    # an explicit unrolled autograd computation of the whole chain
    theta2 = torch.tensor(THETA, dtype=torch.float64, requires_grad=True)
    x = X0
    for k in range(5):
        x = x + (SIGMAS[k + 1] - SIGMAS[k]) * theta2 * x
    x.sum().backward()
    assert full == pytest.approx(float(theta2.grad), rel=1e-12)
    # the closed form: d/dtheta prod_k (1 + h_k theta) = sum_j h_j prod_{i != j} a_i
    assert full == pytest.approx(_hand_truncated_grad(5), rel=1e-12)


def test_draft_lv_estimator_equals_the_hand_formula():
    theta, velocity = _linear()
    g = torch.Generator().manual_seed(0)
    noises = torch.randn(3, *X0.shape, generator=g, dtype=torch.float64)
    x_n = truncated_sample(velocity, X0, SIGMAS, grad_steps=0).x
    weights = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    rewards, points = lv_rewards(velocity, x_n, SIGMAS, noises, lambda x: (x * weights).sum(-1))
    assert rewards.shape == (3, 2) and len(points) == 3
    s = float(SIGMAS[-2])
    x_s = torch.stack([(1 - s) * x_n + s * eps for eps in noises])  # [n, B, D]
    torch.testing.assert_close(rewards, ((1 - s * THETA) * x_s * weights).sum(-1))
    loss = draft_loss(rewards)  # -(1/n) sum_i mean_b r_i,b
    loss.backward()
    # d/dtheta -(1/(n B)) sum_{i,b} w . (x_s - s theta x_s) = (s / (n B)) sum_{i,b} w . x_s
    hand = s / (3 * 2) * float((x_s * weights).sum())
    assert float(theta.grad) == pytest.approx(hand, rel=1e-12)
    torch.testing.assert_close(renoise(x_n, noises[0], s), x_s[0])
