"""The hacking panel in the run (hack/* at every evaluation), KL to the base at evaluation, held-out rewards,
and trainable rewards (the adversarial discriminator) on their schedule, checkpointed and resumed exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.run.metrics import read_metrics
from flowrl.commands.train import load_recipe_config

ROOT = Path(__file__).resolve().parents[2]


class ConstantVelocity:
    """A stand-in model whose velocity is ``c`` (policy) or ``c_ref`` (inside ``reference()``)."""

    latent_shape = (1, 4, 4)
    dtype = torch.float32
    device = torch.device("cpu")

    def __init__(self, c: float, c_ref: float):
        self.c, self.c_ref, self.in_reference = c, c_ref, False

    def velocity_fn(self, guidance):
        return lambda x, sigma, cond: torch.full_like(x, self.c_ref if self.in_reference else self.c)

    def encode_prompts(self, prompts):
        return {}

    def reference(self):
        import contextlib

        @contextlib.contextmanager
        def swap():
            self.in_reference = True
            try:
                yield
            finally:
                self.in_reference = False

        return swap()


def test_kl_to_base_is_zero_for_the_base_quadratic_in_the_velocity_gap_and_zero_for_the_ode():
    from flowrl.eval.panel import kl_to_base
    from samplers import make_step, noise_kwargs
    from samplers.schedules import shifted_sigmas

    sigmas = shifted_sigmas(6, shift=3.0)
    sde = make_step("flow_sde", sigmas, **noise_kwargs("flow_sde", 0.7), reduction="mean")
    args = dict(prompts=["a", "b", "c"], seeds=[0, 1, 2], guidance=None, batch_size=2)
    assert kl_to_base(ConstantVelocity(0.3, 0.3), sde, **args).abs().max() == 0
    one = kl_to_base(ConstantVelocity(0.3, 0.1), sde, **args)
    two = kl_to_base(ConstantVelocity(0.5, 0.1), sde, **args)
    assert one.shape == (3,) and (one > 0).all()
    # The transition mean is affine in v, so the KL grows with the square of the velocity gap (0.2 -> 0.4).
    torch.testing.assert_close(two, 4 * one, rtol=1e-5, atol=0)
    # Constant velocities: the gap and hence the KL do not depend on the state, so every sample agrees.
    torch.testing.assert_close(one, one[:1].expand(3), rtol=1e-6, atol=0)
    ode = make_step("ode", sigmas)
    assert kl_to_base(ConstantVelocity(0.3, 0.1), ode, **args).abs().max() == 0


class GapVelocity(ConstantVelocity):
    """A stand-in whose base velocity depends on the state, ``v_base = -0.5 x``, and whose policy adds a gap that
    depends on the noise level only: ``v = v_base + c sigma``. The policy's samples then differ with ``c``, but the
    squared gap at any noised point is exactly ``c^2 sigma^2``."""

    def __init__(self, c: float):
        super().__init__(c, 0.0)

    def velocity_fn(self, guidance):
        def velocity(x, sigma, cond):
            gap = 0.0 if self.in_reference else self.c * sigma.view(-1, *([1] * (x.ndim - 1)))
            return -0.5 * x + gap

        return velocity


def test_fm_to_base_is_zero_for_the_base_and_quadratic_in_the_velocity_gap():
    from flowrl.eval.panel import fm_levels, fm_to_base
    from samplers.schedules import shifted_sigmas

    sigmas = shifted_sigmas(6, shift=3.0)
    args = dict(prompts=["a", "b", "c"], seeds=[0, 1, 2], guidance=None, batch_size=2)
    assert fm_levels(5) == pytest.approx([0.1, 0.3, 0.5, 0.7, 0.9])
    assert fm_to_base(ConstantVelocity(0.3, 0.3), sigmas, **args).abs().max() == 0
    assert fm_to_base(GapVelocity(0.0), sigmas, **args).abs().max() == 0
    # Hand value: mean over the levels of (c t)^2 = c^2 (0.01 + 0.09 + 0.25 + 0.49 + 0.81) / 5 = 0.33 c^2.
    one = fm_to_base(GapVelocity(0.1), sigmas, **args)
    two = fm_to_base(GapVelocity(0.2), sigmas, **args)
    torch.testing.assert_close(one, torch.full((3,), 0.33 * 0.1**2), rtol=1e-5, atol=0)
    torch.testing.assert_close(two, 4 * one, rtol=1e-5, atol=0)
    # Three levels: (1/6, 1/2, 5/6), mean of t^2 = (1 + 9 + 25) / 108.
    torch.testing.assert_close(fm_to_base(GapVelocity(0.1), sigmas, **args, levels=3),
                               torch.full((3,), 0.01 * 35 / 108), rtol=1e-5, atol=0)


def test_fm_to_base_is_positive_for_a_perturbed_toy_flow_and_zero_for_its_base():
    from flowrl.eval.panel import fm_to_base

    from toy import ToyFlow

    model = ToyFlow()
    model.freeze_reference()
    args = dict(prompts=["p"] * 6, seeds=list(range(6)), guidance=1.0, batch_size=4)
    sigmas = model.sigmas(8)
    assert fm_to_base(model, sigmas, **args).abs().max() == 0
    with torch.no_grad():
        model.denoiser[2].bias.add_(torch.tensor([0.2, -0.1]))
    perturbed = fm_to_base(model, sigmas, **args)
    # A constant correction of the output is a constant velocity gap: (0.2^2 + 0.1^2) / 2 per element.
    torch.testing.assert_close(perturbed, torch.full((6,), 0.025), rtol=1e-5, atol=0)
    with torch.no_grad():
        model.denoiser[2].weight.normal_(generator=torch.Generator().manual_seed(0))
    assert (fm_to_base(model, sigmas, **args) > 0).all()


def run(model_dir, out: Path, *extra: str, epochs: int = 2) -> list[dict]:
    settings = {"model.path": model_dir, "run.output_dir": out, "run.max_minutes": "null", "run.max_epochs": epochs,
                "data.num_eval_prompts": 6, "sampling.num_steps": 4, "sampling.window.max_start": "null",
                "sampling.eval_num_steps": 3, "sampling.groups_per_epoch": 2, "sampling.group_size": 4,
                "sampling.batch_size": 8, "train.micro_batch_size": 8, "eval.every_minutes": "null",
                "eval.every_epochs": 1, "eval.grid_size": 2, "eval.hacking.diversity_prompts": 2,
                "eval.hacking.diversity_seeds": 3, "eval.hacking.kl_prompts": 4, "optim.lr": 3e-3,
                "checkpoint.every_epochs": 1, "reward.train": "{jpeg_incompressibility: 1.0}"}
    recipe, cfg = load_recipe_config(str(ROOT / "configs" / "shapes" / "flow_grpo.yaml"),
                                     [f"{k}={v}" for k, v in settings.items()] + list(extra))
    recipe.main(cfg)
    return read_metrics(out / "metrics.jsonl")


@pytest.mark.slow
def test_every_evaluation_logs_the_panel_from_zero_drift_at_the_start(tiny_shapes_dir, tmp_path):
    rows = run(tiny_shapes_dir, tmp_path / "run", "reward.heldout=[jpeg_compressibility]")
    evals = [r for r in rows if "eval/shapes/mean" in r]
    assert [r["epoch"] for r in evals] == [0, 1, 2]
    start, end = evals[0], evals[-1]
    # Before training the evaluated model is the base: no drift, no KL, and the same images.
    assert start["hack/drift_pixel"] == 0 and start["hack/drift_feature"] == pytest.approx(0, abs=1e-6)
    assert start["hack/kl_to_base"] == 0
    assert start["hack/fm_to_base"] == 0
    # Two updates at a large learning rate move the full fine-tune away from its frozen copy.
    assert end["hack/drift_pixel"] > 0 and end["hack/drift_feature"] > 0 and end["hack/kl_to_base"] > 0
    assert end["hack/fm_to_base"] > 0
    for key in ("hack/diversity", "hack/extra_object_rate", "hack/bg_shift", "hack/accuracy",
                "hack/heldout/jpeg_compressibility/mean"):
        assert all(key in r for r in evals), key
    assert 0 < start["hack/diversity"] <= 2  # cosine distances of random-model images of one prompt
    for name in ("hack_accuracy", "hack_objects", "hack_pixels", "hack_background", "hack_features", "policy"):
        assert (tmp_path / "run" / "plots" / f"{name}.png").exists(), name


@pytest.mark.slow
def test_an_ode_trainer_logs_the_flow_matching_distance_and_no_kl(tiny_shapes_dir, tmp_path):
    # DGPO rolls out with the ODE: its rollout step has no transition density, so hack/kl_to_base would be 0 whatever
    # the weights and is not logged; hack/fm_to_base is 0 before training and grows as the policy moves.
    settings = {"model.path": tiny_shapes_dir, "run.output_dir": tmp_path / "dgpo", "run.max_minutes": "null",
                "run.max_epochs": 2, "data.num_eval_prompts": 4, "sampling.num_steps": 4, "sampling.eval_num_steps": 2,
                "sampling.groups_per_epoch": 2, "sampling.group_size": 4, "sampling.batch_size": 8,
                "train.micro_batch_size": 8, "eval.every_minutes": "null", "eval.every_epochs": 2, "eval.grid_size": 0,
                "eval.hacking.diversity_prompts": 0, "eval.hacking.fm_prompts": 4, "optim.lr": 3e-3,
                "checkpoint.every_epochs": 100, "reward.train": "{jpeg_incompressibility: 1.0}"}
    recipe, cfg = load_recipe_config(str(ROOT / "configs" / "shapes" / "dgpo.yaml"),
                                     [f"{k}={v}" for k, v in settings.items()])
    assert recipe.main(cfg) == 0
    evals = [r for r in read_metrics(tmp_path / "dgpo" / "metrics.jsonl") if "eval/shapes/mean" in r]
    assert [r["epoch"] for r in evals] == [0, 2]
    assert all("hack/kl_to_base" not in r for r in evals)
    assert evals[0]["hack/fm_to_base"] == 0 and evals[-1]["hack/fm_to_base"] > 0


def test_a_trained_reward_cannot_be_held_out(tiny_shapes_dir, tmp_path):
    from flowrl.config import ConfigError

    with pytest.raises(ConfigError, match="heldout: 'jpeg_incompressibility' is also in reward.train"):
        run(tiny_shapes_dir, tmp_path / "run", "reward.heldout=[jpeg_incompressibility]")


ADVERSARIAL = ["reward.train={jpeg_incompressibility: 1.0, adversarial: {weight: 0.5, kwargs: {d_steps: 2}}}",
               "reward.discriminator.period=2", "reward.discriminator.d_epochs=1", "eval.hacking.enabled=false"]
ALTERNATING = [*ADVERSARIAL, "reward.discriminator.d_on_generator_epochs=true"]


@pytest.mark.slow
def test_the_discriminator_trains_on_its_epochs_and_the_policy_on_the_others(tiny_shapes_dir, tmp_path):
    rows = [r for r in run(tiny_shapes_dir, tmp_path / "run", *ADVERSARIAL, epochs=4) if "adv/d_epoch" in r]
    assert [r["adv/d_epoch"] for r in rows] == [1.0, 0.0, 1.0, 0.0]
    # Discriminator epochs (0, 2) update the head and take no policy step; generator epochs the reverse.
    # Generator epochs measure the frozen head without a step: the count stays, the accuracy is a curve
    # over every epoch (and is plotted).
    assert [r.get("adv/d_updates") for r in rows] == [1.0, 1.0, 2.0, 2.0]
    assert all(0.0 <= r["adv/d_acc_fresh"] <= 1.0 for r in rows)
    assert ["train/loss" in r for r in rows] == [False, True, False, True]
    assert (tmp_path / "run" / "plots" / "discriminator.png").is_file()


@pytest.mark.slow
def test_the_discriminator_resumes_exactly(tiny_shapes_dir, tmp_path):
    straight = run(tiny_shapes_dir, tmp_path / "straight", *ALTERNATING, epochs=3)
    run(tiny_shapes_dir, tmp_path / "resumed", *ALTERNATING, epochs=2)
    resumed = run(tiny_shapes_dir, tmp_path / "resumed", *ALTERNATING, "run.resume=true", epochs=3)
    last = [r for r in straight if r.get("epoch") == 3 and "adv/d_loss" in r][0]
    again = [r for r in resumed if r.get("epoch") == 3 and "adv/d_loss" in r][-1]
    for key in ("adv/d_loss", "adv/d_real", "adv/d_fake", "adv/d_updates", "train/reward_mean"):
        assert again[key] == last[key], key
    from flowrl.run.checkpoint_files import latest_checkpoint

    saved = torch.load(latest_checkpoint(tmp_path / "resumed") / "state.pt", weights_only=True)
    assert saved["reward_models"]["rewards"][0]["updates"] == 3
