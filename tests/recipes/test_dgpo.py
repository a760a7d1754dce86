"""DGPO (flowrl/recipes/dgpo.py): updates on the toy flow raise its known reward, negated advantages lower it;
the EMA snapshot moves after every optimizer step. Runs, resume and 2-process equivalence: test_trainers_*.py."""

import pytest

from flowrl.recipes import dgpo

from toy import assert_direction, forward_direction


def test_updates_climb_the_reward_and_negated_advantages_descend():
    epochs_done = []

    def two_steps_and_ema_updates(metrics):
        epochs_done.append(1)
        assert metrics["train/optimizer_steps"] == 2
        # Updated after each optimizer step, decay min(0.001 s, 0.3): s = 2 per epoch so far.
        assert metrics["train/ema_decay"] == pytest.approx(0.001 * 2 * (len(epochs_done) % 8 or 8))

    assert_direction(lambda negate: forward_direction(
        dgpo, {"minibatches": 2, "clip_range": 0.5,
               "times": {"count": 2, "high": 0.5, "share": "batch", "noise": "group"}},
        negate=negate, update_snapshots=False,
        snapshots={"ema_snapshot": lambda cfg: cfg.train.ema_snapshot.schedule()}, check=two_steps_and_ema_updates))
