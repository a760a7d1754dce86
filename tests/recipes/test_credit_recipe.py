"""Step-level credit estimators inside the Flow-GRPO recipe, on the tiny shapes model: one epoch each of
``tp_grpo`` and ``cosine`` (advantage placement, the extra-NFE metric, ODE-completion rewards, on-policy
ratio 1), and a ``main`` run end to end."""

from pathlib import Path

import pytest
import torch

from flowrl.config import from_dict
from flowrl.data.prompt_groups import PromptGroups
from flowrl.data.prompts import load_prompts
from flowrl.dist import Dist
from flowrl.run.metrics import read_metrics
from flowrl.core.estimators import CreditBatch, tp_grpo_estimator
from flowrl.models.config import build_model
from flowrl.recipes.flow_grpo import Config, train_epoch
from flowrl.rl.credit_inputs import completion_rewards
from flowrl.commands.train import load_recipe_config
from rewards import RewardOutput

from golden_reward import NAME as SMOOTH  # registers a reward that varies on a random model
from toy import flow_grpo_epoch

ROOT = Path(__file__).resolve().parents[2]


def mean_pixel(images, prompts, metadata=None) -> RewardOutput:
    """A continuous reward, so that completion rewards can be compared with tolerances."""
    return RewardOutput(images.float().mean(dim=(1, 2, 3)))


def config(model_dir, estimator: str, start: int, size: int | None, **advantage) -> Config:
    return from_dict(Config, {
        "run": {"seed": 3},
        "model": {"path": str(model_dir)},
        "sampling": {"num_steps": 4, "group_size": 4, "groups_per_epoch": 2, "batch_size": 5,
                     "window": {"start": start, "size": size}},
        "advantage": {"estimator": estimator, **advantage},
        "optim": {"lr": 1e-3},
        "train": {"clip_range": 0.2, "micro_batch_size": 8},
    })


@pytest.fixture(scope="module")
def setup(tiny_shapes_dir):
    torch.set_num_threads(1)
    cfg = config(tiny_shapes_dir, "tp_grpo", 1, 2)
    model = build_model(cfg.model, torch.device("cpu"))
    model.freeze_reference()
    train = load_prompts("shapes:train")
    groups = PromptGroups(train.prompts, train.metadata, groups=2, group_size=4, seed=3)
    return model, groups, Dist(cpu=True)


def one_epoch(model, groups, dist, cfg, reward):
    return flow_grpo_epoch(model, cfg, dist, groups.epoch(0), 0, reward)


def test_tp_grpo_epoch(setup, tiny_shapes_dir):
    model, groups, dist = setup
    cfg = config(tiny_shapes_dir, "tp_grpo", 1, 2)  # T = 4, trained steps 1 and 2
    initial = {k: v.clone() for k, v in model.trainable_state_dict().items()}
    samples, advantages, valid, m = one_epoch(model, groups, dist, cfg, mean_pixel)
    traj = samples.trajectory
    assert traj.train_mask.tolist() == [False, True, True, False]
    assert advantages.shape == (8, 4) and valid.all()
    assert (advantages[:, [0, 3]] == 0).all() and (advantages[:, [1, 2]] != 0).any()
    # Rows start at steps 1 and 2 of 4: 3 + 2 remaining steps per sample.
    assert m["credit/extra_nfe"] == 8 * (3 + 2)
    assert 0.0 <= m["credit/tp_rate"] <= 1.0 and m["credit/nan_rows"] == 0
    assert m["credit/tp_positive"] + m["credit/tp_negative"] == round(m["credit/tp_rate"] * 16)

    # The completion rewards: R_n is the rollout's reward; R_0 the pure ODE rollout's (steps before the window
    # are ODE); completing the final window state reproduces the rollout (steps after it are ODE).
    from samplers import ode_complete
    from flowrl.eval.generate import generate

    R, nfe = completion_rewards(samples, model, mean_pixel, guidance=1.0, batch_size=5)
    assert R.shape == (8, 3) and nfe == 40
    assert torch.equal(R[:, -1], samples.rewards)
    ode = generate(model, samples.prompts, samples.sample_seeds.tolist(), steps=4, guidance=1.0, batch_size=8)
    assert torch.allclose(R[:, 0], mean_pixel(ode, samples.prompts).scores, atol=1e-5, rtol=0)
    x0, _ = ode_complete(model.velocity_fn(1.0), traj.latents[:, 3], traj.sigmas, [3] * 8, cond=samples.cond)
    assert torch.allclose(mean_pixel(model.decode(x0), samples.prompts).scores, samples.rewards, atol=1e-5)
    # Step advantages follow from R exactly as the core functions say.
    from flowrl.core.credit import stepwise_group_advantages, turning_point_rewards

    step_rewards, _ = turning_point_rewards(R[:, 1:], R[:, 0])
    assert torch.allclose(advantages[:, 1:3], stepwise_group_advantages(step_rewards, samples.group_ids), atol=1e-6)

    # A NaN completion reward zeroes that sample's step advantages and keeps it out of the normalisation.
    first = samples.prompts[0]

    def nan_for_first(images, prompts, metadata=None):
        scores = mean_pixel(images, prompts).scores
        return RewardOutput(torch.where(torch.tensor([p == first for p in prompts]), torch.nan, scores))

    R_nan, _ = completion_rewards(samples, model, nan_for_first, guidance=1.0, batch_size=5)
    with_nan, nan_metrics = tp_grpo_estimator(CreditBatch(samples.rewards, samples.group_ids, steps=[1, 2], num_steps=4,
                                                          completion_rewards=R_nan))
    bad = torch.tensor([p == first for p in samples.prompts])
    assert torch.isfinite(with_nan).all() and (with_nan[bad] == 0).all()
    assert torch.equal(with_nan[~bad], advantages[~bad])  # other groups are unaffected
    assert nan_metrics["credit/nan_rows"] == int(bad.sum()) > 0

    metrics = train_epoch(model, torch.optim.SGD(model.trainable_parameters(), lr=0.0), samples, advantages, valid,
                          cfg, dist, 0)
    assert abs(metrics["train/ratio_mean"] - 1.0) < 1e-6
    model.load_trainable_state_dict(initial)


def test_cosine_epoch(setup, tiny_shapes_dir):
    model, groups, dist = setup
    cfg = config(tiny_shapes_dir, "cosine", 1, 2, cosine_window=1, cosine_alpha=0.0)
    samples, advantages, valid, m = one_epoch(model, groups, dist, cfg, mean_pixel)
    traj = samples.trajectory
    assert traj.x0_preds.shape == (8, 4) + tuple(model.latent_shape)
    assert advantages.shape == (8, 4) and (advantages[:, [0, 3]] == 0).all() and (advantages[:, 1:3] != 0).any()
    assert m["credit/extra_nfe"] == 0
    # Hand check: rho on the sub-trajectory from the first trained step, A_i rho_t, stepwise normalisation.
    from flowrl.core.advantages import group_advantages
    from flowrl.core.credit import cosine_credit, stepwise_group_advantages

    outcome = group_advantages(samples.rewards, samples.group_ids)
    rho = cosine_credit(traj.x0_preds[:, 1:], traj.latents[:, -1])
    assert torch.equal(rho[:, 0], torch.ones(8))
    expected = stepwise_group_advantages(outcome[:, None] * rho[:, :2], samples.group_ids)
    assert torch.allclose(advantages[:, 1:3], expected, atol=1e-6)
    # rho = 1 at the first trained step: there the step advantage is the outcome advantage, re-standardised.
    assert torch.allclose(advantages[:, 1], group_advantages(outcome, samples.group_ids), atol=1e-6)
    metrics = train_epoch(model, torch.optim.SGD(model.trainable_parameters(), lr=0.0), samples, advantages, valid,
                          cfg, dist, 0)
    assert abs(metrics["train/ratio_mean"] - 1.0) < 1e-6


def test_main_runs_one_cosine_epoch(tiny_shapes_dir, tmp_path):
    # main() must roll out with store_x0 for the cosine estimator (tp_grpo goes through the same
    # compute_advantages call as test_tp_grpo_epoch, with the model and reward main passes).
    overrides = {
        "model.path": str(tiny_shapes_dir), "run.output_dir": str(tmp_path), "run.max_minutes": "null",
        "run.max_epochs": 1, "data.num_eval_prompts": 2, "sampling.num_steps": 3, "sampling.eval_num_steps": 2,
        "sampling.window.max_start": "null",
        "sampling.groups_per_epoch": 2, "sampling.group_size": 2, "sampling.batch_size": 4,
        "train.micro_batch_size": 4, "eval.at_start": "false", "eval.grid_size": 0,
        # the tiny random model draws nothing the shapes reward counts (every group tied: no usable reward)
        "reward.train": f"{{{SMOOTH}: 1.0}}",
    }
    recipe, cfg = load_recipe_config(str(ROOT / "configs" / "shapes" / "cosine_grpo.yaml"),
                                     [f"{k}={v}" for k, v in overrides.items()])
    assert cfg.advantage.estimator == "cosine"
    assert recipe.main(cfg) == 0
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert abs(row["train/ratio_mean"] - 1.0) < 1e-6 and "eval/shapes/accuracy" in row
