"""Direct-Align and SRPO's relative reward (flowrl/core/direct_align.py): numbers produced by the authors' training step
on stand-in networks, the exact recovery, the branches' signs, and clear errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from flowrl.core.direct_align import (SRPO_NEGATIVE, SRPO_POSITIVE, augment, branch_levels, discount_weight,
                                      groundtruth_gap, recover, select_range, srp, window)
from flowrl.core.reward_gradient import refl_loss, renoise, truncated_sample

D = torch.float64
TOL = 1e-10  # float64 arithmetic on O(1) values

# --------------------------------------------------------------------------------------------------
# The reference. A script outside this repository extracted, with `ast`, the source of SRPO_train and of everything it
# calls (run_sample_step, flux_step, sd3_time_shift, pack_latents, unpack_latents, prepare_latent_image_ids, the
# control words, CLIP.SRP_cfg, HPS.SRP_cfg) from Tencent-Hunyuan/SRPO @ 81e58984740e384cda913c7334c0bdaa53dfb244,
# fastvideo/SRPO.py, and executed it unedited in float64: its `torch` was a proxy whose float32 and bfloat16 are
# float64, whose autocasts do nothing and whose randn is a seeded float64 draw (recorded); dist.broadcast a no-op.
# Stand-ins: the FLUX transformer v = tanh(x A) B + b + t c on the packed latents, t the timestep it is given; the VAE
# decoder tanh(M z); the reward models' image preprocessing the CLIP normalisation (no resize or crop), their image
# features a fixed linear map P of the pixels, their text features a fixed random vector per prompt string. The
# arguments are those of scripts/finetune/SRPO_training_{ps,hpsv2}.sh at 16 x 16 pixels and 8 rollout steps. Per case
# the file holds the draw j, the step (which picks the control words), the injected noise, each branch's network
# input, timestep, recovered latent (unpack_latents' input), prompts, k and SRP output, the returned loss and the
# stand-in's gradients after SRPO_train's two backward passes.

REF = json.loads((Path(__file__).parent / "reward_gradient_reference" / "direct_align_reference.json").read_text())
INPUTS = REF["inputs"]


def R(v):
    return torch.tensor(v["data"], dtype=D).reshape(v["shape"])


def close(actual, expected, atol=TOL):
    actual = torch.as_tensor(actual)
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


def timestep(s):
    """The time the authors give the transformer, ``int(1000 s) / 1000``, of a level that flowrl's samplers pass in
    float32 (the 1e-4 absorbs float32's rounding: 0.9 is 0.89999998)."""
    return torch.floor(torch.as_tensor(s).to(D) * 1000 + 1e-4) / 1000


class StandIn(torch.nn.Module):
    """The reference's transformer, on the timestep the authors pass it."""

    def __init__(self):
        super().__init__()
        for name in "ABbc":
            setattr(self, name, torch.nn.Parameter(R(INPUTS[name]).clone()))

    def forward(self, x, s):
        t = timestep(s)
        return torch.tanh(x @ self.A) @ self.B + self.b + t[:, None, None] * self.c


def decode(packed):
    """The reference's decoder on FLUX's packed latents: unpack_latents (16 x 16 pixels), the VAE's scale and shift,
    tanh(M z), then SRPO_train's ``(image / 2 + 0.5).clamp(0, 1)``."""
    z = packed.view(1, 1, 1, 16, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(1, 16, 2, 2)
    z = z / 0.3611 + 0.1159
    return (torch.tanh(torch.einsum("oc,bchw->bohw", R(INPUTS["M"]), z)) / 2 + 0.5).clamp(0, 1)


def stand_in_reward(kind):
    """``r(image, prompt)``: PickScore's ``logit_scale * cos`` or HPS's ``cos`` of the stand-in features."""
    mean = torch.tensor((0.48145466, 0.4578275, 0.40821073), dtype=D)[:, None, None]
    std = torch.tensor((0.26862954, 0.26130258, 0.27577711), dtype=D)[:, None, None]
    scale = torch.tensor(INPUTS["logit_scale_log"], dtype=D).exp() if kind == "pickscore" else 1.0

    def reward(images, prompts):
        f = ((images - mean) / std).reshape(images.shape[0], -1) @ R(INPUTS["P"])
        e = torch.stack([torch.tensor(INPUTS["text"][p], dtype=D) for p in prompts])
        return scale * torch.nn.functional.cosine_similarity(f, e, dim=-1)

    return reward


@pytest.mark.parametrize("case", REF["cases"], ids=lambda c: f"{c['reward']}-j{c['select']}")
def test_direct_align_and_srp_match_the_authors_training_step(case):
    args, net = case["args"], StandIn()
    noise = R(case["noise"])
    sigmas = torch.tensor(case["rollout_sigmas"], dtype=D)
    with torch.no_grad():  # the rollout (run_sample_step): the authors' Euler steps on their shifted schedule
        x0 = truncated_sample(net, noise, sigmas, grad_steps=0).x
    assert timestep(sigmas[:-1].float()).tolist() == case["rollout_timesteps"]
    levels = window(*case["window"], args["timestep_length"])
    gap = groundtruth_gap(args["timestep_length"], args["groundtruth_ratio"])
    step = case["step"]
    pos = augment([INPUTS["caption"]], SRPO_POSITIVE[step % 4])
    neg = augment([INPUTS["caption"]], SRPO_NEGATIVE[step % 5])
    reward = stand_in_reward(case["reward"])
    scale = 1 / 20 if case["reward"] == "pickscore" else 1.0  # CLIP.SRP_cfg: "comparable with hps"
    losses = []
    for ref in case["branches"]:  # the denoising branch first, as SRPO_train runs them
        invert = ref["inversion"]
        lv = branch_levels(levels, case["select"], gap, invert=invert)
        x_in = renoise(x0, noise, lv.sigma_from)
        close(x_in, R(ref["hidden_states"]))  # the injected noise at the injected level
        assert float(timestep(torch.tensor(lv.sigma_from).float())) == ref["timestep"]
        out = recover(net, x0, noise, lv.sigma_from, lv.sigma_to)
        close(out.x, R(ref["x0_hat"]))  # one step with gradients, the rest of the noise removed analytically
        assert len(out.grad_points) == 1 and out.grad_points[0].sigma == pytest.approx(lv.sigma_from, abs=1e-7)
        a, b = (neg, pos) if invert else (pos, neg)
        assert (ref["a"], ref["b"]) == (a, b)
        k = discount_weight(args["discount_inv"] if invert else args["discount_pos"], args["timestep_length"],
                            lv.index)
        close(k, ref["k"])
        images = decode(out.x)
        objective = scale * srp(reward(images, a), reward(images, b), k)
        close(objective, [ref["output"]])
        losses.append(refl_loss(objective, 0.7) / args["gradient_accumulation_steps"])  # F.relu(-outputs + 0.7) / 2
    close(losses[-1], case["returned_loss"])
    for loss in losses:
        loss.backward()
    for name, p in net.named_parameters():
        close(p.grad, R(case["grads"][name]))


def test_the_authors_draws_gap_and_control_words():
    assert select_range(1000) == range(5, 996)  # random.randint(5, args.timestep_length - 5)
    random.seed(0)
    assert {random.randint(5, 15) for _ in range(2000)} == set(select_range(20))
    # int((1 - 0.9) * 1000) + 1: (1 - 0.9) * 1000 is 99.99999999999997 in floating point, so the gap is 100
    assert groundtruth_gap(1000, 0.9) == 100 and groundtruth_gap(1000, 0.0) == 1001
    lv = branch_levels(window(0.9, 0.5, 1000), 500, 100, invert=False)
    assert lv.index == 500 and lv.sigma_from > lv.sigma_to
    inv = branch_levels(window(0.9, 0.5, 1000), 500, 100, invert=True)
    assert inv.index == 400 and inv.sigma_from < inv.sigma_to
    # the draw's bounds cap the gap: near the clean end the inversion's index stops at 1
    assert branch_levels(window(0.9, 0.5, 1000), 7, 100, invert=True).index == 1
    assert discount_weight((0.1, 0.25), 1000, 0) == pytest.approx(0.1)
    assert discount_weight((0.1, 0.25), 1000, 999) == pytest.approx(0.25)
    assert augment(["a cat"], "Real") == ["Real. a cat"]
    assert (SRPO_POSITIVE[1 % 4], SRPO_NEGATIVE[1 % 5]) == ("Detail", "Painting")  # the first step's pair
    r = torch.tensor([2.0, -1.0])
    close(srp(r, r, 0.25), 0.25 * r)  # without control words: k r


@pytest.mark.parametrize("invert", [False, True])
def test_the_exact_velocity_recovers_x0_and_the_branches_pull_opposite_ways(invert):
    """With ``v = eps - x0 + theta`` the recovered image is ``x0 + d theta``: ``d = -(hi - lo) / (1 - lo)`` when
    denoising, ``+(hi - lo) / (1 - hi)`` when inverting."""
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(2, 3, generator=g, dtype=D), torch.randn(2, 3, generator=g, dtype=D)
    theta = torch.zeros((), dtype=D, requires_grad=True)
    lv = branch_levels(window(0.95, 0.6, 100), 50, groundtruth_gap(100, 0.9), invert=invert)
    hi, lo = max(lv.sigma_from, lv.sigma_to), min(lv.sigma_from, lv.sigma_to)
    out = recover(lambda x, s: eps - x0 + theta, x0, eps, lv.sigma_from, lv.sigma_to)
    close(out.x, x0)
    out.x.sum().backward()
    d = (hi - lo) / (1 - hi) if invert else -(hi - lo) / (1 - lo)
    close(theta.grad, d * x0.numel())


def test_clear_errors():
    with pytest.raises(ValueError, match="0 < sigma_min < sigma_max <= 1"):
        window(0.5, 0.7, 100)
    with pytest.raises(ValueError, match="use at least 10"):
        select_range(9)
    with pytest.raises(ValueError, match=r"groundtruth_ratio must be in \[0, 1\)"):
        groundtruth_gap(100, 1.0)
