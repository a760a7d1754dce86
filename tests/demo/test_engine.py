"""The demo's computations: like-for-like sampling, reward columns, the trajectory analysis, scoring uploads."""

import math

import pytest
import torch

from flowrl.demo.engine import RewardSet, compare, sample_images, score_files, trajectory
from flowrl.demo.limits import DemoInputError, Limits
from flowrl.demo.render import grid_image, strip_image
from flowrl.eval.generate import generate

PROMPTS = ["a red circle", "two blue squares"]


@pytest.fixture(scope="module")
def models(demo_state):
    return {name: demo_state.bank.get(name) for name in ("base", "flow_grpo")}


def test_compare_is_like_for_like_and_scored(models, demo_state):
    seeds = [0, 1, 2]
    result = compare(models, PROMPTS, seeds, steps=3, guidance=1.0, sampler="ode", noise_level=None,
                     rewards=demo_state.rewards, reward_names=["shapes", "jpeg_compressibility"])
    assert result.columns == ["shapes", "shapes correct", "jpeg_compressibility"]
    assert result.warnings == []
    flat_prompts = [p for p in PROMPTS for _ in seeds]
    flat_seeds = seeds * len(PROMPTS)
    # The ODE sampler is exactly `flowrl sample`'s generation: the same noise per seed, the same steps.
    expected = generate(models["base"], flat_prompts, flat_seeds, steps=3, guidance=1.0)
    torch.testing.assert_close(result.images["base"], expected, atol=1e-6, rtol=0)
    assert not torch.allclose(result.images["base"], result.images["flow_grpo"])  # the fine-tune moved
    jpeg = demo_state.rewards.loaded["jpeg_compressibility"](result.images["flow_grpo"], flat_prompts).scores
    torch.testing.assert_close(result.scores["flow_grpo"]["jpeg_compressibility"], jpeg)
    means = result.mean_rows()
    assert [row[0] for row in means] == ["base", "flow_grpo"]
    assert means[1][3] == pytest.approx(float(jpeg.mean()), abs=1e-4)
    assert len(result.sample_rows()) == 2 * len(PROMPTS) * len(seeds)
    caption = result.caption("base", 0).splitlines()  # one line per reward, the correct flag on its line
    assert len(caption) == 2 and caption[0].startswith("shapes ") and caption[0].endswith((" correct", " wrong"))
    assert caption[1] == f"jpeg_compre. {float(result.scores['base']['jpeg_compressibility'][0]):.2f}"


def test_sde_noise_depends_on_the_seed_only(models):
    model = models["base"]
    kwargs = dict(steps=4, guidance=1.0, sampler="flow_sde", noise_level=0.7)
    batch = sample_images(model, ["a red circle"] * 3, [5, 6, 7], **kwargs)
    alone = sample_images(model, ["a red circle"], [6], **kwargs)
    torch.testing.assert_close(batch[1:2], alone, atol=1e-6, rtol=0)
    assert not torch.allclose(batch[0], batch[1])
    ode = sample_images(model, ["a red circle"], [6], steps=4, guidance=1.0, sampler="ode", noise_level=None)
    assert not torch.allclose(ode, alone)  # the SDE really drew noise


def test_a_reward_that_cannot_read_the_prompt_is_a_warning(models, demo_state):
    result = compare({"base": models["base"]}, ["a photo of a cat"], [0], steps=2, guidance=1.0, sampler="ode",
                     noise_level=None, rewards=demo_state.rewards, reward_names=["shapes", "jpeg_compressibility"])
    assert math.isnan(float(result.scores["base"]["shapes"][0]))
    assert math.isfinite(float(result.scores["base"]["jpeg_compressibility"][0]))
    assert len(result.warnings) == 1 and "shapes reward" in result.warnings[0]
    assert "n/a" in result.caption("base", 0)
    assert result.mean_rows()[0][1] is None


def test_reward_set_lists_what_did_not_load(demo_state):
    assert demo_state.rewards.names == ["shapes", "jpeg_compressibility"]
    assert "aesthetic" in demo_state.rewards.failed and "checkpoint not found" in demo_state.rewards.failed["aesthetic"]
    assert any("aesthetic" in note for note in demo_state.notes)
    odd = RewardSet.load(["nope", "jpeg_compressibility:quality=50", "jpeg_incompressibility:colour=1",
                          "shapes:bad"])
    assert "unknown reward 'nope'" in odd.failed["nope"]
    assert odd.names == ["jpeg_compressibility"] and odd.loaded["jpeg_compressibility"].quality == 50
    assert "colour" in odd.failed["jpeg_incompressibility"]  # an unexpected keyword argument
    assert "NAME:key=value" in odd.failed["shapes"]
    with pytest.raises(DemoInputError, match="reward 'nope' is not loaded"):
        odd.select(["nope"])


def test_trajectory_rewards_turning_points_and_cosine_credit(models, demo_state):
    from flowrl.core.credit import turning_point_rewards

    model = models["flow_grpo"]
    reward = demo_state.rewards.loaded["jpeg_compressibility"]  # a continuous score, so equalities mean something
    steps = 5
    ticks = []
    result = trajectory(model, "a red circle", 3, steps=steps, guidance=1.0, sampler="flow_sde", noise_level=0.7,
                        reward=reward, reward_name="jpeg_compressibility", tick=ticks.append)
    n = steps - 1  # every step but the deterministic last one is an SDE step
    assert result.num_sde == n and result.x0_images.shape == (steps, 3, 32, 32)
    assert result.R.shape == (n + 1,)
    same = dict(steps=steps, guidance=1.0, noise_level=0.7)
    final = sample_images(model, ["a red circle"], [3], sampler="flow_sde", **same)
    torch.testing.assert_close(result.final, final[0], atol=1e-6, rtol=0)
    ode = sample_images(model, ["a red circle"], [3], sampler="ode", **same)
    assert float(result.R[-1]) == pytest.approx(float(reward(final, ["a red circle"]).scores[0]), abs=1e-6)
    assert float(result.R[0]) == pytest.approx(float(reward(ode, ["a red circle"]).scores[0]), abs=1e-6)
    step_rewards, turning = turning_point_rewards(result.R[None, 1:], result.R[None, 0])
    torch.testing.assert_close(result.step_rewards, step_rewards[0].float())
    assert torch.equal(result.turning, turning[0])
    assert float(result.rho[0]) == pytest.approx(1.0) and float(result.weights.sum()) == pytest.approx(1.0)
    assert result.extra_nfe == sum(steps - k for k in range(n))  # one batched ODE completion per state
    assert len(ticks) == steps + steps  # the rollout, then T calls of the batched completion
    rows = result.table_rows()
    assert len(rows) == steps and rows[0][4] == pytest.approx(float(result.R[1]), abs=1e-4) and rows[-1][4] is None
    strip = strip_image(result.x0_images, result.final, result.sigmas, turning=result.turning.tolist())
    assert strip.size[0] > (steps + 1) * 64


def test_trajectory_with_the_ode_sampler_or_without_the_credit_module(models, demo_state, monkeypatch):
    reward = demo_state.rewards.loaded["shapes"]
    ode = trajectory(models["base"], "a red circle", 0, steps=3, guidance=1.0, sampler="ode", noise_level=None,
                     reward=reward, reward_name="shapes")
    assert ode.num_sde == 0 and ode.R.shape == (1,) and ode.turning is None and ode.extra_nfe == 0
    import flowrl.demo.engine as engine

    monkeypatch.setattr(engine, "_credit_module", lambda: None)
    bare = trajectory(models["base"], "a red circle", 0, steps=3, guidance=1.0, sampler="cps", noise_level=0.5,
                      reward=reward, reward_name="shapes")
    assert bare.R.shape == (3,) and bare.turning is None and bare.rho is None
    assert "flowrl.core.credit is not available" in bare.warnings[0]


def test_score_files(tmp_path, demo_state):
    from PIL import Image

    limits = Limits(max_uploads=3, max_image_side=256)
    red = tmp_path / "red.png"
    Image.new("RGB", (128, 128), (255, 255, 255)).save(red)
    big = tmp_path / "big.png"
    Image.new("RGB", (64, 48), (0, 0, 0)).save(big)
    result = score_files([red, big], ["a red circle"], demo_state.rewards, ["shapes", "jpeg_compressibility"],
                         limits=limits, resize_to=32)
    assert result.headers() == ["image", "size", "prompt", "shapes", "shapes correct", "jpeg_compressibility"]
    rows = result.rows()
    assert [r[0] for r in rows] == ["red.png", "big.png"] and rows[0][1] == "128x128" and rows[1][1] == "64x48"
    assert all(isinstance(v, float) for r in rows for v in r[3:])
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"not an image")
    huge = tmp_path / "huge.png"
    Image.new("RGB", (300, 10)).save(huge)
    for paths, prompts, message in [
        ([], ["a"], "upload at least one image"),
        ([red] * 4, ["a"], "at most 3 per request"),
        ([red, garbage], ["a"], "garbage.png is not a readable image"),
        ([huge], ["a"], r"huge.png is 300x10 px; at most 256 px per side"),
        ([red, big], ["a", "b", "c"], "3 prompts for 2 images"),
    ]:
        with pytest.raises(DemoInputError, match=message):
            score_files(paths, prompts, demo_state.rewards, ["shapes"], limits=limits)


def test_grid_has_a_row_per_model_and_a_column_per_seed():
    images = torch.rand(6, 3, 32, 32)
    grid = grid_image(images, ["base", "tuned"], ["seed 0", "seed 1", "seed 2"], ["r 0.1\nq 0.2"] * 6, cell=128)
    assert grid.size[0] == 170 + 3 * (128 + 6) + 6
    assert grid.size[1] == 22 + 2 * (128 + 2 * 14 + 4 + 6) + 6
    with pytest.raises(ValueError, match="6 images for a 3 x 3 grid"):
        grid_image(images, ["a", "b", "c"], ["0", "1", "2"])
