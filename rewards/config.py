"""The ``reward`` section of a training config: what is trained on, what is evaluated, and how to
build them. The specs are checked when the config loads (every entry's fields and transforms, every
reward name), so a typo never costs a model load."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flowrl.config import fail

from .base import Reward, RewardError

__all__ = ["RewardConfig"]


@dataclass
class RewardConfig:
    # name -> weight, or name -> {weight, kwargs, transform, reward}, or the `gated` entry
    # (see rewards.compose for the spec format).
    train: dict[str, Any] = field(default_factory=lambda: {"shapes": 1.0})
    # Rewards scored at evaluation; one that is also in `train` reuses its kwargs (paths, URLs).
    eval: list[str] = field(default_factory=lambda: ["shapes"])

    def check(self) -> None:
        from flowrl.registry import UnknownNameError

        from .compose import check_reward_spec
        from .registry import REWARDS

        if not self.train:
            fail("train", "name at least one reward, e.g. {shapes: 1.0}")
        try:
            check_reward_spec(self.train)
        except (RewardError, UnknownNameError) as err:
            fail("train", str(err))
        for name in self.eval:
            entry = self.train.get(name)
            registered = entry.get("reward", name) if isinstance(entry, dict) else name
            if registered not in REWARDS:
                fail("eval", str(UnknownNameError("reward", registered, REWARDS.names())))

    def build_train(self, device=None) -> Reward:
        """The training reward (a weighted sum when several are named); rewards that take a ``device``
        run on ``device`` unless their kwargs set one."""
        from .compose import build_reward

        return build_reward(self.train, device=None if device is None else str(device))

    def build_eval(self, device=None) -> dict[str, Reward]:
        """``{name: reward}`` for every eval reward, unweighted."""
        from .compose import build_reward

        def unweighted(entry: Any) -> Any:
            return {**entry, "weight": 1.0} if isinstance(entry, dict) else 1.0

        return {name: build_reward({name: unweighted(self.train.get(name, 1.0))},
                                   device=None if device is None else str(device)) for name in self.eval}
