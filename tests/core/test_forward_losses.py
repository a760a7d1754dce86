"""Forward-process objectives (CRD, DiffusionNFT, AWM) and snapshot schedules: hand-derived values,
numbers produced by the authors' own code on the same inputs, direction properties and clear errors."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.core.forward_losses import (
    ForwardLossOutput,
    adaptive_normaliser,
    awm_log_likelihood,
    awm_loss,
    crd_loss,
    group_mean,
    implicit_reward,
    nft_loss,
    reward_adaptive_kl_weight,
    reward_weights,
    velocity_error,
)
from flowrl.core.snapshots import (
    CRD_OLD_DECAY,
    CRD_SAMPLING_DECAY,
    EMA_REF_DECAY,
    NFT_DECAY,
    NFT_OCR_DECAY,
    DecaySchedule,
    snapshot_decay,
    update_snapshot_,
)

D = torch.float64


def t(*xs):
    return torch.tensor(xs, dtype=D)


def close(actual, expected, atol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


# --------------------------------------------------------------------------------------------------
# The inputs of the reference tests. The same construction (no RNG, so nothing depends on a torch
# version) was fed to the authors' code outside this repository; the numbers below are what it printed.


def field(seed, shape):
    k = torch.arange(math.prod(shape), dtype=D)
    return (torch.sin(k * (0.37 + 0.11 * seed) + 1.3 * seed) * (1.0 + 0.1 * seed)).reshape(shape)


SHAPE = (6, 2, 2, 3)
T_ROWS = t(0.9, 0.7, 0.5, 0.3, 0.8, 0.6)
ADV = t(1.2, -0.4, 2.5, -1.9, 0.3, -7.0)
X0, EPS = field(1, SHAPE), field(2, SHAPE)
X_T = (1 - T_ROWS.view(-1, 1, 1, 1)) * X0 + T_ROWS.view(-1, 1, 1, 1) * EPS
U = EPS - X0
V = U + 0.3 * field(3, SHAPE)
V_OLD = U + 0.35 * field(4, SHAPE)
V_REF = U + 0.4 * field(5, SHAPE)
V_EMA = U + 0.25 * field(7, SHAPE)
W = field(6, SHAPE)  # gradients are summarised as <grad, W>


def value_and_projected_grad(fn):
    v = V.clone().requires_grad_(True)
    out = fn(v)
    loss = out.loss if isinstance(out, ForwardLossOutput) else out
    (g,) = torch.autograd.grad(loss, v)
    return loss.detach(), (g * W).sum()


# --------------------------------------------------------------------------------------------------
# shared pieces


def test_reward_weights_hand_values():
    # clip to [-5, 5], then / 10 + 0.5
    close(reward_weights(t(-7.0, -5.0, 0.0, 2.5, 5.0, 9.0)), [0.0, 0.0, 0.5, 0.75, 1.0, 1.0])
    close(reward_weights(t(-1.0, 0.5), adv_clip=1.0), [0.0, 0.75])  # clip(A, -1, 1) / 2 + 0.5


def test_velocity_error_and_adaptive_normaliser_hand_values():
    v, u = t(1.0, -3.0).reshape(1, 2), torch.zeros(1, 2, dtype=D)
    close(velocity_error(v, u), [5.0])  # (1 + 9) / 2
    w = adaptive_normaliser(v, u)
    assert w.dtype == torch.float64 and not w.requires_grad
    close(w, [2.0])  # (|1| + |-3|) / 2
    close(adaptive_normaliser(u, u), [1e-5])  # the floor


def test_velocity_error_of_bf16_inputs_is_float32():
    v = torch.ones(2, 3, dtype=torch.bfloat16)
    assert velocity_error(v, torch.zeros_like(v)).dtype == torch.float32


def test_group_mean_with_arbitrary_ids():
    close(group_mean(t(1.0, 2.0, 3.0, 10.0), [7, 7, 7, 3]), [2.0, 2.0, 2.0, 10.0])
    close(group_mean(t(1.0, 3.0), ["a cat", "a cat"]), [2.0, 2.0])


def test_implicit_reward_hand_values():
    u = torch.zeros(1, 2, dtype=D)
    v = t(1.0, 1.0).reshape(1, 2)  # err 1, w 1 -> 1
    v_old = t(3.0, 1.0).reshape(1, 2)  # err (9 + 1) / 2 = 5, w (3 + 1) / 2 = 2 -> 2.5
    close(implicit_reward(v, v_old, u), [1.5])  # -(1 - 2.5)
    close(implicit_reward(v, v_old, u, adaptive=False), [4.0])  # -(1 - 5)


# --------------------------------------------------------------------------------------------------
# CRD
#
# Hand example: u = 0, D = 2, two groups {0, 1} and {2, 3}; v_old = [1, 1] everywhere (err 1).
# v rows [1, 1], [0, 0], [2, 0], [1, 0]: err 1, 0, 2, 0.5, so (non-adaptive) r_theta = -(err - 1) =
# [0, 1, -1, 0.5]; group means 0.5 and -0.25: Rtheta = [-0.5, 0.5, -0.75, 0.75].
# A = [5, -5, 2.5, 0]: r = [1, 0, 0.75, 0.5]; group means 0.5 and 0.625: Rc = [0.5, -0.5, 0.125, -0.125].

CRD_U = torch.zeros(4, 2, dtype=D)
CRD_V = t(1.0, 1.0, 0.0, 0.0, 2.0, 0.0, 1.0, 0.0).reshape(4, 2)
CRD_V_OLD = torch.ones(4, 2, dtype=D)
CRD_A = t(5.0, -5.0, 2.5, 0.0)
CRD_GROUPS = torch.tensor([0, 0, 1, 1])


@pytest.mark.parametrize("beta, expected", [
    # beta 1: (Rtheta - Rc) = [-1, 1, -0.875, 0.875]; squares [1, 1, 0.765625, 0.765625] x 5 / 1; mean 4.4140625
    (1.0, 4.4140625),
    # beta 2: (2 Rtheta - Rc) = [-1.5, 1.5, -1.625, 1.625]; squares x 5 / 2 = [5.625, 5.625, 6.6015625 x 2]
    (2.0, 6.11328125),
])
def test_crd_policy_term_hand_values(beta, expected):
    out = crd_loss(CRD_V, CRD_V_OLD, None, CRD_U, CRD_A, CRD_GROUPS, beta=beta, kl_coef=0.0, adaptive=False)
    close(out.loss, expected)
    close(out.policy_loss, expected)
    close(out.kl_loss, 0.0)


def test_crd_reward_adaptive_kl_hand_values():
    # v_ref = 0: kl = err(v) = [1, 0, 2, 0.5]; kappa 0.1, floor 1e-4: m = 1e-3,
    # weights 0.1 (1e-3 + r 0.999) = [0.1, 1e-4, 0.075025, 0.05005]; weighted [0.1, 0, 0.15005, 0.025025]
    out = crd_loss(CRD_V, CRD_V_OLD, torch.zeros(4, 2, dtype=D), CRD_U, CRD_A, CRD_GROUPS, kl_coef=0.1,
                   adaptive=False)
    close(out.kl_loss, 0.275075 / 4)
    close(out.loss, 4.4140625 + 0.275075 / 4)
    close(out.stats["kl_ref"], 3.5 / 4)
    close(reward_adaptive_kl_weight(t(1.0, 0.0, 0.75, 0.5), kl_coef=0.1), [0.1, 1e-4, 0.075025, 0.05005])
    # without the reward-adaptive weight every row gets kappa: 0.1 * 3.5 / 4
    plain = crd_loss(CRD_V, CRD_V_OLD, torch.zeros(4, 2, dtype=D), CRD_U, CRD_A, CRD_GROUPS, kl_coef=0.1,
                     adaptive=False, reward_adaptive=False)
    close(plain.kl_loss, 0.35 / 4)


def test_crd_prompt_normaliser_cancels_within_groups():
    # Raising the old errors of group {2, 3} by 1 shifts its r_theta by +1 (a per-prompt constant):
    # per-group centring removes it; pooled centring (one group) would not.
    v_old = CRD_V_OLD.clone()
    v_old[2:] = t(math.sqrt(3.0), 1.0)  # err (3 + 1) / 2 = 2
    base = crd_loss(CRD_V, CRD_V_OLD, None, CRD_U, CRD_A, CRD_GROUPS, kl_coef=0.0, adaptive=False).loss
    shifted = crd_loss(CRD_V, v_old, None, CRD_U, CRD_A, CRD_GROUPS, kl_coef=0.0, adaptive=False).loss
    close(shifted, base)
    # Pooled over both groups: r_theta [0, 1, -1, 0.5] (mean 0.125), Rc = r - 0.5625: squares of
    # (Rtheta - Rc) = [-0.5625, 1.4375, -1.3125, 0.4375] sum to 4.296875, x 5 / 4 = 5.37109375; after the
    # shift r_theta = [0, 1, 0, 1.5] (mean 0.625): [-1.0625, 0.9375, -0.8125, 0.9375] -> 3.546875 x 5 / 4.
    one = torch.zeros(4, dtype=torch.long)
    close(crd_loss(CRD_V, CRD_V_OLD, None, CRD_U, CRD_A, one, kl_coef=0.0, adaptive=False).loss, 5.37109375)
    close(crd_loss(CRD_V, v_old, None, CRD_U, CRD_A, one, kl_coef=0.0, adaptive=False).loss, 4.43359375)


def test_crd_precomputed_group_means_match_in_call_centring():
    # A recipe whose groups span processes passes the gathered group means of r_theta and of the reward weights.
    r_theta = implicit_reward(V, V_OLD, U)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    full = crd_loss(V, V_OLD, V_REF, U, ADV, groups)
    given = crd_loss(V, V_OLD, V_REF, U, ADV, groups, implicit_group_mean=group_mean(r_theta, groups),
                     reward_group_mean=group_mean(reward_weights(ADV), groups))
    close(given.loss, full.loss.item())


SPLIT_SHAPE = (8, 2, 2, 3)
SPLIT_U = field(8, SPLIT_SHAPE)
SPLIT_V, SPLIT_V_OLD = SPLIT_U + 0.3 * field(9, SPLIT_SHAPE), SPLIT_U + 0.35 * field(10, SPLIT_SHAPE)
SPLIT_V_REF = SPLIT_U + 0.4 * field(11, SPLIT_SHAPE)
SPLIT_ADV = t(1.2, -0.4, 2.5, -1.9, 0.3, -7.0, 0.8, -0.2)


def test_crd_group_split_across_two_calls_gives_the_whole_groups_loss_and_gradient():
    # One group of 8 rows, once in one call, once as two calls of 4 (as two processes would hold it) with the whole
    # group's means of r_theta and of r: the two "sum" losses add up to 8 x the whole call's mean, gradients too.
    one_group = torch.zeros(8, dtype=torch.long)
    v = SPLIT_V.clone().requires_grad_(True)
    whole = crd_loss(v, SPLIT_V_OLD, SPLIT_V_REF, SPLIT_U, SPLIT_ADV, one_group).loss
    (whole_grad,) = torch.autograd.grad(whole, v)
    with torch.no_grad():
        implicit = group_mean(implicit_reward(SPLIT_V, SPLIT_V_OLD, SPLIT_U), one_group)
        reward = group_mean(reward_weights(SPLIT_ADV), one_group)
    v = SPLIT_V.clone().requires_grad_(True)
    parts = [crd_loss(v[rows], SPLIT_V_OLD[rows], SPLIT_V_REF[rows], SPLIT_U[rows], SPLIT_ADV[rows], one_group[rows],
                      implicit_group_mean=implicit[rows], reward_group_mean=reward[rows], reduction="sum").loss
             for rows in (slice(0, 4), slice(4, 8))]
    split = (parts[0] + parts[1]) / 8
    (split_grad,) = torch.autograd.grad(split, v)
    close(split, whole.item())
    torch.testing.assert_close(split_grad, whole_grad, rtol=1e-10, atol=1e-12)
    # Centred on each call's own 4 rows instead, the loss is another number.
    own_centres = [crd_loss(SPLIT_V[rows], SPLIT_V_OLD[rows], SPLIT_V_REF[rows], SPLIT_U[rows], SPLIT_ADV[rows],
                            one_group[rows], reduction="sum").loss for rows in (slice(0, 4), slice(4, 8))]
    assert abs(float(sum(own_centres) / 8 - whole.detach())) > 1e-3
    with pytest.raises(ValueError, match="implicit_group_mean and reward_group_mean go together"):
        crd_loss(SPLIT_V[:4], SPLIT_V_OLD[:4], SPLIT_V_REF[:4], SPLIT_U[:4], SPLIT_ADV[:4], one_group[:4],
                 implicit_group_mean=implicit[:4])


def test_crd_sum_reduction_is_batch_times_mean():
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    mean = crd_loss(V, V_OLD, V_REF, U, ADV, groups).loss
    close(crd_loss(V, V_OLD, V_REF, U, ADV, groups, reduction="sum").loss, 6 * mean.item())


def value_and_grad(fn, v):
    v = v.clone().requires_grad_(True)
    loss = fn(v)
    (g,) = torch.autograd.grad(loss, v)
    return loss.detach(), g


# CRD as Flow-Factory writes it (X-GenGroup/Flow-Factory, commit a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c,
# src/flow_factory/trainers/crd.py, added by the paper's first author, Yuanzhi Zhu, in PR #121, commit 583008b), its
# default settings (weight_temp < 0: uniform single-direction centring; crd_loss_type "mse"; adaptive_logp;
# reward_adaptive_kl), re-implemented here from CRDTrainer.optimize (steps 4-7) and _compute_crd_loss, on one process
# (its gather is then the identity): every row of the micro-batch is centred on the micro-batch's mean.
def crd_flow_factory(forward_pred, old_v_pred, ref_pred, v_target, adv, *, crd_beta=1.0, adv_clip_range=(-5.0, 5.0),
                     kl_beta=0.1, adaptive_logp=True, reward_adaptive_kl=True):
    dims = tuple(range(1, forward_pred.ndim))
    if adaptive_logp:
        with torch.no_grad():
            weight_theta = (forward_pred.double() - v_target.double()).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
            weight_old = (old_v_pred.double() - v_target.double()).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
        r_theta = -((forward_pred - v_target) ** 2 / weight_theta - (old_v_pred - v_target) ** 2 / weight_old)
    else:
        r_theta = -((forward_pred - v_target) ** 2 - (old_v_pred - v_target) ** 2)
    r_theta_local = r_theta.mean(dim=dims)
    r_theta_gathered = r_theta_local.detach()
    adv_cur_rank = torch.clamp((torch.clamp(adv, *adv_clip_range) / max(adv_clip_range)) / 2.0 + 0.5, 0, 1)
    adv_cur = adv_cur_rank.detach()
    softmax_p = torch.softmax(adv_cur / torch.inf, dim=0)  # uniform
    rc = adv_cur_rank - (adv_cur * softmax_p).sum(dim=0, keepdim=True)
    r_theta_c = r_theta_local - (r_theta_gathered * softmax_p).sum(dim=0, keepdim=True).detach()
    ori_policy_loss = ((crd_beta * r_theta_c - rc) ** 2).mean()
    policy_loss = (ori_policy_loss * adv_clip_range[1] / max(crd_beta, 1e-8)).mean()
    kl_div = ((forward_pred - ref_pred) ** 2).mean(dim=dims)
    if reward_adaptive_kl:
        min_coef = 1e-4 / max(kl_beta, 1e-8)
        kl_loss = kl_beta * torch.mean((min_coef + adv_cur_rank * (1 - min_coef)) * kl_div)
    else:
        kl_loss = kl_beta * kl_div.mean()
    return policy_loss + kl_loss


@pytest.mark.parametrize("kl_coef, adaptive, beta", [(0.1, True, 1.0), (0.1, False, 1.0), (0.5, True, 0.3)])
def test_crd_agrees_with_flow_factory_on_one_group_and_departs_on_pooled_groups(kl_coef, adaptive, beta):
    # One group: the same loss and gradient.
    kw = dict(beta=beta, kl_coef=kl_coef, adaptive=adaptive)
    ff = dict(crd_beta=beta, kl_beta=kl_coef, adaptive_logp=adaptive)
    one = torch.zeros(6, dtype=torch.long)
    got, grad = value_and_grad(lambda v: crd_loss(v, V_OLD, V_REF, U, ADV, one, **kw).loss, V)
    ref, ref_grad = value_and_grad(lambda v: crd_flow_factory(v, V_OLD, V_REF, U, ADV, **ff), V)
    close(got, ref.item())
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    # Two prompt groups in one micro-batch: Flow-Factory pools them (one centre), flowrl centres each group.
    two = torch.tensor([0, 0, 0, 1, 1, 1])
    per_group = crd_loss(V, V_OLD, V_REF, U, ADV, two, **kw).loss
    assert abs(float(per_group - ref)) > 1e-3


# Reference: Flow-Factory (X-GenGroup/Flow-Factory, commit a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c),
# src/flow_factory/trainers/crd.py: CRDTrainer._compute_crd_loss (uniform centring, mse) and the
# implicit-reward / advantage / KL lines 753-824 of CRDTrainer.optimize, run with crd_beta 1, adv clip 5,
# reward_adaptive_kl on, on the inputs above as ONE group (their centring pools the whole micro-batch,
# which is the same as flowrl's per-group centring when the batch is one group).
@pytest.mark.parametrize("kl_coef, adaptive, loss, projected", [
    (0.1, True, 0.30696044865233524, -0.5530328050193536),
    (0.1, False, 0.30025629021036976, -0.13496486481489078),
    (0.5, True, 0.3597010307637501, -0.5449355297224215),
])
def test_crd_matches_flow_factory_on_one_group(kl_coef, adaptive, loss, projected):
    got, proj = value_and_projected_grad(
        lambda v: crd_loss(v, V_OLD, V_REF, U, ADV, torch.zeros(6, dtype=torch.long), beta=1.0, kl_coef=kl_coef,
                           adaptive=adaptive))
    close(got, loss)
    close(proj, projected)


# --------------------------------------------------------------------------------------------------
# DiffusionNFT


def test_nft_hand_values():
    # x0 = 0, eps = [2, 0], t = 0.5: x_t = [1, 0], u = [2, 0]; v = [3, -1], v_old = [2, 2], b = 1, A = 2.5.
    # v+ = v: x0+ = x_t - 0.5 v = [-0.5, 0.5]: mean sq 0.25, w+ 0.5 -> 0.5.
    # v- = 2 v_old - v = [1, 5]: x0- = [0.5, -2.5]: mean sq 3.25, w- 1.5 -> 13/6.
    # r = 0.75: policy = 5 (0.75 * 0.5 + 0.25 * 13/6) = 55/12; kl = mean((v - u)^2) = 1, x 1e-4.
    x0, x_t = torch.zeros(1, 2, dtype=D), t(1.0, 0.0).reshape(1, 2)
    v, v_old, v_ref = t(3.0, -1.0).reshape(1, 2), t(2.0, 2.0).reshape(1, 2), t(2.0, 0.0).reshape(1, 2)
    out = nft_loss(v, v_old, v_ref, x_t, x0, 0.5, t(2.5))
    close(out.policy_loss, 55 / 12)
    close(out.kl_loss, 1e-4)
    close(out.loss, 55 / 12 + 1e-4)
    close(out.stats["reward_weight"], 0.75)


# Reference: NVlabs/DiffusionNFT, commit 24af5554898d85e93efa492f42b5e9cdf4156e9b,
# scripts/train_nft_sd3.py lines 908-971 (the per-timestep loss: implicit policies, adaptive weights,
# policy loss x adv_clip_max, + train.beta 1e-4 x KL), run on the inputs above.
@pytest.mark.parametrize("b, loss, projected", [
    (1.0, 1.9463869736870647, 0.031171928560326967),
    (0.1, 12.364333101074049, -0.5824872450710548),
])
def test_nft_matches_the_authors_code(b, loss, projected):
    got, proj = value_and_projected_grad(lambda v: nft_loss(v, V_OLD, V_REF, X_T, X0, T_ROWS, ADV, beta=b))
    close(got, loss)
    close(proj, projected)


# --------------------------------------------------------------------------------------------------
# AWM

# Reference: scxue/advantage_weighted_matching, commit be5137232e33a21b449ed65a533211d0deb97ed8,
# advantage_weighted_matching/scripts/train_sd3_awm.py: compute_log_prob_awm lines 234-252 (after the
# model call) and the loss lines 1292-1350 (exp_first, clip_range 1, advantage_max 1, beta 0.001,
# ema_beta 1, Uniform KL), run on the inputs above as 2 training times x 3 samples (time-major rows).
AWM_LOGP = {
    "ghuber": [-1.9282885225826092, -1.4350662822497222, -1.0323174190110953, -0.6430665867940827,
               -1.6454170980929985, -1.2344478558167535],
    "uniform": [-0.08427598353971204, -0.0707198279475834, -0.07273500872382165, -0.0844344630491984,
                -0.07163990608876346, -0.07172880861756135],
    "t": [-0.07584838518574083, -0.04950387956330838, -0.03636750436191082, -0.02533033891475952,
          -0.05731192487101077, -0.04303728517053681],
    "t2": [-0.06826354666716676, -0.03465271569431586, -0.01818375218095541, -0.007599101674427855,
           -0.04584953989680862, -0.025822371102322085],
    "huber": [-0.26126393535337095, -0.18614539924136314, -0.1348421438553869, -0.08716982651966641,
              -0.2141170568261655, -0.16068740726464817],
}
AWM_PROJECTED = {"ghuber": 0.36201867922715136, "uniform": 0.1548734755435292, "t": 0.13125073021695954,
                 "t2": 0.11800377222228814, "huber": 0.16317877945948542}


@pytest.mark.parametrize("weighting", list(AWM_LOGP))
def test_awm_matches_the_authors_code(weighting):
    close(awm_log_likelihood(V, U, T_ROWS, weighting=weighting), AWM_LOGP[weighting])
    adv_rows = ADV[:3].repeat(2)  # the code repeats the advantages over its 2 training times
    got, proj = value_and_projected_grad(
        lambda v: awm_loss(v, U, T_ROWS, adv_rows, v_ref=V_REF, v_ema=V_EMA, kl_coef=0.001, ema_kl_coef=1.0,
                           weighting=weighting))
    close(got, -0.053384522280433)  # on-policy: -mean(A / 5) + the two KL terms, whatever the weighting
    close(proj, AWM_PROJECTED[weighting])


def test_awm_uniform_gradient_by_hand():
    # On-policy, uniform: loss = -A' l with l = -mean_d (v - u)^2, so grad = A' * 2 (v - u) / D.
    # v - u = [1, -2], A = 2.5 -> A' = 0.5: grad = 0.5 * [1, -2] = [0.5, -1].
    u = torch.zeros(1, 2, dtype=D)
    v = t(1.0, -2.0).reshape(1, 2).requires_grad_(True)
    out = awm_loss(v, u, 0.5, t(2.5), weighting="uniform")
    close(out.loss, -0.5)  # -A' * ratio 1
    (g,) = torch.autograd.grad(out.loss, v)
    close(g, [[0.5, -1.0]])
    # ghuber: d l / d e = -t (e + 1e-10)^(p - 1) with e = 2.5, t = 0.5, p = 0.25; grad = A' t (e)^-0.75 (v - u)
    v2 = t(1.0, -2.0).reshape(1, 2).requires_grad_(True)
    (g2,) = torch.autograd.grad(awm_loss(v2, u, 0.5, t(2.5)).loss, v2)
    scale = 0.5 * 0.5 * (2.5 + 1e-10) ** -0.75
    close(g2, [[scale * 1.0, scale * -2.0]])


def test_awm_clip_removes_the_gradient_of_rows_past_the_range():
    # Row 0: A > 0 and ratio e^0.1 > 1 + 0.05: clipped (no gradient). Row 1: ratio 1: plain gradient.
    u = torch.zeros(2, 2, dtype=D)
    v = t(1.0, 1.0, 1.0, 1.0).reshape(2, 2).requires_grad_(True)
    logp = awm_log_likelihood(v, u, 0.5, weighting="uniform").detach()  # [-1, -1]
    out = awm_loss(v, u, 0.5, t(2.5, 2.5), old_logp=logp - t(0.1, 0.0), weighting="uniform", clip_range=0.05)
    (g,) = torch.autograd.grad(out.loss, v)
    close(g[0], [0.0, 0.0])
    close(g[1], [0.25, 0.25])  # A' 0.5 * 2 (v - u) / D / B = 0.5 * [1, 1] / 2
    close(out.stats["clip_frac"], 0.5)


def test_awm_off_policy_ratio_without_clip():
    u = torch.zeros(1, 2, dtype=D)
    v = t(1.0, 1.0).reshape(1, 2)
    out = awm_loss(v, u, 0.5, t(5.0), old_logp=t(-1.5), weighting="uniform")  # l = -1: ratio e^0.5
    close(out.loss, -math.exp(0.5))
    close(out.stats["ratio"], math.exp(0.5))


# --------------------------------------------------------------------------------------------------
# direction: one small gradient step moves a positive-advantage row's velocity toward u and a
# negative-advantage row's away (relative to the old snapshot, which starts equal to the policy).


def _step(fn, v, lr=1e-2):
    v = v.clone().requires_grad_(True)
    out = fn(v)
    (g,) = torch.autograd.grad(out.loss if hasattr(out, "loss") else out, v)
    return (v - lr * g).detach()


@pytest.mark.parametrize("name", ["crd", "nft", "awm"])
def test_direction_positive_advantage_moves_toward_the_target(name):
    adv = t(1.5, -1.5, 0.8, -0.8, 2.0, -2.0)
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    fns = {
        "crd": lambda v: crd_loss(v, V, None, U, adv, groups, kl_coef=0.0),
        "nft": lambda v: nft_loss(v, V, None, X_T, X0, T_ROWS, adv, kl_coef=0.0),
        "awm": lambda v: awm_loss(v, U, T_ROWS, adv),
    }
    before = velocity_error(V, U)
    after = velocity_error(_step(fns[name], V), U)
    assert bool((after[adv > 0] < before[adv > 0]).all()), (before, after)
    assert bool((after[adv < 0] > before[adv < 0]).all()), (before, after)


@pytest.mark.parametrize("name", ["crd", "nft", "awm"])
def test_zero_advantages_leave_only_the_pull_toward_the_reference(name):
    # A = 0 and v_old = v: CRD's centred rewards are 0, AWM's weights are 0, and NFT's positive and
    # negative terms (r = 0.5 each, v+ = v- = v) have opposite gradients that cancel exactly.
    adv = torch.zeros(6, dtype=D)
    fns = {
        "crd": lambda v: crd_loss(v, V, V_REF, U, adv, torch.zeros(6, dtype=torch.long), kl_coef=0.1,
                                  reward_adaptive=False),
        "nft": lambda v: nft_loss(v, V, V_REF, X_T, X0, T_ROWS, adv, kl_coef=1.0),
        "awm": lambda v: awm_loss(v, U, T_ROWS, adv, v_ref=V_REF, kl_coef=1.0),
    }
    v = V.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(fns[name](v).loss, v)
    kl_coef = 0.1 if name == "crd" else 1.0
    close(g, kl_coef * 2 * (V - V_REF) / 12 / 6)  # d/dv of coef * mean_rows mean_d (v - v_ref)^2, D = 12


# --------------------------------------------------------------------------------------------------
# dtypes, reductions, errors


def test_bf16_velocities_give_a_float64_loss_and_a_gradient():
    v = V.to(torch.bfloat16).requires_grad_(True)
    out = nft_loss(v, V_OLD.to(torch.bfloat16), V_REF.to(torch.bfloat16), X_T.to(torch.bfloat16),
                   X0.to(torch.bfloat16), T_ROWS, ADV)
    assert out.loss.dtype == torch.float64
    out.loss.backward()
    assert v.grad is not None and v.grad.dtype == torch.bfloat16 and torch.isfinite(v.grad.float()).all()


@pytest.mark.parametrize("fn", [
    lambda r: nft_loss(V, V_OLD, V_REF, X_T, X0, T_ROWS, ADV, reduction=r),
    lambda r: awm_loss(V, U, T_ROWS, ADV, v_ref=V_REF, kl_coef=0.01, reduction=r),
    lambda r: awm_loss(V, U, T_ROWS, ADV, v_ref=V_REF, kl_coef=0.01, clip_range=0.2, reduction=r),
])
def test_sum_reduction_is_rows_times_mean(fn):
    close(fn("sum").loss, 6 * fn("mean").loss.item(), atol=1e-11)


@pytest.mark.parametrize("call, message", [
    (lambda: crd_loss(V, V_OLD, None, U, ADV, torch.zeros(6, dtype=torch.long)), "v_ref_cfg is required"),
    (lambda: nft_loss(V, V_OLD, None, X_T, X0, T_ROWS, ADV), "v_ref is required"),
    (lambda: awm_loss(V, U, T_ROWS, ADV, ema_kl_coef=1.0), "v_ema is required"),
    (lambda: nft_loss(V, V_OLD[:5], V_REF, X_T, X0, T_ROWS, ADV), "must have the same shape"),
    (lambda: nft_loss(V, V_OLD, V_REF, X_T, X0, T_ROWS * 2, ADV), r"noise levels in \[0, 1\]"),
    (lambda: nft_loss(V, V_OLD, V_REF, X_T, X0, T_ROWS[:3], ADV), r"t must have shape \[B\] = \[6\]"),
    (lambda: nft_loss(V, V_OLD, V_REF, X_T, X0, T_ROWS, ADV[:5]), r"advantages must have shape \[B\]"),
    (lambda: nft_loss(V, V_OLD, V_REF, X_T, X0, T_ROWS, ADV * float("nan")), "NaN or inf"),
    (lambda: nft_loss(V, V_OLD, V_REF, X_T, X0, T_ROWS, ADV, beta=0.0), "beta must be a finite number > 0"),
    (lambda: nft_loss(V, V_OLD, V_REF, X_T, X0, T_ROWS, ADV, reduction="none"), "reduction must be one of"),
    (lambda: awm_loss(V, U, T_ROWS, ADV, weighting="elbo"), "weighting must be one of"),
    (lambda: awm_loss(V, U, T_ROWS, ADV, clip_range=1.0), r"clip_range must be a number in \(0, 1\)"),
    (lambda: crd_loss(V, V_OLD, V_REF, U, ADV, torch.zeros(6, dtype=torch.long), kl_coef=1e-5),
     "kl_floor must be <= kl_coef"),
    (lambda: velocity_error(V[:, 0, 0, 0], U[:, 0, 0, 0]), "at least one non-batch dimension"),
])
def test_bad_arguments_are_one_line_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --------------------------------------------------------------------------------------------------
# snapshots


@pytest.mark.parametrize("schedule, step, expected", [
    (CRD_OLD_DECAY, 0, 0.25),
    (CRD_OLD_DECAY, 100, 0.75),  # 0.25 + 100 * 0.005
    (CRD_OLD_DECAY, 150, 0.999),  # 0.25 + 0.75 = 1.0, capped
    (CRD_SAMPLING_DECAY, 74, 0.0),  # on-policy for the first 75 steps
    (CRD_SAMPLING_DECAY, 75, 0.0),
    (CRD_SAMPLING_DECAY, 76, 0.0075),
    (CRD_SAMPLING_DECAY, 208, 0.9975),  # 133 * 0.0075
    (CRD_SAMPLING_DECAY, 209, 0.999),  # 134 * 0.0075 = 1.005, capped
    (NFT_DECAY, 300, 0.3),
    (NFT_DECAY, 600, 0.5),
    (EMA_REF_DECAY, 250, 0.25),
    (EMA_REF_DECAY, 400, 0.3),
])
def test_decay_schedules(schedule, step, expected):
    assert schedule(step) == pytest.approx(expected, abs=1e-12)
    assert snapshot_decay(step, start=schedule.start, initial=schedule.initial, slope=schedule.slope,
                          maximum=schedule.maximum) == pytest.approx(expected, abs=1e-12)


def test_nft_presets_are_the_authors_return_decay():
    # NVlabs/DiffusionNFT (commit 24af555) scripts/train_nft_sd3.py `return_decay`, lines 169-189:
    # decay_type 1: flat 0, uprate 0.001, uphold 0.5; decay_type 2: flat 75, uprate 0.0075, uphold 0.999;
    # 0.0 before `flat`, else min((step - flat) * uprate, uphold).
    def return_decay(step, flat, uprate, uphold):
        return 0.0 if step < flat else min((step - flat) * uprate, uphold)

    for step in range(0, 700, 7):
        assert NFT_DECAY(step) == return_decay(step, 0, 0.001, 0.5)
        assert NFT_OCR_DECAY(step) == return_decay(step, 75, 0.0075, 0.999)


def test_update_snapshot_hand_values_and_edge_decays():
    snap = [t(1.0, 2.0), t(0.0)]
    params = [t(3.0, 6.0), t(8.0)]
    update_snapshot_(snap, params, 0.25)  # 0.25 * snap + 0.75 * theta
    close(snap[0], [2.5, 5.0])
    close(snap[1], [6.0])
    update_snapshot_(snap, params, 1.0)  # frozen
    close(snap[0], [2.5, 5.0])
    stale = [t(float("inf"), float("nan"))]
    update_snapshot_(stale, [t(1.0, 2.0)], 0.0)  # an exact copy, even over non-finite values
    close(stale[0], [1.0, 2.0])


def test_update_snapshot_casts_and_does_not_track_gradients():
    snap = [torch.zeros(3, dtype=torch.float32)]
    param = torch.ones(3, dtype=torch.bfloat16, requires_grad=True)
    update_snapshot_(snap, [param], 0.5)
    assert snap[0].dtype == torch.float32 and not snap[0].requires_grad
    close(snap[0], [0.5, 0.5, 0.5])


@pytest.mark.parametrize("call, message", [
    (lambda: update_snapshot_([torch.zeros(2)], [torch.zeros(2), torch.zeros(2)], 0.5), "same tensors"),
    (lambda: update_snapshot_([torch.zeros(2)], [torch.zeros(3)], 0.5), "same order"),
    (lambda: update_snapshot_([torch.zeros(2)], [torch.zeros(2)], 1.5),
     r"decay must be a finite number in \[0.0, 1.0\]"),
    (lambda: snapshot_decay(-1), "step must be an integer >= 0"),
    (lambda: DecaySchedule(start=0, initial=0.0, slope=-0.1, maximum=0.5), "slope must be a finite number >= 0"),
    (lambda: DecaySchedule(maximum=2.0), r"maximum must be a finite number in \[0.0, 1.0\]"),
])
def test_snapshot_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
