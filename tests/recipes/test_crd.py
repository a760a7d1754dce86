"""CRD (flowrl/recipes/crd.py): updates on the toy flow, sampled by the sampling snapshot, raise its known
reward; negated advantages lower it; the config insists on group-shared (t, eps). Runs, resume and 2-process
equivalence: test_trainers_*.py."""

import pytest

from flowrl.config import ConfigError, from_dict
from flowrl.recipes import crd

from toy import assert_direction, forward_direction


def test_updates_climb_the_reward_and_negated_advantages_descend():
    train = {"teacher_guidance": 1.0, "times": {"count": 2, "share": "group", "noise": "group"}}
    assert_direction(lambda negate: forward_direction(
        crd, train, negate=negate, snapshots={"old": lambda cfg: cfg.train.old.schedule()},
        rollout_snapshot=lambda cfg: cfg.train.rollout_snapshot.schedule()))


def test_config_requires_group_shared_noise():
    with pytest.raises(ConfigError, match=r"train\.times: CRD centres within a prompt group at one shared"):
        from_dict(crd.Config, {"train": {"times": {"share": "sample", "noise": "sample"}}})
    with pytest.raises(ConfigError, match=r"train\.kl_floor: 0\.5 exceeds kl_coef 0\.1"):
        from_dict(crd.Config, {"train": {"kl_floor": 0.5}})
