"""A run never lies and never loses work: each case found by the fault campaign, reproduced on the tiny shapes
model through the real ``flowrl train`` entry point (in-process, so it is cheap)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flowrl.run.checkpoint_files import checkpoints, latest_checkpoint, load_state
from flowrl.run.metrics import read_metrics
from rewards import RewardOutput
from rewards.registry import REWARDS

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "shapes" / "flow_grpo.yaml"


def settings(model_dir, out, **extra) -> list[str]:
    base = {
        "model.path": str(model_dir), "run.output_dir": str(out), "run.max_minutes": "null", "run.max_epochs": 2,
        "eval.at_start": "false", "eval.every_minutes": "null", "eval.every_epochs": 10, "eval.grid_size": 0,
        "sampling.num_steps": 3, "sampling.eval_num_steps": 2, "sampling.window.max_start": "null",
        "sampling.groups_per_epoch": 2, "sampling.group_size": 2, "sampling.batch_size": 4,
        "train.micro_batch_size": 4, "data.num_eval_prompts": 2, "checkpoint.every_epochs": 10,
        "reward.train": "{jpeg_incompressibility: 1.0}", "reward.eval": "[jpeg_incompressibility]",
    }
    base.update(extra)
    return [str(CONFIG)] + [f"{k}={v}" for k, v in base.items()]


def train(capsys, *argv) -> tuple[int, str]:
    from flowrl.commands.train import main

    code = main(list(argv))
    return code, capsys.readouterr().err


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def register(name, factory):
    if name not in REWARDS:
        REWARDS.register(name, factory)


class AllNaN:
    def __call__(self, images, prompts, metadata=None):
        return RewardOutput(torch.full((len(prompts),), math.nan))


class WrongCount:
    def __call__(self, images, prompts, metadata=None):
        return RewardOutput(torch.zeros(len(prompts) + 1))


@pytest.mark.slow
def test_a_short_run_that_never_had_a_usable_reward_does_not_exit_0(tiny_shapes_dir, tmp_path, capsys):
    """Before: a 2-epoch run with every reward NaN (fewer epochs than run.max_degenerate_epochs) printed
    "finished" and exited 0, so a scheduler read a run that learned nothing as a success."""
    register("all_nan", AllNaN)
    code, err = train(capsys, *settings(tiny_shapes_dir, tmp_path / "short", **{"reward.train": "{all_nan: 1.0}"}))
    assert code == 3
    assert "none of the 2 epochs had a usable reward" in last_line(err)
    # One usable epoch is enough for a normal exit.
    code, _ = train(capsys, *settings(tiny_shapes_dir, tmp_path / "ok"))
    assert code == 0


def test_all_nan_rewards_warn_then_stop_with_an_error_and_a_checkpoint(tiny_shapes_dir, tmp_path, capsys):
    register("all_nan", AllNaN)
    out = tmp_path / "nan"
    code, err = train(capsys, *settings(tiny_shapes_dir, out, **{"reward.train": "{all_nan: 1.0}",
                                                                  "run.max_epochs": 5, "run.max_degenerate_epochs": 2}))
    assert code == 2
    assert ("warning: epoch 1: every reward is NaN (the reward failed on every image); skipping its update (1 of 2"
            in err)
    assert last_line(err).startswith("flowrl train: error: stopped after epoch 1: every reward is NaN (the reward "
                                     "failed on every image) in 2 epochs in a row; check the reward ({'all_nan': 1.0})")
    assert "checkpoint of epoch 1 saved" in last_line(err)
    assert [r["epoch"] for r in read_metrics(out / "metrics.jsonl")] == [1]
    assert load_state(latest_checkpoint(out))["epoch"] == 1


def test_non_finite_updates_are_skipped_then_stop_with_the_last_finite_weights(tiny_shapes_dir, tmp_path, capsys):
    """A model whose training forward pass turns NaN (as a huge learning rate or guidance would)."""
    from flowrl.models.shapes import ShapesModel
    from flowrl.commands.train import load_recipe_config

    model = ShapesModel.from_pretrained(tiny_shapes_dir)
    initial = {k: v.clone() for k, v in model.trainable_state_dict().items()}
    model.denoiser.register_forward_hook(
        lambda module, args, output: output.__class__(sample=output.sample * math.nan) if torch.is_grad_enabled()
        else output)
    recipe, cfg = load_recipe_config(*[a for a in [settings(tiny_shapes_dir, tmp_path / "run")[0]]],
                                     settings(tiny_shapes_dir, tmp_path / "run",
                                              **{"run.max_epochs": 6, "run.max_nonfinite_updates": 2})[1:])
    from flowrl.errors import RunError

    with pytest.raises(RunError, match=r"stopped after epoch 2: 2 optimizer updates in a row had a non-finite loss or "
                                       r"gradient and were skipped .*checkpoint of epoch 2 saved"):
        recipe.main(cfg, model=model)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["train/skipped_updates"] for r in rows] == [1, 2]
    state = load_state(latest_checkpoint(tmp_path / "run"))
    assert state["epoch"] == 2
    for key, value in initial.items():  # no update was applied: the saved weights are the initial, finite ones
        assert torch.equal(state["model"][key], value), key


@pytest.mark.slow
def test_run_folders_fresh_resume_overwrite(tiny_shapes_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(capsys, *settings(tiny_shapes_dir, out, **{"run.max_epochs": 1}))[0] == 0
    code, err = train(capsys, *settings(tiny_shapes_dir, out, **{"run.max_epochs": 1}))
    assert code == 2 and last_line(err) == (
        f"flowrl train: error: run.output_dir: {out} holds an earlier run; continue it with run.resume=true, "
        "start over with run.overwrite=true (deletes its metrics and checkpoints), or choose another run.output_dir")
    (out / "notes.txt").write_text("mine")  # a user's file survives an overwrite
    stale = out / "checkpoints" / ".tmp_step_0000009_123"
    stale.mkdir()
    assert train(capsys, *settings(tiny_shapes_dir, out, **{"run.max_epochs": 1, "run.overwrite": "true"}))[0] == 0
    assert [r["epoch"] for r in read_metrics(out / "metrics.jsonl")] == [1]  # not 1, 1
    assert (out / "notes.txt").read_text() == "mine" and not stale.exists()
    assert train(capsys, *settings(tiny_shapes_dir, out, **{"run.max_epochs": 2, "run.resume": "true"}))[0] == 0
    assert [r["epoch"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
    file_dir = tmp_path / "a_file"
    file_dir.write_text("x")
    code, err = train(capsys, *settings(tiny_shapes_dir, file_dir))
    assert code == 2 and "run.output_dir: " in err and "is a file, not a folder" in err
    code, err = train(capsys, *settings(tiny_shapes_dir, "/dev/null/run"))
    assert code == 2 and "run.output_dir: " in err and "Traceback" not in err


@pytest.mark.slow
def test_a_corrupt_or_partial_newest_checkpoint_falls_back_to_the_previous_one(tiny_shapes_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert train(capsys, *settings(tiny_shapes_dir, out, **{"run.max_epochs": 2, "checkpoint.every_epochs": 1,
                                                            "checkpoint.keep": 3}))[0] == 0
    newest = latest_checkpoint(out)
    assert newest.name == "epoch_0000002"
    torch.save({"epoch": 2}, newest / "state.pt")  # partial: no model, no rng
    code, err = train(capsys, *settings(tiny_shapes_dir, out, **{"run.max_epochs": 3, "run.resume": "true"}))
    assert code == 0
    assert f"warning: checkpoint {newest}/state.pt is incomplete (no model" in err
    assert "resuming from" in err and "epoch_0000001" in err
    # The bad one is set aside, out of resume and rotation (before, it stayed among the newest).
    assert (out / "checkpoints" / "corrupt_epoch_0000002").is_dir()
    assert [p.name for p in checkpoints(out)] == ["epoch_0000003", "epoch_0000001"]
    assert [r["epoch"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    for checkpoint in (out / "checkpoints").glob("epoch_*"):
        (checkpoint / "state.pt").write_bytes(b"")  # every checkpoint unreadable: one line, no KeyError
    code, err = train(capsys, *settings(tiny_shapes_dir, out, **{"run.max_epochs": 4, "run.resume": "true"}))
    assert code == 2 and "Traceback" not in err and "can be read" in last_line(err)


def test_disk_full_while_checkpointing_is_one_line_and_leaves_no_partial_copy(tiny_shapes_dir, tmp_path, capsys,
                                                                               monkeypatch):
    import errno

    import flowrl.run.checkpoint_files as checkpoint

    def full(state, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "_write_state", full)
    out = tmp_path / "run"
    code, err = train(capsys, *settings(tiny_shapes_dir, out, **{"run.max_epochs": 1}))
    assert code == 2 and "Traceback" not in err
    assert "could not write checkpoint" in last_line(err) and "No space left on device" in last_line(err)
    assert not list((out / "checkpoints").glob(".tmp_step_*"))


def test_bad_rewards_and_sizes_are_config_or_one_line_errors(tiny_shapes_dir, tmp_path, capsys):
    register("wrong_count", WrongCount)
    cases = {
        "reward.train={no_such_reward: 1.0}": "reward.train: unknown reward 'no_such_reward'",
        "optim.lr=.inf": "optim.lr: got inf; expected a finite number",
        "sampling.num_steps=10000000": "sampling.num_steps: got 10000000; must be >= 2 and <= 1000",
        "data.num_eval_prompts=1000000000": "data.num_eval_prompts: got 1000000000; must be >= 1 and <= 100000",
        f"run.seed={2**63}": f"run.seed: got {2**63}; must be >= 0 and < {2**63}",
        "log.backends=[tensorbored]": "log.backends: unknown backend 'tensorbored'",
        "sampling.guidance=1e30": "sampling.guidance: got 1e+30; must be >= 0 and <= 100",
    }
    for override, message in cases.items():
        code, err = train(capsys, *settings(tiny_shapes_dir, tmp_path / "x"), override)
        assert code == 2 and message in err and "Traceback" not in err, (override, err)
    code, err = train(capsys, *settings(tiny_shapes_dir, tmp_path / "w", **{"reward.train": "{wrong_count: 1.0}"}))
    assert code == 2 and "the reward WrongCount returned 5 scores for 4 images" in last_line(err)
    broken = tmp_path / "broken_model"
    import shutil

    shutil.copytree(tiny_shapes_dir, broken)
    (broken / "model.json").write_text("{not json")
    code, err = train(capsys, *settings(broken, tmp_path / "b"))
    assert code == 2 and "model.json is not a flowrl model description" in err and "Traceback" not in err


@pytest.mark.slow
def test_resume_after_a_failure_in_epoch_one_logs_each_epoch_once(tiny_shapes_dir, tmp_path, capsys):
    class FailFirst:
        calls = 0

        def __call__(self, images, prompts, metadata=None):
            FailFirst.calls += 1
            if FailFirst.calls == 1:
                raise RuntimeError("transient")
            return RewardOutput(images.float().mean(dim=(1, 2, 3)))

    register("fail_first", FailFirst)
    out = tmp_path / "run"
    args = settings(tiny_shapes_dir, out, **{"reward.train": "{fail_first: 1.0}", "eval.at_start": "true"})
    code, err = train(capsys, *args)
    assert code == 2 and "the reward FailFirst failed: RuntimeError: transient" in last_line(err)
    code, err = train(capsys, *args, "run.resume=true")
    assert code == 0, err
    assert [r["epoch"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]


@pytest.mark.slow
def test_sigterm_interrupts_an_evaluation_within_seconds_and_exits_143(tiny_shapes_dir, tmp_path):
    out = tmp_path / "run"
    args = settings(tiny_shapes_dir, out, **{"eval.at_start": "true", "data.num_eval_prompts": 5000,
                                              "sampling.eval_num_steps": 200, "eval.batch_size": 50})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([sys.executable, "-m", "flowrl", "train", *args], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = ""
    while "eval (epoch 0)" not in output:  # the progress bar of the first evaluation
        chunk = process.stdout.read(1)
        assert chunk, output
        output += chunk
    time.sleep(1.0)
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    rest, _ = process.communicate(timeout=120)
    waited = time.monotonic() - sent
    assert process.returncode == 143, output + rest
    assert waited < 20, waited  # one model call of 50 samples at most, not the whole 5000-prompt evaluation
    assert "evaluation of epoch 0 interrupted by SIGTERM" in rest
    assert load_state(latest_checkpoint(out))["epoch"] == 0
    assert not (out / "metrics.jsonl").exists() or read_metrics(out / "metrics.jsonl") == []
