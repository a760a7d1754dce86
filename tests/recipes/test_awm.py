"""AWM (flowrl/recipes/awm.py): updates on the toy flow raise its known reward, negated advantages lower it;
the update is on-policy (ratio 1). Runs, resume and 2-process equivalence: test_trainers_*.py."""

from flowrl.recipes import awm

from toy import assert_direction, forward_direction


def on_policy(metrics):
    assert metrics["train/ratio_mean"] == 1.0


def test_updates_climb_the_reward_and_negated_advantages_descend():
    assert_direction(lambda negate: forward_direction(
        awm, {"ema_kl_coef": 0.1, "times": {"count": 2, "mode": "stratified", "share": "batch"}}, negate=negate,
        snapshots={"ema_snapshot": lambda cfg: cfg.train.ema_snapshot.schedule()},
        check=on_policy))
