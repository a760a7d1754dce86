"""With its parity options on (``cfg_grad=cond_only``, ``drop_zero_advantage``, ``kl_coef_units=flow_grpo``), one
training step of flowrl's Flow-GRPO equals a Flow-GRPO training step written out by hand on the tiny SD3
pipeline: the same data, the same gradient (cosine > 0.9999, norms within 1e-4).

The hand-written step follows Flow-GRPO's ``train_sd3.py`` and ``sde_step_with_logprob``, independently of
flowrl's step, guidance and loss code: one batched transformer call on ``[uncond; cond]`` with the
unconditional half detached, the mean ``x (1 + g^2 dt / (2 sigma)) + v (1 + g^2 (1 - sigma) / (2 sigma)) dt``
with ``g = a sqrt(sigma / (1 - sigma))`` (``sigma_1`` in place of 1 at the first step), the log-density
averaged over elements, the clipped surrogate, the KL ``mean_d(mu - mu_ref)^2 / (2 g^2)`` with the LoRA
adapters off as the reference, samples whose advantage is 0 left out, and gradients averaged over
(sample, step) pairs.
"""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.config import from_dict
from flowrl.data.prompt_groups import PromptGroups
from flowrl.dist import Dist
from flowrl.models.config import build_model
from flowrl.recipes.flow_grpo import Config, train_epoch
from flowrl.testing import build_tiny_sd3
from rewards import RewardOutput

from toy import flow_grpo_epoch

PROMPTS = ["a red cat", "a blue dog", "a green square"]
CONSTANT = "a blue dog"  # its group's rewards are all equal: advantage 0 at every step
# Larger than Flow-GRPO's 0.04 so that the KL's share of the gradient is large enough for a wrong KL to show.
BETA = 0.5


def reward(images, prompts, metadata=None) -> RewardOutput:
    scores = images.float().mean(dim=(1, 2, 3))
    return RewardOutput(torch.where(torch.tensor([p == CONSTANT for p in prompts]), torch.ones_like(scores), scores))


def flow_grpo_gradient(model, rollouts, advantages, *, guidance, noise_level, clip_range, beta) -> torch.Tensor:
    """Flow-GRPO's gradient on the epoch's data, written out by hand."""
    traj = rollouts.trajectory
    sigmas = traj.sigmas.double()
    keep = (advantages != 0).any(dim=1)  # Flow-GRPO: samples whose advantages are all zero are filtered out
    rows = torch.nonzero(keep).flatten()
    steps = traj.trained_steps
    denoiser = model.denoiser
    uncond = model.uncond(1)
    params = model.trainable_parameters()
    for p in params:
        p.grad = None
    embeds = {k: torch.cat([uncond[k].expand(len(rows), *uncond[k].shape[1:]), rollouts.cond[k][rows]])
              for k in ("prompt_embeds", "pooled_prompt_embeds")}

    def transition_mean(x, t, **kw):
        sigma, sigma_next = float(sigmas[t]), float(sigmas[t + 1])
        timestep = torch.full((2 * len(x),), sigma * 1000.0)
        out = denoiser(hidden_states=torch.cat([x, x]), timestep=timestep,
                       encoder_hidden_states=embeds["prompt_embeds"],
                       pooled_projections=embeds["pooled_prompt_embeds"], return_dict=False)[0]
        v_uncond, v_text = out.chunk(2)
        v = v_uncond.detach() + guidance * (v_text - v_uncond.detach())
        dt = sigma_next - sigma
        g = math.sqrt(sigma / (1 - (float(sigmas[1]) if sigma == 1.0 else sigma))) * noise_level
        mean = x * (1 + g**2 / (2 * sigma) * dt) + v * (1 + g**2 * (1 - sigma) / (2 * sigma)) * dt
        return mean, g, dt

    for t in steps:
        x, x_next = traj.latents[rows, t], traj.latents[rows, t + 1]
        mean, g, dt = transition_mean(x, t)
        std = g * math.sqrt(-dt)
        log_prob = (-((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi))).mean(
            dim=(1, 2, 3))
        ratio = torch.exp(log_prob - traj.log_probs[rows, t])
        adv = advantages[rows, t]
        policy = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)).mean()
        with torch.no_grad():
            denoiser.disable_adapters()
            mean_ref, _, _ = transition_mean(x, t)
            denoiser.enable_adapters()
        kl = (((mean - mean_ref) ** 2).mean(dim=(1, 2, 3)) / (2 * g**2)).mean()
        ((policy + beta * kl) / len(steps)).backward()  # accumulated over the trained steps
    return torch.cat([p.grad.flatten() for p in params])


@pytest.fixture(scope="module")
def epoch_data():
    torch.set_num_threads(1)
    cfg = from_dict(Config, {
        "run": {"seed": 5},
        "model": {"name": "sd3", "path": str(build_tiny_sd3()), "max_sequence_length": 16,
                  "lora": {"rank": 4, "alpha": 8}},
        "sampling": {"num_steps": 4, "step": "flow_sde", "noise_level": 0.7, "guidance": 4.5, "group_size": 4,
                     "groups_per_epoch": 3, "batch_size": 12},
        "optim": {"lr": 1e-3, "grad_clip": 1e9},
        "train": {"clip_range": 0.2, "kl_coef": BETA, "kl_coef_units": "flow_grpo", "cfg_grad": "cond_only",
                  "drop_zero_advantage": True, "micro_batch_size": 12},
    })
    model = build_model(cfg.model, "cpu")
    generator = torch.Generator().manual_seed(0)
    for name, p in model.denoiser.named_parameters():
        if "lora_B" in name:  # move the policy away from the reference, so the KL has a gradient
            p.data.normal_(0.0, 0.05, generator=generator)
    model.freeze_reference()
    dist = Dist(cpu=True)
    groups = PromptGroups(PROMPTS, None, groups=3, group_size=4, seed=5)
    rollouts, advantages, valid, _ = flow_grpo_epoch(model, cfg, dist, groups.epoch(0), 0, reward)
    assert traj_steps(rollouts) == [0, 1, 2]
    return cfg, model, dist, rollouts, advantages, valid


def traj_steps(rollouts):
    return rollouts.trajectory.trained_steps


def flowrl_gradient(cfg, model, dist, rollouts, advantages, valid) -> tuple[torch.Tensor, dict]:
    params = model.trainable_parameters()
    optimizer = torch.optim.SGD(params, lr=0.0)  # the step leaves the weights as they are; .grad keeps the gradient
    metrics = train_epoch(model, optimizer, rollouts, advantages, valid, cfg, dist, 0)
    return torch.cat([p.grad.flatten() for p in params]), metrics


def test_one_training_step_equals_flow_grpo_with_the_parity_options(epoch_data):
    cfg, model, dist, rollouts, advantages, valid = epoch_data
    constant = torch.tensor([p == CONSTANT for p in rollouts.prompts])
    assert (advantages[constant] == 0).all() and (advantages[~constant][:, :3] != 0).all()
    ours, metrics = flowrl_gradient(cfg, model, dist, rollouts, advantages, valid)
    assert metrics["train/dropped_zero_advantage"] == 4 and metrics["train/kl_ref"] > 0
    reference = flow_grpo_gradient(model, rollouts, advantages, guidance=4.5, noise_level=0.7, clip_range=0.2,
                                   beta=BETA)
    cosine = float(torch.nn.functional.cosine_similarity(ours.double(), reference.double(), dim=0))
    assert cosine > 0.9999, cosine
    assert float(ours.norm() / reference.norm()) == pytest.approx(1.0, abs=1e-4)


def test_without_the_parity_options_the_step_differs(epoch_data):
    """Each option changes the gradient: the test above would catch an option that does nothing."""
    cfg, model, dist, rollouts, advantages, valid = epoch_data
    reference = flow_grpo_gradient(model, rollouts, advantages, guidance=4.5, noise_level=0.7, clip_range=0.2,
                                   beta=BETA)
    for change in ({"cfg_grad": "full"}, {"drop_zero_advantage": False}, {"kl_coef_units": "flowrl"}):
        changed = from_dict(Config, {**_as_dict(cfg), "train": {**_as_dict(cfg)["train"], **change}})
        ours, _ = flowrl_gradient(changed, model, dist, rollouts, advantages, valid)
        cosine = float(torch.nn.functional.cosine_similarity(ours.double(), reference.double(), dim=0))
        ratio = float(ours.norm() / reference.norm())
        assert cosine < 0.999 or abs(ratio - 1) > 0.01, (change, cosine, ratio)


def _as_dict(cfg):
    from flowrl.config import to_dict

    return to_dict(cfg)
