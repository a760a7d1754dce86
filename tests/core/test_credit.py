"""Step-level credit (docs/algorithms.md, section 4): hand-built reward sequences and trajectories with known
answers."""

import math

import pytest
import torch

from flowrl.core.advantages import group_advantages
from flowrl.core.credit import cosine_credit, stepwise_group_advantages, turning_point_rewards

D = torch.float64


def tp(rows, balance=False):
    """rows: lists [R_0, R_1, ..., R_n]."""
    full = torch.tensor(rows, dtype=D)
    return turning_point_rewards(full[:, 1:], full[:, 0], balance=balance)


# ---------------------------------------------------------------------------------------------- turning points


def test_turning_point_in_the_middle_gets_its_long_term_gain():
    # R = 0, 1, 0.5, 2, 3: d = 1, -0.5, 1.5, 1; Delta = 3 > 0; s = +, -, +, +.
    # Step 1: sign(d_1) sign(R_4 - R_1) = + * + > 0 -> turning point, reward R_4 - R_0 = 3.
    # Step 3: s_2 < 0, s_3 > 0, sign(d_3) sign(R_4 - R_3) = + * + -> turning point, reward R_4 - R_2 = 2.5.
    # Step 4: s_3 > 0 -> not; step 2: s_1 > 0 -> not.
    rewards, turning = tp([[0.0, 1.0, 0.5, 2.0, 3.0]])
    assert turning.tolist() == [[True, False, True, False]]
    assert rewards.tolist() == [[3.0, -0.5, 2.5, 1.0]]


def test_consistency_condition_blocks_a_flip_that_the_rest_of_the_trajectory_undoes():
    # R = 0, -1, 2, 1, 1.5: Delta = 1.5; d = -1, 3, -1, 0.5; s = -, +, -, +.
    # Step 1: sign(d_1)=-1, sign(R_4 - R_1)=+1 -> not. Step 2: s_1 < 0 < s_2 but R_4 - R_2 = -0.5 < 0 -> not
    # (the gain of step 2 is partly undone later). Step 4: s_3 < 0 < s_4 but R_4 - R_4 = 0 -> not.
    rewards, turning = tp([[0.0, -1.0, 2.0, 1.0, 1.5]])
    assert not turning.any()
    assert rewards.tolist() == [[-1.0, 3.0, -1.0, 0.5]]
    # The same flip without the later dip is a turning point: R = 0, -1, 1, 1.2, 1.5.
    rewards, turning = tp([[0.0, -1.0, 1.0, 1.2, 1.5]])
    assert turning.tolist() == [[False, True, False, False]]
    assert rewards[0].tolist() == pytest.approx([-1.0, 1.5 - (-1.0), 0.2, 0.3], abs=1e-12)


def test_first_step_rule_and_negative_trajectories():
    # Falling trajectory R = 0, -1, -0.5, -2: Delta = -2; d = -1, 0.5, -1.5; s = +, -, +.
    # Step 1: sign(d_1) sign(R_3 - R_1) = (-1)(-1) > 0 -> turning point with reward R_3 - R_0 = -2.
    # Step 3: s_2 < 0 < s_3 but R_3 - R_3 = 0 -> not (the last step never is one).
    rewards, turning = tp([[0.0, -1.0, -0.5, -2.0]])
    assert turning.tolist() == [[True, False, False]]
    assert rewards.tolist() == [[-2.0, 0.5, -1.5]]
    # First step moving against the final outcome: R = 0, 1, -1 -> sign(d_1) sign(R_2 - R_1) = (+)(-) -> not.
    rewards, turning = tp([[0.0, 1.0, -1.0]])
    assert not turning.any() and rewards.tolist() == [[1.0, -2.0]]


def test_monotone_trajectory_has_no_turning_point_beyond_the_first_step_rule():
    # Strictly rising: every s_t > 0, so no t > 1 qualifies; step 1 does by the first-step rule.
    rewards, turning = tp([[0.0, 0.1, 0.3, 0.6, 1.0]])
    assert turning.tolist() == [[True, False, False, False]]
    assert rewards[0].tolist() == pytest.approx([1.0, 0.2, 0.3, 0.4], abs=1e-12)
    # Flat start then rising: d_1 = 0 -> sign 0 -> no turning point anywhere; rewards are the increments.
    rewards, turning = tp([[0.5, 0.5, 0.7, 0.9]])
    assert not turning.any()
    assert rewards[0].tolist() == pytest.approx([0.0, 0.2, 0.2], abs=1e-12)


def test_balancing_keeps_equal_numbers_of_each_sign_largest_first():
    rows = [
        [0.0, 1.0, 0.5, 2.0, 3.0],  # turning points: step 1 (+3), step 3 (+2.5)
        [0.0, 0.1, 0.2, 0.3, 0.4],  # step 1 (+0.4)
        [0.0, -1.0, -0.5, -2.0, -2.5],  # step 1 (-2.5); step 3: s_2 < 0 < s_3, R_4 - R_3 = -0.5 -> (-2.0)
    ]
    rewards, turning = tp(rows)
    assert turning.tolist() == [[True, False, True, False], [True, False, False, False],
                                [True, False, True, False]]
    assert rewards[2].tolist() == pytest.approx([-2.5, 0.5, -2.0, -0.5], abs=1e-12)
    # 3 positive (3, 2.5, 0.4), 2 negative (-2.5, -2.0): keep both negatives and the two largest positives.
    rewards_b, turning_b = tp(rows, balance=True)
    assert turning_b.tolist() == [[True, False, True, False], [False, False, False, False],
                                  [True, False, True, False]]
    assert rewards_b[1].tolist() == pytest.approx([0.1, 0.1, 0.1, 0.1], abs=1e-12)  # demoted: back to d_1
    assert torch.equal(rewards_b[[0, 2]], rewards[[0, 2]])
    # Only one sign present: balancing keeps none.
    rewards_c, turning_c = tp(rows[:2], balance=True)
    assert not turning_c.any()
    assert rewards_c[0].tolist() == pytest.approx([1.0, -0.5, 1.5, 1.0], abs=1e-12)


def test_turning_point_inputs_are_checked():
    with pytest.raises(ValueError, match="non-finite"):
        turning_point_rewards(torch.tensor([[1.0, math.nan]]), torch.tensor([0.0]))
    with pytest.raises(ValueError, match="R_ode"):
        turning_point_rewards(torch.zeros(2, 3), torch.zeros(3))


# ---------------------------------------------------------------------------------------------- normalisation


def test_stepwise_normalisation_by_hand():
    step_rewards = torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 5.0], [2.0, 1.0]], dtype=D)
    groups = torch.tensor([7, 7, 3, 3])
    adv = stepwise_group_advantages(step_rewards, groups, eps=0.0, clip=None)
    # Group 7, step 0: (1, 3), mean 2, std 1 -> -1, +1; step 1: (0, 0) constant -> 0.
    # Group 3, step 0: (2, 2) constant -> 0; step 1: (5, 1), mean 3, std 2 -> +1, -1.
    assert adv.tolist() == [[-1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, -1.0]]
    with_eps = stepwise_group_advantages(step_rewards, groups, eps=1e-4, clip=0.5)
    assert with_eps[0, 0].item() == pytest.approx(-0.5, abs=0)  # 1 / 1.0001 clipped to 0.5
    assert with_eps[2, 1].item() == pytest.approx(0.5, abs=0)
    # Columns are independent and each equals group_advantages of that column.
    for j in range(2):
        assert torch.equal(with_eps[:, j], group_advantages(step_rewards[:, j], groups, eps=1e-4, clip=0.5))


def test_constant_step_rewards_reduce_to_outcome_credit():
    final = torch.tensor([1.0, 3.0, 2.0, 6.0, 2.0, 4.0], dtype=D)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    outcome = group_advantages(final, groups)
    n = 4
    # A step-reward matrix whose steps all carry the sample's reward: every step gets the outcome advantage.
    same = stepwise_group_advantages(final[:, None].expand(-1, n), groups)
    assert torch.equal(same, outcome[:, None].expand(-1, n))
    # Through TP-GRPO: R_0 = 0 and equal increments d_t = R_n / n. Step 1 is a turning point by the
    # first-step rule (reward R_n - R_0 = R_n), no later step is (every s_t > 0), so the step rewards are
    # R_n, R_n / n, ..., R_n / n: affine in R_n, hence the outcome advantage at every step after stepwise
    # normalisation, exactly up to eps: (R_n / n - m / n) / (s / n + eps) = (R_n - m) / (s + n eps).
    R = torch.stack([final * (t + 1) / n for t in range(n)], dim=1)
    step_rewards, turning = turning_point_rewards(R, torch.zeros_like(final))
    assert turning[:, 0].all() and not turning[:, 1:].any()
    assert torch.allclose(step_rewards, torch.cat([final[:, None], (final / n)[:, None].expand(-1, n - 1)], 1),
                          atol=1e-12, rtol=0)
    adv = stepwise_group_advantages(step_rewards, groups, eps=1e-4)
    assert torch.allclose(adv[:, 0], outcome, atol=1e-12, rtol=0)
    scaled_eps = group_advantages(final, groups, eps=n * 1e-4)
    assert torch.allclose(adv[:, 1:], scaled_eps[:, None].expand(-1, n - 1), atol=1e-12, rtol=0)
    tiny = stepwise_group_advantages(step_rewards, groups, eps=1e-12)
    assert torch.allclose(tiny, group_advantages(final, groups, eps=1e-12)[:, None].expand(-1, n),
                          atol=1e-9, rtol=0)


# ---------------------------------------------------------------------------------------------- cosine credit


def unit(i, dim=4):
    v = torch.zeros(dim, dtype=D)
    v[i] = 1.0
    return v


def test_cosine_weights_hand_values():
    # x_fin = e0. Predictions: e1 (c=0), (e0+e1)/sqrt2 (c=1/sqrt2), e0+0.2e2 (c=1/sqrt(1.04)).
    final = unit(0)[None]
    preds = torch.stack([unit(1), (unit(0) + unit(1)), unit(0) + 0.2 * unit(2)])[None]
    rho = cosine_credit(preds, final)
    c = torch.tensor([0.0, 1 / math.sqrt(2), 1 / math.sqrt(1.04)], dtype=D)
    g = torch.cat([c[1:], torch.ones(1, dtype=D)]) - c
    w = g / g.sum()
    expected = torch.stack([w.sum(), w[1:].sum(), w[2:].sum()])
    assert torch.allclose(rho[0], expected, atol=1e-12, rtol=0)
    assert rho[0, 0].item() == 1.0
    assert rho.dtype == D


def test_cosine_weights_are_a_non_increasing_reward_to_go_starting_at_one():
    torch.manual_seed(0)
    preds = torch.randn(5, 12, 3, 4, 4)
    final = torch.randn(5, 3, 4, 4)
    for window, alpha in ((1, 0.0), (3, 0.0), (5, 0.3)):
        rho = cosine_credit(preds, final, window=window, alpha=alpha)
        assert rho.shape == (5, 12) and rho.dtype == torch.float32
        assert torch.equal(rho[:, 0], torch.ones(5))
        assert (rho[:, 1:] <= rho[:, :-1] + 1e-7).all()
        assert (rho >= alpha - 1e-7).all()


def test_a_jump_to_the_final_image_puts_all_weight_on_that_step():
    # Predictions orthogonal to x_fin up to step k (0-based), equal to it from step k + 1 on: only the
    # transition of step k makes progress, so w_k = 1, rho = 1 up to step k and 0 after.
    final = unit(0)[None]
    k, T = 2, 5
    preds = torch.stack([unit(1) if t <= k else unit(0) for t in range(T)])[None]
    rho = cosine_credit(preds, final)
    assert rho[0].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    mixed = cosine_credit(preds, final, alpha=0.25)
    assert mixed[0].tolist() == [1.0, 1.0, 1.0, 0.25, 0.25]


def test_window_averaging():
    # c = 0, 0.5, 0.5, 1, 1 then c_6 = 1: g = 0.5, 0, 0.5, 0, 0.
    final = unit(0)[None]
    cos_targets = [0.0, 0.5, 0.5, 1.0, 1.0]
    preds = torch.stack([c * unit(0) + math.sqrt(1 - c * c) * unit(1) for c in cos_targets])[None]
    plain = cosine_credit(preds, final)
    assert plain[0].tolist() == pytest.approx([1.0, 0.5, 0.5, 0.0, 0.0], abs=1e-12)
    # W = 2: blocks (0.5, 0) -> 0.25, 0.25; (0.5, 0) -> 0.25, 0.25; (0) -> 0. Weights 0.25 each on 4 steps.
    windowed = cosine_credit(preds, final, window=2)
    assert windowed[0].tolist() == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0], abs=1e-12)
    # W = 3: blocks (0.5, 0, 0.5) -> 1/3 each; (0, 0) -> 0.
    w3 = cosine_credit(preds, final, window=3)
    assert w3[0].tolist() == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0, 0.0], abs=1e-12)


def test_uniform_weights_when_no_step_makes_progress():
    # Every prediction is already the final image (c = 1 everywhere): g = 0, so w = 1/T.
    final = torch.randn(2, 6, dtype=D)
    preds = final[:, None].expand(-1, 4, -1) * torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=D)[None, :, None]
    rho = cosine_credit(preds, final)
    assert torch.allclose(rho, torch.tensor([[1.0, 0.75, 0.5, 0.25]] * 2, dtype=D), atol=1e-12, rtol=0)
    # A step that moves away from the final image gets no credit; the one that comes back gets it all.
    away = torch.stack([unit(0), unit(1)])[None]
    assert cosine_credit(away, unit(0)[None])[0].tolist() == pytest.approx([1.0, 1.0], abs=1e-12)


def test_cosine_credit_arguments_are_checked():
    with pytest.raises(ValueError, match="window"):
        cosine_credit(torch.zeros(1, 2, 3), torch.zeros(1, 3), window=0)
    with pytest.raises(ValueError, match="alpha"):
        cosine_credit(torch.zeros(1, 2, 3), torch.zeros(1, 3), alpha=1.5)
    with pytest.raises(ValueError, match="x_final"):
        cosine_credit(torch.zeros(1, 2, 3), torch.zeros(1, 4))
