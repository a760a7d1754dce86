"""The hacking panel in the run (hack/* at every evaluation), KL to the base at evaluation, held-out rewards,
and trainable rewards (the adversarial discriminator) on their schedule, checkpointed and resumed exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.logging import read_metrics
from flowrl.train import load_recipe_config

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
    from flowrl.rl.panel import kl_to_base
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


def test_every_evaluation_logs_the_panel_from_zero_drift_at_the_start(tiny_shapes_dir, tmp_path):
    rows = run(tiny_shapes_dir, tmp_path / "run", "reward.heldout=[jpeg_compressibility]")
    evals = [r for r in rows if "eval/shapes/mean" in r]
    assert [r["epoch"] for r in evals] == [0, 1, 2]
    start, end = evals[0], evals[-1]
    # Before training the evaluated model is the base: no drift, no KL, and the same images.
    assert start["hack/drift_pixel"] == 0 and start["hack/drift_feature"] == pytest.approx(0, abs=1e-6)
    assert start["hack/kl_to_base"] == 0
    # Two updates at a large learning rate move the full fine-tune away from its frozen copy.
    assert end["hack/drift_pixel"] > 0 and end["hack/drift_feature"] > 0 and end["hack/kl_to_base"] > 0
    for key in ("hack/diversity", "hack/extra_object_rate", "hack/bg_shift", "hack/accuracy_strict",
                "hack/heldout/jpeg_compressibility/mean"):
        assert all(key in r for r in evals), key
    assert 0 < start["hack/diversity"] <= 2  # cosine distances of random-model images of one prompt
    for name in ("hack_accuracy", "hack_objects", "hack_pixels", "hack_background", "hack_features", "policy"):
        assert (tmp_path / "run" / "plots" / f"{name}.png").exists(), name


def test_a_trained_reward_cannot_be_held_out(tiny_shapes_dir, tmp_path):
    from flowrl.config import ConfigError

    with pytest.raises(ConfigError, match="heldout: 'jpeg_incompressibility' is also in reward.train"):
        run(tiny_shapes_dir, tmp_path / "run", "reward.heldout=[jpeg_incompressibility]")


ADVERSARIAL = ["reward.train={jpeg_incompressibility: 1.0, adversarial: {weight: 0.5, kwargs: {d_steps: 2}}}",
               "reward.discriminator.period=2", "reward.discriminator.d_epochs=1", "eval.hacking.enabled=false"]
ALTERNATING = [*ADVERSARIAL, "reward.discriminator.d_on_generator_epochs=true"]


def test_the_discriminator_trains_on_its_epochs_and_the_policy_on_the_others(tiny_shapes_dir, tmp_path):
    rows = [r for r in run(tiny_shapes_dir, tmp_path / "run", *ADVERSARIAL, epochs=4) if "adv/d_epoch" in r]
    assert [r["adv/d_epoch"] for r in rows] == [1.0, 0.0, 1.0, 0.0]
    # Discriminator epochs (0, 2) update the head and take no policy step; generator epochs the reverse.
    assert [r.get("adv/d_updates") for r in rows] == [1.0, None, 2.0, None]
    assert ["train/loss" in r for r in rows] == [False, True, False, True]


def test_the_discriminator_resumes_exactly(tiny_shapes_dir, tmp_path):
    straight = run(tiny_shapes_dir, tmp_path / "straight", *ALTERNATING, epochs=3)
    run(tiny_shapes_dir, tmp_path / "resumed", *ALTERNATING, epochs=2)
    resumed = run(tiny_shapes_dir, tmp_path / "resumed", *ALTERNATING, "run.resume=true", epochs=3)
    last = [r for r in straight if r.get("epoch") == 3 and "adv/d_loss" in r][0]
    again = [r for r in resumed if r.get("epoch") == 3 and "adv/d_loss" in r][-1]
    for key in ("adv/d_loss", "adv/d_real", "adv/d_fake", "adv/d_updates", "train/reward_mean"):
        assert again[key] == last[key], key
    from flowrl.checkpoint import latest_checkpoint

    saved = torch.load(latest_checkpoint(tmp_path / "resumed") / "state.pt", weights_only=True)
    assert saved["reward_models"]["rewards"][0]["updates"] == 3
