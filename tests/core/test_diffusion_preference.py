"""Diffusion preference objectives (DGPO, Diffusion-DPO, D3PO): hand-derived values, numbers produced by
the authors' own code on the same inputs, invariances, direction and clear errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flowrl.core.diffusion_preference import DGPOOutput, d3po_loss, dgpo_loss, diffusion_dpo_loss
from flowrl.core.forward_losses import velocity_error
from flowrl.core.losses import dpo_loss

D = torch.float64


def t(*xs):
    return torch.tensor(xs, dtype=D)


def close(actual, expected, atol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


# The inputs of the reference tests (the same construction was fed to the authors' code; see
# tests/core/test_forward_losses.py).


def field(seed, shape):
    k = torch.arange(math.prod(shape), dtype=D)
    return (torch.sin(k * (0.37 + 0.11 * seed) + 1.3 * seed) * (1.0 + 0.1 * seed)).reshape(shape)


SHAPE = (6, 2, 2, 3)
X0, EPS = field(1, SHAPE), field(2, SHAPE)
U = EPS - X0
V = U + 0.3 * field(3, SHAPE)
V_REF = U + 0.4 * field(5, SHAPE)
V_OLD_DGPO = U + 0.31 * field(8, SHAPE)
W = field(6, SHAPE)
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])
ADV = t(1.2, -0.4, -0.8, 2.5, -1.9, -0.6)


def projected_grad(loss_of_v):
    v = V.clone().requires_grad_(True)
    loss = loss_of_v(v)
    (g,) = torch.autograd.grad(loss, v)
    return loss.detach(), (g * W).sum()


# --------------------------------------------------------------------------------------------------
# DGPO


def test_dgpo_hand_values():
    # One group of 2: err = [1, 2], err_ref = [1.5, 1.5], A = [1, -1], beta = 2:
    # s = 2 / 2 * (1 * (1 - 1.5) + (-1) * (2 - 1.5)) = -1; loss = softplus(-1) / 2 = log(1 + e^-1) / 2.
    err = t(1.0, 2.0).requires_grad_(True)
    out = dgpo_loss(err, t(1.5, 1.5), t(1.0, -1.0), [0, 0], beta=2.0)
    assert isinstance(out, DGPOOutput)
    close(out.loss, math.log1p(math.exp(-1.0)) / 2)
    # d loss / d err_i = sigmoid(s) * A_i / n_g (the 1 / beta cancels beta): sigmoid(-1) / 2 * [1, -1]
    (g,) = torch.autograd.grad(out.loss, err)
    sig = 1 / (1 + math.e)
    close(g, [sig / 2, -sig / 2])
    close(out.group_weight, sig)
    close(out.implicit_acc, 1.0)  # s < 0: the positive half is already preferred


def test_dgpo_two_groups_of_unequal_size_and_sum_reduction():
    # Group 0 = rows {0, 1}: s0 = 1 / 2 * (2 * (1 - 0) + (-2) * (0 - 0)) = 1; group 1 = row {2}: s1 = 0.5 * 2 = 1.
    err, ref = t(1.0, 0.0, 2.0), t(0.0, 0.0, 0.0)
    adv = t(2.0, -2.0, 0.5)
    mean = dgpo_loss(err, ref, adv, [5, 5, 9], beta=1.0)
    close(mean.loss, math.log1p(math.e))  # (softplus(1) + softplus(1)) / 2
    close(dgpo_loss(err, ref, adv, [5, 5, 9], beta=1.0, reduction="sum").loss, 2 * math.log1p(math.e))


def test_dgpo_advantages_are_clipped():
    # A = 10 is clipped to 5: s = 1 * 5 * (1 - 0) / 1 = 5.
    close(dgpo_loss(t(1.0), t(0.0), t(10.0), [0], beta=1.0).loss, F.softplus(torch.tensor(5.0, dtype=D)))


def test_dgpo_shared_error_offsets_cancel():
    # A constant added to every error and reference error of a row changes nothing (the implicit reward is
    # a difference), and a zero-advantage row never matters.
    base = dgpo_loss(t(1.0, 2.0, 0.3), t(1.5, 1.5, 0.1), t(1.0, -1.0, 0.0), [0, 0, 0], beta=3.0).loss
    shifted = dgpo_loss(t(4.0, 2.5, 9.0), t(4.5, 2.0, 0.0), t(1.0, -1.0, 0.0), [0, 0, 0], beta=3.0).loss
    close(shifted, base.item())


# Reference: Luo-Yihong/DGPO, commit 01ceb4b83c0bbc55d96246fe1b6d9a3d4749ebd6, scripts/train_sd3_dgpo.py:
# compute_group_dgpo_loss_allreduce (lines 162-193; one process, so its all_reduce is the identity) with
# group_size 3 on the inputs above; for the clip case, the training-step lines 1127-1149 (advantage clamp,
# PPO-style ratio against the EMA snapshot, clip_dsm). The code's value is a surrogate; its gradient is the
# reference (flowrl's value is the DGPO objective / beta, whose gradient is the same).
@pytest.mark.parametrize("beta, clip, value, projected, clip_frac", [
    (100.0, None, 0.011211381739095007, 0.0897982557430407, 0.0),
    (10.0, None, 0.07301332051851968, 0.06940200773667868, 0.0),
    (100.0, 1e-2, 0.011211381739095007, 0.040485953522812305, 1 / 3),
])
def test_dgpo_gradient_matches_the_authors_code(beta, clip, value, projected, clip_frac):
    err_ref = velocity_error(V_REF, U)
    old_err = velocity_error(V_OLD_DGPO, U) if clip is not None else None
    outs = []

    def loss_of(v):
        out = dgpo_loss(velocity_error(v, U), err_ref, ADV, GROUPS, beta=beta, old_err=old_err, clip_range=clip)
        outs.append(out)
        return out.loss

    got, proj = projected_grad(loss_of)
    close(got, value)  # softplus form, flowrl's own number (not the code's surrogate value)
    close(proj, projected)
    close(outs[0].clip_frac, clip_frac)


def test_dgpo_direction_positive_rows_move_toward_the_target():
    v = V.clone().requires_grad_(True)
    out = dgpo_loss(velocity_error(v, U), velocity_error(V, U), ADV, GROUPS, beta=10.0)
    (g,) = torch.autograd.grad(out.loss, v)
    before, after = velocity_error(V, U), velocity_error(V - 0.05 * g, U)
    assert bool((after[ADV > 0] < before[ADV > 0]).all()) and bool((after[ADV < 0] > before[ADV < 0]).all())


@pytest.mark.parametrize("call, message", [
    (lambda: dgpo_loss(t(1.0), t(1.0), t(1.0), [0], beta=0.0), "beta must be a finite number > 0"),
    (lambda: dgpo_loss(t(1.0), t(1.0), t(1.0), [0], beta=1.0, clip_range=0.1), "old_err is required"),
    (lambda: dgpo_loss(t(1.0, 2.0), t(1.0), t(1.0, 1.0), [0, 0], beta=1.0),
     r"err_ref must be a tensor of shape \[B\] = \[2\]"),
    (lambda: dgpo_loss(t(1.0), t(1.0), t(1.0), [0], beta=1.0, reduction="none"), "reduction must be one of"),
])
def test_dgpo_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --------------------------------------------------------------------------------------------------
# Diffusion-DPO


def test_diffusion_dpo_hand_value_and_dpo_equivalence():
    # err_w = 1, err_l = 2, both reference errors 1.5: Delta_w = 0.5, Delta_l = -0.5; beta 1: -log sigmoid(1).
    loss = diffusion_dpo_loss(t(1.0), t(2.0), t(1.5), t(1.5), beta=1.0)
    close(loss, [math.log1p(math.exp(-1.0))])
    close(loss, dpo_loss(t(0.5), t(-0.5), beta=1.0))
    smoothed = diffusion_dpo_loss(t(1.0), t(2.0), t(1.5), t(1.5), beta=1.0, label_smoothing=0.1)
    close(smoothed, [0.9 * math.log1p(math.exp(-1.0)) + 0.1 * math.log1p(math.e)])


# Reference: SalesforceAIResearch/DiffusionDPO, commit 5233e75919f912f3f631958ee4ebb5b5204382d9, train.py
# lines 1125-1145 (chunk(2) into chosen / rejected, ref losses, -0.5 * beta_dpo, -logsigmoid mean), on the
# inputs above (rows 0-2 chosen, 3-5 rejected); flowrl beta = beta_dpo / 2.
@pytest.mark.parametrize("beta_dpo, value, projected", [
    (5000.0, 14.221473850537754, 7.894824685715342),
    (50.0, 0.7327799351020241, 0.09528326683375227),
])
def test_diffusion_dpo_matches_the_authors_code(beta_dpo, value, projected):
    err_ref = velocity_error(V_REF, U)

    def loss_of(v):
        err = velocity_error(v, U)
        return diffusion_dpo_loss(err[:3], err[3:], err_ref[:3], err_ref[3:], beta=beta_dpo / 2).mean()

    got, proj = projected_grad(loss_of)
    close(got, value)
    close(proj, projected, atol=1e-10)  # the saturated case has gradients of size ~50


def test_diffusion_dpo_reference_errors_get_no_gradient():
    ref = t(1.5).requires_grad_(True)
    loss = diffusion_dpo_loss(t(1.0).requires_grad_(True), t(2.0), ref, t(1.5), beta=1.0)
    loss.sum().backward()
    assert ref.grad is None


# --------------------------------------------------------------------------------------------------
# D3PO


def test_d3po_trajectory_hand_value_and_mask():
    # log-ratios w: [0.1, 0.2], l: [-0.1, 0.05]: Delta_w = 0.3, Delta_l = -0.05; beta 1: -log sigmoid(0.35).
    lw, ll = t(0.1, 0.2).reshape(1, 2), t(-0.1, 0.05).reshape(1, 2)
    zero = torch.zeros(1, 2, dtype=D)
    close(d3po_loss(lw, zero, ll, zero, beta=1.0), [math.log1p(math.exp(-0.35))])
    # only step 0 trained: Delta_w = 0.1, Delta_l = -0.1; the masked step may even hold -inf
    lw_inf = t(0.1, float("-inf")).reshape(1, 2)
    mask = torch.tensor([[True, False]])
    close(d3po_loss(lw_inf, zero, ll, zero, mask, beta=1.0), [math.log1p(math.exp(-0.2))])


def test_d3po_ratio_clip_clamps_each_step():
    # ratio_clip 0.1: log-ratios clamp to [log 0.9, log 1.1]; 0.5 -> log 1.1, -0.5 -> log 0.9.
    lw, ll = t(0.5, 0.0).reshape(1, 2).requires_grad_(True), t(-0.5, 0.0).reshape(1, 2)
    zero = torch.zeros(1, 2, dtype=D)
    loss = d3po_loss(lw, zero, ll, zero, beta=1.0, ratio_clip=0.1)
    close(loss, [math.log1p(math.exp(-(math.log(1.1) - math.log(0.9))))])
    (g,) = torch.autograd.grad(loss.sum(), lw)
    close(g[0, 0], 0.0)  # clamped step: no gradient
    assert g[0, 1] < 0


def test_d3po_per_step_hand_value():
    # per step: -log sigmoid(beta (d_w - d_l)): steps (0.1 - -0.1) = 0.2 and (0.2 - 0.05) = 0.15, mean.
    lw, ll = t(0.1, 0.2).reshape(1, 2), t(-0.1, 0.05).reshape(1, 2)
    zero = torch.zeros(1, 2, dtype=D)
    expected = (math.log1p(math.exp(-0.2)) + math.log1p(math.exp(-0.15))) / 2
    close(d3po_loss(lw, zero, ll, zero, beta=1.0, mode="per_step"), [expected])


# Reference: yk7333/d3po, commit 40d31758048f62ff49814eaa0403d820493ad374, scripts/rm/train_d3po.py:
# compare (lines 183-197) and the per-step loss lines 595-599 (beta 0.1, eps 0.1), run per step on 3 pairs
# x 4 steps of the log-probs below and averaged over the steps as its accumulation does.
def test_d3po_per_step_matches_the_authors_code():
    lp0 = (0.08 * field(9, (3, 4))).requires_grad_(True)
    lp1 = (0.08 * field(10, (3, 4))).requires_grad_(True)
    ref0, ref1 = 0.08 * field(11, (3, 4)), 0.08 * field(12, (3, 4))
    chosen_is_0 = torch.tensor([True, False, True])[:, None]  # rewards [0.9, 0.1, 0.5] vs [0.2, 0.7, 0.4]
    loss = d3po_loss(torch.where(chosen_is_0, lp0, lp1), torch.where(chosen_is_0, ref0, ref1),
                     torch.where(chosen_is_0, lp1, lp0), torch.where(chosen_is_0, ref1, ref0),
                     beta=0.1, mode="per_step", ratio_clip=0.1).mean()
    g0, g1 = torch.autograd.grad(loss, (lp0, lp1))
    close(loss, 0.6931842321455391)
    w2 = field(13, (3, 4))
    close((g0 * w2).sum(), -0.009192662037949072)
    close((g1 * w2).sum(), -0.0008963444595413207)
    assert int((g0 == 0).sum()) == 8  # the clamp removed the gradient of 8 of the 12 steps


@pytest.mark.parametrize("call, message", [
    (lambda: d3po_loss(t(0.1), t(0.0), t(0.1), t(0.0), beta=1.0, mode="sum"), "mode must be one of"),
    (lambda: d3po_loss(t(0.1), t(0.0), t(0.1), t(0.0), beta=1.0, ratio_clip=1.0),
     r"ratio_clip must be a number in \(0, 1\)"),
    (lambda: d3po_loss(t(0.1, 0.2), t(0.0), t(0.1), t(0.0), beta=1.0), "must have the same shape"),
])
def test_d3po_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
