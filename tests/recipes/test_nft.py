"""DiffusionNFT (flowrl/recipes/nft.py): updates on the toy flow, sampled by the old snapshot, raise its known
reward; negated advantages lower it. Runs, resume and 2-process equivalence: test_trainers_*.py."""

from flowrl.recipes import nft

from toy import assert_direction, forward_direction


def test_updates_climb_the_reward_and_negated_advantages_descend():
    assert_direction(lambda negate: forward_direction(nft, {"times": {"count": 2}}, negate=negate,
                                                      snapshots={"old": lambda cfg: cfg.train.old.schedule()},
                                                      rollout_snapshot="old"))
