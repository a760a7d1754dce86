"""The ``sampling`` section's rollout step (flowrl/rl/sampling.py)."""

from __future__ import annotations


def test_every_step_takes_its_own_default_noise_level():
    from flowrl.rl.sampling import SamplingConfig, rollout_step
    from samplers import linear_sigmas

    sigmas = linear_sigmas(4)
    assert rollout_step(SamplingConfig(step="dance_sde"), sigmas).hyperparams["eta"] == 0.3
    assert rollout_step(SamplingConfig(step="flow_sde"), sigmas).hyperparams["noise_level"] == 0.7
    assert rollout_step(SamplingConfig(step="dance_sde", noise_level=0.5), sigmas).hyperparams["eta"] == 0.5
