"""Policy, KL and preference losses: hand-derived values (derivations in comments) and properties."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.core.losses import (
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    LossOutput,
    aggregate,
    clipped_policy_loss,
    dpo_loss,
    dppo_policy_loss,
    gaussian_kl,
    ipo_loss,
    kl_estimate,
    ratio_norm_policy_loss,
    simpo_loss,
)

D = torch.float64


def t(*xs, **kw):
    return torch.tensor(xs, dtype=D, **kw)


def close(actual, expected, atol=1e-9):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


# ---------------------------------------------------------------------------- aggregate

# L = [[1, 2, 3], [4, 5, 6], [7, 8, 9]], mask = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]: kept 1, 2 | 4 | (none)
AGG_L = t(1, 2, 3, 4, 5, 6, 7, 8, 9).reshape(3, 3)
AGG_M = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token_mean", 7 / 3),  # (1 + 2 + 4) / 3 = 2.3333333333333335
        ("seq_mean_token_mean", 2.75),  # row means 1.5 and 4; the empty row is excluded: (1.5 + 4) / 2
        ("seq_mean_token_sum", 7 / 3),  # row sums 3, 4, 0 over B = 3 rows
        ("seq_mean_token_sum_norm", 7 / 9),  # 7 / (B * T_max) = 7 / (3 * 3) = 0.7777777777777778
    ],
)
def test_aggregate_hand_values(mode, expected):
    close(aggregate(AGG_L, AGG_M, mode), expected)
    close(aggregate(AGG_L, AGG_M.float(), mode), expected)


def test_aggregate_two_rows_and_float_weights():
    L, m = AGG_L[:2], AGG_M[:2]
    close(aggregate(L, m, "seq_mean_token_sum"), 3.5)  # (3 + 4) / 2
    close(aggregate(L, m, "seq_mean_token_sum_norm"), 7 / 6)  # 7 / (2 * 3) = 1.1666666666666667
    close(aggregate(L, None, "token_mean"), 3.5)  # (1 + ... + 6) / 6 = 21 / 6
    # float mask = weights: (0.5*1 + 1*2 + 0*3 + 0.25*4) / (0.5 + 1 + 0 + 0.25) = 3.5 / 1.75 = 2
    close(aggregate(t(1, 2, 3, 4).reshape(2, 2), t(0.5, 1, 0, 0.25).reshape(2, 2), "token_mean"), 2.0)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_aggregate_zero_mask_is_zero_with_graph(mode):
    L = torch.randn(2, 3, dtype=D, requires_grad=True)
    out = aggregate(L, torch.zeros(2, 3, dtype=torch.bool), mode)
    assert out.item() == 0.0 and out.requires_grad
    out.backward()
    assert torch.equal(L.grad, torch.zeros(2, 3, dtype=D))


def test_token_mean_of_halves_weighted_by_token_counts_equals_whole():
    gen = torch.Generator().manual_seed(0)
    L = torch.randn(6, 5, generator=gen, dtype=D)
    m = torch.rand(6, 5, generator=gen) > 0.4
    n1, n2 = m[:3].sum(), m[3:].sum()
    halves = (aggregate(L[:3], m[:3], "token_mean") * n1 + aggregate(L[3:], m[3:], "token_mean") * n2) / (n1 + n2)
    close(halves, aggregate(L, m, "token_mean"), atol=1e-12)


def test_aggregate_errors():
    with pytest.raises(ValueError, match="mode.*'token_mean'.*'seq_mean_token_sum_norm'.*received 'mean'"):
        aggregate(AGG_L, AGG_M, "mean")
    with pytest.raises(ValueError, match="mask.*\\[3, 3\\].*\\[3, 2\\]"):
        aggregate(AGG_L, AGG_M[:, :2], "token_mean")


# ---------------------------------------------------------------------------- clipped policy loss


def test_clip_clips_positive_advantage():
    # rho = 1.5, eps = 0.2, A = 2: max(-2 * 1.5, -2 * 1.2) = max(-3, -2.4) = -2.4 = -1.2 A; constant -> no gradient
    logp = t(math.log(1.5), requires_grad=True)
    out = clipped_policy_loss(logp, t(0.0), t(2.0), clip_range=0.2)
    assert isinstance(out, LossOutput)
    close(out.loss, -2.4)
    close(out.clip_frac, 1.0)
    out.loss.backward()
    assert torch.equal(logp.grad, t(0.0))


def test_clipped_loss_hand_batch():
    # rho = [[1.5, 0.5], [0.5, 1.5]], A = [2, -2] per sample, eps = 0.2:
    #   (1.5, +2): max(-3, -2.4)  = -2.4 clipped   grad 0
    #   (0.5, +2): max(-1, -1.6)  = -1             grad -A rho = -1
    #   (0.5, -2): max(1, 1.6)    = 1.6 clipped    grad 0
    #   (1.5, -2): max(3, 2.4)    = 3              grad -A rho = 3
    # token_mean = (-2.4 - 1 + 1.6 + 3) / 4 = 0.3; grads / 4 = [[0, -0.25], [0, 0.75]]; clip_frac 2/4.
    # ratio_mean = (1.5 + 0.5 + 0.5 + 1.5) / 4 = 1.
    # approx_kl: (1.5 - 1) - log 1.5 = 0.09453489189183562, (0.5 - 1) - log 0.5 = 0.1931471805599453,
    #   mean = 0.14384103622589045.
    old = t(0.3, -1.0, 2.0, 0.0).reshape(2, 2)
    logp = (old + torch.log(t(1.5, 0.5, 0.5, 1.5).reshape(2, 2))).requires_grad_()
    out = clipped_policy_loss(logp, old, t(2.0, -2.0), clip_range=0.2)
    close(out.loss, 0.3)
    close(out.clip_frac, 0.5)
    close(out.ratio_mean, 1.0)
    close(out.approx_kl, 0.14384103622589045)
    for metric in out[1:]:
        assert not metric.requires_grad and metric.ndim == 0
    out.loss.backward()
    close(logp.grad, [[0.0, -0.25], [0.0, 0.75]])
    # [B, T] advantages and an explicit all-ones mask give the same
    out2 = clipped_policy_loss(logp, old, t(2.0, 2.0, -2.0, -2.0).reshape(2, 2), torch.ones(2, 2), clip_range=0.2)
    close(out2.loss, 0.3)
    # masking the two clipped elements: (-1 + 3) / 2 = 1, clip_frac 0
    out3 = clipped_policy_loss(logp, old, t(2.0, -2.0), torch.tensor([[False, True], [False, True]]), clip_range=0.2)
    close(out3.loss, 1.0)
    close(out3.clip_frac, 0.0)
    # seq_mean_token_sum: row sums (-2.4 - 1) = -3.4 and (1.6 + 3) = 4.6, mean 0.6
    close(clipped_policy_loss(logp, old, t(2.0, -2.0), clip_range=0.2, aggregation="seq_mean_token_sum").loss, 0.6)


def test_clip_higher_and_dual_clip():
    # clip_range 0.2, clip_range_high 0.28: rho 1.5, A = 1 -> max(-1.5, -1.28) = -1.28;
    # rho 0.5, A = -1 -> max(0.5, 0.8) = 0.8
    logp = torch.log(t(1.5, 0.5))
    out = clipped_policy_loss(
        logp, t(0.0, 0.0), t(1.0, -1.0), clip_range=0.2, clip_range_high=0.28, aggregation="seq_mean_token_sum"
    )
    close(out.loss, (-1.28 + 0.8) / 2)
    # Dual clip c = 3, rho = 4, A = -1: max(4, 1.2) = 4, then min(4, -A c = 3) = 3; constant -> no gradient.
    logp = torch.log(t(4.0)).requires_grad_()
    out = clipped_policy_loss(logp, t(0.0), t(-1.0), clip_range=0.2, dual_clip=3.0)
    close(out.loss, 3.0)
    close(out.clip_frac, 1.0)
    out.loss.backward()
    assert torch.equal(logp.grad, t(0.0))
    # below the cap it does nothing: rho 1.5, A = -2 -> 3 < 6; without dual clip rho 4 gives 4
    close(clipped_policy_loss(torch.log(t(1.5)), t(0.0), t(-2.0), clip_range=0.2, dual_clip=3.0).loss, 3.0)
    close(clipped_policy_loss(torch.log(t(4.0)), t(0.0), t(-1.0), clip_range=0.2).loss, 4.0)
    # positive advantages are never dual-clipped: rho 4, A = 1 -> max(-4, -1.2) = -1.2
    close(clipped_policy_loss(torch.log(t(4.0)), t(0.0), t(1.0), clip_range=0.2, dual_clip=3.0).loss, -1.2)


def test_on_policy_loss_is_minus_mean_advantage_and_gradient_is_policy_gradient():
    gen = torch.Generator().manual_seed(3)
    B, T = 5, 7
    logp = torch.randn(B, T, generator=gen, dtype=D).requires_grad_()
    A = torch.randn(B, generator=gen, dtype=D)
    m = torch.rand(B, T, generator=gen) > 0.3
    out = clipped_policy_loss(logp, logp.detach().clone(), A, m, clip_range=0.2)
    mf = m.to(D)
    A_bt = A[:, None].expand(B, T)
    close(out.loss, -(A_bt * mf).sum() / mf.sum(), atol=1e-12)
    close(out.ratio_mean, 1.0)
    close(out.clip_frac, 0.0)
    close(out.approx_kl, 0.0)
    out.loss.backward()
    close(logp.grad, -A_bt * mf / mf.sum(), atol=1e-12)


def test_masked_padding_with_inf_and_nan_is_ignored():
    # Element (0, 1) is padding holding -inf and NaN; the unmasked elements are on-policy with A = [1, -3]:
    # token_mean = (-1 + 3 + 3) / 3 = 5/3; gradient -A / 3 on unmasked, 0 on padding.
    logp = t(0.0, float("-inf"), 0.5, 0.5).reshape(2, 2).requires_grad_()
    old = t(0.0, float("nan"), 0.5, 0.5).reshape(2, 2)
    m = torch.tensor([[True, False], [True, True]])
    out = clipped_policy_loss(logp, old, t(1.0, -3.0), m, clip_range=0.2)
    close(out.loss, 5 / 3)
    close(out.ratio_mean, 1.0)
    close(out.approx_kl, 0.0)
    out.loss.backward()
    close(logp.grad, [[-1 / 3, 0.0], [1.0, 1.0]])
    close(aggregate(t(1.0, float("nan")).reshape(1, 2), m[:1], "token_mean"), 1.0)


def test_bf16_logp_is_upcast():
    logp = torch.log(torch.tensor([1.5, 1.0])).to(torch.bfloat16)
    out = clipped_policy_loss(logp, logp.clone(), torch.tensor([1.0, 1.0]), clip_range=0.2)
    assert out.loss.dtype == torch.float32
    close(out.loss, -1.0)


def test_ratio_clamp_keeps_loss_finite():
    out = clipped_policy_loss(t(100.0), t(0.0), t(-1.0), clip_range=0.2)
    # log-ratio clamped at 20: loss = -A * exp(20) = 485165195.4097903
    close(out.loss, 485165195.4097903, atol=1e-3)


def test_clipped_loss_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages.*\\[B\\] = \\[2\\].*\\[3\\]"):
        clipped_policy_loss(x, x, torch.zeros(3), clip_range=0.2)
    with pytest.raises(ValueError, match="old_logp"):
        clipped_policy_loss(x, torch.zeros(2, 2), torch.zeros(2), clip_range=0.2)
    with pytest.raises(ValueError, match="dual_clip.*> 1.*0.5"):
        clipped_policy_loss(x, x, torch.zeros(2), clip_range=0.2, dual_clip=0.5)
    with pytest.raises(ValueError, match="aggregation"):
        clipped_policy_loss(x, x, torch.zeros(2), clip_range=0.2, aggregation="sum")
    with pytest.raises(ValueError, match="clip_range"):
        clipped_policy_loss(x, x, torch.zeros(2), clip_range=1.5)
    assert POLICY_LOSSES.get("clipped") is clipped_policy_loss


# ---------------------------------------------------------------------------- one Gaussian step: RatioNorm, Flow-DPPO
#
# The reference implementations below are written in this file from a reading of the authors' code (nothing is
# imported or copied from it) and fed the same float64 inputs as flowrl's loss; values and gradients must agree.
#
# A rollout step of Flow-GRPO's SDE (flow_grpo/diffusers_patch/sd3_sde_with_logprob.py, "sde" branch):
#   mean(v) = x (1 + g^2 dt / (2 sigma)) + v (1 + g^2 (1 - sigma) / (2 sigma)) dt,  std = g sqrt(-dt),
#   log_prob = mean_d [-(x_next - mean)^2 / (2 std^2) - log std - log sqrt(2 pi)]
# with g the authors' std_dev_t. Rows are samples at one step, as in the authors' micro-batches.

STEP_SHAPE = (2, 3, 4)  # D = 24 elements per sample


def sde_mean(v, x, sigma, g, dt):
    return x * (1 + g**2 / (2 * sigma) * dt) + v * (1 + g**2 * (1 - sigma) / (2 * sigma)) * dt


def sde_log_prob(x_next, mean, std):
    per = -((x_next.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))
    return per.mean(dim=tuple(range(1, per.ndim)))


def step_inputs(rows: int, spread: float, seed: int = 0, sigma: float = 0.7, dt: float = -0.1, g: float = 0.6):
    """A stored transition of ``rows`` samples (rollout velocity ``v_old``) and a current velocity ``v``:
    ``(v, v_old, x, x_next, sigma, g, dt, advantages)`` in float64; ``spread`` scales ``v - v_old`` per row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, *STEP_SHAPE, generator=gen, dtype=D)
    v_old = torch.randn(rows, *STEP_SHAPE, generator=gen, dtype=D)
    scale = torch.as_tensor(spread, dtype=D).reshape(-1, 1, 1, 1) if not isinstance(spread, float) else spread
    v = v_old + scale * torch.randn(rows, *STEP_SHAPE, generator=gen, dtype=D)
    std = g * math.sqrt(-dt)
    x_next = sde_mean(v_old, x, sigma, g, dt) + std * torch.randn(rows, *STEP_SHAPE, generator=gen, dtype=D)
    adv = 4.0 * torch.rand(rows, generator=gen, dtype=D) - 2.0
    return v, v_old, x, x_next, sigma, torch.tensor(g, dtype=D), torch.tensor(dt, dtype=D), adv


def value_and_grad(fn, v):
    v = v.clone().requires_grad_(True)
    loss = fn(v)
    loss = loss.loss if isinstance(loss, LossOutput) else loss
    (grad,) = torch.autograd.grad(loss, v)
    return loss.detach(), grad


# GRPO-Guard as its authors wrote it: Jing Wang's commit "GRPO-Guard" to Flow-GRPO (jingw193, merged into
# yifan123/flow_grpo as PR #175; read at zhtmike/flow_grpo, commit 2e2f712e9feb19246fa0db9527878e2766b5353f),
# scripts/train_sd3_GRPO_Guard.py lines 912-932 (the `config.rationorm` branches of the training loop): the
# bias is the squared mean shift averaged over `dim=tuple(range(1, log_prob.ndim))`, which for the [B] log-prob
# is an empty tuple, i.e. over the whole micro-batch and every element; divided by 2 (sqrt_dt.mean() *
# std_dev_t.mean())^2; ratio = exp((log_prob - old_log_prob + bias) * sqrt_dt.mean() * std_dev_t.mean()); PPO's
# clip with clip_range on both sides; the mean over the micro-batch divided by sqrt_dt.mean()^2.
def grpo_guard_authors(log_prob, old_log_prob, mean, old_mean, std_dev_t, sqrt_dt, advantages, clip_range,
                       adv_clip_max=5.0):
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    sigma_t = std_dev_t.mean()
    bias = (mean - old_mean).pow(2).mean(dim=tuple(range(1, log_prob.ndim)))
    bias = bias / (2 * (sqrt_dt.mean() * sigma_t) ** 2)
    ratio = torch.exp((log_prob - old_log_prob + bias) * (sqrt_dt.mean() * sigma_t))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.mean(torch.maximum(unclipped, clipped)) / sqrt_dt.mean() ** 2


# The same loss as verl-omni writes it (verl-project/verl-omni, commit a1139bafffb5b9711f0a6b6edff8ecaa60bfff30,
# verl_omni/trainer/diffusion/diffusion_algos.py, GRPOGuardLoss.compute_loss): the squared mean shift averaged
# over the non-batch dimensions only, i.e. one bias per sample; otherwise as above.
def grpo_guard_verl_omni(log_prob, old_log_prob, mean, old_mean, std_dev_t, sqrt_dt, advantages, clip_ratio,
                         adv_clip_max=5.0):
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    scale = sqrt_dt.mean() * std_dev_t.mean()
    mean_diff_sq = (mean - old_mean).pow(2).mean(dim=tuple(range(1, mean.ndim)))
    ratio = torch.exp((log_prob - old_log_prob + mean_diff_sq / (2 * scale**2)) * scale)
    per_elem = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio))
    return torch.mean(per_elem) / sqrt_dt.mean() ** 2


def guard_setup(rows=6, spread=0.3):
    v, v_old, x, x_next, sigma, g, dt, adv = step_inputs(rows, spread)
    std, sqrt_dt = g * torch.sqrt(-dt), torch.sqrt(-dt)
    old_mean = sde_mean(v_old, x, sigma, g, dt)
    old_logp = sde_log_prob(x_next, old_mean, std)

    def current(v):
        mean = sde_mean(v, x, sigma, g, dt)
        return mean, sde_log_prob(x_next, mean, std)

    def flowrl(v, eps=3e-3):
        mean, logp = current(v)
        return ratio_norm_policy_loss(logp, old_logp, adv, mean, old_mean, std, dt, clip_range=eps)

    return v, current, old_mean, old_logp, g, sqrt_dt, adv, flowrl


def test_ratio_norm_matches_the_grpo_guard_authors_code_per_sample():
    v, current, old_mean, old_logp, g, sqrt_dt, adv, flowrl = guard_setup()
    out = flowrl(v.clone())
    # Both branches of the clip are exercised (a loss that never clips would not test the clip).
    assert 0 < float(out.clip_frac) < 1
    got, grad = value_and_grad(flowrl, v)

    # The authors average their bias over the micro-batch; flowrl keeps one per sample (docs/algorithms.md, section
    # 5): with one sample per micro-batch the two are the same, so flowrl's loss is the mean of the authors' losses
    # of the rows taken one at a time.
    def authors_one_row_at_a_time(v):
        mean, logp = current(v)
        return torch.stack([grpo_guard_authors(logp[i:i + 1], old_logp[i:i + 1], mean[i:i + 1], old_mean[i:i + 1],
                                               g.expand(1, 1, 1, 1), sqrt_dt.expand(1, 1, 1, 1), adv[i:i + 1], 3e-3)
                            for i in range(len(adv))]).mean()

    ref, ref_grad = value_and_grad(authors_one_row_at_a_time, v)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


def test_ratio_norm_matches_verl_omni_and_departs_from_the_authors_batch_mean_bias():
    # Rows whose mean shifts differ by 10x: a batch-mean bias then centres each row by the wrong KL.
    v, current, old_mean, old_logp, g, sqrt_dt, adv, flowrl = guard_setup(spread=t(0.05, 0.5, 0.1, 1.0, 0.3, 0.02))
    got, grad = value_and_grad(flowrl, v)

    def verl_omni(v):
        mean, logp = current(v)
        return grpo_guard_verl_omni(logp, old_logp, mean, old_mean, g.expand(6, 1, 1, 1),
                                    sqrt_dt.expand(6, 1, 1, 1), adv, 3e-3)

    ref, ref_grad = value_and_grad(verl_omni, v)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)

    def authors_whole_batch(v):
        mean, logp = current(v)
        return grpo_guard_authors(logp, old_logp, mean, old_mean, g.expand(6, 1, 1, 1), sqrt_dt.expand(6, 1, 1, 1),
                                  adv, 3e-3)

    batch, _ = value_and_grad(authors_whole_batch, v)
    assert abs(float(batch - got)) > 1e-3 * abs(float(got))


def test_ratio_norm_hand_values():
    # D = 2, std s = 0.5, old mean 0, x_next = s z with z = [1, -1], new mean [0.1, 0.3], |dt| = 0.25.
    # logp = -mean((x_next - mean)^2) / (2 s^2) + c = -mean(0.16, 0.64) / 0.5 + c = -0.8 + c;
    # old_logp = -mean(0.25, 0.25) / 0.5 + c = -0.5 + c; KL = mean(0.01, 0.09) / 0.5 = 0.1.
    # normalised log-ratio = (-0.3 + 0.1) * 0.5 = -0.1 = mean_d(z (mean - old_mean)); rho = e^-0.1.
    s, x_next, old_mean = 0.5, t(0.5, -0.5).reshape(1, 2), torch.zeros(1, 2, dtype=D)

    def loss(mean, adv, eps):
        logp = -((x_next - mean) ** 2).mean(dim=1) / (2 * s * s) - math.log(s) - 0.5 * math.log(2 * math.pi)
        old = -((x_next - old_mean) ** 2).mean(dim=1) / (2 * s * s) - math.log(s) - 0.5 * math.log(2 * math.pi)
        return ratio_norm_policy_loss(logp, old, t(adv), mean, old_mean, s, -0.25, clip_range=eps)

    rho = math.exp(-0.1)
    mean = t(0.1, 0.3).reshape(1, 2).requires_grad_(True)
    out = loss(mean, 2.0, 0.2)  # inside [0.8, 1.2]: L = -A rho / |dt|
    close(out.loss, -2.0 * rho / 0.25)
    close(out.ratio_mean, rho)
    close(out.clip_frac, 0.0)
    close(out.approx_kl, math.exp(-0.3) - 1 + 0.3)  # k3 of the raw log-ratio -0.3
    (grad,) = torch.autograd.grad(out.loss, mean)
    # d/dmean of -A exp(mean_d(z (mean - old_mean))) / |dt| = -A rho z / (D |dt|)
    close(grad, [[-2.0 * rho * 0.5 / 0.25, 2.0 * rho * 0.5 / 0.25]])
    # A = -2 with eps 0.05: rho < 0.95 makes -A clip(rho) = 1.9 the larger branch: clipped, constant, no gradient.
    mean = t(0.1, 0.3).reshape(1, 2).requires_grad_(True)
    out = loss(mean, -2.0, 0.05)
    close(out.loss, 1.9 / 0.25)
    close(out.clip_frac, 1.0)
    (grad,) = torch.autograd.grad(out.loss, mean)
    close(grad, [[0.0, 0.0]])


def test_ratio_norm_is_one_on_policy_whatever_the_step():
    # Unchanged policy: mean = old mean, logp = old logp, so the normalised ratio is exactly 1 and the loss -A / |dt|.
    mean = torch.randn(3, 4, dtype=D)
    out = ratio_norm_policy_loss(t(-1.0, -2.0, -3.0), t(-1.0, -2.0, -3.0), t(1.0, -1.0, 3.0), mean, mean.clone(),
                                 t(0.3, 0.2, 0.1), t(0.1, 0.1, 0.2), clip_range=1e-6)
    close(out.ratio_mean, 1.0)
    close(out.loss, (-1.0 / 0.1 + 1.0 / 0.1 - 3.0 / 0.2) / 3)


# Flow-DPPO as UniRL writes it (Tencent-Hunyuan/UniRL, commit 1a7b501e8fe8517b432a130220d2ff462f9b5afa,
# unirl/algorithms/flowdppo.py, _flowdppo_kl_adv_loss and FlowDPPO._compute_sigma_t): rows [B, S'] of steps, the
# KL (new - old)^2 / (2 sigma_t^2) averaged over the latent dimensions, sigma_t = sqrt(s / (1 - min(s, 0.99))) eta
# sqrt(-dt); keep where KL < threshold; among the others drop (ratio > 1 and A > 0) or (ratio < 1 and A < 0); the
# loss is the mean of where(keep, -A ratio, 0). verl-omni's FlowDPPOLoss (commit a1139baf, diffusion_algos.py) is
# the same with KL >= threshold marking the far rows.
def flow_dppo_unirl(new_logp, old_logp, new_means, old_means, advantages, sigma_t, threshold):
    ratio = torch.exp(new_logp - old_logp)
    adv = advantages.detach()
    unclipped = -adv * ratio
    kl = ((new_means - old_means) ** 2 / (2 * sigma_t**2)).mean(dim=tuple(range(2, new_means.ndim)))
    near = kl < threshold
    drop = (~near & (ratio > 1.0) & (adv > 0)) | (~near & (ratio < 1.0) & (adv < 0))
    return torch.where(~drop, unclipped, torch.zeros((), dtype=unclipped.dtype)).mean(), drop


def test_flow_dppo_matches_the_unirl_code():
    rows = 32
    # Mean shifts over two decades, so that the rows' KLs (about 2e-5 to 0.2) straddle the threshold.
    spread = torch.logspace(-2, 0, rows, dtype=D)[torch.randperm(rows, generator=torch.Generator().manual_seed(1))]
    v, v_old, x, x_next, sigma, g, dt, adv = step_inputs(rows, spread, seed=3)
    std = g * torch.sqrt(-dt)
    old_mean = sde_mean(v_old, x, sigma, g, dt)
    old_logp = sde_log_prob(x_next, old_mean, std)
    threshold = 5e-3

    def flowrl(v):
        mean = sde_mean(v, x, sigma, g, dt)
        return dppo_policy_loss(sde_log_prob(x_next, mean, std), old_logp, adv, mean, old_mean, std,
                                threshold=threshold)

    # UniRL's sigma_t from its noise level eta (sigma = 0.7 < 0.99, so its clamp does not act): the same std.
    eta = g / math.sqrt(sigma / (1 - sigma))
    sigma_t = math.sqrt(sigma / (1 - min(sigma, 0.99))) * eta * torch.sqrt(-dt)

    def unirl(v):
        mean = sde_mean(v, x, sigma, g, dt)
        return flow_dppo_unirl(sde_log_prob(x_next, mean, std)[:, None], old_logp[:, None], mean[:, None],
                               old_mean[:, None], adv[:, None], sigma_t.reshape(1, 1, 1, 1, 1), threshold)

    got, grad = value_and_grad(flowrl, v)
    ref, ref_grad = value_and_grad(lambda v: unirl(v)[0], v)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    # Every case of the mask occurs: near rows, far rows dropped, far rows kept because they move back.
    drop = unirl(v)[1].flatten()
    far = gaussian_kl(sde_mean(v, x, sigma, g, dt), old_mean, std) >= threshold
    assert 0 < int(far.sum()) < rows and 0 < int(drop.sum()) < int(far.sum())
    close(flowrl(v).clip_frac, float(drop.to(D).mean()))


def test_flow_dppo_hand_values():
    # std 1, D = 1, old mean 0: KL = mean^2 / 2, 0.005 (near) or 0.5 (far) against a threshold of 0.1.
    # rows: (log rho, A, mean) = (0.2, 1, 0.1) near: kept | (0.2, 1, 1) far, rho > 1, A > 0: dropped |
    # (-0.2, 1, 1) far but rho < 1 with A > 0 (corrective): kept | (-0.2, -1, 1) far, rho < 1, A < 0: dropped |
    # (0.2, -1, 1) far, corrective: kept.  loss = (-e^0.2 - e^-0.2 + e^0.2) / 5 = -e^-0.2 / 5.
    logp = t(0.2, 0.2, -0.2, -0.2, 0.2, requires_grad=True)
    mean = t(0.1, 1.0, 1.0, 1.0, 1.0).reshape(5, 1)
    out = dppo_policy_loss(logp, torch.zeros(5, dtype=D), t(1.0, 1.0, 1.0, -1.0, -1.0), mean,
                           torch.zeros(5, 1, dtype=D), 1.0, threshold=0.1)
    close(out.loss, -math.exp(-0.2) / 5)
    close(out.clip_frac, 0.4)
    (grad,) = torch.autograd.grad(out.loss, logp)
    e = math.exp(0.2)
    close(grad, [-e / 5, 0.0, -1 / e / 5, 0.0, e / 5])  # d(-A rho)/d log rho = -A rho; dropped rows 0


def test_step_losses_errors():
    x, m = torch.zeros(2), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="std must be > 0.*stochastic step"):
        dppo_policy_loss(x, x, x, m, m, 0.0, threshold=1e-5)
    with pytest.raises(ValueError, match="std must be a float or hold one value per row"):
        dppo_policy_loss(x, x, x, m, m, torch.ones(3), threshold=1e-5)
    with pytest.raises(ValueError, match="logp must have shape \\[B\\]"):
        dppo_policy_loss(m, m, m, m, m, 1.0, threshold=1e-5)
    with pytest.raises(ValueError, match="mean must have shape \\[B, ...\\] with B = 2"):
        dppo_policy_loss(x, x, x, torch.zeros(3, 3), torch.zeros(3, 3), 1.0, threshold=1e-5)
    with pytest.raises(ValueError, match="threshold must be a number > 0"):
        dppo_policy_loss(x, x, x, m, m, 1.0, threshold=0.0)
    with pytest.raises(ValueError, match="dt must be non-zero"):
        ratio_norm_policy_loss(x, x, x, m, m, 1.0, 0.0, clip_range=0.1)
    with pytest.raises(ValueError, match="clip_range"):
        ratio_norm_policy_loss(x, x, x, m, m, 1.0, 0.1, clip_range=1.5)
    assert POLICY_LOSSES.get("grpo_guard") is ratio_norm_policy_loss
    assert POLICY_LOSSES.get("flow_dppo") is dppo_policy_loss


# ---------------------------------------------------------------------------- KL


def test_kl_estimate_hand_values():
    # delta = logp - ref = [0, 1, -1, 2]
    logp, ref = t(0.5, 1.5, -0.5, 3.0), t(0.5, 0.5, 0.5, 1.0)
    close(kl_estimate(logp, ref, "k1"), [0.0, 1.0, -1.0, 2.0])
    close(kl_estimate(logp, ref, "k2"), [0.0, 0.5, 0.5, 2.0])
    # k3 = exp(-d) - 1 + d: 0; e^-1 = 0.36787944117144233; e - 2 = 0.7182818284590451; e^-2 + 1 = 1.1353352832366128
    close(kl_estimate(logp, ref, "k3"), [0.0, 0.36787944117144233, 0.7182818284590451, 1.1353352832366128])
    with pytest.raises(ValueError, match="kind.*'k1', 'k2', 'k3'.*received 'k4'"):
        kl_estimate(logp, ref, "k4")


def test_kl_estimates_properties():
    gen = torch.Generator().manual_seed(4)
    logp = torch.randn(64, 8, generator=gen) * 5
    ref = torch.randn(64, 8, generator=gen) * 5
    assert (kl_estimate(logp, ref, "k3") >= 0).all()
    assert torch.isfinite(kl_estimate(logp * 100, ref, "k3")).all()
    for kind in ("k1", "k2", "k3"):
        assert torch.equal(kl_estimate(logp, logp.clone(), kind), torch.zeros_like(logp))


def test_gaussian_kl_hand_values():
    # diffs [[1, 2], [3, 0]]: squared sums [5, 9]
    mean, ref = t(1, 2, 3, 0).reshape(2, 2), torch.zeros(2, 2, dtype=D)
    # std 0.5: 2 std^2 = 0.5 -> sum [10, 18], mean over D = 2 elements [5, 9]
    close(gaussian_kl(mean, ref, 0.5, reduction="sum"), [10.0, 18.0])
    close(gaussian_kl(mean, ref, 0.5), [5.0, 9.0])
    # per-sample std [1, 0.5]: sum [5 / 2, 9 / 0.5] = [2.5, 18], mean [1.25, 9]; also with image-like dims
    std_b = t(1.0, 0.5)
    close(gaussian_kl(mean, ref, std_b, reduction="sum"), [2.5, 18.0])
    close(gaussian_kl(mean.reshape(2, 1, 2, 1), ref.reshape(2, 1, 2, 1), std_b), [1.25, 9.0])
    # per-element std [[1, 0.5]]: sample 0: 1/2 + 4/0.5 = 8.5; sample 1: 9/2 + 0 = 4.5
    close(gaussian_kl(mean, ref, t(1.0, 0.5).reshape(1, 2), reduction="sum"), [8.5, 4.5])
    close(gaussian_kl(mean, ref, t(1.0, 0.5).reshape(1, 2)), [4.25, 2.25])
    with pytest.raises(ValueError, match="reduction"):
        gaussian_kl(mean, ref, 0.5, reduction="none")
    with pytest.raises(ValueError, match="std.*broadcastable.*\\[3\\]"):
        gaussian_kl(mean, ref, t(1.0, 1.0, 1.0))
    with pytest.raises(ValueError, match="std"):
        gaussian_kl(mean, ref, 0.0)


# ---------------------------------------------------------------------------- preference losses


def test_dpo_hand_values_and_label_smoothing():
    # z = Delta_w - Delta_l = [1, 0, -2], beta 0.5 -> x = [0.5, 0, -1]; loss = log(1 + e^-x):
    #   log(1 + e^-0.5) = 0.4740769841801067, log 2 = 0.6931471805599453, log(1 + e) = 1.3132616875182228
    dw, dl = t(1.0, 0.0, -1.0), t(0.0, 0.0, 1.0)
    close(dpo_loss(dw, dl, beta=0.5), [0.4740769841801067, 0.6931471805599453, 1.3132616875182228])
    # e = 0.1: -(0.9) log s(x) - 0.1 log s(-x) = 0.9 * 0.4740769841801067 + 0.1 * 0.9740769841801067
    #   = 0.5240769841801067 at x = 0.5; log 2 at x = 0; 0.9 * 1.3132616875182228 + 0.1 * 0.31326168751822286
    #   = 1.2132616875182228 at x = -1
    close(dpo_loss(dw, dl, beta=0.5, label_smoothing=0.1), [0.5240769841801067, 0.6931471805599453, 1.2132616875182228])


def test_preference_losses_numerically_stable():
    big = t(1000.0, -1000.0)
    out = dpo_loss(big, torch.zeros(2, dtype=D), beta=1.0)
    close(out, [0.0, 1000.0])
    close(simpo_loss(big, torch.zeros(2, dtype=D), beta=1.0, gamma=0.0), [0.0, 1000.0])
    x = torch.tensor([80.0, -80.0], requires_grad=True)  # float32: sigmoid(-80) underflows
    loss = dpo_loss(x, torch.zeros(2), beta=1.0).sum()
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()


def test_ipo_hand_values():
    # z = [1, 0, -2]; beta 0.5 -> target 1/(2 beta) = 1: (z - 1)^2 = [0, 1, 9]; beta 0.25 -> target 2: [1, 4, 16]
    dw, dl = t(1.0, 0.0, -1.0), t(0.0, 0.0, 1.0)
    close(ipo_loss(dw, dl, beta=0.5), [0.0, 1.0, 9.0])
    close(ipo_loss(dw, dl, beta=0.25), [1.0, 4.0, 16.0])


def test_simpo_hand_values():
    # beta 2, gamma 1: x = 2 * (-1 - -2) - 1 = 1 -> log(1 + e^-1) = 0.31326168751822286;
    #                  x = 2 * (-2 - -1) - 1 = -3 -> log(1 + e^3) = 3.048587351573742
    close(simpo_loss(t(-1.0, -2.0), t(-2.0, -1.0), beta=2.0, gamma=1.0), [0.31326168751822286, 3.048587351573742])


def test_preference_registry_and_errors():
    assert PREFERENCE_LOSSES.get("dpo") is dpo_loss
    assert PREFERENCE_LOSSES.get("ipo") is ipo_loss
    assert PREFERENCE_LOSSES.get("simpo") is simpo_loss
    with pytest.raises(ValueError, match="beta.*> 0.*-1"):
        dpo_loss(t(1.0), t(0.0), beta=-1)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(t(1.0), t(0.0), beta=1.0, label_smoothing=0.7)
    with pytest.raises(ValueError, match="same shape"):
        ipo_loss(t(1.0, 2.0), t(0.0), beta=1.0)
