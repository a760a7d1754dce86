"""The samplers against the closed-form Gaussian flow (see conftest.py for the derivation).

* ODE: the Euler map is affine in the initial noise, so its push-forward of N(0, 1) is exactly
  N(b, A^2); we read A and b off two trajectories and compare with the exact flow map. No sampling.
* SDEs: statistical, 8000 samples x 4 elements = 32000 iid scalars per sigma; tolerance 5 standard
  errors (sample mean: sqrt(V / n); sample variance: V sqrt(2 / (n - 1))). Fine schedules (400 steps)
  keep the discretisation bias below 1 standard error, which each test checks with an independent
  float64 moment recursion written from docs/algorithms.md, so the tolerance measures sampling error only.
"""

import math

import pytest
import torch

from samplers import Window, cps_step, linear_sigmas, make_step, rollout, shifted_sigmas

N_SAMPLES, DIM = 8000, 4
N = N_SAMPLES * DIM


def _affine_euler(flow, sigmas):
    """(A [T+1], b [T+1]) with x_t = A_t z + b_t along the Euler trajectory."""
    z = torch.tensor([[0.0], [1.0]])
    traj = rollout(flow.velocity, z, sigmas, step="ode")
    lat = traj.latents[:, :, 0].double()
    return lat[1] - lat[0], lat[0]


def test_ode_maps_standard_normal_to_data_within_discretisation_error(gaussian_flow):
    flow = gaussian_flow
    errors = []
    for n in (10, 40, 160):
        sig = linear_sigmas(n)
        A, b = _affine_euler(flow, sig)
        s64 = sig.double()
        # the exact flow map is z -> (1 - sigma) m + sqrt(V(sigma)) z
        err = max((A - flow.var(s64).sqrt()).abs().max().item(), (b - flow.mean(s64)).abs().max().item())
        errors.append(err)
        # at sigma = 0: N(b, A^2) vs N(m, s^2)
        assert abs(b[-1].item() - flow.m) < 1e-5  # the mean is exact (the mean path is linear)
        assert abs(A[-1].item() ** 2 - flow.s**2) <= 2 * err
    # first order: the error shrinks about 4x per 4x more steps
    assert errors[1] < errors[0] / 3 and errors[2] < errors[1] / 3, errors
    assert errors[2] < 1e-2, errors


def _hand_sde_moments(flow, sigmas, scales, sde_mask):
    """Exact mean/var after each step of the discretised Flow-SDE (float64, from docs/algorithms.md)."""
    mean, var = 0.0, 1.0
    out = []
    for t in range(len(sigmas) - 1):
        s, sn = float(sigmas[t]), float(sigmas[t + 1])
        dt = sn - s
        V = flow.var(s)
        A = (s - (1 - s) * flow.s**2) / V  # v = A (x - (1 - s) m) - m
        c = -A * (1 - s) * flow.m - flow.m  # v = A x + c
        g = float(scales[t]) if sde_mask[t] else 0.0
        k = g * g / (2 * s)
        alpha = 1 + dt * A + k * dt * (1 + (1 - s) * A)
        beta = dt * c + k * dt * (1 - s) * c
        mean, var = alpha * mean + beta, alpha * alpha * var + g * g * (-dt)
        out.append((mean, var))
    return out


def _check_marginals(flow, sigmas, step, first_sde_step):
    """Run the SDE on N iid scalars; check mean and variance at every sigma against N((1-s) m, V)."""
    T = len(sigmas) - 1
    mask = [first_sde_step <= t < T - 1 for t in range(T)]
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(N_SAMPLES, DIM, generator=gen)
    hand = _hand_sde_moments(flow, sigmas, step.noise_scales, mask) if step.name != "cps" else None
    checked = 0
    for t in range(T - 1):
        v = flow.velocity(x, sigmas[t].expand(N_SAMPLES))
        out = step(v, x, t, generator=gen) if mask[t] else step.ode(v, x, t)
        x = out.x_next
        sn = float(sigmas[t + 1])
        V, mu = flow.var(sn), flow.mean(sn)
        se_mean, se_var = math.sqrt(V / N), V * math.sqrt(2 / (N - 1))
        if hand is not None:  # the discretisation bias is below one standard error
            assert abs(hand[t][0] - mu) < se_mean and abs(hand[t][1] - V) < se_var, (t, hand[t], mu, V)
        if mask[t]:
            m_hat, v_hat = x.double().mean().item(), x.double().var().item()
            assert abs(m_hat - mu) < 5 * se_mean, (t, sn, m_hat, mu)
            assert abs(v_hat - V) < 5 * se_var, (t, sn, v_hat, V)
            checked += 1
    assert checked == sum(mask)


def test_flow_sde_keeps_marginals(gaussian_flow):
    # The SDE starts at step 40 (sigma = 0.9): next to sigma = 1 Flow-GRPO's g_t makes the first steps'
    # drift correction O(1) for any step size (see the next test), so no schedule resolves them.
    sig = linear_sigmas(400)
    _check_marginals(gaussian_flow, sig, make_step("flow_sde", sig, noise_level=0.7), first_sde_step=40)


def test_dance_sde_keeps_marginals(gaussian_flow):
    sig = linear_sigmas(400)
    _check_marginals(gaussian_flow, sig, make_step("dance_sde", sig, eta=0.3), first_sde_step=0)


def test_flow_sde_first_step_error_does_not_shrink_with_resolution(gaussian_flow):
    """Known property of g_0 = a sqrt(1 / (1 - sigma_1)): g_0^2 |dt| = a^2 whatever the step size.

    At sigma = 1, x ~ N(0, 1), v = x - m and eps_hat = x, so the first step's mean is
    x (1 - h - a^2 / 2) + h m with std a (h = 1 - sigma_1): its variance (1 - h - a^2 / 2)^2 + a^2 exceeds
    the marginal's (1 - h)^2 + h^2 s^2 by about a^4 / 4 (6 % for a = 0.7) for every h.
    """
    a, flow = 0.7, gaussian_flow
    for n in (10, 100, 1000):
        sig = linear_sigmas(n)
        h = 1 - float(sig[1])
        step = make_step("flow_sde", sig, noise_level=a)
        xs = torch.tensor([[0.0], [1.0]])
        out = step(flow.velocity(xs, sig[0].expand(2)), xs, 0, noise=torch.zeros_like(xs))
        alpha = (out.mean[1] - out.mean[0]).item()
        var_after = alpha**2 + out.std[0].item() ** 2
        assert var_after == pytest.approx((1 - h - a * a / 2) ** 2 + a * a, rel=1e-5)
        assert var_after / flow.var(1 - h) - 1 > 0.05


def test_cps_keeps_marginals_when_predictions_are_exact(make_gaussian_flow):
    """CPS is exact when x0_hat and eps_hat are the sample's own x0 and eps (a point mass of data):
    x_next = (1 - sigma') x0 + sqrt(sigma'^2 - s^2) eps + s z has the marginal N((1 - sigma') m, sigma'^2)
    at any step size, so a coarse 10-step schedule is enough."""
    flow = make_gaussian_flow(m=0.3, s=0.0)
    sig = shifted_sigmas(10, 3.0)
    _check_marginals(flow, sig, make_step("cps", sig, noise_level=0.7), first_sde_step=0)


def test_cps_contracts_variance_under_posterior_mean_predictions(gaussian_flow):
    """Documented limitation (docs/algorithms.md does not claim otherwise): with a model that predicts posterior
    means, x0_hat and eps_hat have less variance than x0 and eps, and CPS's fresh noise s z does not
    make up for it. From the exact marginal at sigma, one small step (dt -> 0) gives
    Var(x_next) / V(sigma') = 1 - r (1 - r) (1 - cos(a pi / 2))^2 with r = sigma^2 / V(sigma),
    an O(1) bias per step that finer schedules do not remove."""
    flow, a = gaussian_flow, 0.7
    s, sn = 0.5, 0.4999
    xs = torch.tensor([[0.0], [1.0]], dtype=torch.float64)
    out = cps_step(flow.velocity(xs, torch.full((2,), s)).float(), xs.float(), s, sn, noise_level=a,
                   noise=torch.zeros(2, 1))
    alpha = (out.mean[1] - out.mean[0]).item()
    ratio = (alpha**2 * flow.var(s) + out.std[0].item() ** 2) / flow.var(sn)
    r = s * s / flow.var(s)
    assert ratio == pytest.approx(1 - r * (1 - r) * (1 - math.cos(a * math.pi / 2)) ** 2, abs=2e-3)
    assert ratio < 0.98


def test_sde_rollout_samples_data_distribution(gaussian_flow):
    """End to end through rollout: the final samples of a Flow-SDE rollout have the data's moments."""
    flow = gaussian_flow
    sig = linear_sigmas(200)
    x = torch.randn(N_SAMPLES, DIM, generator=torch.Generator().manual_seed(0))
    traj = rollout(flow.velocity, x, sig, step="flow_sde", window=Window("fixed", start=20),
                   generator=torch.Generator().manual_seed(1))
    x0 = traj.x0.double()
    se_mean, se_var = math.sqrt(flow.s**2 / N), flow.s**2 * math.sqrt(2 / (N - 1))
    # 200 steps: the ODE's own discretisation error in the variance is ~0.4 % (< 1 SE = 0.8 %)
    assert abs(x0.mean().item() - flow.m) < 5 * se_mean
    assert abs(x0.var().item() - flow.s**2) < 5 * se_var
