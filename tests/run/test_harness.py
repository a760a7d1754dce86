"""The run harness (flowrl/run/harness.py), each case a bug fixed with the online-loop redesign: a reward error whose
constructor takes several arguments reaches the user as one line (not a TypeError) and the last epoch is saved, a
failure while the weights change saves nothing inconsistent, an evaluation that failed is owed after the resume, and
``Run`` takes every section it reads. (A step's default noise level: tests/rl/test_sampling.py; a group layout that
does not fit the processes: tests/data/test_prompt_groups.py.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from flowrl.run.metrics import read_metrics
from rewards import RewardError, RewardOutput
from rewards.registry import REWARDS

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "shapes" / "flow_grpo.yaml"


def harness(cfg, **kwargs):
    """The :class:`flowrl.run.harness.Run` of an image recipe's config, given its sections as the recipes do."""
    from flowrl.config import to_dict
    from flowrl.run.harness import Run

    return Run(cfg.run, "test", schedule=cfg.eval, log=cfg.log, checkpoint=cfg.checkpoint,
               precision=cfg.sampling.precision, reward=str(cfg.reward.train), config=to_dict(cfg), **kwargs)


class ServerAnswered500(RewardError):
    """Like an HTTP client's status error: the constructor takes the status too."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class FailsOnSecondCall:
    calls = 0

    def __call__(self, images, prompts, metadata=None):
        FailsOnSecondCall.calls += 1
        if FailsOnSecondCall.calls >= 2:
            raise ServerAnswered500("reward server http://127.0.0.1:9/score answered 500: model crashed", 500)
        return RewardOutput(images.float().mean(dim=(1, 2, 3)))


def test_a_failing_remote_reward_is_one_line_and_the_last_epoch_is_saved(tiny_shapes_dir, tmp_path, capsys):
    from flowrl.commands.train import main

    if "fails_on_second_call" not in REWARDS:
        REWARDS.register("fails_on_second_call", FailsOnSecondCall)
    FailsOnSecondCall.calls = 0
    out = tmp_path / "run"
    code = main([str(CONFIG), f"model.path={tiny_shapes_dir}", f"run.output_dir={out}", "run.max_minutes=null",
                 "run.max_epochs=3", "eval.at_start=false", "eval.every_minutes=null", "eval.every_epochs=10",
                 "sampling.num_steps=3", "sampling.window.max_start=null", "sampling.groups_per_epoch=2",
                 "sampling.group_size=2", "sampling.batch_size=4", "train.micro_batch_size=4",
                 "reward.train={fails_on_second_call: 1.0}", "reward.eval=[jpeg_incompressibility]",
                 "data.num_eval_prompts=2", "checkpoint.every_epochs=10"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert err == (f"flowrl train: error: epoch 2: reward server http://127.0.0.1:9/score answered 500: model "
                   f"crashed (checkpoint of epoch 1 saved in {out}/checkpoints; resume with run.resume=true)")
    assert [r["epoch"] for r in read_metrics(out / "metrics.jsonl")] == [1]
    assert (out / "checkpoints" / "epoch_0000001" / "state.pt").is_file()


def test_a_failure_while_the_weights_change_saves_nothing_inconsistent(tiny_shapes_dir, tmp_path):
    """A failure inside the update leaves no checkpoint of half-updated weights, and says so."""
    from flowrl.errors import RunError
    from flowrl.commands.train import load_recipe_config

    _, cfg = load_recipe_config(str(CONFIG), [f"run.output_dir={tmp_path}", "eval.at_start=false"])
    run = harness(cfg)
    weights = {"w": torch.zeros(1)}

    class State:
        def state_dict(self):
            return dict(weights)

        def load_state_dict(self, state):
            weights.update(state)

    run.track(state=State())
    with pytest.raises(RunError, match="epoch 1: bad input .*the epoch was not saved; the last checkpoint"):
        with run:
            while run.next_epoch():
                with run.updating():
                    weights["w"] += 1
                    raise RewardError("bad input")
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").glob("epoch_*"))
    assert math.isfinite(float(weights["w"]))


def test_an_evaluation_that_failed_is_owed_after_the_resume(tmp_path, monkeypatch):
    """An evaluation due at 10 training minutes fails (the run saves and stops); the resumed run evaluates at its
    first epoch instead of waiting for the next multiple of eval.every_minutes (20)."""
    from flowrl.errors import RunError
    from flowrl.run.harness import Run
    from flowrl.commands.train import load_recipe_config

    monkeypatch.setattr(Run, "train_minutes", lambda self: 4.0 * self.epoch)  # epochs end at 4, 8, 12, ... minutes
    calls = []

    def evaluate(epoch, should_stop):
        calls.append(epoch)
        if len(calls) == 1:
            raise RuntimeError("evaluation crashed")
        return {"eval/shapes/accuracy": 0.5}

    def scripted(resume: bool) -> None:
        _, cfg = load_recipe_config(str(CONFIG), [f"run.output_dir={tmp_path}", "eval.at_start=false",
                                                  "eval.every_epochs=null", "eval.every_minutes=10",
                                                  "run.max_minutes=null", "run.max_epochs=6",
                                                  *(["run.resume=true"] if resume else [])])
        run = harness(cfg)
        run.evaluation(evaluate)
        with run:
            while run.next_epoch():
                run.end_epoch({"train/reward_mean": 0.5})
        run.finish()

    with pytest.raises(RunError, match=r"evaluation of epoch 3: internal error RuntimeError: evaluation crashed "
                                       r"\(checkpoint of epoch 3 saved"):
        scripted(resume=False)
    scripted(resume=True)
    assert calls == [3, 4, 5, 6]  # owed at 12 minutes (epoch 3): epoch 4; then 20 (epoch 5) and the last epoch
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["epoch"] for r in rows if "eval/shapes/accuracy" in r] == [4, 5, 6]


def test_the_harness_takes_the_sections_it_reads_and_saves_the_resolved_config(tmp_path):
    """Run takes every section it reads as an argument: a missing one is a TypeError when the run is built (it was a
    silent default: no checkpoint section meant every 5 epochs, no eval section no schedule), and the config it
    writes to config.yaml is plain data, written only when the run starts."""
    import yaml

    from flowrl.commands.train import load_recipe_config
    from flowrl.config import to_dict
    from flowrl.run.harness import Run

    _, cfg = load_recipe_config(str(CONFIG), [f"run.output_dir={tmp_path / 'run'}", "checkpoint.every_epochs=7"])
    with pytest.raises(TypeError, match="checkpoint"):
        Run(cfg.run, "test", schedule=cfg.eval, log=cfg.log, precision=None, reward="r", config=to_dict(cfg))
    with pytest.raises(TypeError, match="plain data"):
        Run(cfg.run, "test", schedule=cfg.eval, log=cfg.log, checkpoint=cfg.checkpoint, precision=None, reward="r",
            config=cfg)
    run = harness(cfg)
    assert not (tmp_path / "run" / "config.yaml").exists()  # nothing is claimed before the run starts
    with run:
        saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    run.finish()
    assert saved == {"recipe": "test", **to_dict(cfg)} and saved["checkpoint"]["every_epochs"] == 7
