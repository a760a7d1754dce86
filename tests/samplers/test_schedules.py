"""Schedules: closed forms, and diffusers' FlowMatchEulerDiscreteScheduler reproduced exactly."""

import numpy as np
import pytest
import torch

from samplers import (
    calculate_shift,
    diffusers_flow_sigmas,
    flux_pipeline_sigmas,
    linear_sigmas,
    shifted_sigmas,
)


def test_linear_and_shifted_closed_forms():
    s = linear_sigmas(4)
    assert s.dtype == torch.float32
    assert s.tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    sh = shifted_sigmas(4, 3.0)
    # sigma' = 3 sigma / (1 + 2 sigma), by hand: 0.75 -> 2.25/2.5 = 0.9, 0.5 -> 1.5/2 = 0.75, 0.25 -> 0.75/1.5 = 0.5
    assert torch.allclose(sh, torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0]), atol=1e-7)
    assert torch.equal(shifted_sigmas(7, 1.0), linear_sigmas(7))
    with pytest.raises(ValueError):
        linear_sigmas(0)


def test_calculate_shift_matches_flux_line():
    # mu passes through (256, 0.5) and (4096, 1.15)
    assert calculate_shift(256) == pytest.approx(0.5)
    assert calculate_shift(4096) == pytest.approx(1.15)
    assert calculate_shift(1024) == pytest.approx(0.5 + 0.65 * 768 / 3840)


diffusers = pytest.importorskip("diffusers")


def _scheduler_sigmas(n, config, **kw):
    sched = diffusers.FlowMatchEulerDiscreteScheduler(**config)
    sched.set_timesteps(n, **kw)
    return sched.sigmas


CONFIGS = [
    ("default", {}, {}),
    ("sd3", {"shift": 3.0}, {}),
    ("sd35_shift_terminal", {"shift": 3.0, "shift_terminal": 0.02}, {}),
    (
        "flux_dynamic",
        {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
         "max_image_seq_len": 4096},
        {"mu": calculate_shift(1024)},
    ),
    ("dynamic_linear", {"use_dynamic_shifting": True, "time_shift_type": "linear"}, {"mu": 0.9}),
]


@pytest.mark.parametrize("name,config,kw", CONFIGS, ids=[c[0] for c in CONFIGS])
@pytest.mark.parametrize("n", [4, 10, 28])
def test_matches_diffusers_scheduler(name, config, kw, n):
    expected = _scheduler_sigmas(n, config, **kw)
    got = diffusers_flow_sigmas(n, **config, **kw)
    assert got.shape == (n + 1,) and got[-1] == 0
    assert torch.equal(got, expected), (got - expected).abs().max()


@pytest.mark.parametrize("n", [4, 28])
@pytest.mark.parametrize("image_seq_len", [256, 1024, 4096])
def test_matches_flux_pipeline_schedule(n, image_seq_len):
    # FluxPipeline passes its own base sigmas linspace(1, 1/n, n) plus mu from calculate_shift.
    mu = calculate_shift(image_seq_len)
    expected = _scheduler_sigmas(
        n, {"use_dynamic_shifting": True, "shift": 3.0}, sigmas=np.linspace(1.0, 1 / n, n), mu=mu
    )
    assert torch.equal(flux_pipeline_sigmas(n, image_seq_len), expected)
    # mu may also come from image_seq_len directly
    assert torch.equal(
        diffusers_flow_sigmas(
            n, use_dynamic_shifting=True, image_seq_len=image_seq_len, sigmas=np.linspace(1.0, 1 / n, n)
        ),
        expected,
    )


def test_dynamic_shifting_needs_mu():
    with pytest.raises(ValueError, match="mu"):
        diffusers_flow_sigmas(10, use_dynamic_shifting=True)
