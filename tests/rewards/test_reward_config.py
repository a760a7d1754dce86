"""The ``reward`` config section: which held-out rewards count as held out."""

from __future__ import annotations

import pytest

from flowrl.config import ConfigError, from_dict
from rewards.config import RewardConfig


def test_a_held_out_reward_is_refused_only_when_it_is_the_trained_model():
    """The same name with the same kwargs is the trained reward (refused); another proxy of the same class, with
    other weights, is held out (the over-optimisation study's held-out proxy); so is a rule with other kwargs."""
    proxy = {"shapes_proxy": {"weight": 1.0, "kwargs": {"path": "proxies/n2000_s0"}}}
    with pytest.raises(ConfigError, match=r"^heldout: 'shapes_proxy' is also in reward.train with the same kwargs, "
                                          r"so it is not held out; remove it"):
        from_dict(RewardConfig, {"train": proxy,
                                 "heldout": [{"shapes_proxy": {"kwargs": {"path": "proxies/n2000_s0"}}}]})
    with pytest.raises(ConfigError, match=r"^heldout: 'shapes' is also in reward.train"):
        from_dict(RewardConfig, {"train": {"shapes": 1.0}, "heldout": ["shapes"]})
    with pytest.raises(ConfigError, match=r"^heldout: 'other' is also in reward.train"):  # renamed, same model
        from_dict(RewardConfig, {"train": {"shapes": 1.0}, "heldout": [{"other": {"reward": "shapes"}}]})
    held = from_dict(RewardConfig, {"train": proxy, "heldout": [
        {"heldout_proxy": {"reward": "shapes_proxy", "kwargs": {"path": "proxies/n2000_s1"}}},
        {"shapes": {"kwargs": {"count_mode": "strict"}}}]})
    assert [name for name, _ in held._heldout_specs()] == ["heldout_proxy", "shapes"]
