"""The reward registry: ``rewards.load(name, **kwargs)`` and ``rewards.available()``.

Bundled rewards register lazily as ``"module:Class"`` so that listing them imports no model library.
"""

from __future__ import annotations

from flowrl.registry import Registry

from .base import Reward

REWARDS: Registry = Registry("reward")

# name -> "module:factory"; each factory takes keyword arguments and returns a Reward.
REWARDS.register("shapes", "rewards.shapes:ShapesReward")


def register_reward(name: str):
    """Decorator registering a Reward subclass (or factory) under ``name``."""
    return REWARDS.register(name)


def load(name: str, **kwargs) -> Reward:
    """Build the reward registered as ``name`` with its keyword arguments."""
    return REWARDS.get(name)(**kwargs)


def available() -> list[str]:
    """Names of every registered reward."""
    return REWARDS.names()
