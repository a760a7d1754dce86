"""``run.stop_on``: a run stops when the held-out gold has not improved for ``patience`` evaluations while the
training reward rose, and keeps the best evaluation's checkpoint in ``checkpoints/best``; the rule resumes exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrl.run.checkpoint_files import load_state
from flowrl.run.metrics import read_metrics
from flowrl.commands.train import load_recipe_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "shapes" / "flow_grpo.yaml"
# Per epoch: (training reward, held-out gold). The gold peaks at epoch 3 while the reward keeps rising.
SCRIPT = {1: (0.50, 0.50), 2: (0.55, 0.55), 3: (0.60, 0.60), 4: (0.65, 0.58), 5: (0.70, 0.57), 6: (0.75, 0.52),
          7: (0.80, 0.50), 8: (0.85, 0.49)}


def scripted_run(out: Path, *extra: str, max_epochs: int = 8, resume: bool = False) -> tuple[object, list[float]]:
    """A Run whose epochs "train" a weight to the epoch number and whose evaluations read SCRIPT."""
    from flowrl.config import to_dict
    from flowrl.run.harness import Run

    _, cfg = load_recipe_config(str(CONFIG), [f"run.output_dir={out}", "eval.at_start=false", "eval.every_epochs=1",
                                              f"run.max_epochs={max_epochs}", "eval.every_minutes=null",
                                              *(["run.resume=true"] if resume else []), *extra])
    run = Run(cfg.run, "test", schedule=cfg.eval, log=cfg.log, checkpoint=cfg.checkpoint,
              precision=cfg.sampling.precision, reward=str(cfg.reward.train), config=to_dict(cfg))
    weight = {"w": torch.zeros(1)}

    class Weights:
        def state_dict(self):
            return dict(weight)

        def load_state_dict(self, state):
            weight.update(state)

    run.track(weights=Weights())
    run.evaluation(lambda epoch, should_stop: {"hack/accuracy": SCRIPT[epoch][1], "eval/shapes/accuracy": 0.7})
    trained = []
    with run:
        while run.next_epoch():
            weight["w"] = torch.tensor([float(run.epoch + 1)])
            trained.append(run.epoch + 1)
            run.end_epoch({"train/reward_mean": SCRIPT[run.epoch + 1][0]})
    assert run.finish() == 0
    return run, trained


def test_stops_when_the_gold_falls_while_the_reward_rises_and_keeps_the_best(tmp_path):
    stop = ["run.stop_on={metric: hack/accuracy, patience: 3}"]
    run, trained = scripted_run(tmp_path / "run", *stop)
    assert trained == [1, 2, 3, 4, 5, 6]  # best at 3; 4, 5, 6 did not improve: stop after the third
    assert run.status.startswith("early stop: hack/accuracy has not improved for 3 evaluations (best 0.6 at "
                                 "epoch 3, while the training reward rose)")
    best = load_state(tmp_path / "run" / "checkpoints" / "best")
    assert best["epoch"] == 3 and float(best["weights"]["w"]) == 3.0
    assert [r["epoch"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_no_stop_while_the_reward_falls_too_and_off_by_default(tmp_path):
    # Patience 1, but the reward must rise: with while_reward_rises off it stops at once after the peak.
    run, trained = scripted_run(tmp_path / "a", "run.stop_on={metric: hack/accuracy, patience: 1, "
                                               "while_reward_rises: false}")
    assert trained == [1, 2, 3, 4]
    run, trained = scripted_run(tmp_path / "b")  # no stop_on: every epoch
    assert trained == list(range(1, 9)) and not (tmp_path / "b" / "checkpoints" / "best").exists()


def test_the_rule_resumes_exactly(tmp_path):
    stop = ["run.stop_on={metric: hack/accuracy, patience: 3}", "checkpoint.every_epochs=1"]
    scripted_run(tmp_path / "run", *stop, max_epochs=4)  # best at 3, one evaluation without improvement
    run, trained = scripted_run(tmp_path / "run", *stop, max_epochs=8, resume=True)
    assert trained == [5, 6]  # two more without improvement, as if it had never stopped
    assert load_state(tmp_path / "run" / "checkpoints" / "best")["epoch"] == 3


def test_a_metric_the_evaluation_lacks_is_one_line(tmp_path):
    from flowrl.config import ConfigError
    from flowrl.errors import RunError

    with pytest.raises(RunError, match="run.stop_on.metric 'hack/nothing' is not among the evaluation's metrics "
                                       r"\(eval/shapes/accuracy, hack/accuracy\)"):
        scripted_run(tmp_path / "x", "run.stop_on={metric: hack/nothing}")
    with pytest.raises(ConfigError, match="is not a held-out measure"):
        load_recipe_config(str(CONFIG), ["run.stop_on={metric: train/reward_mean}"])
