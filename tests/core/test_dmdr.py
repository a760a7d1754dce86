"""DMDR's generator loss and cold-start schedules (flowrl/core/dmdr.py): numbers produced by the authors' code and by
Flow-Factory's DMDR trainer on the same inputs, the composition (the reward weight 0 is DMD2's loss), and clear
errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from flowrl.core.distillation import dmd_generator_loss
from flowrl.core.dmdr import (
    cosine_decay,
    dmdr_generator_loss,
    dynamic_beta_params,
    dynamic_real_mix,
    generator_steps_done,
    reward_loss,
    sample_beta_sigmas,
)

D = torch.float64
TOL = 1e-10  # float64 arithmetic on O(1) values

# --------------------------------------------------------------------------------------------------
# The reference. A script outside this repository ran, in float64 (their `.float()` casts made identity):
# - vvvvvjdy/dmdr @ 061dc296e570adaae2925241bd1de505376a9fce, train_cc/sit/train_sitxl_refl_deepspeed.py lines
#   497-566 (the reward, lora_scale_r, the DMD loss and loss_gen) executed as they are, with the velocities replaced
#   by fixed seeded tensors (the fake score's at lora_scale_f, the real one's otherwise), the VAE decoder by tanh and
#   DINOv2 by a fixed linear head; its sample_continue (train_cc/sit/utils.py) executed as it is, after
#   torch.manual_seed(seed); the loop's initial reward_loss_dino_mean (zeros(1), line 402) for the cold start;
# - X-GenGroup/Flow-Factory @ 1796c8d390cd1c05d8c8c247ec062c838e3c1371 (branch DMDR),
#   src/flow_factory/trainers/DMDR/dmdr.py, DMDRTrainer.optimize lines 551-607 on the same stand-ins, its text-to-image
#   reward 0.
# The file holds the inputs, the draws, the losses, the gradients w.r.t. x0 and the schedules' values.

REF = json.loads((Path(__file__).parent / "distillation_reference" / "dmdr_reference.json").read_text())


def R(section, key, sub=None):
    v = (REF[section] if sub is None else REF[section][sub])[key]
    if isinstance(v, dict):
        return torch.tensor(v["data"], dtype=D).reshape(v["shape"])
    return torch.tensor(v, dtype=D)


def close(actual, expected, atol=TOL):
    actual = torch.as_tensor(actual)
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=0, atol=atol)


def rows(x, like):
    return x.reshape(-1, *([1] * (like.ndim - 1)))


def stand_in_reward_loss(x0):
    """The reference's stand-in for the authors' reward: DINOv2's cross-entropy on the decoded image, with tanh as the
    decoder and a fixed linear head as the classifier (train_sitxl_refl_deepspeed.py lines 503-511)."""
    inp = REF["inputs"]
    images = ((torch.tanh((x0 - inp["latents_bias"]) / inp["latents_scale"]) + 1) / 2).clamp(0, 1)
    logits = images.reshape(x0.shape[0], -1) @ R("inputs", "head").T
    return torch.nn.functional.cross_entropy(logits, torch.tensor(inp["ys"]))


@pytest.mark.parametrize("case", ["rl", "cold_start", "rl_dynamic"])
def test_the_generator_loss_matches_the_authors_code(case):
    sec = REF["generator"][case]
    x0 = R("inputs", "x0").requires_grad_(True)
    sigma, noise = R("generator", "ts_dmd", case), R("generator", "noise", case)
    x_t = (1 - rows(sigma, x0)) * x0.detach() + rows(sigma, x0) * noise
    close(x_t, R("generator", "input_latent_dmd", case))  # flowrl's convention is theirs
    # the reward enters from the cold start's end on: global_step >= cold_start_iter
    on = sec["global_step"] >= sec["cold_start_iter"]
    reward = stand_in_reward_loss(x0) if on else None
    out = dmdr_generator_loss(x0, x_t, sigma, R("inputs", "v_real"), R("inputs", "v_fake"), reward,
                              reward_weight=sec["dino_loss_weight"])
    close(out.dmd.grad, R("generator", "grad", case))
    close(out.stats["dmd_loss"], sec["dmd_loss"])
    close(out.reward_loss, sec["reward_loss"])
    close(out.loss, sec["loss_gen"])
    (g,) = torch.autograd.grad(out.loss, x0)
    close(g, R("generator", "dloss_dx0", case))
    # the real and fake clean predictions the gradient is made of
    close(x_t - rows(sigma, x0) * R("inputs", "v_real"), R("generator", "x0_r", case))
    close(x_t - rows(sigma, x0) * R("inputs", "v_fake"), R("generator", "x0_f", case))


def test_the_generator_loss_matches_flow_factory():
    """Flow-Factory's text-to-image DMDR: the same statements, its reward term 0 (loss_gen is float32 there)."""
    sec = REF["ff_generator"]
    x0 = R("inputs", "x0").requires_grad_(True)
    sigma = R("ff_generator", "ts_dmd")
    x_t = (1 - rows(sigma, x0)) * x0.detach() + rows(sigma, x0) * R("ff_generator", "noise")
    out = dmdr_generator_loss(x0, x_t, sigma, R("inputs", "v_real"), R("inputs", "v_fake"),
                              torch.zeros((), dtype=D), reward_weight=0.5)
    close(out.dmd.grad, R("ff_generator", "grad"))
    close(out.loss, sec["dmd_loss"])
    close(out.loss, sec["loss_gen"], atol=1e-8)
    (g,) = torch.autograd.grad(out.loss, x0)
    close(g, R("ff_generator", "dloss_dx0"), atol=1e-9)  # their gradient comes back through a float32 sum
    assert sec["lora_scale_r"] == pytest.approx(dynamic_real_mix(0.25, sec["global_step"], sec["dynamic_step"]),
                                                abs=1e-15)


def test_the_reward_weight_0_is_dmd2s_loss_and_the_reward_term_adds_its_own_gradient():
    x0 = R("inputs", "x0").requires_grad_(True)
    sigma = R("generator", "ts_dmd", "rl")
    x_t = (1 - rows(sigma, x0)) * x0.detach() + rows(sigma, x0) * R("generator", "noise", "rl")
    args = (x0, x_t, sigma, R("inputs", "v_real"), R("inputs", "v_fake"))
    dmd = dmd_generator_loss(*args)  # DMD2's eps = 0
    (g_dmd,) = torch.autograd.grad(dmd.loss, x0)
    for reward in (None, stand_in_reward_loss(x0)):
        out = dmdr_generator_loss(*args, reward, reward_weight=0.0, eps=0.0)
        assert torch.equal(out.loss.detach(), dmd.loss.detach())
        (g,) = torch.autograd.grad(out.loss, x0)
        assert torch.equal(g, g_dmd)
    weight = 0.3
    reward = stand_in_reward_loss(x0)
    (g_reward,) = torch.autograd.grad(reward, x0, retain_graph=True)
    out = dmdr_generator_loss(*args, reward, reward_weight=weight, eps=0.0)
    (g,) = torch.autograd.grad(out.loss, x0)
    close(g, g_dmd + weight * g_reward)
    assert g_reward.abs().max() > 1e-3  # the stand-in's reward term has a gradient of its own
    close(out.loss, dmd.loss + weight * reward.detach())


def test_the_reward_losses_by_hand():
    r = torch.tensor([0.2, 0.5, 0.8], dtype=D, requires_grad=True)
    close(reward_loss(r), -0.5)
    close(torch.autograd.grad(reward_loss(r), r)[0], torch.full((3,), -1 / 3, dtype=D))
    close(reward_loss(r, "hinge", margin=0.6), (0.4 + 0.1 + 0.0) / 3)  # relu(margin - r): the last is past it
    close(reward_loss(r, "log"), -(math.log(0.2) + math.log(0.5) + math.log(0.8)) / 3)
    close(torch.autograd.grad(reward_loss(r, "log"), r)[0], -1 / (3 * r.detach()))  # d(-log r)/dr = -1/r
    # the authors' cross-entropy of a classifier is -log of the wanted class's probability
    logits = torch.tensor([[1.0, -0.5], [0.3, 0.2]], dtype=D)
    wanted = torch.tensor([0, 1])
    p = torch.softmax(logits, dim=1)[torch.arange(2), wanted]
    close(reward_loss(p, "log"), torch.nn.functional.cross_entropy(logits, wanted))
    assert math.isfinite(float(reward_loss(torch.zeros(2, dtype=D), "log")))  # floored at 1e-12
    assert math.isnan(float(reward_loss(torch.tensor([0.5, math.nan], dtype=D), "log")))  # NaN passes through
    with pytest.raises(ValueError, match=r"the reward loss 'log' needs rewards in \[0, 1\] .*received 1.5: use"):
        reward_loss(torch.tensor([0.5, 1.5], dtype=D), "log")
    with pytest.raises(ValueError, match="kind must be one of 'negative', 'hinge', 'log'; received 'neg'"):
        reward_loss(r, "neg")
    with pytest.raises(ValueError, match=r"rewards must be a floating tensor \[B\]; received \[3, 1\]"):
        reward_loss(r.reshape(3, 1))


def test_sample_continue_draws_are_the_authors():
    """The authors' DynaRS draw after torch.manual_seed(seed) is ours with that seed (their cosine uses 3.141593 in
    float32: the Beta parameters, and so the draws, agree to ~1e-7)."""
    for case in REF["sample_continue"]:
        ours = sample_beta_sigmas(len(case["t"]["data"]), case["alpha"], case["beta"], seed=case["seed"],
                                  step=case["step"], dynamic_steps=case["dynamic_step"], dtype=D)
        close(ours, torch.tensor(case["t"]["data"], dtype=D), atol=2e-6)


def test_the_real_scores_mix_is_the_authors_lora_scale_r():
    for case in REF["lora_scale_r"]:
        ours = dynamic_real_mix(case["lora_scale_r"], case["step"], case["dynamic_step"])
        assert ours == pytest.approx(case["value"], abs=1e-15), case


def test_the_schedules_by_hand():
    assert cosine_decay(0, 10) == 1.0 and cosine_decay(5, 10) == pytest.approx(0.5) and cosine_decay(10, 10) == 0.0
    assert cosine_decay(30, 10) == 0.0
    assert dynamic_beta_params(4.0, 1.5, 0, 100) == (4.0, 1.5)
    assert dynamic_beta_params(4.0, 1.5, 50, 100) == pytest.approx((2.5, 1.25))
    assert dynamic_beta_params(4.0, 1.5, 100, 100) == (1.0, 1.0) == dynamic_beta_params(4.0, 1.5, 900, 100)
    assert dynamic_beta_params(4.0, 1.5, 900, 0) == (4.0, 1.5)  # no horizon: the Beta stays
    assert dynamic_real_mix(0.5, 0, 8) == 0.5 and dynamic_real_mix(0.5, 4, 8) == pytest.approx(0.25)
    assert dynamic_real_mix(0.5, 8, 8) == 0.0 and dynamic_real_mix(0.5, 0, 0) == 0.0  # no horizon: the teacher
    # DMD2's generator steps 0, r, 2r, ...: updates made before step g are ceil(g / r)
    assert [generator_steps_done(g, 5) for g in range(12)] == [0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3]
    assert [generator_steps_done(g, 1) for g in range(4)] == [0, 1, 2, 3]


def test_the_beta_draw_is_seeded_and_leaves_the_global_generator_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    a = sample_beta_sigmas(64, 4.0, 1.5, seed=7)
    assert torch.equal(torch.rand(3), expected)
    assert torch.equal(a, sample_beta_sigmas(64, 4.0, 1.5, seed=7))
    assert not torch.equal(a, sample_beta_sigmas(64, 4.0, 1.5, seed=8))
    assert a.dtype == torch.float32 and a.shape == (64,) and bool(((a > 0) & (a < 1)).all())
    assert float(a.mean()) > 0.6  # Beta(4, 1.5) has mean 0.73: skewed toward noise
    late = sample_beta_sigmas(4096, 4.0, 1.5, seed=7, step=10, dynamic_steps=10)  # uniform by then
    assert abs(float(late.mean()) - 0.5) < 0.02


@pytest.mark.parametrize("call, message", [
    (lambda: cosine_decay(3, 0), "cosine_decay needs dynamic_steps > 0"),
    (lambda: dynamic_real_mix(0.5, -1, 8), "step must be an integer >= 0; received -1"),
    (lambda: dynamic_beta_params(0.0, 1.5, 0, 8), "alpha must be a finite number > 0; received 0.0"),
    (lambda: sample_beta_sigmas(4, 4.0, 1.5, seed=None), "seed must be an integer"),
    (lambda: sample_beta_sigmas(0, 4.0, 1.5, seed=1), "batch must be an integer >= 1; received 0"),
    (lambda: generator_steps_done(3, 0), "dfake_gen_update_ratio must be an integer >= 1; received 0"),
])
def test_errors_name_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_reward_loss_must_be_a_scalar_and_the_weight_non_negative():
    x0 = torch.randn(2, 3, dtype=D)
    args = (x0, x0, 0.5, x0, x0)
    with pytest.raises(ValueError, match=r"reward_loss must be a floating scalar tensor .*received \[2\]"):
        dmdr_generator_loss(*args, torch.zeros(2, dtype=D), reward_weight=1.0)
    with pytest.raises(ValueError, match="reward_weight must be a finite number >= 0"):
        dmdr_generator_loss(*args, None, reward_weight=-1.0)
    with pytest.raises(ValueError, match="reward_weight must be a finite number >= 0"):
        dmdr_generator_loss(*args, None, reward_weight=math.nan)
