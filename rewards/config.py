"""The ``reward`` section of a training config: what is trained on, what is evaluated, and how to
build them. The specs are checked when the config loads (every entry's fields and transforms, every
reward name), so a typo never costs a model load."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flowrl.config import fail

from .adversarial import DiscriminatorSchedule
from .base import Reward, RewardError

__all__ = ["RewardConfig"]


@dataclass
class RewardConfig:
    # name -> weight, or name -> {weight, kwargs, transform, reward}, or the `gated` entry
    # (see rewards.compose for the spec format).
    train: dict[str, Any] = field(default_factory=lambda: {"shapes": 1.0})
    # Rewards scored at evaluation; one that is also in `train` reuses its kwargs (paths, URLs).
    eval: list[str] = field(default_factory=lambda: ["shapes"])
    # Held-out rewards, never trained on, scored on the evaluation images in the hacking panel
    # (hack/heldout/<name>): names, or {name: {kwargs: {...}}} entries.
    heldout: list[Any] = field(default_factory=list)
    # When `train` holds a trainable reward (adversarial): which epochs train the discriminator and which the
    # policy (Adv-GRPO: 9 discriminator epochs of every 10).
    discriminator: DiscriminatorSchedule = field(default_factory=DiscriminatorSchedule)

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
        # A held-out reward is the same model as a trained one when both name and kwargs agree: another proxy of the
        # same class (other labels, another seed: a different `path`) is held out.
        trained = {_identity(name, entry) for name, entry in self.train.items() if name != "gated"}
        for name, entry in self._heldout_specs():
            try:
                check_reward_spec({name: entry})
            except (RewardError, UnknownNameError) as err:
                fail("heldout", str(err))
            if _identity(name, entry) in trained:
                fail("heldout", f"{name!r} is also in reward.train with the same kwargs, so it is not held out; "
                     "remove it from one of them or give it other weights (e.g. another proxy's path)")

    def _heldout_specs(self) -> list[tuple[str, Any]]:
        specs = []
        for item in self.heldout:
            if isinstance(item, str):
                specs.append((item, 1.0))
            elif isinstance(item, dict) and len(item) == 1:
                specs.append(next(iter(item.items())))
            else:
                fail("heldout", f"each entry is a reward name or {{name: {{kwargs: ...}}}}, got {item!r}")
        return specs

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

    def build_heldout(self, device=None) -> dict[str, Reward]:
        """``{name: reward}`` for every held-out reward, unweighted."""
        from .compose import build_reward

        return {name: build_reward({name: {**entry, "weight": 1.0} if isinstance(entry, dict) else 1.0},
                                   device=None if device is None else str(device))
                for name, entry in self._heldout_specs()}


def _identity(name: str, entry: Any) -> tuple[str, str]:
    """A reward spec's (registered name, kwargs as canonical JSON): what makes two entries the same model."""
    import json

    registered = entry.get("reward", name) if isinstance(entry, dict) else name
    kwargs = entry.get("kwargs", {}) if isinstance(entry, dict) else {}
    return registered, json.dumps(kwargs, sort_keys=True, default=str)
