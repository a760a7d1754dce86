"""Sampling steps with log-probabilities, schedules, guidance and rollout (torch only).

This package imports only torch, numpy and the standard library (docs/architecture.md: ``samplers`` sits below
``flowrl`` and never imports diffusers, transformers, accelerate or flowrl).

Public API:

* schedules: ``linear_sigmas``, ``shifted_sigmas``, ``shift_sigmas``, ``calculate_shift``,
  ``diffusers_flow_sigmas``, ``flux_pipeline_sigmas``
* steps: ``StepOutput``, ``euler_step``, ``sde_step``, ``cps_step``, ``ddim_step``, ``flow_ddim_step``,
  ``gaussian_log_prob``, ``flow_grpo_noise_scale``, ``constant_noise_scale``, ``noise_std_ratio``
* the uniform step interface: ``STEPS``, ``get_step``, ``make_step``, ``noise_kwargs``, ``Step``, ``UnknownStepError``
* guidance: ``classifier_free_guidance``
* rollout: ``Window``, ``train_mask``, ``window_start``, ``Trajectory``, ``rollout``, ``ode_complete``
* per-sample noise: ``make_sample_seeds``, ``initial_noise``, ``step_noise``, ``steps_noise``, ``derive_seed``
"""

from .guidance import classifier_free_guidance, concat_cond, expand_cond, select_cond
from .noise import derive_seed, initial_noise, make_sample_seeds, sample_generators, step_noise, steps_noise
from .rollout import (
    WINDOW_MODES,
    Trajectory,
    Window,
    ode_complete,
    rollout,
    train_mask,
    trainable_steps,
    window_start,
)
from .schedules import (
    calculate_shift,
    diffusers_flow_sigmas,
    flux_pipeline_sigmas,
    linear_sigmas,
    shift_sigmas,
    shifted_sigmas,
)
from .steps import (
    STEPS,
    Step,
    StepOutput,
    StepSpec,
    UnknownStepError,
    constant_noise_scale,
    cps_step,
    ddim_step,
    euler_step,
    flow_ddim_step,
    flow_grpo_noise_scale,
    gaussian_log_prob,
    get_step,
    make_step,
    noise_kwargs,
    noise_std_ratio,
    sde_step,
    step_names,
)

__all__ = [
    "classifier_free_guidance",
    "concat_cond",
    "expand_cond",
    "select_cond",
    "derive_seed",
    "initial_noise",
    "make_sample_seeds",
    "sample_generators",
    "step_noise",
    "steps_noise",
    "WINDOW_MODES",
    "Trajectory",
    "Window",
    "ode_complete",
    "rollout",
    "train_mask",
    "trainable_steps",
    "window_start",
    "calculate_shift",
    "diffusers_flow_sigmas",
    "flux_pipeline_sigmas",
    "linear_sigmas",
    "shift_sigmas",
    "shifted_sigmas",
    "STEPS",
    "Step",
    "StepOutput",
    "StepSpec",
    "UnknownStepError",
    "constant_noise_scale",
    "cps_step",
    "ddim_step",
    "euler_step",
    "flow_ddim_step",
    "flow_grpo_noise_scale",
    "gaussian_log_prob",
    "get_step",
    "make_step",
    "noise_kwargs",
    "noise_std_ratio",
    "sde_step",
    "step_names",
]
