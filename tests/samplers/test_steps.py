"""Step functions: exact Gaussian log-probs, zero noise = Euler, Flow-GRPO's formula, float32 math,
bitwise re-scoring, and the registry's uniform interface."""

import math

import pytest
import torch
from torch.distributions import Normal

from samplers import (
    STEPS,
    StepOutput,
    UnknownStepError,
    constant_noise_scale,
    cps_step,
    ddim_step,
    euler_step,
    flow_ddim_step,
    flow_grpo_noise_scale,
    gaussian_log_prob,
    get_step,
    linear_sigmas,
    make_step,
    sde_step,
    shifted_sigmas,
)

B, SHAPE = 5, (3, 4, 4)
D = 3 * 4 * 4


def _inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((B,) + SHAPE, generator=g)
    v = torch.randn((B,) + SHAPE, generator=g)
    return v.to(dtype), x.to(dtype)


def _gen(seed=1):
    return torch.Generator().manual_seed(seed)


STOCHASTIC = {
    "sde": lambda v, x, s, sn, **kw: sde_step(v, x, s, sn, g=0.8, **kw),
    "cps": lambda v, x, s, sn, **kw: cps_step(v, x, s, sn, noise_level=0.7, **kw),
    "flow_ddim": lambda v, x, s, sn, **kw: flow_ddim_step(v, x, s, sn, eta=1.0, **kw),
}


# --- exact log-density --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(STOCHASTIC))
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_log_prob_is_normal_log_prob(kind, reduction):
    v, x = _inputs()
    out = STOCHASTIC[kind](v, x, 0.6, 0.5, generator=_gen(), reduction=reduction)
    assert isinstance(out, StepOutput)
    assert out.log_prob.shape == (B,) and out.std.shape == (B, 1, 1, 1)
    ref = Normal(out.mean.double(), out.std.double()).log_prob(out.x_next.double()).flatten(1).sum(1)
    if reduction == "mean":
        ref = ref / D
    assert torch.allclose(out.log_prob.double(), ref, rtol=1e-5, atol=1e-5)


def test_ddim_log_prob_is_normal_log_prob():
    _, x = _inputs()
    eps = torch.randn(x.shape, generator=_gen(3))
    out = ddim_step(eps, x, 0.4, 0.6, eta=1.0, generator=_gen(), reduction="sum")
    ref = Normal(out.mean.double(), out.std.double()).log_prob(out.x_next.double()).flatten(1).sum(1)
    assert torch.allclose(out.log_prob.double(), ref, rtol=1e-5, atol=1e-5)


def test_gaussian_log_prob_formula_by_hand():
    # one sample, D = 2, mean 0, std 2, x = (2, 0): -(4)/(2*4) - 2 log 2 - log(2 pi)
    x = torch.tensor([[2.0, 0.0]])
    lp = gaussian_log_prob(x, torch.zeros_like(x), torch.tensor([[2.0]]), "sum")
    assert lp.item() == pytest.approx(-0.5 - 2 * math.log(2) - math.log(2 * math.pi), abs=1e-6)
    assert gaussian_log_prob(x, torch.zeros_like(x), 2.0, "mean").item() == pytest.approx(lp.item() / 2, abs=1e-6)
    # per-element std (broadcast) works too
    std = torch.tensor([[1.0, 3.0]])
    lp2 = gaussian_log_prob(x, torch.zeros_like(x), std, "sum")
    assert lp2.item() == pytest.approx(Normal(0.0, std).log_prob(x).sum().item(), abs=1e-6)
    with pytest.raises(ValueError, match="reduction"):
        gaussian_log_prob(x, x, 1.0, "avg")


# --- noise scale 0 is the Euler step --------------------------------------------------------------------


def test_zero_noise_is_euler_exactly():
    v, x = _inputs()
    for sigma, sigma_next in [(1.0, 0.9), (0.6, 0.5), (0.2, 0.0)]:
        ref = euler_step(v, x, sigma, sigma_next)
        assert torch.equal(ref.log_prob, torch.zeros(B)) and torch.equal(ref.std, torch.zeros(B, 1, 1, 1))
        outs = [
            sde_step(v, x, sigma, sigma_next, g=0.0, generator=_gen()),
            cps_step(v, x, sigma, sigma_next, noise_level=0.0, generator=_gen()),
            flow_ddim_step(v, x, sigma, sigma_next, eta=0.0, generator=_gen()),
        ]
        for out in outs:
            assert torch.equal(out.x_next, ref.x_next)
            assert torch.equal(out.mean, ref.x_next)
            assert torch.equal(out.log_prob, torch.zeros(B))  # 0, not NaN
        # without any randomness source a deterministic step is fine
        assert torch.equal(sde_step(v, x, sigma, sigma_next, g=0.0).x_next, ref.x_next)
    # through the registry: every family with its noise hyperparameter at 0, at every step
    sig = linear_sigmas(6)
    for name, hp in [("flow_sde", {"noise_level": 0.0}), ("dance_sde", {"eta": 0.0}), ("cps", {"noise_level": 0.0}),
                     ("ddim", {"eta": 0.0}), ("ode", {})]:
        step = make_step(name, sig, **hp)
        for t in range(6):
            out = step(v, x, t, generator=_gen())
            assert torch.equal(out.x_next, euler_step(v, x, sig[t], sig[t + 1]).x_next), (name, t)
            assert not torch.isnan(out.log_prob).any() and torch.equal(out.log_prob, torch.zeros(B))


def test_raw_ddim_eta0_is_deterministic_ddim_and_flow_euler():
    # Flow state x at sigma <-> VP state x / n(sigma) with n = sqrt((1-sigma)^2 + sigma^2), ab = ((1-sigma)/n)^2.
    v, x = _inputs()
    sigma, sigma_next = 0.7, 0.55
    n, nn = math.hypot(1 - sigma, sigma), math.hypot(1 - sigma_next, sigma_next)
    ab, ab_prev = ((1 - sigma) / n) ** 2, ((1 - sigma_next) / nn) ** 2
    eps_hat = x + (1 - sigma) * v
    out = ddim_step(eps_hat, x / n, ab, ab_prev, eta=0.0)
    x0_hat = (x / n - math.sqrt(1 - ab) * eps_hat) / math.sqrt(ab)
    assert torch.allclose(out.x_next, math.sqrt(ab_prev) * x0_hat + math.sqrt(1 - ab_prev) * eps_hat, atol=1e-5)
    assert torch.equal(out.log_prob, torch.zeros(B))
    assert torch.allclose(out.x_next * nn, euler_step(v, x, sigma, sigma_next).x_next, atol=1e-5)


def test_flow_ddim_is_raw_ddim_in_flow_coordinates():
    v, x = _inputs()
    sigma, sigma_next, eta = 0.7, 0.55, 0.8
    n, nn = math.hypot(1 - sigma, sigma), math.hypot(1 - sigma_next, sigma_next)
    ab, ab_prev = ((1 - sigma) / n) ** 2, ((1 - sigma_next) / nn) ** 2
    z = torch.randn(x.shape, generator=_gen(4))
    raw = ddim_step(x + (1 - sigma) * v, x / n, ab, ab_prev, eta=eta, noise=z, reduction="sum")
    flow = flow_ddim_step(v, x, sigma, sigma_next, eta=eta, noise=z, reduction="sum")
    assert torch.allclose(flow.mean, raw.mean * nn, atol=1e-5)
    assert torch.allclose(flow.std, raw.std * nn, atol=1e-6)
    assert torch.allclose(flow.x_next, raw.x_next * nn, atol=1e-5)
    # densities differ by the constant Jacobian of the rescaling: D log nn
    assert torch.allclose(flow.log_prob, raw.log_prob - D * math.log(nn), atol=1e-3)


# --- Flow-GRPO's published formula ----------------------------------------------------------------------


def test_flow_grpo_noise_scale_by_hand():
    sig = linear_sigmas(10)
    g = flow_grpo_noise_scale(sig, 0.7)
    assert g.shape == (10,)
    # sigma = 1 uses 1 - sigmas[1] = 0.1 in the denominator
    assert g[0].item() == pytest.approx(0.7 * math.sqrt(1 / 0.1), rel=1e-6)
    assert g[3].item() == pytest.approx(0.7 * math.sqrt(0.7 / 0.3), rel=1e-6)
    assert g[9].item() == pytest.approx(0.7 * math.sqrt(0.1 / 0.9), rel=1e-6)
    assert torch.equal(constant_noise_scale(sig, 0.3), torch.full((10,), 0.3))


@pytest.mark.parametrize("t", [0, 1, 4, 8])
def test_sde_step_reproduces_flow_grpo(t):
    a = 0.7
    sig = shifted_sigmas(10, 3.0).double()
    v, x = _inputs(seed=t)
    x, v = x.double(), v.double()
    sigma, sigma_next = sig[t].item(), sig[t + 1].item()
    dt = sigma_next - sigma
    # Flow-GRPO's sde_step_with_logprob, written out from docs/algorithms.md:
    std_dev_t = a * math.sqrt(sigma / (1 - (sig[1].item() if sigma == 1 else sigma)))
    prev_mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    noise_std = std_dev_t * math.sqrt(-dt)
    z = torch.randn(x.shape, generator=_gen(t + 10), dtype=torch.float64)
    prev = prev_mean + noise_std * z
    log_prob = (
        -((prev - prev_mean) ** 2) / (2 * noise_std**2) - math.log(noise_std) - math.log(math.sqrt(2 * math.pi))
    )
    log_prob = log_prob.mean(dim=(1, 2, 3))

    g = flow_grpo_noise_scale(sig.float(), a)[t]
    out = sde_step(v.float(), x.float(), sig.float()[t], sig.float()[t + 1], g=g, x_next=prev.float(), reduction="mean")
    assert torch.allclose(out.mean.double(), prev_mean, atol=2e-5, rtol=1e-5)
    assert out.std.flatten()[0].item() == pytest.approx(noise_std, rel=1e-5)
    assert torch.allclose(out.log_prob.double(), log_prob, atol=1e-3, rtol=1e-4)
    # sampling with the same standard normal gives Flow-GRPO's sample
    out2 = make_step("flow_sde", sig.float(), noise_level=a)(v.float(), x.float(), t, noise=z.float())
    assert torch.allclose(out2.x_next.double(), prev, atol=2e-5, rtol=1e-5)


# --- dtypes ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(STOCHASTIC) + ["euler"])
def test_bf16_inputs_compute_in_float32(kind):
    v, x = _inputs()
    vb, xb = v.to(torch.bfloat16), x.to(torch.bfloat16)
    z = torch.randn(x.shape, generator=_gen(5))
    if kind == "euler":
        def call(v_, x_):
            return euler_step(v_, x_, 0.6, 0.5)
    else:
        def call(v_, x_):
            return STOCHASTIC[kind](v_, x_, 0.6, 0.5, noise=z)
    out_b, out_upcast, out_f = call(vb, xb), call(vb.float(), xb.float()), call(v, x)
    for field in StepOutput._fields:
        assert getattr(out_b, field).dtype == torch.float32, field
        # bf16 inputs are upcast first: identical to feeding the upcast values
        assert torch.equal(getattr(out_b, field), getattr(out_upcast, field)), field
    # and within bf16 rounding (8 mantissa bits, rel 2^-8 of |x| + |v|) of the float32-input result
    tol = 2.0**-8 * (x.abs() + v.abs()).max().item() * 2
    assert (out_b.x_next - out_f.x_next).abs().max().item() < tol
    assert (out_b.mean - out_f.mean).abs().max().item() < tol


# --- re-scoring is bitwise, the uniform interface -------------------------------------------------------


@pytest.mark.parametrize("name", ["flow_sde", "dance_sde", "cps", "ddim"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_rescoring_a_stored_transition_is_bitwise(name, reduction):
    sig = shifted_sigmas(8, 3.0)
    step = make_step(name, sig, reduction=reduction)
    v, x = _inputs()
    for t in range(7):
        out = step(v, x, t, generator=_gen(t))
        again = step(v, x, t, x_next=out.x_next)
        assert torch.equal(again.log_prob, out.log_prob) and torch.equal(again.mean, out.mean)
        assert torch.equal(again.x_next, out.x_next)
        # per-row index tensor (a training minibatch that mixes steps) gives the same bits
        rows = torch.tensor([3, 1])
        sub = step(v[rows], x[rows], torch.full((2,), t), x_next=out.x_next[rows])
        assert torch.equal(sub.log_prob, out.log_prob[rows])
        assert (out.log_prob - again.log_prob).exp().eq(1).all()  # on-policy ratio exactly 1


def test_index_tensor_mixes_steps():
    sig = linear_sigmas(8)
    step = make_step("flow_sde", sig)
    v, x = _inputs()
    idx = torch.tensor([0, 2, 4, 6, 7])
    z = torch.randn(x.shape, generator=_gen())
    mixed = step(v, x, idx, noise=z)
    for r, t in enumerate(idx.tolist()):
        single = step(v[r : r + 1], x[r : r + 1], t, noise=z[r : r + 1])
        assert torch.equal(mixed.x_next[r], single.x_next[0])
        assert torch.equal(mixed.log_prob[r], single.log_prob[0])
        expected_std = step.noise_scales[t] * torch.sqrt(sig[t] - sig[t + 1])
        assert mixed.std[r].item() == pytest.approx(expected_std.item(), rel=1e-6)


def test_randomness_only_from_explicit_sources():
    v, x = _inputs()
    a = sde_step(v, x, 0.6, 0.5, g=0.5, generator=_gen(7))
    b = sde_step(v, x, 0.6, 0.5, g=0.5, generator=_gen(7))
    assert torch.equal(a.x_next, b.x_next)
    with pytest.raises(ValueError, match="generator"):
        sde_step(v, x, 0.6, 0.5, g=0.5)
    torch.manual_seed(0)
    z = torch.randn_like(x)
    c = sde_step(v, x, 0.6, 0.5, g=0.5, noise=z)
    assert torch.equal(c.x_next, c.mean + c.std * z)


def test_registry_names_and_errors():
    assert list(STEPS) == ["ode", "flow_sde", "dance_sde", "cps", "ddim"]
    assert get_step("cps").name == "cps"
    with pytest.raises(UnknownStepError) as info:
        get_step("flow-sde")
    assert isinstance(info.value, KeyError)
    msg = str(info.value)
    for name in STEPS:
        assert name in msg
    assert "did you mean 'flow_sde'" in msg
    with pytest.raises(TypeError, match="noise_level"):
        make_step("flow_sde", linear_sigmas(4), eta=0.3)
    with pytest.raises(ValueError, match="reduction"):
        make_step("flow_sde", linear_sigmas(4), reduction="avg")
    with pytest.raises(ValueError, match="decreasing"):
        make_step("flow_sde", torch.tensor([0.0, 0.5, 1.0]))
    step = make_step("dance_sde", linear_sigmas(4), eta=0.25, reduction="sum")
    assert step.hyperparams == {"eta": 0.25, "reduction": "sum"}
    assert torch.equal(step.noise_scales, torch.full((4,), 0.25))
    with pytest.raises(IndexError):
        step(*_inputs(), 4, generator=_gen())
