"""Reward models for image generators: one registry, composition, a scoring CLI and an HTTP server."""

from .base import Reward, RewardError, RewardOutput, to_image_tensor, to_pil_images
from .registry import REWARDS, available, load, register_reward
from .compose import build_reward  # noqa: E402  (after the registry it uses)

__all__ = ["Reward", "RewardError", "RewardOutput", "REWARDS", "available", "build_reward", "load",
           "register_reward", "to_image_tensor", "to_pil_images"]
