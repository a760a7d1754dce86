"""The RL trainers on a few-step student (docs/trainers.md, "Few-step students"): which window and training-time
settings are valid at 2, 3 and 4 steps and the one-line errors (naming the fix) of those that are not; the warnings
of an SDE that overshoots its noise levels and of a student run off its schedule; and, on a tiny shapes student made
the way a user makes one (a DMD2 run at 4 steps, `flowrl export --format merged`), tiny runs of
configs/shapes/flow_grpo_student.yaml and dgpo_student.yaml that train: the window lands on real steps with finite
log-probabilities, DGPO's training times are the student's own levels, and the weights move."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from flowrl.config import ConfigError
from flowrl.recipes import load_recipe_config
from flowrl.rl.sampling import NOISE_STD_RATIO_LIMIT, rollout_notes, rollout_window, student_notes
from flowrl.run.checkpoint_files import latest_checkpoint, load_state
from flowrl.run.metrics import read_metrics
from samplers import linear_sigmas, train_mask

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ROOT / "configs" / "shapes"

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def load(name: str, *overrides: str):
    return load_recipe_config(str(SHAPES / f"{name}.yaml"), list(overrides))[1]


# ---------------------------------------------------------------------------- the shipped student configs


def test_the_student_configs_roll_out_and_evaluate_at_the_students_four_steps():
    flow, dgpo = load("flow_grpo_student"), load("dgpo_student")
    main, dgpo_main = load("flow_grpo"), load("dgpo")
    for cfg in (flow, dgpo):
        assert (cfg.sampling.num_steps, cfg.sampling.eval_num_steps) == (4, 4)
        assert cfg.model.path == "runs/shapes_dmd2_student" and cfg.model.name == "shapes"
    # Flow-GRPO: CPS (no noise overshoot), 2 of the 3 stochastic steps; the rest is the main job's
    assert flow.sampling.step == "cps" and rollout_notes(flow.sampling, linear_sigmas(4)) == []
    w = flow.sampling.window
    assert (w.mode, w.start, w.size, w.max_start) == ("random", 0, 2, 1)
    assert (flow.optim.lr, flow.sampling.group_size, flow.advantage.normalizer) == (
        main.optim.lr, main.sampling.group_size, main.advantage.normalizer)
    # DGPO: 2 of the levels 1, 0.75, 0.5 per epoch; the rest is dgpo.yaml's
    t = dgpo.train.times
    assert (t.count, t.mode, t.low, t.high) == (2, "schedule", 0.0, 0.75)
    assert (dgpo.train.beta, dgpo.sampling.step, dgpo.advantage.std_scope) == (
        dgpo_main.train.beta, "ode", dgpo_main.advantage.std_scope)


# ---------------------------------------------------------------------------- 2-4 steps: valid and invalid


@pytest.mark.parametrize("num_steps", [2, 3, 4])
def test_a_window_with_an_unset_max_start_lands_on_the_trainable_steps(num_steps):
    """A random window whose size fits (max_start unset: the last start that fits) is valid at every step count, and
    every draw trains consecutive steps among 0..T-2 (the last step is deterministic)."""
    size = min(2, num_steps - 1)
    cfg = load("flow_grpo_student", f"sampling.num_steps={num_steps}",
               f"sampling.window={{mode: random, start: 0, size: {size}}}")
    seen = set()
    for epoch in range(40):
        steps = torch.nonzero(train_mask(rollout_window(cfg.sampling), num_steps, epoch, seed=0)).flatten().tolist()
        assert len(steps) == size and steps == list(range(steps[0], steps[0] + size))
        assert 0 <= steps[0] and steps[-1] <= num_steps - 2
        seen.add(steps[0])
    assert seen == set(range(num_steps - size))  # every start that fits is drawn


@pytest.mark.parametrize("name,overrides,message", [
    # the main job's window (2 steps starting anywhere in 0..4) at few steps
    ("flow_grpo", ["sampling.num_steps=4"], "sampling.window.max_start: max_start 4 + size 2 exceeds the 3 trainable "
     "steps of a 4-step schedule; lower max_start to at most 1 or leave it unset (the last start that fits)"),
    ("flow_grpo", ["sampling.num_steps=3"], "sampling.window.max_start: max_start 4 + size 2 exceeds the 2 trainable "
     "steps of a 3-step schedule; lower max_start to at most 0 or leave it unset (the last start that fits)"),
    ("flow_grpo", ["sampling.num_steps=2", "sampling.window.max_start=null"], "sampling.window: start 0 + size 2 "
     "exceeds the 1 trainable steps of a 2-step schedule (steps 0..0; the last step is deterministic); set "
     "window.size to at most 1"),
    # the student config's window is for 4 steps
    ("flow_grpo_student", ["sampling.num_steps=3"], "sampling.window.max_start: max_start 1 + size 2 exceeds the 2 "
     "trainable steps of a 3-step schedule; lower max_start to at most 0 or leave it unset"),
    ("flow_grpo_student", ["sampling.num_steps=2"], "sampling.window: start 0 + size 2 exceeds the 1 trainable steps "
     "of a 2-step schedule (steps 0..0; the last step is deterministic); set window.size to at most 1"),
    # a fixed window that starts past the trainable steps, or names a max_start it would ignore
    ("flow_grpo_student", ["sampling.num_steps=2", "sampling.window={mode: fixed, start: 1}"],
     "sampling.window.start: 1 leaves no trainable step of a 2-step schedule (steps 0..0; the last step is "
     "deterministic); set window.start to at most 0"),
    ("flow_grpo_student", ["sampling.window={mode: fixed, start: 0, size: 1, max_start: 2}"],
     "sampling.window.max_start: max_start applies to random and sliding windows; unset it for a fixed window"),
    ("flow_grpo_student", ["sampling.window={mode: random, start: 2, size: 1, max_start: 1}"],
     "sampling.window.max_start: 1 is below window.start 2; set it to at least 2"),
    # the forward-process trainers' training times are positions of the rollout schedule
    ("dgpo", ["sampling.num_steps=2"], "train.times.count: 2 times per sample, but only 1 positions of the 2-step "
     "rollout schedule lie in [low, high) = [0.0, 0.5) (positions round(low T) <= i < round(high T) of sigma_0 = 1 > "
     "... > sigma_1); set train.times.count=1 or train.times.high=1"),
    ("dgpo_student", ["sampling.num_steps=2", "train.times.count=3"], "train.times.count: 3 times per sample, but "
     "only 2 positions of the 2-step rollout schedule lie in [low, high) = [0.0, 0.75)"),
    ("dgpo_student", ["train.times.low=0.9", "train.times.high=1.0"], "train.times.count: 2 times per sample, but "
     "only 0 positions of the 4-step rollout schedule lie in [low, high) = [0.9, 1.0) (positions round(low T) <= i < "
     "round(high T) of sigma_0 = 1 > ... > sigma_3); set train.times.low=0.5 and train.times.high=1.0"),
])
def test_invalid_few_step_settings_are_one_line_errors_naming_the_fix(name, overrides, message):
    with pytest.raises(ConfigError) as err:
        load(name, *overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("num_steps,positions", [(2, [0, 1]), (3, [0, 1]), (4, [0, 1, 2])])
def test_the_student_dgpo_times_are_levels_of_the_rollout_schedule(num_steps, positions):
    """dgpo_student's times at 2-4 steps: two distinct levels the student steps from, never the clean end."""
    from flowrl.rl.forward import draw_times, schedule_positions

    cfg = load("dgpo_student", f"sampling.num_steps={num_steps}")
    t = cfg.train.times
    assert schedule_positions(num_steps, t.low, t.high) == positions
    sigmas = linear_sigmas(num_steps)
    ids = torch.arange(8)
    for epoch in range(6):
        times = draw_times(t, sigmas, ids // 4, ids, seed=0, epoch=epoch)
        assert times.shape == (8, 2) and bool((times == times[0]).all())  # share: batch
        assert set(times[0].tolist()) <= {float(sigmas[i]) for i in positions} and times[0, 0] != times[0, 1]


# ---------------------------------------------------------------------------- warnings that are not errors


def test_an_sde_that_overshoots_its_noise_levels_warns_with_the_fix():
    # the main job at 10 steps: no warning; the same Flow-SDE window at 4 steps: the worst reachable step is named
    assert rollout_notes(load("flow_grpo").sampling, linear_sigmas(10)) == []
    few = load("flow_grpo", "sampling.num_steps=4", "sampling.window.max_start=null").sampling
    (note,) = rollout_notes(few, linear_sigmas(4))
    assert note.startswith("sampling.step=flow_sde on this 4-step schedule: the state after trained step 2 (sigma "
                           "0.5 -> 0.25) carries 1.49x the noise of its level") and "sampling.step=cps" in note
    # a window that stays on steps under the limit (step 0: 1.15x) does not warn; the ODE never does
    early = load("flow_grpo", "sampling.num_steps=4", "sampling.window={mode: fixed, start: 0, size: 1}").sampling
    assert rollout_notes(early, linear_sigmas(4)) == [] and NOISE_STD_RATIO_LIMIT == 1.25
    # nor the published many-step window on SD3.5's shifted schedule (all 9 stochastic steps of 10, shift 3)
    from samplers import shifted_sigmas

    sd3 = load_recipe_config(str(ROOT / "configs" / "sd3" / "flow_grpo_pickscore.yaml"), [])[1].sampling
    assert rollout_notes(sd3, shifted_sigmas(10, 3.0)) == []
    assert rollout_notes(load("dgpo_student").sampling, linear_sigmas(4)) == []


def test_a_student_sampled_or_evaluated_off_its_schedule_warns_with_the_fix(tmp_path):
    from flowrl.models.resolve import exported_student_steps

    (tmp_path / "flowrl_export.json").write_text(json.dumps({"format": "merged", "student_steps": 4}))
    assert exported_student_steps(tmp_path) == 4
    assert exported_student_steps(tmp_path / "none") is None and exported_student_steps(None) is None
    (note,) = student_notes(4, load("flow_grpo").sampling)
    assert note == ("model.path is a 4-step student (its flowrl_export.json), distilled on the model's 4-step "
                    "schedule; this run samples it at 10 steps (sampling.num_steps) and evaluates it at 20 "
                    "(sampling.eval_num_steps): set sampling.num_steps=4 sampling.eval_num_steps=4 to train and "
                    "evaluate it on its own schedule (e.g. configs/shapes/flow_grpo_student.yaml)")
    assert student_notes(4, load("flow_grpo_student").sampling) == []
    assert student_notes(None, load("flow_grpo").sampling) == []
    (dmd,) = student_notes(4, load("dmd2").sampling, 2, "train.student_steps")  # distilling a 4-step student to 2
    assert "samples it at 2 steps (train.student_steps)" in dmd and "set train.student_steps=4" in dmd


# ---------------------------------------------------------------------------- tiny runs on a tiny student


@pytest.fixture(scope="module")
def student_dir(tiny_shapes_dir, tmp_path_factory) -> Path:
    """A 4-step student of the tiny shapes model, made as a user makes one: one epoch of configs/shapes/dmd2.yaml at
    4 steps, then `flowrl export --format merged`."""
    from flowrl.commands.export import export

    root = tmp_path_factory.mktemp("student")
    overrides = {
        "model.path": str(tiny_shapes_dir), "run.output_dir": str(root / "dmd2"), "run.max_minutes": "null",
        "run.max_epochs": 1, "data.num_eval_prompts": 2, "sampling.groups_per_epoch": 2, "sampling.group_size": 2,
        "train.micro_batch_size": 2, "train.minibatches": 1, "optim.lr": 1e-3, "eval.every_minutes": "null",
        "eval.grid_size": 0, "eval.hacking.enabled": "false", "checkpoint.every_epochs": 1,
    }
    recipe, cfg = load_recipe_config(str(SHAPES / "dmd2.yaml"), [f"{k}={v}" for k, v in overrides.items()])
    assert (cfg.train.student_steps, cfg.sampling.eval_num_steps) == (4, 4)
    assert recipe.main(cfg) == 0
    out = export(root / "dmd2", fmt="merged", out=root / "student")
    assert json.loads((out / "flowrl_export.json").read_text())["student_steps"] == 4
    return out


def tiny(name: str, student: Path, out: Path, **extra) -> tuple[int, list[dict]]:
    """A tiny run of a student config, its 4-step schedule, window and times as shipped."""
    settings = {
        "model.path": str(student), "run.output_dir": str(out), "run.max_minutes": "null", "run.max_epochs": 2,
        "run.deterministic": "true", "data.num_eval_prompts": 4, "sampling.groups_per_epoch": 2,
        "sampling.group_size": 4, "sampling.batch_size": 8, "train.micro_batch_size": 4, "optim.lr": 1e-3,
        "eval.every_epochs": 2, "eval.every_minutes": "null", "checkpoint.every_epochs": 1, "eval.grid_size": 0,
        # The tiny random model draws no shapes; JPEG size varies per image, so advantages are non-zero.
        "reward.train": "{jpeg_incompressibility: 1.0}",
    }
    settings.update(extra)
    recipe, cfg = load_recipe_config(str(SHAPES / f"{name}.yaml"), [f"{k}={v}" for k, v in settings.items()])
    code = recipe.main(cfg)
    return code, read_metrics(out / "metrics.jsonl")


def _moved(student: Path, run: Path) -> float:
    from diffusers import UNet2DConditionModel

    initial = UNet2DConditionModel.from_pretrained(student / "unet").state_dict()
    final = load_state(latest_checkpoint(run))["model"]
    return max(float((initial[k] - v).abs().max()) for k, v in final.items())


@pytest.mark.slow
def test_flow_grpo_on_the_student_trains_on_its_window_with_finite_log_probs(student_dir, tmp_path, monkeypatch,
                                                                             capsys):
    from flowrl.recipes import flow_grpo

    trajectories = []
    original = flow_grpo.train_epoch

    def recording(model, optimizer, rollouts, *args, **kwargs):
        trajectories.append(rollouts.trajectory)
        return original(model, optimizer, rollouts, *args, **kwargs)

    monkeypatch.setattr(flow_grpo, "train_epoch", recording)
    code, rows = tiny("flow_grpo_student", student_dir, tmp_path / "run")
    assert code == 0 and len(trajectories) == 2
    assert "flowrl: warning" not in capsys.readouterr().err  # on its schedule, CPS: nothing to warn about
    for traj in trajectories:
        assert traj.num_steps == 4 and traj.step.name == "cps"
        steps = traj.trained_steps
        assert len(steps) == 2 and steps[1] == steps[0] + 1 and steps[0] in (0, 1)  # 2 of steps 0..2
        lp = traj.log_probs[:, steps]
        assert bool(torch.isfinite(lp).all()) and bool((lp != 0).all()) and bool((traj.stds[:, steps] > 0).all())
        others = [t for t in range(4) if t not in steps]
        assert bool((traj.log_probs[:, others] == 0).all()) and bool((traj.stds[:, others] == 0).all())
    epochs = [r for r in rows if "train/loss" in r]
    assert len(epochs) == 2
    for r in epochs:
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/approx_kl"]) and r["train/grad_norm"] > 0
    assert "eval/shapes/accuracy" in rows[-1]
    assert _moved(student_dir, tmp_path / "run") > 1e-5


@pytest.mark.slow
def test_dgpo_on_the_student_trains_at_the_students_own_levels(student_dir, tmp_path, monkeypatch):
    from flowrl.rl import forward

    drawn = []
    original = forward.draw_times

    def recording(*args, **kwargs):
        drawn.append(original(*args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(forward, "draw_times", recording)
    code, rows = tiny("dgpo_student", student_dir, tmp_path / "run")
    assert code == 0 and len(drawn) == 2
    for times in drawn:
        assert set(times.flatten().tolist()) <= {1.0, 0.75, 0.5} and times[0, 0] != times[0, 1]
    epochs = [r for r in rows if "train/loss" in r]
    assert len(epochs) == 2 and all(math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 for r in epochs)
    assert _moved(student_dir, tmp_path / "run") > 1e-5


@pytest.mark.slow
def test_a_run_that_takes_the_student_off_its_schedule_or_overshoots_warns(student_dir, tmp_path, capsys):
    code, _ = tiny("flow_grpo_student", student_dir, tmp_path / "run", **{
        "run.max_epochs": 1, "eval.every_epochs": 1, "sampling.step": "flow_sde", "sampling.eval_num_steps": 2})
    err = capsys.readouterr().err
    assert code == 0
    assert ("flowrl: warning: model.path is a 4-step student (its flowrl_export.json), distilled on the model's "
            "4-step schedule; this run evaluates it at 2 (sampling.eval_num_steps): set sampling.num_steps=4 "
            "sampling.eval_num_steps=4") in err
    assert "flowrl: warning: sampling.step=flow_sde on this 4-step schedule: the state after trained step 2" in err
