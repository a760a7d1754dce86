"""samplers.noise_std_ratio: the noise a step's state carries over its level's, read off the step's own kernel,
checked against sampled states where the velocity's noise estimate is exact (point-mass data, and the first step
from pure noise for any velocity); 1 for the ODE and the coefficient-preserving steps at any step size; the
Euler-Maruyama SDE's overshoot at a few large steps (docs/trainers.md, "Few-step students")."""

import math

import pytest
import torch

from samplers import linear_sigmas, make_step, noise_std_ratio, shifted_sigmas

N = 400_000  # elements: the sampled std's relative standard error is about 1 / sqrt(2 N) = 0.0011


def _sampled_ratio(step, t: int, velocity) -> float:
    """The empirical noise std of the state after step ``t`` from ``x = (1 - sigma) m + sigma e``, over sigma_next,
    for data at the point ``m`` (the state minus its clean part ``(1 - sigma_next) m``)."""
    g = torch.Generator().manual_seed(t)
    m = 0.3
    sigma, sigma_next = float(step.sigmas[t]), float(step.sigmas[t + 1])
    e = torch.randn(1, N, generator=g)
    x = (1 - sigma) * m + sigma * e
    out = step(velocity(x, sigma, m), x, t, generator=g)
    return float((out.x_next - (1 - sigma_next) * m).double().std()) / sigma_next


def _point_mass_velocity(x, sigma, m):
    return (x - m) / sigma  # v = eps - x0 with x0 = m exactly: eps_hat is the sample's own noise


@pytest.mark.parametrize("name,kwargs", [("flow_sde", {"noise_level": 0.7}), ("dance_sde", {"eta": 0.3}),
                                         ("cps", {"noise_level": 0.7}), ("ddim", {"eta": 1.0}), ("ode", {})])
@pytest.mark.parametrize("num_steps", [2, 4, 10])
def test_the_ratio_is_the_sampled_noise_level_when_the_noise_estimate_is_exact(name, kwargs, num_steps):
    step = make_step(name, linear_sigmas(num_steps), **kwargs)
    ratios = noise_std_ratio(step)
    assert ratios.shape == (num_steps,) and ratios.dtype == torch.float64
    assert math.isnan(float(ratios[-1]))  # the step to sigma = 0: no level to compare with
    for t in range(num_steps - 1):
        assert _sampled_ratio(step, t, _point_mass_velocity) == pytest.approx(float(ratios[t]), rel=6e-3), t
        if name not in ("flow_sde", "dance_sde"):
            assert float(ratios[t]) == pytest.approx(1.0, abs=1e-6)  # coefficient-preserving at any step size


def test_from_pure_noise_the_ratio_holds_for_any_velocity():
    """At sigma = 1 the noise estimate is the initial noise itself, whatever the model predicts."""
    step = make_step("flow_sde", linear_sigmas(4), noise_level=0.7)
    g = torch.Generator().manual_seed(0)
    e = torch.randn(1, N, generator=g)
    v = torch.tanh(3 * e) - 0.2  # some velocity of the state, not the exact one
    out = step(v, e, 0, generator=g)
    x0_hat = e - v  # x - sigma v at sigma = 1
    noise = out.x_next - (1 - float(step.sigmas[1])) * x0_hat
    assert float(noise.double().std()) / float(step.sigmas[1]) == pytest.approx(float(noise_std_ratio(step)[0]),
                                                                                  rel=6e-3)


def test_flow_sde_overshoots_on_a_few_large_steps_and_not_on_many():
    few = noise_std_ratio(make_step("flow_sde", linear_sigmas(4), noise_level=0.7))
    many = noise_std_ratio(make_step("flow_sde", linear_sigmas(10), noise_level=0.7))
    assert [round(float(r), 2) for r in few[:3]] == [1.15, 1.32, 1.49]
    assert float(many[:6].max()) < 1.09  # the main job's window (steps 0-5 of 10)
    # The first step from pure noise always has transition std a, so its overshoot depends on sigma_1 only.
    shifted = noise_std_ratio(make_step("flow_sde", shifted_sigmas(4, 3.0), noise_level=0.7))
    s1 = float(shifted_sigmas(4, 3.0)[1])
    assert float(shifted[0]) == pytest.approx(math.sqrt((s1 - 0.7 ** 2 / 2) ** 2 + 0.7 ** 2) / s1, rel=1e-5)
