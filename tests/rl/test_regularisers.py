"""The regularisers of the reward-hacking comparison, each on constructed inputs: CRD's reward-adaptive KL scale on
Flow-GRPO, Elastic Reset's EMA and resets (and their exact resume in a run), and the base model for the last
denoising steps (which steps it takes, a re-entrant reference, a run that trains and evaluates with it)."""

import contextlib
import types

import pytest
import torch
from torch import nn

from flowrl.config import ConfigError
from flowrl.run.metrics import read_metrics
from flowrl.recipes.flow_grpo import TrainConfig, reward_adaptive_kl_scale
from flowrl.rl.base_tail import base_tail, base_tail_velocity, tail_sigma
from flowrl.rl.elastic_reset import ElasticReset, ElasticResetConfig

from test_flow_grpo_runs import CONFIG, comparable, run  # noqa: E402  (tests/recipes is on the path)


# ------------------------------------------------------------------------------ CRD's reward-adaptive anchor


def test_reward_adaptive_kl_scale_holds_rewarded_samples_and_frees_the_others():
    train = TrainConfig(kl_coef=0.1, kl_floor=0.01, kl_reward_adaptive=True)
    scale = reward_adaptive_kl_scale(train, torch.tensor([-9.0, -5.0, 0.0, 2.5, 5.0, 7.0]), adv_clip=5.0)
    m = 0.01 / 0.1
    r = torch.tensor([0.0, 0.0, 0.5, 0.75, 1.0, 1.0])  # clip(A, +-5) / 10 + 0.5
    assert torch.allclose(scale.float(), m + r * (1 - m))
    # The floor equal to the weight: every sample gets the uniform KL.
    assert torch.equal(reward_adaptive_kl_scale(TrainConfig(kl_coef=0.1, kl_floor=0.1), torch.tensor([-3.0, 3.0]),
                                                adv_clip=5.0), torch.ones(2))
    # The clip is the run's one advantage clip (advantage.clip): at 2.5, an advantage of 2.5 is fully rewarded.
    assert torch.allclose(reward_adaptive_kl_scale(train, torch.tensor([2.5]), adv_clip=2.5).float(), torch.ones(1))


def test_reward_adaptive_anchor_needs_a_kl_and_a_floor_below_it():
    from flowrl.commands.train import load_recipe_config

    with pytest.raises(ConfigError, match="train.kl_reward_adaptive: .*set train.kl_coef > 0"):
        load_recipe_config(str(CONFIG), ["train.kl_reward_adaptive=true"])
    with pytest.raises(ConfigError, match="train.kl_floor: 0.5 exceeds kl_coef 0.1"):
        load_recipe_config(str(CONFIG), ["train.kl_reward_adaptive=true", "train.kl_coef=0.1", "train.kl_floor=0.5"])


# ------------------------------------------------------------------------------ Elastic Reset


def fake_model(value: float) -> types.SimpleNamespace:
    layer = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(value)
    return types.SimpleNamespace(denoiser=layer)


def weight(model) -> torch.Tensor:
    return model.denoiser.weight.detach().clone()


def test_elastic_reset_resets_the_policy_to_its_ema_and_the_ema_to_the_base():
    model = fake_model(1.0)  # the base: every weight 1
    elastic = ElasticReset(model, ElasticResetConfig(every_epochs=2, decay_per_epoch=0.75))
    with torch.no_grad():
        model.denoiser.weight.fill_(5.0)
    assert elastic.end_epoch(model, 0) == {"train/elastic_reset": 0.0, "train/elastic_resets": 0.0}
    assert torch.allclose(elastic.ema.tensors["weight"], torch.full((1, 2), 0.75 * 1 + 0.25 * 5))  # 2.0
    assert torch.equal(weight(model), torch.full((1, 2), 5.0))  # not a reset epoch
    with torch.no_grad():
        model.denoiser.weight.fill_(9.0)
    assert elastic.end_epoch(model, 1) == {"train/elastic_reset": 1.0, "train/elastic_resets": 1.0}
    # The EMA after epoch 1 was 0.75 * 2 + 0.25 * 9 = 3.75: the policy takes it, the EMA goes back to the base.
    assert torch.allclose(weight(model), torch.full((1, 2), 3.75))
    assert torch.equal(elastic.ema.tensors["weight"], torch.full((1, 2), 1.0))
    # The state restores the EMA and the count; the base is the building model's.
    again = ElasticReset(fake_model(1.0), ElasticResetConfig(every_epochs=2, decay_per_epoch=0.75))
    with torch.no_grad():
        elastic.ema.tensors["weight"].fill_(2.5)
    again.load_state_dict(elastic.state_dict())
    assert again.resets == 1 and torch.equal(again.ema.tensors["weight"], torch.full((1, 2), 2.5))


@pytest.mark.slow
def test_elastic_reset_run_resets_on_schedule_and_resumes_exactly(tiny_shapes_dir, tmp_path):
    # Stopped after 2 epochs, mid-period: the reset at the third epoch takes the EMA the checkpoint restored.
    reset = {"train.elastic_reset": "{every_epochs: 3, decay_per_epoch: 0.5}"}
    run(tiny_shapes_dir, tmp_path / "straight", **reset, **{"run.max_epochs": 4})
    run(tiny_shapes_dir, tmp_path / "resumed", **reset, **{"run.max_epochs": 2})
    run(tiny_shapes_dir, tmp_path / "resumed", **reset, **{"run.max_epochs": 4, "run.resume": "true"})
    straight = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["train/elastic_reset"] for r in straight if "train/elastic_reset" in r] == [0.0, 0.0, 1.0, 0.0]
    assert comparable(resumed) == comparable(straight)
    from flowrl.run.checkpoint_files import latest_checkpoint, load_state

    a, b = load_state(latest_checkpoint(tmp_path / "straight")), load_state(latest_checkpoint(tmp_path / "resumed"))
    assert a["elastic_reset"]["resets"] == 1
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for key, value in a["elastic_reset"]["ema"].items():
        assert torch.equal(value, b["elastic_reset"]["ema"][key]), key


# ------------------------------------------------------------------------------ the base model's last steps


class TwoModels:
    """A stand-in adapter: velocity 1 for the policy, 0 inside ``reference()``; records who drew each level."""

    def __init__(self):
        self.in_reference, self.calls = False, []

    @contextlib.contextmanager
    def reference(self):
        self.in_reference = True
        try:
            yield
        finally:
            self.in_reference = False

    def velocity(self, x, sigma, cond):
        self.calls.append(("base" if self.in_reference else "policy", [round(float(s), 4) for s in sigma]))
        return torch.full_like(x, 0.0 if self.in_reference else 1.0)

    def velocity_fn(self, guidance_scale=None, *, detach_uncond=False):
        return self.velocity


def test_the_base_takes_every_step_at_or_below_the_tail_level():
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    assert tail_sigma(sigmas, 2) == 0.5  # steps 2 and 3 (starting at 0.5 and 0.25) are the base's
    with pytest.raises(ValueError, match=r"base_last_steps must be in \[1, 3\]"):
        tail_sigma(sigmas, 4)
    model = TwoModels()
    velocity = base_tail_velocity(model, model.velocity, model.velocity, tail_sigma(sigmas, 2))
    x = torch.zeros(2, 3)
    outs = [float(velocity(x, sigmas[t].expand(2), None).mean()) for t in range(4)]
    assert outs == [1.0, 1.0, 0.0, 0.0]
    assert [who for who, _ in model.calls] == ["policy", "policy", "base", "base"]
    # A batch that mixes levels is split row by row.
    mixed = velocity(x, torch.tensor([0.75, 0.25]), None)
    assert mixed[:, 0].tolist() == [1.0, 0.0]
    # Inside base_tail(...) the adapter's velocity_fn answers with the tail (another schedule hands over at the
    # same level: a 40-step evaluation's steps at or below 0.5).
    with base_tail(model, 0.5):
        v = model.velocity_fn(1.0)
        assert [float(v(x, torch.full((2,), s), None).mean()) for s in (0.9, 0.5125, 0.5, 0.0125)] == [1, 1, 0, 0]
    assert model.velocity_fn(1.0) == model.velocity  # restored


def test_reference_is_reentrant(tiny_shapes_dir):
    from flowrl.models.resolve import load_named_model

    model = load_named_model(str(tiny_shapes_dir))
    model.freeze_reference()
    trained = model.denoiser
    with model.reference():
        with model.reference():  # a tail step inside a base-model drawing
            pass
        assert model.denoiser is model._reference  # the outer reference is still in force
    assert model.denoiser is trained


def test_base_last_steps_config_keeps_the_window_before_the_tail():
    from flowrl.commands.train import load_recipe_config

    _, cfg = load_recipe_config(str(CONFIG), ["sampling.base_last_steps=4"])  # window ends at step 5 of 0..9
    assert cfg.sampling.base_last_steps == 4
    with pytest.raises(ConfigError, match=r"sampling.base_last_steps: the base model takes steps 5..9 but the "
                                          r"training window reaches step 5"):
        load_recipe_config(str(CONFIG), ["sampling.base_last_steps=5"])
    with pytest.raises(ConfigError, match="leaves the policy no step"):
        load_recipe_config(str(CONFIG), ["sampling.base_last_steps=10"])


@pytest.mark.slow
def test_a_run_with_the_base_tail_trains_its_own_steps_and_evaluates_the_pipeline(tiny_shapes_dir, tmp_path):
    # 4 steps, window of 1 at steps 0..1, the base takes steps 2 and 3.
    tail = {"sampling.base_last_steps": 2, "sampling.window": "{mode: random, start: 0, size: 1, max_start: 1}",
            "run.max_epochs": 2, "eval.every_epochs": 2}
    run(tiny_shapes_dir, tmp_path / "tail", **tail)
    rows = read_metrics(tmp_path / "tail" / "metrics.jsonl")
    assert [r["epoch"] for r in rows if "train/loss" in r] == [1, 2]
    assert all(abs(r["train/ratio_mean"] - 1.0) < 1e-3 for r in rows if "train/ratio_mean" in r)  # on-policy
    assert any("eval/shapes/accuracy" in r for r in rows if r["epoch"] == 2)


@pytest.mark.slow
def test_reward_adaptive_anchor_in_a_run_scales_each_samples_kl(tiny_shapes_dir, tmp_path):
    """A floor equal to the weight is the uniform KL (the same loss); a low floor frees the unrewarded samples
    (mean scale below 1, a smaller loss at the same KL to the base)."""
    kl = {"train.kl_coef": 0.5, "run.max_epochs": 2, "eval.every_epochs": 2}  # the KL is 0 until the first step
    run(tiny_shapes_dir, tmp_path / "uniform", **kl)
    run(tiny_shapes_dir, tmp_path / "full", **kl, **{"train.kl_reward_adaptive": "true", "train.kl_floor": 0.5})
    run(tiny_shapes_dir, tmp_path / "free", **kl, **{"train.kl_reward_adaptive": "true", "train.kl_floor": 0.005})
    last = {name: [r for r in read_metrics(tmp_path / name / "metrics.jsonl") if "train/loss" in r][-1]
            for name in ("uniform", "full", "free")}
    assert last["uniform"]["train/kl_ref"] > 0
    assert last["full"]["train/kl_scale"] == 1.0
    assert last["full"]["train/loss"] == pytest.approx(last["uniform"]["train/loss"], rel=1e-5, abs=1e-12)
    assert 0.005 / 0.5 < last["free"]["train/kl_scale"] < 1.0
    assert last["free"]["train/kl_ref"] == pytest.approx(last["uniform"]["train/kl_ref"], rel=1e-5)  # same 1st step
