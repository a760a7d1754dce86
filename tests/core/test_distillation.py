"""DMD / DMD2 losses: numbers produced by the authors' code (DMD2) and by Flow-Factory's DMD trainer on the same
inputs, hand-derived values that fail on a wrong sign or normaliser, properties and clear errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from flowrl.core.distillation import (
    DMDGeneratorOutput,
    dmd_generator_loss,
    dmd_gradient,
    dmd_step_range,
    fake_score_loss,
    gan_discriminator_loss,
    gan_generator_loss,
    is_generator_step,
    sample_dmd_timesteps,
)

D = torch.float64
# Float64 arithmetic on O(1) values (and on the EDM fake loss, O(100)): another CPU's rounding stays ~1e-13.
TOL = 1e-10


def t(*xs):
    return torch.tensor(xs, dtype=D)


def close(actual, expected, atol=TOL):
    actual = torch.as_tensor(actual)
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


# --------------------------------------------------------------------------------------------------
# The reference. A script outside this repository ran, in float64 (their `.float()` casts made identity, EDM's
# float32 Karras sigmas held in float64 so that its loss weight 1 / sigma^2 is not rounded to float32):
# - tianweiy/DMD2 @ 8d8fa55633d47cfb81bbc7a892e7248f9518763f, the unmodified methods of SDGuidance
#   (main/sd_guidance.py, SD v1.5's DDPM schedule, real guidance 1.75) and EDMGuidance (main/edm/edm_guidance.py,
#   Karras sigmas 0.002..80, sigma_data 0.5): compute_distribution_matching_loss, compute_loss_fake,
#   compute_generator_clean_cls_loss, compute_guidance_clean_cls_loss, with the UNets replaced by fixed seeded
#   linear maps and compute_cls_logits by a fixed linear head; the authors' own randint / randn_like draws
#   were recorded;
# - X-GenGroup/Flow-Factory @ 1796c8d390cd1c05d8c8c247ec062c838e3c1371 (branch DMDR),
#   src/flow_factory/trainers/DMD/dmd.py, the statements of DMDTrainer.optimize at lines 620-621, 635-637
#   (fake-score loss), 704 and 728-742 (DMD loss), executed as they are on stand-in velocities.
# The file holds the inputs, the models' outputs and the losses, gradients and logged values.

REF = json.loads((Path(__file__).parent / "distillation_reference" / "dmd2_reference.json").read_text())


def R(section, key):
    v = REF[section][key]
    if isinstance(v, dict):
        return torch.tensor(v["data"], dtype=D).reshape(v["shape"])
    return torch.tensor(v, dtype=D)


def rows(x, like):
    return x.reshape(-1, *([1] * (like.ndim - 1)))


def from_ddpm(x_vp, ab, eps_hat):
    """DDPM (x = sqrt(ab) x0 + sqrt(1 - ab) eps, epsilon prediction) -> flowrl's (sigma, x_t, v)."""
    a, b = rows(ab.sqrt(), x_vp), rows((1 - ab).sqrt(), x_vp)
    x0_hat = (x_vp - b * eps_hat) / a
    return (b / (a + b)).flatten(), x_vp / (a + b), eps_hat - x0_hat


def from_edm(x_ve, s, x0_hat):
    """EDM (x = x0 + s eps, x0 prediction) -> flowrl's (sigma, x_t, v)."""
    s = rows(s, x_ve)
    return (s / (1 + s)).flatten(), x_ve / (1 + s), (x_ve - x0_hat) / s - x0_hat


def loss_and_grad(x0, *args, **kwargs):
    x0 = x0.clone().requires_grad_(True)
    out = dmd_generator_loss(x0, *args, **kwargs)
    (g,) = torch.autograd.grad(out.loss, x0)
    return out, g


def test_conversions_preserve_the_noised_point():
    # x_t = (1 - sigma) x0 + sigma eps with the authors' own x0 and noise: the conversions are the right ones.
    sec = REF["sd_dmd"]
    sigma, x_t, _ = from_ddpm(R("sd_dmd", "noisy_latents"), t(*sec["alphas_cumprod"]), R("sd_dmd", "eps_fake"))
    x0, eps = R("sd_dmd", "latents"), R("sd_dmd", "noise")
    close(x_t, (1 - rows(sigma, x0)) * x0 + rows(sigma, x0) * eps)
    sigma, x_t, _ = from_edm(R("edm_dmd", "noisy_latents"), t(*REF["edm_dmd"]["sigma"]), R("edm_dmd", "x0_fake"))
    x0, eps = R("edm_dmd", "latents"), R("edm_dmd", "noise")
    close(x_t, (1 - rows(sigma, x0)) * x0 + rows(sigma, x0) * eps)


def test_dmd_matches_the_authors_sd_code():
    sec = REF["sd_dmd"]
    ab, x_vp, w = t(*sec["alphas_cumprod"]), R("sd_dmd", "noisy_latents"), sec["guidance_scale"]
    sigma, x_t, v_fake = from_ddpm(x_vp, ab, R("sd_dmd", "eps_fake"))
    _, _, v_u = from_ddpm(x_vp, ab, R("sd_dmd", "eps_real_uncond"))
    _, _, v_c = from_ddpm(x_vp, ab, R("sd_dmd", "eps_real_cond"))
    v_real = v_u + w * (v_c - v_u)  # their guidance is on epsilon; on the velocity it is the same
    x0 = R("sd_dmd", "latents")
    close(x_t - rows(sigma, x0) * v_real, R("sd_dmd", "pred_real_image"))
    close(x_t - rows(sigma, x0) * v_fake, R("sd_dmd", "pred_fake_image"))

    out, g = loss_and_grad(x0, x_t, sigma, v_real, v_fake)
    close(out.grad, R("sd_dmd", "grad"))
    close(out.loss, sec["loss"])
    close(g, R("sd_dmd", "dloss_dlatents"))
    assert out.stats["nonfinite_frac"] == 0


def test_dmd_matches_the_authors_edm_code():
    sec = REF["edm_dmd"]
    x_ve, s = R("edm_dmd", "noisy_latents"), t(*sec["sigma"])
    sigma, x_t, v_real = from_edm(x_ve, s, R("edm_dmd", "x0_real"))
    _, _, v_fake = from_edm(x_ve, s, R("edm_dmd", "x0_fake"))
    out, g = loss_and_grad(R("edm_dmd", "latents"), x_t, sigma, v_real, v_fake)
    close(out.grad, R("edm_dmd", "grad"))
    close(out.loss, sec["loss"])
    close(g, R("edm_dmd", "dloss_dlatents"))


def test_dmd_matches_flow_factory_with_its_epsilon_and_differs_without():
    sec = REF["ff_dmd"]
    x0, x_t, sigma = R("ff_dmd", "x0"), R("ff_dmd", "x_t"), t(*sec["sigma"])
    v_real, v_fake = R("ff_dmd", "v_real"), R("ff_dmd", "v_fake")
    close(x_t, (1 - rows(sigma, x0)) * x0 + rows(sigma, x0) * R("ff_dmd", "noise"))  # flowrl's convention
    out, g = loss_and_grad(x0, x_t, sigma, v_real, v_fake, eps=1e-8)
    close(out.grad, R("ff_dmd", "grad"))
    close(out.loss, sec["loss"])
    close(g, R("ff_dmd", "dloss_dx0"))
    # The default (DMD2's eps = 0) is a different, larger gradient by the factor (w + 1e-8) / w.
    default = dmd_generator_loss(x0, x_t, sigma, v_real, v_fake)
    ratio = (default.normaliser + 1e-8) / default.normaliser
    close(default.grad, out.grad * rows(ratio, x0))
    assert (default.grad - out.grad).abs().max() > 100 * TOL


def test_fake_score_loss_matches_the_authors_sd_code():
    # epsilon MSE at DDPM steps == flowrl's velocity error weighted by (1 - sigma)^2; gradient w.r.t. eps_hat too.
    sec = REF["sd_fake"]
    eps_hat = R("sd_fake", "eps_fake").requires_grad_(True)
    sigma, x_t, v = from_ddpm(R("sd_fake", "noisy_latents"), t(*sec["alphas_cumprod"]), eps_hat)
    x0, noise = R("sd_fake", "latents"), R("sd_fake", "noise")
    close(x_t, (1 - rows(sigma, x0)) * x0 + rows(sigma, x0) * noise)
    out = fake_score_loss(v, x0, noise, sigma, weighting="epsilon")
    close(out.loss, sec["loss"])
    (g,) = torch.autograd.grad(out.loss, eps_hat)
    close(g, R("sd_fake", "dloss_deps"))


def test_fake_score_loss_matches_the_authors_edm_code():
    sec = REF["edm_fake"]
    x0_hat = R("edm_fake", "x0_fake").requires_grad_(True)
    sigma, _, v = from_edm(R("edm_fake", "noisy_latents"), t(*sec["sigma"]), x0_hat)
    out = fake_score_loss(v, R("edm_fake", "latents"), R("edm_fake", "noise"), sigma, weighting="edm",
                          sigma_data=sec["sigma_data"])
    close(out.loss, sec["loss"])
    (g,) = torch.autograd.grad(out.loss, x0_hat)
    close(g, R("edm_fake", "dloss_dx0"))


def test_fake_score_loss_matches_flow_factory():
    sec = REF["ff_fake"]
    v = R("ff_fake", "v_fake").requires_grad_(True)
    out = fake_score_loss(v, R("ff_fake", "x0"), R("ff_fake", "noise"), t(*sec["sigma"]))
    close(out.loss, sec["loss"])
    (g,) = torch.autograd.grad(out.loss, v)
    close(g, R("ff_fake", "dloss_dv"))


@pytest.mark.parametrize("section", ["sd_gan", "edm_gan"])
def test_gan_losses_match_the_authors_code(section):
    sec = REF[section]
    gen_logits = R(section, "logits_gen").requires_grad_(True)
    gen = gan_generator_loss(gen_logits)
    close(gen.loss, sec["gen_loss"])
    close(torch.autograd.grad(gen.loss, gen_logits)[0], R(section, "dgen_dlogits"))

    real, fake = R(section, "logits_real").requires_grad_(True), R(section, "logits_fake").requires_grad_(True)
    disc = gan_discriminator_loss(real, fake)  # sd_gan: 4 real and 3 fake rows
    close(disc.loss, sec["disc_loss"])
    g_real, g_fake = torch.autograd.grad(disc.loss, [real, fake])
    close(g_real, R(section, "ddisc_dreal"))
    close(g_fake, R(section, "ddisc_dfake"))
    if "p_real" in sec:
        close(disc.stats["p_real"], R(section, "p_real").mean())
        close(disc.stats["p_fake"], R(section, "p_fake").mean())


def test_step_range_is_the_authors():
    # SDGuidance / EDMGuidance: min_step = int(0.02 N), max_step = int(0.98 N), randint(min, min(max + 1, N)).
    for section in ("sd_dmd", "edm_dmd"):
        low, high = dmd_step_range(0.02, 0.98, 1000)
        assert (low, high - 1) == (REF[section]["min_step"], REF[section]["max_step"])
        assert all(low <= k < high for k in REF[section]["timesteps"])
    assert dmd_step_range(0.0, 1.0, 1000) == (0, 1000)  # compute_loss_fake's randint(0, N)
    assert dmd_step_range(0.29, 0.5, 100) == (28, 51)  # int(0.29 * 100) = 28: their truncation, kept


def test_timesteps_are_the_authors_draw():
    # compute_distribution_matching_loss draws torch.randint(self.min_step, min(self.max_step + 1, N), [B]) from
    # the global generator; an explicit generator seeded alike gives the same integers.
    for seed in (0, 11, 2024):
        torch.manual_seed(seed)
        theirs = torch.randint(int(0.02 * 1000), min(int(0.98 * 1000) + 1, 1000), [64])
        got = sample_dmd_timesteps(64, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(got.index, theirs)
        close(got.sigma, theirs.double() / 1000, atol=1e-7)  # float32 sigma = k / N
        assert got.sigma.dtype == torch.float32


def test_timesteps_shift_and_table():
    g = torch.Generator().manual_seed(3)
    out = sample_dmd_timesteps(32, generator=g, shift=3.0, dtype=D)
    u = out.index.double() / 1000
    close(out.sigma, 3 * u / (1 + 2 * u))
    assert bool((out.sigma >= 0.02).all()) and bool((out.sigma < 1).all())
    # A table of DDPM steps as flow sigmas reproduces the authors' SD noised points.
    ab = t(*REF["sd_dmd"]["alphas_cumprod"])
    table = torch.linspace(0.0, 1.0, 1000, dtype=D)
    table[torch.tensor(REF["sd_dmd"]["timesteps"])] = (1 - ab).sqrt() / (ab.sqrt() + (1 - ab).sqrt())
    out = sample_dmd_timesteps(50, generator=torch.Generator().manual_seed(5), sigma_table=table, dtype=D)
    close(out.sigma, table[out.index], atol=0)


def test_two_time_scales():
    assert [is_generator_step(s, 5) for s in range(11)] == [True] + [False] * 4 + [True] + [False] * 4 + [True]
    assert all(is_generator_step(s, 1) for s in range(5))


# --------------------------------------------------------------------------------------------------
# hand-derived values


def hand_case():
    # One row, D = 2, sigma = 0.5, x_t = 0: x0_hat = -0.5 v. x0 = [1, -3].
    # x0_hat_real = [-1, -1] (v_real = [2, 2]): p_real = [2, -2], w = 2.
    # x0_hat_fake = [0, -4] (v_fake = [0, 8]): p_fake = [1, 1].
    # grad = ([2, -2] - [1, 1]) / 2 = [0.5, -1.5]; loss = 0.5 * (0.25 + 2.25) / 2 = 0.625; d/dx0 = grad / 2.
    x0 = t(1.0, -3.0).reshape(1, 2)
    return x0, torch.zeros(1, 2, dtype=D), 0.5, t(2.0, 2.0).reshape(1, 2), t(0.0, 8.0).reshape(1, 2)


def test_dmd_hand_values():
    out, g = loss_and_grad(*hand_case())
    assert isinstance(out, DMDGeneratorOutput)
    close(out.grad, [[0.5, -1.5]])
    close(out.normaliser, [2.0])
    close(out.loss, 0.625)
    close(g, [[0.25, -0.75]])
    close(out.stats["score_gap"], 2.0)  # mean_d |x0_hat_fake - x0_hat_real| = (|1| + |-3|) / 2
    close(out.stats["grad_norm"], math.sqrt(0.25 + 2.25))


def test_dmd_hand_values_without_normaliser_and_with_epsilon():
    x0, x_t, s, v_r, v_f = hand_case()
    close(dmd_gradient(x0, x_t, s, v_r, v_f, normalise=False)[0], [[1.0, -3.0]])
    close(dmd_gradient(x0, x_t, s, v_r, v_f, eps=0.5)[0], [[1.0 / 2.5, -3.0 / 2.5]])


def test_dmd_sum_reduction_scales_by_rows():
    x0, x_t, s, v_r, v_f = hand_case()
    two = [torch.cat([a, a]) for a in (x0, x_t, v_r, v_f)]
    mean, g_mean = loss_and_grad(two[0], two[1], s, two[2], two[3])
    summed, g_sum = loss_and_grad(two[0], two[1], s, two[2], two[3], reduction="sum")
    close(mean.loss, 0.625)
    close(summed.loss, 1.25)
    close(g_mean, [[0.125, -0.375]] * 2)  # grad / (B D)
    close(g_sum, [[0.25, -0.75]] * 2)  # grad / D


def test_equal_scores_give_exactly_zero():
    x0 = torch.randn(3, 2, 2, 2, dtype=D, generator=torch.Generator().manual_seed(0))
    v = torch.randn_like(x0)
    out, g = loss_and_grad(x0, 0.3 * x0 + 0.1, t(0.2, 0.5, 0.9), v, v.clone())
    assert torch.equal(out.grad, torch.zeros_like(x0))
    assert out.loss.item() == 0.0 and torch.equal(g, torch.zeros_like(x0))


def test_gradient_is_the_normalised_dmd_direction_and_descent_moves_toward_the_teacher():
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(4, 3, 5, dtype=D, generator=gen)
    eps = torch.randn(4, 3, 5, dtype=D, generator=gen)
    sigma = t(0.1, 0.4, 0.7, 0.95)
    s = rows(sigma, x0)
    x_t = (1 - s) * x0 + s * eps
    v_real = torch.randn(4, 3, 5, dtype=D, generator=gen)
    v_fake = torch.randn(4, 3, 5, dtype=D, generator=gen)
    out, g = loss_and_grad(x0, x_t, sigma, v_real, v_fake)
    x0_real, x0_fake = x_t - s * v_real, x_t - s * v_fake
    w = (x0 - x0_real).abs().mean(dim=(1, 2))
    expected = (x0_fake - x0_real) / rows(w, x0)
    close(out.grad, expected)
    close(g, expected / x0.numel())
    # A descent step moves x0 along x0_hat_real - x0_hat_fake: a positive inner product with it in every row.
    assert bool(((-g) * (x0_real - x0_fake)).sum(dim=(1, 2)).gt(0).all())
    # Score form: grad = sigma^2 / (1 - sigma) (s_fake - s_real) / w with s = -eps_hat / sigma.
    score = lambda v: -(x_t + (1 - s) * v) / s  # noqa: E731
    close(out.grad, s**2 / (1 - s) * (score(v_fake) - score(v_real)) / rows(w, x0))


def test_zero_normaliser_gives_zero_where_the_authors_overflow():
    # p_real = 0 (the teacher denoises x0 to itself): DMD2 divides by 0, its nan_to_num turns -p_fake / 0 into
    # -+ the largest float. flowrl zeroes the row and counts it; Flow-Factory's eps gives a huge finite value.
    x0 = t(1.0, 2.0, 0.0, 1.0).reshape(2, 2)
    x_t = torch.zeros(2, 2, dtype=D)
    v_real = -2.0 * x0  # x0_hat_real = 0 - 0.5 * v = x0
    v_fake = t(0.0, 0.0, 2.0, 2.0).reshape(2, 2)  # row 0: x0_hat_fake = 0, row 1: [-1, -1]
    v_real[1] = t(2.0, 2.0)  # row 1: x0_hat_real = [-1, -1], p_real = [1, 2], p_fake = [1, 2]: grad 0
    out = dmd_generator_loss(x0, x_t, 0.5, v_real, v_fake)
    assert torch.equal(out.grad, torch.zeros(2, 2, dtype=D))
    close(out.stats["nonfinite_frac"], 0.5)
    assert torch.isfinite(out.loss)
    with torch.no_grad():
        theirs = torch.nan_to_num((t(0.0, 0.0) - t(1.0, 2.0)) / t(0.0, 0.0).abs().mean())
    assert bool((theirs.abs() == torch.finfo(D).max).all())  # what the authors' code would do
    ff = dmd_gradient(x0, x_t, 0.5, v_real, v_fake, eps=1e-8)[0]
    close(ff[0], [-1e8, -2e8], atol=1e-4)


def test_nan_inputs_are_zeroed_and_counted():
    x0, x_t, s, v_r, v_f = hand_case()
    v_f = v_f.clone()
    v_f[0, 1] = float("nan")
    out = dmd_generator_loss(x0, x_t, s, v_r, v_f)
    close(out.grad, [[0.5, 0.0]])
    close(out.stats["nonfinite_frac"], 0.5)


def test_bf16_inputs_give_a_float64_loss_and_a_bf16_gradient():
    x0, x_t, s, v_r, v_f = (a.to(torch.bfloat16) if torch.is_tensor(a) else a for a in hand_case())
    x0 = x0.requires_grad_(True)
    out = dmd_generator_loss(x0, x_t, s, v_r, v_f)
    assert out.loss.dtype == torch.float64
    out.loss.backward()
    assert x0.grad.dtype == torch.bfloat16
    close(x0.grad.double(), [[0.25, -0.75]], atol=0)  # all exact in bf16


def test_fake_score_weightings_by_hand():
    # x0 = 0, noise = 1: u = 1; v = 3: err 4. sigma = 0.25: (1 - s)^2 = 0.5625, EDM adds s^2 / 0.25 = 0.25.
    x0, noise, v = torch.zeros(1, 2, dtype=D), torch.ones(1, 2, dtype=D), torch.full((1, 2), 3.0, dtype=D)
    close(fake_score_loss(v, x0, noise, 0.25).loss, 4.0)
    close(fake_score_loss(v, x0, noise, 0.25, weighting="epsilon").loss, 4.0 * 0.5625)
    close(fake_score_loss(v, x0, noise, 0.25, weighting="edm").loss, 4.0 * 0.8125)
    close(fake_score_loss(v, x0, noise, 0.25, weighting="edm", sigma_data=1.0).loss, 4.0 * 0.625)
    out = fake_score_loss(v, x0, noise, 0.25, weighting="epsilon")
    close(out.stats["velocity_mse"], 4.0)


def test_fake_score_loss_sends_no_gradient_to_the_student():
    x0 = torch.ones(2, 3, dtype=D, requires_grad=True)
    v = torch.zeros(2, 3, dtype=D, requires_grad=True)
    fake_score_loss(v, x0, torch.zeros(2, 3, dtype=D), t(0.3, 0.6)).loss.backward()
    assert x0.grad is None and v.grad is not None
    close(v.grad, torch.full((2, 3), 2 * 1.0 / 6, dtype=D))  # d mean (v + 1)^2 = 2 (v + 1) / 6


def test_gan_losses_by_hand():
    # logit 0: softplus(0) = log 2 on both sides; the optimal classifier's losses at chance.
    close(gan_generator_loss(t(0.0, 0.0)).loss, math.log(2))
    close(gan_discriminator_loss(t(0.0), t(0.0, 0.0)).loss, 2 * math.log(2))
    # sign: a confident, correct classifier has a small loss, the generator a large one.
    disc = gan_discriminator_loss(t(10.0), t(-10.0))
    close(disc.loss, 2 * math.log1p(math.exp(-10.0)))
    close(gan_generator_loss(t(-10.0)).loss, math.log1p(math.exp(10.0)))
    close(disc.stats["p_real"], 1 / (1 + math.exp(-10.0)))
    # [B, 1] logits (the authors' shape) equal [B]; "sum" sums the rows of both batches.
    close(gan_generator_loss(t(1.0, -2.0).reshape(2, 1)).loss, gan_generator_loss(t(1.0, -2.0)).loss)
    s = gan_discriminator_loss(t(1.0, 2.0), t(-1.0), reduction="sum").loss
    close(s, math.log1p(math.exp(-1.0)) + math.log1p(math.exp(-2.0)) + math.log1p(math.exp(-1.0)))


# --------------------------------------------------------------------------------------------------
# errors


X = torch.zeros(2, 3, dtype=D)


@pytest.mark.parametrize("call, message", [
    (lambda: dmd_generator_loss(X, X, 0.5, X, X[:1]), "must have the same shape"),
    (lambda: dmd_generator_loss(X, X, 1.5, X, X), r"sigma must hold noise levels in \[0, 1\]"),
    (lambda: fake_score_loss(X, X, X, t(0.5, float("nan"))), "sigma contains NaN or inf"),
    (lambda: dmd_generator_loss(X, X, t(0.5, 0.5, 0.5), X, X), r"sigma must have shape \[B\] = \[2\]"),
    (lambda: dmd_generator_loss(X, X, 0.5, X, X, eps=-1.0), "eps must be a finite number >= 0"),
    (lambda: dmd_generator_loss(X, X, 0.5, X, X, reduction="none"), "reduction must be one of"),
    (lambda: dmd_generator_loss(X[:, 0], X[:, 0], 0.5, X[:, 0], X[:, 0]), "at least one non-batch dimension"),
    (lambda: fake_score_loss(X, X, X, 0.5, weighting="x0"), "weighting must be one of"),
    (lambda: fake_score_loss(X, X, X, 0.5, weighting="edm", sigma_data=0.0), "sigma_data must be"),
    (lambda: gan_generator_loss(torch.tensor(1.0)), "classifier logits"),
    (lambda: gan_discriminator_loss(t(1.0), [0.0]), "logits_fake must be a floating tensor"),
    (lambda: dmd_step_range(0.5, 0.2), "max_step_percent must be >= min_step_percent"),
    (lambda: dmd_step_range(1.0, 1.0), "leaves no step"),
    (lambda: dmd_step_range(-0.1, 0.5), r"min_step_percent must be a number in \[0, 1\]"),
    (lambda: sample_dmd_timesteps(4, generator=None), "generator must be a torch.Generator"),
    (lambda: sample_dmd_timesteps(0, generator=torch.Generator()), "batch must be an integer >= 1"),
    (lambda: sample_dmd_timesteps(4, generator=torch.Generator(), shift=3.0, sigma_table=torch.rand(10)),
     "shift and sigma_table are alternatives"),
    (lambda: sample_dmd_timesteps(4, generator=torch.Generator(), num_train_timesteps=20,
                                  sigma_table=torch.rand(10)), r"len\(sigma_table\) = 10"),
    (lambda: sample_dmd_timesteps(4, generator=torch.Generator(), sigma_table=torch.rand(10) + 1),
     r"noise levels in \[0, 1\]"),
    (lambda: is_generator_step(3, 0), "dfake_gen_update_ratio must be an integer >= 1"),
])
def test_bad_arguments_are_one_line_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
